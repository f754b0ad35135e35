"""Which ranks of a group share one node's shared memory: one probe for everything that asks.

The rank asked about creates a small segment holding a random token after the shared-memory
header (``shm.header``, magic ``VBPR``) and tells the others its name; every rank tries to
open it (``shm.posix.attach``: this user's file only) and compares the token; an all-gather
tells everyone the answers. GroupCoordinator's ``in_the_same_node_as`` (vLLM's name and
signature), the device communicators and ``MessageQueue.create_from_process_group`` all ask
through :func:`same_node_as`.
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Any

import torch.distributed as dist
from torch.distributed import Backend, ProcessGroup

from bridge_py.distributed.auth import resolve_key
from bridge_py.distributed.errors import SharedMemoryError
from bridge_py.distributed.groups.objects import ObjectGroup, object_group
from bridge_py.distributed.shm import posix
from bridge_py.distributed.shm.header import Header

__all__ = ["in_the_same_node_as", "same_node_as"]

PROBE_PREFIX = "vbprobe_"
_PROBE = Header(b"VBPR", 1, "2x16s")  # the token


def same_node_as(group: ObjectGroup, src: int) -> list[bool]:
    """For every rank of ``group`` (group ranks), whether it can open shared memory that
    ``src`` created. A collective: every rank calls it with the same ``src``."""
    if group.rank == src:
        token = secrets.token_bytes(16)
        try:
            probe = posix.create(PROBE_PREFIX + secrets.token_hex(8), _PROBE.size)
        except (OSError, SharedMemoryError):  # no (room in) shared memory: nobody shares it
            group.broadcast_obj(None, src)
            return [bool(x) for x in group.all_gather_obj(True)]
        try:
            _PROBE.pack_into(posix.view(probe), token)
            group.broadcast_obj((probe.name, token), src)
            return [bool(x) for x in group.all_gather_obj(True)]
        finally:
            probe.close()
            with contextlib.suppress(FileNotFoundError):
                posix.unlink(probe)
    shared = group.broadcast_obj(None, src)
    same = False
    if isinstance(shared, tuple) and len(shared) == 2:
        name, token = shared
        with contextlib.suppress(OSError, ValueError, TypeError, SharedMemoryError):
            segment = posix.attach(str(name))
            try:
                same = _PROBE.unpack_from(posix.view(segment), str(name)) == (token,)
            finally:
                segment.close()
    return [bool(x) for x in group.all_gather_obj(same)]


def in_the_same_node_as(pg: ProcessGroup | Any, source_rank: int = 0) -> list[bool]:
    """
    This is a collective operation that returns if each rank is in the same node
    as the source rank. It tests if processes are attached to the same
    memory system (shared access to shared memory).

    ``pg`` is a gloo ProcessGroup or a StatelessProcessGroup; ``source_rank`` and the
    result's indices are its ranks.
    """
    if isinstance(pg, ProcessGroup) and _backend(pg) == Backend.NCCL:
        raise ValueError("in_the_same_node_as should be tested with a non-NCCL group.")
    # Over a torch group the probe's name travels sealed with the operator's key; a
    # StatelessProcessGroup seals with its own.
    group = object_group(pg, resolve_key(None), purpose="same_node")
    if not 0 <= source_rank < group.world_size:
        raise ValueError(f"source_rank must be in [0, {group.world_size}), got {source_rank}")
    return same_node_as(group, source_rank)


def _backend(pg: ProcessGroup) -> str:
    try:
        return str(dist.get_backend(pg))
    except (RuntimeError, ValueError):  # a group unknown to torch's global state
        return str(pg.name())
