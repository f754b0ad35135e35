"""``python -m bridge_py.codegen.audit``: implementation talk left in the Elixir docs.

A report, not a check (it always exits 0): for every generated module and function
whose Markdown still mentions something an Elixir user should not need (the
shared-memory boards and doorbells, segments, ``/dev/shm``, store key names, HMAC
sealing, Python module paths...), one line per docstring line that says it, as
``path:line`` of the Python source, so that the text can be moved into a comment,
docs/architecture.md or an ``Implementation:`` paragraph (see ``docstrings``).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bridge_py.codegen.build import build
from bridge_py.codegen.docstrings import kept_lines
from bridge_py.codegen.model import Function, Module
from bridge_py.worker.exports import ExportTable

ROOT = Path(__file__).resolve().parents[2]

# What each pattern finds, and the pattern (case-sensitive unless it says otherwise).
WORDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("board", re.compile(r"\bboards?\b")),  # lowercase: not a class named Board
    ("doorbell", re.compile(r"\bdoorbells?\b", re.I)),
    ("spg_ module", re.compile(r"\bspg_\w+")),
    ("segment", re.compile(r"\bsegments?\b", re.I)),
    ("FIFO", re.compile(r"\bFIFO\b")),
    ("/dev/shm", re.compile(r"/dev/shm")),
    ("mmap", re.compile(r"\bmmap\b")),
    ("slot or ring", re.compile(r"\bslots?\b|\bthe ring\b", re.I)),
    ("HMAC internals", re.compile(r"\bHMAC\b|\bseal(?:ed|s|ing)?\b|\btags?\b", re.I)),
    # p2p/<src>/<dst>, gx/{rank}/{peer}, 'p2p/1/0/3': a path of placeholders or numbers.
    ("store key name", re.compile(r"\b[a-z]\w*(?:/(?:<\w+>|\{\w+\}))+|\b[a-z]\w*(?:/\d+){2,}")),
    (
        "store internals",
        re.compile(r"\bmulti_get\b|\bstore queues?\b|\breaper\b|\bstore operation\b", re.I),
    ),
    ("Python module path", re.compile(r"\bbridge_py\.[\w.]+|\b(?:auth|parallel_state)\.\w+")),
    ("vLLM internals", re.compile(r"\bDynamo\b|\bcustom ops?\b")),
)


@dataclass(frozen=True)
class Finding:
    """One docstring line (or generated text) that mentions implementation words."""

    member: str  # Elixir: Module or Module.fun/arity
    labels: tuple[str, ...]
    where: str  # path:line of the Python docstring line, or "(generated)"
    text: str


def _labels(text: str) -> list[str]:
    return [label for label, pattern in WORDS if pattern.search(text)]


def _markdown(fn: Function) -> str:
    parts = [fn.doc, fn.returns_doc or ""]
    parts += [p.doc for p in fn.params]
    parts += [text for _, text in fn.errors]
    return "\n".join(parts)


def _documented(obj: object, cls: type | None, name: str) -> object:
    """The object whose own __doc__ :func:`inspect.getdoc` shows for ``obj``."""
    if getattr(obj, "__doc__", None) or cls is None:
        return obj
    for klass in cls.__mro__:
        member = vars(klass).get(name)
        if member is not None and getattr(member, "__doc__", None):
            return member
    return obj


def _docstring_line(obj: object) -> tuple[str, int] | None:
    """The file and 1-based line of the first line of ``inspect.getdoc(obj)``."""
    target = obj.fget if isinstance(obj, property) else obj
    target = getattr(target, "__func__", target)
    try:
        path = inspect.getsourcefile(target)  # type: ignore[arg-type]  # checked: TypeError
        lines, start = inspect.getsourcelines(target)  # type: ignore[arg-type]  # likewise
    except (OSError, TypeError):
        return None  # built in, or made at run time (a namedtuple)
    if path is None:
        return None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    node: ast.AST = tree if inspect.ismodule(target) else tree.body[0]
    body = getattr(node, "body", [])
    if not body or not isinstance(body[0], ast.Expr):
        return None
    raw = (getattr(target, "__doc__", None) or "").split("\n")
    lead = 0  # lines inspect.cleandoc drops from the top
    while lead < len(raw) and not raw[lead].strip():
        lead += 1
    first = (start if start else 1) + body[0].lineno - 1 + lead
    return str(Path(path).resolve().relative_to(ROOT)), first


def _located(member: str, obj: object, doc: str, markdown: str) -> Iterator[Finding]:
    labels = _labels(markdown)
    if not labels:
        return
    where = _docstring_line(obj)
    found = False
    for index, line in kept_lines(doc):
        hits = tuple(label for label in _labels(line) if label in labels)
        if hits:
            found = True
            place = f"{where[0]}:{where[1] + index}" if where else "(source not found)"
            yield Finding(member, hits, place, line.strip())
    if not found:
        yield Finding(member, tuple(labels), "(generated)", markdown.split("\n", 1)[0])


def _module_object(doc: str) -> object | None:
    """The imported Python module whose docstring is ``doc``."""
    for module in list(sys.modules.values()):
        own = vars(module).get("__doc__") if module is not None else None
        if isinstance(own, str) and inspect.cleandoc(own) == doc:
            return module
    return None


def findings(modules: list[Module]) -> list[Finding]:
    """Everything :data:`WORDS` finds in the generated docs of ``modules``."""
    out: list[Finding] = []
    for module in modules:
        cls = module.origin if isinstance(module.origin, type) else None
        origin = module.origin if cls is not None else _module_object(module.python_doc)
        raw = inspect.getdoc(origin) or "" if origin is not None else module.python_doc
        out += _located(module.name, origin, raw, module.moduledoc)
        for fn in module.functions:
            member = f"{module.name}.{fn.name}/{fn.arity}"
            obj = _documented(fn.origin, cls, fn.python_name) if fn.python_doc else None
            raw = inspect.getdoc(obj) or "" if obj is not None else ""
            out += _located(member, obj, raw, _markdown(fn))
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the findings for an export table; always 0 (a report, not a check)."""
    parser = argparse.ArgumentParser(prog="python -m bridge_py.codegen.audit", description=__doc__)
    parser.add_argument(
        "--table",
        default="bridge_py.worker.export_table:default_exports",
        help="MODULE:FUNCTION returning the ExportTable (default: the shipped one)",
    )
    args = parser.parse_args(argv)
    module_name, _, function = args.table.partition(":")
    table: ExportTable = getattr(importlib.import_module(module_name), function)()
    found = findings(build(table))
    member = None
    for finding in found:
        if finding.member != member:
            member = finding.member
            print(f"\n{member}")
        print(f"  {finding.where}  [{', '.join(finding.labels)}]  {finding.text}")
    members = len({f.member for f in found})
    print(f"\n{members} generated docs mention implementation words ({len(found)} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
