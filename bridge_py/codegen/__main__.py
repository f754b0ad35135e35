"""``python -m bridge_py.codegen [--check] [--table MODULE:FUNCTION] [--root DIR]``.

Writes one Elixir file per generated module under ``elixir/lib`` (``Vllm.Distributed``
-> ``elixir/lib/vllm/distributed.ex``), and the wire schema's field tables and error
categories, read from ``proto/``, for both codecs (``bridge_py/worker/schema.py``,
``elixir/lib/vllm_bridge/proto/schema.ex``; see :mod:`.schema`). Elixir is formatted
by Elixir's own formatter and Python by ruff, so that ``mix format --check-formatted``
and ``ruff format --check`` agree. With ``--check`` it writes nothing and exits 1 when
a checked-in file differs from a fresh generation (or a generated file is missing or
no longer generated). ``--root`` is the checkout read and written (this one by default).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bridge_py.codegen import schema
from bridge_py.codegen.build import build
from bridge_py.codegen.render import HEADER, render_module
from bridge_py.worker.exports import ExportTable

ROOT = Path(__file__).resolve().parents[2]
GENERATED_ROOT = "vllm"
ELIXIR_LIB = "elixir/lib"

# Exactly what `mix format` writes: the formatted code and one trailing newline.
_FORMAT = (
    "for path <- System.argv(), do: File.write!(path, "
    "[path |> Code.format_file!() |> IO.iodata_to_binary() |> String.trim_trailing(), ?\\n])"
)


def _table(spec: str) -> ExportTable:
    module_name, _, function = spec.partition(":")
    return getattr(importlib.import_module(module_name), function)()


def generate(table: ExportTable) -> dict[str, str]:
    """Path under ``elixir/lib`` -> formatted Elixir source, for every ``Vllm.*`` module."""
    return _format_elixir({m.path: render_module(m) for m in build(table)})


def generate_all(table: ExportTable, root: Path) -> dict[str, str]:
    """Repository-relative path -> formatted source, for every generated file: the
    ``Vllm.*`` modules of ``table`` and the schema's files, from ``root/proto``."""
    wire = schema.render(schema.read(root / "proto"))
    elixir = {f"{ELIXIR_LIB}/{m.path}": render_module(m) for m in build(table)}
    elixir[schema.ELIXIR_PATH] = wire[schema.ELIXIR_PATH]
    return {
        **_format_elixir(elixir),
        schema.PYTHON_PATH: _format_python(wire[schema.PYTHON_PATH], schema.PYTHON_PATH),
    }


def _format_elixir(sources: dict[str, str]) -> dict[str, str]:
    elixir = shutil.which("elixir")
    if elixir is None:
        raise SystemExit("codegen needs `elixir` on PATH to format its output (make setup)")
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for rel, text in sources.items():
            path = Path(tmp, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            paths.append(str(path))
        subprocess.run([elixir, "-e", _FORMAT, *paths], check=True, cwd=tmp)
        return {rel: Path(tmp, rel).read_text() for rel in sources}


def _format_python(text: str, rel: str) -> str:
    """``text`` as ``ruff format`` writes it at ``rel`` of this checkout (its settings)."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(ROOT / rel), "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise SystemExit(f"codegen needs ruff to format {rel} (make setup):\n{done.stderr}")
    return done.stdout


def _existing(root: Path) -> dict[str, str]:
    """Generated files already in the checkout at ``root``: the ``Vllm.*`` modules
    (recognised by their header) and the schema's files, where they exist."""
    found = {}
    lib = root / ELIXIR_LIB
    for path in (lib / GENERATED_ROOT).rglob("*.ex"):
        text = path.read_text()
        if text.startswith(HEADER.splitlines()[0]):
            found[f"{ELIXIR_LIB}/{path.relative_to(lib)}"] = text
    for rel in (schema.PYTHON_PATH, schema.ELIXIR_PATH):
        if (root / rel).is_file():
            found[rel] = (root / rel).read_text()
    return found


def main(argv: list[str] | None = None) -> int:
    """Generate (or check) the files; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m bridge_py.codegen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    parser.add_argument(
        "--table",
        default="bridge_py.worker.export_table:default_exports",
        help="MODULE:FUNCTION returning the ExportTable (default: the shipped one)",
    )
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the checkout to read and write (default: this)"
    )
    args = parser.parse_args(argv)

    try:
        fresh = generate_all(_table(args.table), args.root)
    except schema.SchemaError as exc:
        print(f"codegen: {exc}", file=sys.stderr)
        return 1
    current = _existing(args.root)
    stale = sorted(rel for rel in fresh if current.get(rel) != fresh[rel])
    orphaned = sorted(set(current) - set(fresh))
    if args.check:
        for rel in stale:
            print(f"out of date: {rel}", file=sys.stderr)
        for rel in orphaned:
            print(f"no longer generated: {rel}", file=sys.stderr)
        if stale or orphaned:
            print("run `make codegen` and commit the result", file=sys.stderr)
            return 1
        print(f"codegen: {len(fresh)} generated files are up to date")
        return 0
    for rel in stale:
        path = args.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fresh[rel])
        print(f"wrote {rel}")
    for rel in orphaned:
        (args.root / rel).unlink()
        print(f"removed {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
