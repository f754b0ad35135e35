"""How a GroupCoordinator's groups are laid out: the ranks it is given, its name, its device
and the device communicator that runs its collectives."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Backend

from bridge_py.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)
from bridge_py.distributed.device_communicators.cpu_communicator import CpuCommunicator

__all__ = ["check_group_ranks", "communicator_class", "device_for", "unique_name"]

_group_name_counter: dict[str, int] = {}


def unique_name(name: str) -> str:
    """Get a unique name for the group: ``tp`` -> ``tp:0``, then ``tp:1``, ..."""
    index = _group_name_counter.get(name, 0)
    _group_name_counter[name] = index + 1
    return f"{name}:{index}"


def device_for(backend: str, local_rank: int) -> torch.device:
    """The device a group's tensors live on: CUDA for NCCL groups, else the CPU."""
    if str(backend) == Backend.NCCL and torch.cuda.is_available():
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def communicator_class(device: torch.device) -> type[DeviceCommunicatorBase]:
    """The device communicator for tensors on ``device``."""
    if device.type == "cuda":
        from bridge_py.distributed.device_communicators.cuda_communicator import (
            CudaCommunicator,
        )

        return CudaCommunicator
    return CpuCommunicator


def check_group_ranks(group_ranks: Any) -> None:
    """Raise ValueError unless ``group_ranks`` lists disjoint lists of distinct ranks of the
    world (torch.distributed's), as every rank must pass them."""
    if not isinstance(group_ranks, (list, tuple)) or not group_ranks:
        raise ValueError(f"group_ranks must be a non-empty list of rank lists, got {group_ranks!r}")
    world = dist.get_world_size()
    seen: set[int] = set()
    for ranks in group_ranks:
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise ValueError(f"each entry of group_ranks must be a non-empty list, got {ranks!r}")
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
                raise ValueError(f"rank {r!r} in group_ranks is not in [0, {world})")
        if len(set(ranks)) != len(ranks) or seen & set(ranks):
            raise ValueError(f"group_ranks {group_ranks} names a rank twice")
        seen.update(ranks)
