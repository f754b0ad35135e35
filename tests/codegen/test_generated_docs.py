"""What an Elixir user reads: the generated docs carry Markdown, not reStructuredText.

Scans every generated file under elixir/lib/vllm/ (the checked-in ones, which
``test_check_passes_on_the_checked_in_files`` keeps equal to a fresh generation).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bridge_py.codegen.__main__ import generate
from bridge_py.codegen.build import build
from bridge_py.codegen.docstrings import DocstringError
from bridge_py.worker.exports import ExportedClass, ExportTable
from tests.codegen.sample_docs import table as sample_table

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
GENERATED = sorted((ROOT / "elixir" / "lib" / "vllm").rglob("*.ex"))

_DOC = re.compile(r'@(?:module)?doc ~S"""\n(.*?)\n\s*"""', re.S)
_ROLE = re.compile(r":(?:[a-z]+:)?[a-z][a-z-]*:`")
_DOUBLE_BACKTICK = re.compile(r"(?<!`)``(?!`)")  # ``literal``, not a ``` fence
_DEF = re.compile(r"^  def (\w+[?!]?)\(([^)]*)\) do", re.M)
_MODULE = re.compile(r"^defmodule ([\w.]+) do", re.M)
_REFERENCE = re.compile(r"`((?:[A-Z]\w*\.)*[A-Z]\w*)?\.?([a-z_]\w*[?!]?)/(\d+)`")


def docs(source: str) -> list[str]:
    """The bodies of a file's @moduledoc and @doc heredocs."""
    return _DOC.findall(source)


def rest_in(source: str) -> list[str]:
    """Every reStructuredText construct in a generated file, as 'line N: text'."""
    found = []
    for n, line in enumerate(source.splitlines(), 1):
        if _ROLE.search(line) or _DOUBLE_BACKTICK.search(line):
            found.append(f"line {n}: {line.strip()}")
    for doc in docs(source):
        fenced = False
        for line in doc.splitlines():
            if line.strip().startswith("```"):
                fenced = not fenced
            elif not fenced and line.rstrip().endswith("::"):
                found.append(f"literal-block marker: {line.strip()}")
            elif not fenced and re.match(r"\s*\.\.\s+[\w-]+::", line):
                found.append(f"directive: {line.strip()}")
    return found


def test_there_are_generated_files_to_scan() -> None:
    names = {p.name for p in GENERATED}
    assert {"distributed.ex", "stateless_process_group.ex", "message_queue.ex"} <= names


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_restructuredtext_in_generated_docs(path: Path) -> None:
    assert rest_in(path.read_text()) == []


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_python_boilerplate_in_generated_docs(path: Path) -> None:
    text = "\n".join(docs(path.read_text()))
    for python in ("Initialize self.", "See help(type(self))", "<factory>", "default: `None`"):
        assert python not in text, f"{path.name}: {python}"
    # a default with no Elixir term (an enum member) reads as its name, not as its repr
    assert "(Python)" not in text and "<RedOpType" not in text, path.name


def test_an_enum_default_is_the_string_an_elixir_caller_passes_for_it() -> None:
    spg = next(p for p in GENERATED if p.name == "stateless_process_group.ex").read_text()
    assert '* `op` (`VllmBridge.Ref.t() | String.t()`, default: `"sum"`)' in spg
    comm = next(p for p in GENERATED if p.name == "py_nccl_communicator.ex").read_text()
    assert "default: Python's `ReduceOp.SUM` (leave the argument out for it)" in comm


def test_function_references_name_generated_functions() -> None:
    """Every `Module.fun/N` or `fun/N` in the docs names a def of that arity."""
    defs: dict[str, set[tuple[str, int]]] = {}
    sources = {path: path.read_text() for path in GENERATED}
    for source in sources.values():
        module = _MODULE.search(source)
        assert module is not None
        defs[module.group(1)] = {
            (name, len([p for p in params.split(",") if p.strip()]))
            for name, params in _DEF.findall(source)
        }
    checked = 0
    for path, source in sources.items():
        module = _MODULE.search(source)
        assert module is not None
        for doc in docs(source):
            for owner, name, arity in _REFERENCE.findall(doc):
                target = owner or module.group(1)
                if target.startswith("VllmBridge"):
                    continue
                assert (name, int(arity)) in defs.get(target, set()), (
                    f"{path.name}: `{owner}{'.' if owner else ''}{name}/{arity}` names no function"
                )
                checked += 1
    assert checked >= 10  # the docs do cross-reference (e.g. MessageQueue's moduledoc)


def test_the_sample_dialect_comes_out_as_markdown() -> None:
    files = generate(sample_table())
    for source in files.values():
        assert rest_in(source) == []
    queue = files["sample/docs/queue.ex"]
    assert "A queue; readers call `get/2` and writers `put/4`." in queue
    assert (
        "See `Sample.Docs.Board` and `Sample.Docs.make_queue/2`; `Hidden` is not exported." in queue
    )
    assert (
        "Waits at most `timeout` seconds (None: forever):\n\n  ```\n  q.put(1, timeout=2.0)\n  ```"
        in queue
    )
    assert "> **Note:** Blocks while the queue is empty." in queue
    # Args entries sit beside the parameters they describe; the class's, beside new's.
    assert "* `item` (`VllmBridge.Ref.t()`) - what to add." in queue
    assert "(in `args`, position 0) - what the queue is called,\n      across two lines." in queue
    assert "* `boolean()` - Whether `item` was added." in queue
    assert "## Errors" in queue and "* `TimeoutError` - when the queue stays full" in queue
    # Implementation notes are not for Elixir users.
    for word in ("doorbell", "/dev/shm", "a ring", "Implementation"):
        assert word not in queue
    # Python's own docstrings give way to generated sentences; defaults are Elixir terms.
    record = files["sample/docs/record.ex"]
    assert "Record(counts" not in record and "A Python `Record`, held by a worker." in record
    assert "default: `%{}`" in record and "default: `false`" in record
    assert "Pair(left, right)" not in files["sample/docs/pair.ex"]


class _Bad:
    def f(self) -> None:
        """Head.

        .. autofunction:: g
        """


def test_a_docstring_without_a_markdown_rendering_fails_generation_naming_it() -> None:
    bad = ExportTable.build(classes=[ExportedClass("Bad", _Bad, "Sample.Bad", methods=("f",))])
    with pytest.raises(
        DocstringError, match=r"Sample\.Bad\.f: the directive '\.\. autofunction::'"
    ):
        build(bad)


def test_the_audit_points_at_the_python_docstring_lines() -> None:
    from bridge_py.codegen.audit import findings

    found = findings(build(sample_table()))
    source = (ROOT / "tests" / "codegen" / "sample_docs.py").read_text().splitlines()
    post = [f for f in found if f.member == "Sample.Docs.Board.post/3"]
    assert len(post) == 1 and post[0].labels == ("board", "slot or ring")
    path, line = post[0].where.split(":")
    assert path == "tests/codegen/sample_docs.py"
    assert source[int(line) - 1].strip() == "It goes in a slot of the shared-memory board."
    # Implementation paragraphs never reach the Elixir docs, so they are not reported.
    assert not [f for f in found if f.member.startswith("Sample.Docs.Queue")]


def _exception_names() -> set[str]:
    """Names of the exception classes a generated module's Errors section may list: the
    builtins, and every exception class of bridge_py (as ``python_type`` names them)."""
    import builtins
    import importlib
    import pkgutil

    import bridge_py

    names = {n for n, v in vars(builtins).items() if isinstance(v, type)}
    for info in pkgutil.walk_packages(bridge_py.__path__, "bridge_py."):
        if ".codegen" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        names |= {
            n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, Exception)
        }
    return names


def test_errors_sections_name_the_exception_classes_raised() -> None:
    """Each bullet of an Errors section names a real exception class (what arrives as
    ``python_type``), not a base class with the real one in the prose."""
    known = _exception_names()
    listed = {
        (path.name, match.group(1))
        for path in GENERATED
        for match in re.finditer(r"^    \* `(\w+)` - ", path.read_text(), re.MULTILINE)
        if match.group(1).endswith(("Error", "Timeout", "Failure", "Exception"))
    }
    assert listed, "no Errors section found"
    assert sorted(name for _, name in listed if name not in known) == []
    spg = next(p for p in GENERATED if p.name == "stateless_process_group.ex").read_text()
    assert "* `BarrierTimeout` - " in spg and "* `BarrierFailure` - " in spg
    assert "* `RuntimeError` - BarrierTimeout" not in spg
