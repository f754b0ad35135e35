"""Our signatures against vLLM 0.33's and 0.34's: same parameter names, order and defaults.

The expected lists are copied from vLLM's source (vllm/distributed/...). Every parameter
vLLM has comes in its place, so a call written for vLLM, positional or by name, means the
same here; our own additions are keyword-only. Where vLLM has no default we may have one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from bridge_py.distributed import parallel_state as ps
from bridge_py.distributed import utils
from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue

REQUIRED = inspect.Parameter.empty
MiB = 1024 * 1024

# (where vLLM defines it, our callable, vLLM's parameters as (name, default))
VLLM: list[tuple[str, Callable[..., Any], list[tuple[str, Any]]]] = [
    (
        "shm_broadcast.MessageQueue.__init__",
        MessageQueue.__init__,
        [
            ("self", REQUIRED),
            ("n_reader", REQUIRED),
            ("n_local_reader", REQUIRED),
            ("local_reader_ranks", None),
            ("max_chunk_bytes", 24 * MiB),
            ("max_chunks", 10),
            ("connect_ip", None),
            ("enable_shm_tensor_arena", False),
        ],
    ),
    (
        "shm_broadcast.MessageQueue.enqueue",
        MessageQueue.enqueue,
        [("self", REQUIRED), ("obj", REQUIRED), ("timeout", None)],
    ),
    (
        "shm_broadcast.MessageQueue.dequeue",
        MessageQueue.dequeue,
        [("self", REQUIRED), ("timeout", None), ("indefinite", False)],
    ),
    ("shm_broadcast.MessageQueue.shutdown", MessageQueue.shutdown, [("self", REQUIRED)]),
    (
        "shm_broadcast.MessageQueue.create_from_handle",
        MessageQueue.create_from_handle,
        [("handle", REQUIRED), ("rank", REQUIRED)],
    ),
    (
        "shm_broadcast.MessageQueue.create_from_process_group",
        MessageQueue.create_from_process_group,
        [
            ("pg", REQUIRED),
            ("max_chunk_bytes", REQUIRED),
            ("max_chunks", REQUIRED),
            ("writer_rank", 0),
            ("external_writer_handle", None),
            ("blocking", True),
        ],
    ),
    ("parallel_state._node_count", ps._node_count, [("pg", REQUIRED)]),
    (
        "parallel_state.GroupCoordinator.__init__",
        ps.GroupCoordinator.__init__,
        [
            ("self", REQUIRED),
            ("group_ranks", REQUIRED),
            ("local_rank", REQUIRED),
            ("torch_distributed_backend", REQUIRED),
            ("use_device_communicator", REQUIRED),
            ("use_message_queue_broadcaster", False),
            ("group_name", None),
            ("use_all2all", False),
        ],
    ),
    (
        "parallel_state.initialize_model_parallel",
        ps.initialize_model_parallel,
        [
            ("tensor_model_parallel_size", 1),
            ("pipeline_model_parallel_size", 1),
            ("prefill_context_model_parallel_size", 1),
            ("decode_context_model_parallel_size", 1),
            ("backend", None),
        ],
    ),
    (
        "parallel_state.ensure_model_parallel_initialized",
        ps.ensure_model_parallel_initialized,
        [
            ("tensor_model_parallel_size", REQUIRED),
            ("pipeline_model_parallel_size", REQUIRED),
            ("prefill_context_model_parallel_size", 1),
            ("decode_context_model_parallel_size", 1),
            ("backend", None),
        ],
    ),
    (
        "utils.stateless_init_torch_distributed_process_group",
        utils.stateless_init_torch_distributed_process_group,
        [
            ("host", REQUIRED),
            ("port", REQUIRED),
            ("rank", REQUIRED),
            ("world_size", REQUIRED),
            ("backend", REQUIRED),
            ("group_name", None),
            ("return_store", False),
            ("listen_socket", None),
            ("timeout", None),  # (vLLM 0.34)
        ],
    ),
]


@pytest.mark.parametrize(("where", "ours", "theirs"), VLLM, ids=[v[0] for v in VLLM])
def test_parameters_are_vllms(
    where: str, ours: Callable[..., Any], theirs: list[tuple[str, Any]]
) -> None:
    params = list(inspect.signature(ours).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert [p.name for p in positional] == [name for name, _ in theirs], where
    for param, (name, default) in zip(positional, theirs, strict=True):
        if default is not REQUIRED:
            assert param.default == default, f"{where}: {name}"
    extra = [p.name for p in params if p.kind not in (p.KEYWORD_ONLY, p.VAR_KEYWORD)]
    assert extra == [p.name for p in positional], f"{where}: our additions are keyword-only"
