"""Object collectives over whatever group MessageQueue.create_from_process_group is given.

Three kinds of group are accepted: a ``StatelessProcessGroup`` (or anything with ``rank``,
``world_size``, ``broadcast_obj`` and ``all_gather_obj``), a torch ``ProcessGroup`` with a CPU
backend (gloo), used through its own methods so that groups made by
``stateless_init_torch_distributed_process_group`` (unknown to torch's global state) work
too, and a GroupCoordinator-like object, through its ``cpu_group``. Ranks are group ranks.

:func:`same_node_as` tells which ranks share the writer's shared memory: the writer creates a
small probe segment holding a random token, every rank tries to open it and compares.

Over a torch ProcessGroup the objects are pickled (``shm_serialization``); given the queue's
key they are sealed, each bound to its operation, sender and number, and checked before
they are unpickled, so that nobody who can inject into the group's gloo connections makes a
rank unpickle anything.
"""

from __future__ import annotations

import contextlib
import secrets
from multiprocessing import shared_memory
from typing import Any, Protocol

import torch
from torch.distributed import ProcessGroup

from bridge_py.distributed.device_communicators.shm_ring import attach_segment
from bridge_py.distributed.device_communicators.shm_serialization import pack, unpack

__all__ = ["ObjectGroup", "object_group", "same_node_as"]

_PROBE_PREFIX = "vbmqp_"


class ObjectGroup(Protocol):
    """What MessageQueue needs of a group: its size, our rank, two object collectives."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast_obj(self, obj: Any | None, src: int) -> Any: ...

    def all_gather_obj(self, obj: Any) -> list[Any]: ...


class _TorchObjectGroup:
    """Object collectives over a torch ProcessGroup's CPU tensors (length, then bytes).

    With ``key`` (resolved: ``auth.resolve_key``) every object is sealed for the operation,
    its sender and its number on this group object, and checked before it is unpickled.
    """

    def __init__(self, pg: ProcessGroup, key: bytes | None) -> None:
        self._pg = pg
        self._key = key
        self._ops = 0
        self.rank = pg.rank()
        self.world_size = pg.size()

    def _context(self, op: str, sender: int) -> str:
        return f"mq/group/{op}/{self._ops}/{sender}"

    def broadcast_obj(self, obj: Any | None, src: int) -> Any:
        context = self._context("broadcast", src)
        self._ops += 1
        if self.rank == src:
            data = pack(obj, self._key, context)
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._pg.broadcast(size, src).wait()
        if self.rank == src:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._pg.broadcast(payload, src).wait()
        if self.rank == src:
            return obj
        return unpack(payload.numpy().tobytes(), self._key, context, f"an object from rank {src}")

    def all_gather_obj(self, obj: Any) -> list[Any]:
        contexts = [self._context("all_gather", r) for r in range(self.world_size)]
        self._ops += 1
        data = pack(obj, self._key, contexts[self.rank])
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        longest = max(int(size.item()) for size in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._pg.allgather([gathered], [mine]).wait()
        return [
            unpack(
                tensor[: int(size.item())].numpy().tobytes(),
                self._key,
                contexts[r],
                f"the all_gather value of rank {r}",
            )
            for r, (tensor, size) in enumerate(zip(gathered, sizes, strict=True))
        ]


def object_group(pg: Any, key: bytes | None = None) -> ObjectGroup:
    """``pg`` as an :class:`ObjectGroup` (see the module docstring for what is accepted).

    ``key`` (already resolved) seals the objects of a torch ProcessGroup; a
    StatelessProcessGroup seals with its own key.
    """
    if hasattr(pg, "cpu_group"):  # a GroupCoordinator: its CPU group carries metadata
        return object_group(pg.cpu_group, key)
    if isinstance(pg, ProcessGroup):
        return _TorchObjectGroup(pg, key)
    if all(hasattr(pg, name) for name in ("rank", "world_size", "broadcast_obj", "all_gather_obj")):
        return pg
    raise TypeError(
        "expected a StatelessProcessGroup, a torch ProcessGroup or an object with a "
        f"cpu_group, got {type(pg).__name__}"
    )


def same_node_as(group: ObjectGroup, src: int) -> list[bool]:
    """For every rank of ``group``, whether it can open shared memory created by ``src``.

    A collective: every rank must call it with the same ``src``.
    """
    if group.rank == src:
        token = secrets.token_bytes(16)
        probe = shared_memory.SharedMemory(
            name=_PROBE_PREFIX + secrets.token_hex(6), create=True, size=len(token)
        )
        try:
            probe.buf[: len(token)] = token
            group.broadcast_obj((probe.name, token), src)
            return group.all_gather_obj(True)
        finally:
            probe.close()
            with contextlib.suppress(FileNotFoundError):
                probe.unlink()
    name, token = group.broadcast_obj(None, src)
    try:
        segment = attach_segment(name)
    except OSError:
        same = False
    else:
        try:
            same = bytes(segment.buf[: len(token)]) == token
        finally:
            segment.close()
    return group.all_gather_obj(same)
