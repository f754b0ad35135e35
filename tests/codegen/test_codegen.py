"""The code generator: conventions on a sample table, and the --check contract."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge_py.codegen.__main__ import generate, main
from bridge_py.codegen.build import build
from bridge_py.codegen.model import underscore
from bridge_py.codegen.render import render_module
from bridge_py.codegen.typespecs import typespec
from bridge_py.worker.exports import ExportedClass, ExportTable
from tests.worker.sample_exports import table as sample_table

ROOT = Path(__file__).resolve().parents[2]


def test_module_paths_follow_elixir_underscore() -> None:
    assert underscore("StatelessProcessGroup") == "stateless_process_group"
    assert underscore("NFSWorkspace") == "nfs_workspace"
    assert underscore("GroupCoordinator") == "group_coordinator"
    names = {m.name: m.path for m in build(sample_table())}
    assert names == {"Sample": "sample.ex", "Sample.Counter": "sample/counter.ex"}


def test_conventions_on_the_sample_table() -> None:
    files = generate(sample_table())
    counter = files["sample/counter.ex"]
    # Counter(start=0, *, step=1): the optional positional goes in args, step is an option.
    assert "def new(args \\\\ [], opts \\\\ []) do" in counter
    assert 'VllmBridge.Runtime.call_class("Counter", [], [{:__args__, args} | opts])' in counter
    assert "(keyword option `step:`)" in counter
    # incr(self, by=None): ref first, then the args list.
    assert "def incr(ref, args \\\\ [], opts \\\\ []) do" in counter
    assert "@spec incr(t(), [term()], keyword()) :: {:ok, integer()}" in counter
    # wait_gate(self, timeout: float = 10.0) -> bool
    assert "{:ok, boolean()}" in counter
    # Attributes are getters: the ref, and runtime options like every other call.
    assert "def value(ref, opts \\\\ []) do" in counter
    assert 'get_attr(ref, "value", opts)' in counter
    assert "@spec value(t(), keyword())" in counter
    # Unexported methods get no function.
    assert "secret" not in counter
    sample = files["sample.ex"]
    assert "def echo(value, opts \\\\ []) do" in sample
    assert "def open_gate(counter, opts \\\\ []) do" in sample
    assert "@spec double(VllmBridge.Tensor.t() | float(), keyword())" in sample
    assert "DO NOT EDIT" in sample


def test_check_passes_on_the_checked_in_files() -> None:
    assert main(["--check"]) == 0


def test_check_fails_on_a_hand_edit_and_generation_repairs_it(checkout: Path) -> None:
    root = ["--root", str(checkout)]
    assert main(["--check", *root]) == 0
    edited = checkout / "elixir" / "lib" / "vllm" / "distributed" / "stateless_process_group.ex"
    edited.write_text(edited.read_text().replace("def barrier(", "def barrier_renamed("))
    assert main(["--check", *root]) == 1
    assert main(root) == 0
    assert main(["--check", *root]) == 0


def test_check_fails_when_a_file_is_missing_or_orphaned(checkout: Path) -> None:
    root = ["--root", str(checkout)]
    lib = checkout / "elixir" / "lib" / "vllm"
    (lib / "distributed.ex").unlink()
    assert main(["--check", *root]) == 1
    main(root)
    orphan = lib / "old.ex"
    orphan.write_text((lib / "distributed.ex").read_text())
    assert main(["--check", *root]) == 1


@pytest.mark.parametrize("bad", ['"""', '  """  '])
def test_docstrings_that_would_break_a_heredoc_are_refused(bad: str) -> None:
    from bridge_py.codegen.render import _heredoc

    with pytest.raises(ValueError):
        _heredoc(f"line\n{bad}\nmore")


def test_tuple_annotations_become_tuple_typespecs() -> None:
    tensor = "VllmBridge.Tensor.t()"
    assert typespec(tuple[torch.Tensor, int], {}) == f"{{{tensor}, integer()}}"
    assert typespec(tuple[Any, Any], {}) == "{term(), term()}"
    assert typespec(tuple[()], {}) == "{}"  # the empty tuple
    for any_tuple in (tuple, typing.Tuple, tuple[int, ...]):  # noqa: UP006
        assert typespec(any_tuple, {}) == "tuple()", any_tuple
    assert (typespec(list, {}), typespec(dict, {})) == ("list()", "map()")


def test_dispatch_returns_the_tensors_it_moves() -> None:
    """vLLM's annotations. dispatch/5 (the seeds' arity) is vLLM 0.34's
    dispatch_router_logits: (hidden_states, router_logits), plus the extra tensors if
    given; dispatch/6 is vLLM 0.34's dispatch: (hidden_states, topk_weights, topk_ids)."""
    tensor = "VllmBridge.Tensor.t()"
    error = "| {:error, VllmBridge.Error.t()}"
    for path in ("device_communicator_base.ex", "group_coordinator.ex"):
        source = (ROOT / "elixir" / "lib" / "vllm" / "distributed" / path).read_text()
        specs = [" ".join(part.split()) for part in source.split("@spec dispatch(")[1:3]]
        # extra_tensors, a list, is given by name only (Options.by_name/3).
        by_name = (
            'with {:ok, args} <- VllmBridge.Runtime.Options.by_name(args, 1, ["extra_tensors"])'
        )
        assert specs[0].startswith(
            f"t(), {tensor}, {tensor}, [term()], keyword()) :: "
            f"{{:ok, {{{tensor}, {tensor}}} | {{{tensor}, {tensor}, [{tensor}]}}}} {error} "
            "def dispatch(ref, hidden_states, router_logits, args \\\\ [], opts \\\\ []) do "
            f"{by_name} do VllmBridge.Runtime.call_method( ref, "
            '"dispatch_router_logits",'
        ), path
        three = f"{tensor}, {tensor}, {tensor}"
        assert specs[1].startswith(
            f"t(), {three}, [term()], keyword() ) :: "
            f"{{:ok, {{{three}}} | {{{three}, [{tensor}]}}}} {error} "
            "def dispatch(ref, hidden_states, topk_weights, topk_ids, args, opts) do "
            f'{by_name} do VllmBridge.Runtime.call_method(ref, "dispatch",'
        ), path


class _Mover:
    def dispatch(self, h: int, w: int, ids: int, sp: bool = False) -> int:
        """Routed tokens."""
        return h + w + ids

    def dispatch_router_logits(self, h: int, logits: int, sp: bool = False) -> int:
        """Tokens with logits."""
        return h + logits

    def other(self, h: int, logits: int, sp: bool = False) -> int:
        """The arities of dispatch_router_logits."""
        return h


def _mover_table(aliases: tuple[tuple[str, str], ...], methods: tuple[str, ...]) -> ExportTable:
    entry = ExportedClass("Mover", _Mover, "Sample.Mover", methods, elixir_aliases=aliases)
    return ExportTable.build([entry])


def test_an_alias_calls_its_method_and_a_longer_namesake_loses_its_defaults() -> None:
    methods = ("dispatch", "dispatch_router_logits")
    (module,) = build(_mover_table((("dispatch", "dispatch_router_logits"),), methods))
    source = render_module(module)
    # The alias keeps the short arities (3..5) and calls the other method on the wire.
    alias = source.split("def dispatch(ref, h, logits, args \\\\ [], opts \\\\ []) do")[1]
    assert (
        alias.split("end")[0]
        .strip()
        .startswith('VllmBridge.Runtime.call_method(ref, "dispatch_router_logits", [h, logits]')
    )
    assert "The same call as `dispatch_router_logits/5`." in source
    # The method of that name is defined at its full arity only, and says so.
    assert "def dispatch(ref, h, w, ids, args, opts) do" in source
    assert "cannot be left out here (pass `[]`)" in source
    assert "def dispatch_router_logits(ref, h, logits, args \\\\ [], opts \\\\ []) do" in source
    assert source.index("def dispatch(ref, h, logits") < source.index("def dispatch(ref, h, w")
    with pytest.raises(ValueError, match=r"Sample.Mover.other/5 would be generated twice"):
        build(_mover_table((("other", "dispatch_router_logits"),), (*methods, "other")))
    with pytest.raises(ValueError, match="must name an exported method, not 'other'"):
        _mover_table((("alias", "other"),), methods)
