"""Small helpers of ``vllm.distributed.utils``: divisibility, tensor splitting, layer partitioning.

The same names and results as vLLM's. ``StatelessProcessGroup`` and the stateless torch
process-group functions, which vLLM also keeps in this module, are re-exported from their own
modules here so that ``from ...utils import StatelessProcessGroup`` works as it does in vLLM.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from bridge_py.distributed import parallel_state
from bridge_py.distributed.errors import StateError
from bridge_py.distributed.groups.torch_group import (
    cpu_all_reduce_,
    default_group_timeout,
    init_gloo_process_group,
    set_gloo_backend_timeout,
    stateless_destroy_torch_distributed_process_group,
    stateless_init_torch_distributed_process_group,
)
from bridge_py.distributed.shm.wait import sched_yield
from bridge_py.distributed.spg.group import StatelessProcessGroup
from bridge_py.distributed.store.ports import (
    allocate_group_ports,
    create_tcp_store,
    fetch_group_ports,
    get_cached_tcp_store_client,
)

__all__ = [
    "StatelessProcessGroup",
    "all_reduce_int",
    "allocate_group_ports",
    "cpu_all_reduce_",
    "create_tcp_store",
    "divide",
    "ensure_divisibility",
    "enter_steady_state",
    "fetch_group_ports",
    "get_cached_tcp_store_client",
    "get_cpu_distributed_timeout_or_none",
    "get_distributed_timeout_or_none",
    "get_pp_indices",
    "get_worker_rank_suffix",
    "init_gloo_process_group",
    "is_weak_contiguous",
    "sched_yield",
    "set_gloo_backend_timeout",
    "split_tensor_along_last_dim",
    "stateless_destroy_torch_distributed_process_group",
    "stateless_init_torch_distributed_process_group",
    "steady_state_entered",
    "verify_group_size_divides_partition",
]

# vLLM's environment variable for a hand-made pipeline partition, e.g. "4,4,5,3".
PP_LAYER_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Ensure that numerator is divisible by the denominator.

    Raises ValueError (vLLM asserts) so that the check survives ``python -O``.
    """
    if denominator == 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


_steady_state = False


def enter_steady_state() -> None:
    """Note that this process is past its start-up (vLLM's engine calls it once its
    warm-up is done; code may then choose shorter timeouts): see
    :func:`steady_state_entered`."""
    global _steady_state
    _steady_state = True


def steady_state_entered() -> bool:
    """Whether :func:`enter_steady_state` has been called in this process."""
    return _steady_state


def get_distributed_timeout_or_none() -> datetime.timedelta | None:
    """The timeout of the distributed environment: the one torch.distributed's default
    group was made with (``init_distributed_environment``'s ``timeout``), or None when
    there is none to read (vLLM reads its engine's configuration; there is none here)."""
    return default_group_timeout()


def get_cpu_distributed_timeout_or_none() -> datetime.timedelta | None:
    """The timeout of CPU (gloo) collectives: :func:`get_distributed_timeout_or_none`'s,
    since this package's CPU groups are made with it."""
    return get_distributed_timeout_or_none()


def all_reduce_int(
    group: ProcessGroup | None, value: int, op: ReduceOp | ReduceOp.RedOpType = ReduceOp.MIN
) -> int:
    """``value`` reduced with ``op`` (default MIN) over the CPU process group ``group``,
    for ranks to agree on a size or a decision; ``value`` itself with no group or a group
    of one rank."""
    if group is None or group.size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=op, group=group)
    return int(tensor.item())


def verify_group_size_divides_partition(
    input_size_per_partition: int,
    group_size: int,
    layer_name: str | None = None,
    extra_suggestion: str = "",
) -> None:
    """ValueError unless a tensor-parallel shard of ``input_size_per_partition`` holds a
    whole number of quantization groups of ``group_size``."""
    if group_size and input_size_per_partition % group_size == 0:
        return
    where = f" for layer '{layer_name}'" if layer_name else ""
    raise ValueError(
        f"Weight {input_size_per_partition=}{where} is not divisible by {group_size=}: "
        "tensor_parallel_size splits the layer's input into shards that are not a whole "
        f"number of quantization groups. Consider reducing tensor_parallel_size{extra_suggestion}."
    )


def is_weak_contiguous(inp: torch.Tensor) -> bool:
    """Whether ``inp`` fills one block of memory: contiguous, or (column-major and the
    like) its storage from its offset on holds exactly its elements."""
    if inp.is_contiguous():
        return True
    left = inp.untyped_storage().nbytes() - inp.storage_offset() * inp.element_size()
    return left == inp.numel() * inp.element_size()


def divide(numerator: int, denominator: int) -> int:
    """Ensure that numerator is divisible by the denominator and return
    the division value."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor,
    num_partitions: int,
    contiguous_split_chunks: bool = False,
) -> Sequence[torch.Tensor]:
    """Split a tensor along its last dimension.

    Arguments:
        tensor: input tensor.
        num_partitions: number of partitions to split the tensor
        contiguous_split_chunks: If True, make each chunk contiguous
                                 in memory.

    Returns:
        A list of Tensors (views of ``tensor`` unless ``contiguous_split_chunks``).
    """
    last_dim = tensor.dim() - 1
    chunk = divide(tensor.size()[last_dim], num_partitions)
    pieces = torch.split(tensor, chunk, dim=last_dim)
    if contiguous_split_chunks:
        return tuple(piece.contiguous() for piece in pieces)
    return pieces


def _partition_from_env(text: str, num_hidden_layers: int, pp_size: int) -> list[int]:
    try:
        partitions = [int(layer) for layer in text.split(",")]
    except ValueError as err:
        raise ValueError(f"Invalid partition string: {text}") from err
    if len(partitions) != pp_size:
        raise ValueError(f"{len(partitions)=} does not match {pp_size=}.")
    if sum(partitions) != num_hidden_layers:
        raise ValueError(f"{sum(partitions)=} does not match {num_hidden_layers=}.")
    if any(p < 0 for p in partitions):
        raise ValueError(f"Negative layer count in {text=}.")
    return partitions


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Try to evenly distribute layers across partitions.

    If the number of layers is not divisible by the number of partitions, the remaining
    layers are spread one each over the partitions just before the last one (the last
    partition often holds an extra norm layer, so it is spared). The environment variable
    ``VLLM_PP_LAYER_PARTITION`` ("4,4,5,3") overrides the split, as in vLLM. Returns the
    half-open range ``(start_layer, end_layer)`` of ``pp_rank``.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    text = os.environ.get(PP_LAYER_PARTITION_ENV)
    if text is not None:
        partitions = _partition_from_env(text, num_hidden_layers, pp_size)
    else:
        partitions = [num_hidden_layers // pp_size] * pp_size
        remaining = num_hidden_layers % pp_size
        for i in range(2, remaining + 2):
            partitions[-i] += 1
    start_layer = sum(partitions[:pp_rank])
    return start_layer, start_layer + partitions[pp_rank]


def get_worker_rank_suffix(global_rank: int | None = None) -> str:
    """This worker's place in the parallel layout, for names of files and logs:
    ``"dp0_pp1_tp0_dcp0_ep0"`` (its rank in the data, pipeline, tensor, decode context
    and expert parallel groups; decode context parallelism is always 1 here, so ``dcp0``),
    then ``"_rank{global_rank}"`` when ``global_rank`` is given. Before the model parallel
    groups exist: ``"rank{global_rank}"``, or ``""`` without one, as vLLM's.

    Raises:
        TypeError: ``global_rank`` is neither None nor an int.
        ValueError: ``global_rank`` is negative.
    """
    if global_rank is not None:
        if isinstance(global_rank, bool) or not isinstance(global_rank, int):
            raise TypeError(f"global_rank must be an int or None, got {type(global_rank).__name__}")
        if global_rank < 0:
            raise ValueError(f"global_rank must not be negative, got {global_rank}")
    ps = parallel_state
    try:
        ranks = [g().rank_in_group for g in (ps.get_dp_group, ps.get_pp_group, ps.get_tp_group)]
        ep = ps.get_ep_group().rank_in_group
    except StateError:  # the model parallel groups are not initialized
        return "" if global_rank is None else f"rank{global_rank}"
    suffix = "dp{}_pp{}_tp{}_dcp0_ep{}".format(*ranks, ep)
    return suffix if global_rank is None else f"{suffix}_rank{global_rank}"
