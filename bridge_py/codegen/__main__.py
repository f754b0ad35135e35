"""``python -m bridge_py.codegen [--check] [--table MODULE:FUNCTION] [--out DIR]``.

Writes one Elixir file per generated module under ``elixir/lib`` (``Vllm.Distributed``
-> ``elixir/lib/vllm/distributed.ex``), formatted by Elixir's own formatter so that
``mix format --check-formatted`` agrees. With ``--check`` it writes nothing and exits
1 when a checked-in file differs from a fresh generation (or a generated file is
missing or no longer generated).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bridge_py.codegen.build import build
from bridge_py.codegen.render import HEADER, render_module
from bridge_py.worker.exports import ExportTable

ROOT = Path(__file__).resolve().parents[2]
GENERATED_ROOT = "vllm"

# Exactly what `mix format` writes: the formatted code and one trailing newline.
_FORMAT = (
    "for path <- System.argv(), do: File.write!(path, "
    "[path |> Code.format_file!() |> IO.iodata_to_binary() |> String.trim_trailing(), ?\\n])"
)


def _table(spec: str) -> ExportTable:
    module_name, _, function = spec.partition(":")
    return getattr(importlib.import_module(module_name), function)()


def generate(table: ExportTable) -> dict[str, str]:
    """Relative path -> formatted Elixir source, for every generated module."""
    sources = {m.path: render_module(m) for m in build(table)}
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


def _existing(out: Path) -> dict[str, str]:
    """Generated files already in ``out`` (recognised by their header)."""
    found = {}
    for path in (out / GENERATED_ROOT).rglob("*.ex"):
        text = path.read_text()
        if text.startswith(HEADER.splitlines()[0]):
            found[str(path.relative_to(out))] = text
    return found


def main(argv: list[str] | None = None) -> int:
    """Generate (or check) the modules; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m bridge_py.codegen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    parser.add_argument(
        "--table",
        default="bridge_py.worker.export_table:default_exports",
        help="MODULE:FUNCTION returning the ExportTable (default: the shipped one)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "elixir" / "lib")
    args = parser.parse_args(argv)

    fresh = generate(_table(args.table))
    current = _existing(args.out)
    stale = sorted(rel for rel in fresh if current.get(rel) != fresh[rel])
    orphaned = sorted(set(current) - set(fresh))
    if args.check:
        for rel in stale:
            print(f"out of date: elixir/lib/{rel}", file=sys.stderr)
        for rel in orphaned:
            print(f"no longer generated: elixir/lib/{rel}", file=sys.stderr)
        if stale or orphaned:
            print("run `make codegen` and commit the result", file=sys.stderr)
            return 1
        print(f"codegen: {len(fresh)} generated files are up to date")
        return 0
    for rel in stale:
        path = args.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fresh[rel])
        print(f"wrote elixir/lib/{rel}")
    for rel in orphaned:
        (args.out / rel).unlink()
        print(f"removed elixir/lib/{rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
