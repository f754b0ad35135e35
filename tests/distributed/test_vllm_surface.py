"""vLLM 0.34's distributed surface, read from its released wheel, against ours (issue 38).

For each module and class below, every public function and method of vLLM 0.34 (read
with ``ast`` from the wheel's source: nothing of vLLM is imported) must exist at the same
path in ``bridge_py.distributed``, and take vLLM's positional parameters by the same
names in the same order (ours may add keyword-only ones after them), and vLLM's
keyword-only ones by name, except the names of :data:`OUT_OF_SCOPE` (left out on
purpose, and said so in docs/guide-python.md).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import zipfile
from functools import cache
from typing import Any

import pytest

from tests.distributed.vllm_release import wheel

pytestmark = pytest.mark.timeout(600)

VERSION = "0.34.0"

# vLLM's module (under vllm/distributed/) -> the classes whose methods are compared;
# its public module-level functions are compared too.
MODULES: dict[str, tuple[str, ...]] = {
    "utils": ("StatelessProcessGroup",),
    "parallel_state": ("GroupCoordinator",),
    "communication_op": (),
    "device_communicators/base_device_communicator": (
        "DeviceCommunicatorBase",
        "All2AllManagerBase",
    ),
    "device_communicators/cpu_communicator": ("CpuCommunicator",),
    "device_communicators/pynccl": ("PyNcclCommunicator",),
    "device_communicators/shm_broadcast": ("MessageQueue",),
}

OUT_OF_SCOPE: dict[str, str] = {
    # Groups that only vLLM's engine configuration makes (decode/prefill context
    # parallel, expert load balancing, engram embeddings, inner data parallel).
    **dict.fromkeys(
        [
            "parallel_state:get_dcp_group",
            "parallel_state:get_dcp_world_size_and_rank",
            "parallel_state:get_pcp_group",
            "parallel_state:get_eplb_group",
            "parallel_state:get_engram_dp_group",
            "parallel_state:get_engram_dp_size",
            "parallel_state:get_etp_group",
            "parallel_state:get_inner_dp_world_group",
        ],
        "a group made from vLLM's engine configuration",
    ),
    "parallel_state:set_custom_all_reduce": "vLLM's custom all-reduce kernels",
    **dict.fromkeys(
        [
            "device_communicators/pynccl:PyNcclCommunicator.register_comm_window",
            "device_communicators/pynccl:PyNcclCommunicator.register_comm_window_raw",
            "device_communicators/pynccl:PyNcclCommunicator.deregister_comm_window",
            "device_communicators/pynccl:register_nccl_symmetric_ops",
            "parallel_state:patched_fused_scaled_matmul_reduce_scatter",
            "parallel_state:patched_fused_scaled_matmul_reduce_scatter_fake",
        ],
        "symmetric-memory windows and the torch.compile ops built on them",
    ),
    "device_communicators/pynccl:defer_comm_warmup_on_rocm": "ROCm",
}
"""vLLM 0.34 names bridge_py leaves out on purpose, and why (docs/guide-python.md,
"Out of scope", says the same to users)."""


def _source(module: str) -> str:
    with zipfile.ZipFile(wheel(VERSION)) as whl:
        return whl.read(f"vllm/distributed/{module}.py").decode()


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[str], list[str]]:
    """(positional parameter names in order, keyword-only names) of a ``def``."""
    args = fn.args
    return [a.arg for a in [*args.posonlyargs, *args.args]], [a.arg for a in args.kwonlyargs]


def _public(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"


@cache
def vllm_surface() -> dict[str, tuple[list[str], list[str]]]:
    """``module:name`` / ``module:Class.method`` -> vLLM 0.34's parameters."""
    surface = {}
    for module, classes in MODULES.items():
        tree = ast.parse(_source(module))
        for node in tree.body:
            is_def = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if is_def and _public(node.name) and node.name != "__init__":
                surface[f"{module}:{node.name}"] = _params(node)
            if isinstance(node, ast.ClassDef) and node.name in classes:
                for item in node.body:
                    is_def = isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                    if is_def and _public(item.name):
                        surface[f"{module}:{node.name}.{item.name}"] = _params(item)
    return surface


def _ours(path: str) -> Any:
    module, _, name = path.partition(":")
    try:
        found: Any = importlib.import_module("bridge_py.distributed." + module.replace("/", "."))
    except ModuleNotFoundError:
        return None
    for part in name.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def _differs(path: str, theirs: tuple[list[str], list[str]]) -> str | None:
    """Why ours at ``path`` does not take vLLM's parameters ``theirs`` (None: it does)."""
    ours = _ours(path)
    if ours is None:
        return "missing"
    if isinstance(ours, property) or not callable(ours):
        return None  # an attribute or property where vLLM has a method of no arguments
    try:
        signature = inspect.signature(ours)
    except (TypeError, ValueError):
        return None
    kinds = inspect.Parameter
    positional = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    named = {
        p.name
        for p in signature.parameters.values()
        if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    }
    takes_any = any(p.kind is kinds.VAR_KEYWORD for p in signature.parameters.values())
    wanted, keywords = theirs
    if wanted and wanted[0] in ("self", "cls") and (not positional or positional[0] != wanted[0]):
        wanted = wanted[1:]  # a bound or static method of ours
    if positional[: len(wanted)] != wanted:
        return f"positional parameters {positional}, vLLM's {wanted}"
    absent = [k for k in keywords if k not in named and not takes_any]
    if absent:
        return f"no keyword parameters {absent}"
    return None


def test_the_wheel_has_the_surface_this_test_reads() -> None:
    surface = vllm_surface()
    assert "utils:StatelessProcessGroup.create" in surface
    assert "parallel_state:GroupCoordinator.all_reduce" in surface
    assert "device_communicators/shm_broadcast:MessageQueue.dequeue" in surface


def test_what_is_left_out_is_still_in_vllm() -> None:
    surface = vllm_surface()
    assert [path for path in OUT_OF_SCOPE if path not in surface] == []


def test_every_public_function_and_method_of_vllm_is_ours_with_its_parameters() -> None:
    problems = {
        path: why
        for path, theirs in sorted(vllm_surface().items())
        if (why := _differs(path, theirs)) is not None
    }
    unexpected = {path: why for path, why in problems.items() if path not in OUT_OF_SCOPE}
    assert unexpected == {}, f"differs from vLLM {VERSION}: {unexpected}"
    arrived = sorted(set(OUT_OF_SCOPE) - set(problems))
    assert arrived == [], f"built after all: take these off OUT_OF_SCOPE: {arrived}"
