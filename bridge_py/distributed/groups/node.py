"""``in_the_same_node_as``: which ranks of a group share this node's memory, as vLLM's."""

from __future__ import annotations

import contextlib
from multiprocessing import shared_memory

import torch
import torch.distributed as dist
from torch.distributed import Backend, ProcessGroup

from bridge_py.distributed.auth import resolve_key
from bridge_py.distributed.device_communicators.shm_ring import attach_segment
from bridge_py.distributed.groups.objects import ObjectChannel
from bridge_py.distributed.spg.group import StatelessProcessGroup

__all__ = ["in_the_same_node_as"]


def _group_info(pg: ProcessGroup | StatelessProcessGroup) -> tuple[int, int, list[int]]:
    if isinstance(pg, ProcessGroup):
        if dist.get_backend(pg) == Backend.NCCL:
            raise ValueError("in_the_same_node_as should be tested with a non-NCCL group.")
        return (
            dist.get_rank(group=pg),
            dist.get_world_size(group=pg),
            dist.get_process_group_ranks(pg),
        )
    return pg.rank, pg.world_size, list(range(pg.world_size))


def in_the_same_node_as(
    pg: ProcessGroup | StatelessProcessGroup, source_rank: int = 0
) -> list[bool]:
    """
    This is a collective operation that returns if each rank is in the same node
    as the source rank. It tests if processes are attached to the same
    memory system (shared access to shared memory).

    ``source_rank`` and the result's indices are ranks of ``pg``.
    """
    rank, world_size, ranks = _group_info(pg)
    if not 0 <= source_rank < world_size:
        raise ValueError(f"source_rank must be in [0, {world_size}), got {source_rank}")
    flags = torch.zeros(world_size, dtype=torch.int32)
    magic = b"magic_message"
    shm: shared_memory.SharedMemory | None = None

    # The probe's name travels like any object (sealed with the operator's key); a
    # StatelessProcessGroup uses its own key.
    channel = (
        ObjectChannel(pg, ranks, rank, resolve_key(None), "same_node")
        if isinstance(pg, ProcessGroup)
        else None
    )

    def share(name: str | None) -> str | None:
        if channel is not None:
            result: str | None = channel.broadcast(name, source_rank)
            return result
        return pg.broadcast_obj(name, src=source_rank)

    try:
        if rank == source_rank:
            try:
                shm = shared_memory.SharedMemory(create=True, size=128)
                shm.buf[: len(magic)] = magic
                name = shm.name
            except OSError:
                name = None
            share(name)
            flags[rank] = 1
        else:
            name = share(None)
            if name is not None:
                with contextlib.suppress(OSError):
                    shm = attach_segment(name)  # checked: this user's file only
                    if bytes(shm.buf[: len(magic)]) == magic:
                        flags[rank] = 1
    finally:
        if shm is not None:
            shm.close()
    if isinstance(pg, ProcessGroup):
        dist.barrier(group=pg)
    else:
        pg.barrier()
    if rank == source_rank and shm is not None:
        with contextlib.suppress(OSError):
            shm.unlink()
    if isinstance(pg, ProcessGroup):
        dist.all_reduce(flags, group=pg)
        total = flags
    else:
        total = torch.zeros_like(flags)
        for i in range(world_size):
            total += pg.broadcast_obj(flags, src=i)
    return [bool(x == 1) for x in total.tolist()]
