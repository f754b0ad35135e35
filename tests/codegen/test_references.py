"""Python names in docstrings -> the Elixir names of the generated functions."""

from __future__ import annotations

import pytest

from bridge_py.codegen.build import build
from bridge_py.codegen.model import Module
from bridge_py.codegen.references import References
from bridge_py.codegen.render import _elixir_params
from bridge_py.worker.export_table import default_exports
from tests.codegen.sample_docs import table

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return {m.name: m for m in build(table())}


@pytest.mark.parametrize(
    ("context", "target", "written"),
    [
        # In a class's own module: name/arity, which ExDoc links within the module.
        ("Sample.Docs.Queue", "put", "`put/4`"),
        ("Sample.Docs.Queue", "Queue.put", "`put/4`"),
        ("Sample.Docs.Queue", "pkg.mod.Queue.get", "`get/2`"),
        ("Sample.Docs.Queue", "self.size", "`size/2`"),
        ("Sample.Docs.Queue", "Queue.__init__", "`new/3`"),
        # Elsewhere: Module.name/arity, and a class is its module.
        ("Sample.Docs.Queue", "Board.post", "`Sample.Docs.Board.post/3`"),
        ("Sample.Docs.Queue", "Board", "`Sample.Docs.Board`"),
        ("Sample.Docs.Queue", "tests.codegen.sample_docs.Board", "`Sample.Docs.Board`"),
        ("Sample.Docs.Queue", "make_queue", "`Sample.Docs.make_queue/2`"),
        ("Sample.Docs.Queue", "pkg.mod.make_queue", "`Sample.Docs.make_queue/2`"),
        # A bare member of exactly one other class.
        ("Sample.Docs.Queue", "post", "`Sample.Docs.Board.post/3`"),
        ("Sample.Docs", "make_queue", "`make_queue/2`"),
        ("Sample.Docs", "put", "`Sample.Docs.Queue.put/4`"),
        # Not exported: left to the converter (the last component, as plain code).
        ("Sample.Docs.Queue", "Hidden", None),
        ("Sample.Docs.Queue", "Hidden.put", None),
        ("Sample.Docs.Queue", "Queue.secret", None),
        ("Sample.Docs.Queue", "auth_key", None),
        ("Sample.Docs", "size", "`Sample.Docs.Queue.size/2`"),
        # A bare member of several classes is ambiguous outside them.
        ("Sample.Docs", "__init__", None),
    ],
)
def test_resolution(
    modules: dict[str, Module], context: str, target: str, written: str | None
) -> None:
    references = References(modules.values())
    assert references.resolve(modules[context], target) == written


def test_the_arity_in_references_is_the_generated_functions() -> None:
    for module in build(default_exports()):
        for fn in module.functions:
            assert fn.arity == len(_elixir_params(fn)), f"{module.name}.{fn.name}"
