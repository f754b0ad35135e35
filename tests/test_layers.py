"""The layers of bridge_py/distributed: imports flow one way, from a layer to those below.

Every import of the package, also one inside a function, is checked against the order
below (docs/architecture.md draws it). A module may import from its own layer and from
lower ones; an upward import, or one that names a module nobody has placed, fails here.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bridge_py" / "distributed"

# Lowest first. Each entry is a folder or a module of bridge_py/distributed.
LAYERS: list[set[str]] = [
    {"auth", "errors", "vllm_pickle"},
    {"shm", "store"},
    {"spg"},
    {"groups"},
    {"device_communicators"},
    {"coordinator"},
    {"parallel_state", "communication_op", "utils"},
    {"distribute"},
    {"__init__"},
]


def _layer(part: str) -> int:
    for index, members in enumerate(LAYERS):
        if part in members:
            return index
    raise AssertionError(f"bridge_py.distributed.{part} is in no layer: add it to LAYERS")


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, top-level part)`` of every ``bridge_py.distributed`` import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "bridge_py.distributed":
                names = [f"bridge_py.distributed.{alias.name}" for alias in node.names]
            else:
                names = [node.module]
        for name in names:
            if name.startswith("bridge_py.distributed."):
                found.append((node.lineno, name.split(".")[2]))
    return found


def test_imports_flow_down_the_layers() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        own = relative.parts[0].removesuffix(".py")
        for line, part in _imports(path):
            if _layer(part) > _layer(own):
                upward.append(f"{relative}:{line} imports {part} (a higher layer than {own})")
    assert not upward, "\n".join(upward)


def test_at_most_twelve_modules_directly_in_the_package() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 12, modules


ROOT = PACKAGE.parent


def _module_file(dotted: str) -> Path | None:
    """The file of bridge_py module ``dotted`` (a package's ``__init__.py``), if any."""
    base = ROOT.parent.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_files(path: Path) -> set[Path]:
    """The bridge_py files ``path`` names in any import (also lazy or for type checking
    only): ``from package import module`` names the module's file, not the package's."""
    named: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        dotted: list[str] = []
        if isinstance(node, ast.Import):
            dotted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            dotted = [
                f"{node.module}.{alias.name}"
                if _module_file(f"{node.module}.{alias.name}")
                else node.module
                for alias in node.names
            ]
        for name in dotted:
            target = _module_file(name) if name.startswith("bridge_py") else None
            if target is not None and target != path:
                named.add(target)
    return named


def test_no_import_circle_in_bridge_py() -> None:
    graph = {path: _imported_files(path) for path in sorted(ROOT.rglob("*.py"))}
    # Depth-first search; a back edge to a module on the current path closes a circle.
    state: dict[Path, int] = {}  # 1: on the path, 2: done
    circles: list[str] = []

    def visit(node: Path, path: list[Path]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                loop = [*path[path.index(nxt) :], nxt]
                circles.append(" -> ".join(str(p.relative_to(ROOT.parent)) for p in loop))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in graph:
        if start not in state:
            visit(start, [start])
    assert not circles, "\n".join(circles)


def _code_lines(path: Path) -> int:
    """Lines of ``path`` with code on them: no blank, comment or docstring lines."""
    source = path.read_text()
    lines: set[int] = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (*skip, tokenize.ENDMARKER):
            lines.update(range(token.start[0], token.end[0] + 1))
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                lines -= set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return len(lines)


def test_the_distributed_layer_stays_within_10700_code_lines() -> None:
    # 9,500 until vLLM 0.34's whole surface (issue 38) added about 1,150 lines.
    total = sum(_code_lines(path) for path in PACKAGE.rglob("*.py"))
    assert total <= 10_700, total


def test_no_module_over_700_lines() -> None:
    long = [
        f"{path.relative_to(ROOT.parent)}: {lines} lines"
        for path in sorted(ROOT.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > 700
    ]
    assert not long, "\n".join(long)


def test_no_class_name_is_defined_twice() -> None:
    """One name, one class: a reader who meets ``Segment`` knows which one it is."""
    where: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT.parent)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
