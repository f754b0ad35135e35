"""The little that the ``distribute`` gathers need from a group, for every kind of group.

ModelOpt's gathers only call ``barrier(group)``. Ours also agree on what names each call
(:class:`CallId`: a random token, so that two calls, or two jobs on one node, never collide,
and the reader's process, so that segments whose reader is gone can be found and removed), so
a group must offer three things: this process's rank in the group, a barrier, and a
broadcast of a few non-negative 63-bit integers. :func:`as_group_sync` gathers them into one
:class:`GroupSync` for:

* a torch ``ProcessGroup`` (torch's global groups or one from
  ``stateless_init_torch_distributed_process_group``): the collectives are called on the
  object itself, so its ranks are group ranks; the tensors live on the group's device
  (CPU when it has a CPU backend, else the current CUDA device);
* a ``StatelessProcessGroup``: ``barrier(timeout)`` and ``broadcast_obj``;
* a ``GroupCoordinator`` (duck-typed: an object with ``barrier()`` and ``cpu_group``): its
  own ``barrier()``; its rank (``rank_in_group``, else the CPU group's) and the broadcast
  of its ``cpu_group`` (a torch ProcessGroup or a StatelessProcessGroup);
* ``None``: torch.distributed's default group when it is initialized, else a group of this
  process alone.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from bridge_py.distributed.coordinator.group import GroupCoordinator
from bridge_py.distributed.errors import DistributedError
from bridge_py.distributed.groups.work import finish
from bridge_py.distributed.shm.wait import pid_namespace
from bridge_py.distributed.spg.group import StatelessProcessGroup

__all__ = ["CallId", "GroupSync", "SyncGroup", "as_group_sync"]

# StatelessProcessGroup.barrier's own default, used when the caller gives no timeout.
_DEFAULT_BARRIER_TIMEOUT = 30.0


class CallId(NamedTuple):
    """What names one gather call on every rank: a random ``token`` and the reader's
    process (``pid`` in PID namespace ``namespace``), the one that reads and removes what
    the call leaves in shared memory."""

    token: int
    pid: int
    namespace: int


@dataclasses.dataclass(frozen=True)
class GroupSync:
    """Rank, size, barrier and a token broadcast: what one gather needs from its group."""

    rank: int
    size: int
    #: Returns once every rank of the group has called it (raises if that cannot happen).
    barrier: Callable[[], None]
    #: ``broadcast(values, src)``: ``src``'s list of ints on every rank (as many as given).
    broadcast: Callable[[list[int], int], list[int]]

    def agree_call(self, src: int) -> CallId:
        """The same :class:`CallId` on every rank: a token drawn by rank ``src``, which is
        the reader. Raises DistributedError if what arrives is not one."""
        if self.rank == src:
            mine = [secrets.randbits(63), os.getpid(), pid_namespace()]
        else:
            mine = [0] * len(CallId._fields)  # the shape src sends: overwritten
        got = self.broadcast(mine, src)
        if not (
            isinstance(got, list)
            and len(got) == len(CallId._fields)
            and all(type(v) is int and 0 <= v < 1 << 63 for v in got)
        ):
            raise DistributedError(f"rank {src} sent {got!r:.80} where a gather's id belongs")
        return CallId(*got)


def _torch_sync(pg: ProcessGroup) -> GroupSync:
    """A torch ProcessGroup: the barrier is a one-element all-reduce (any backend has one);
    the tensors live on the CPU when the group has a CPU backend, else on the current GPU."""
    device_types = getattr(pg, "_device_types", None)
    device = torch.device("cpu")
    if device_types is not None and not any(d.type == "cpu" for d in device_types):
        device = torch.device("cuda", torch.cuda.current_device())

    where = f"rank {pg.rank()} of a gather's group"
    bounded = device.type == "cpu"  # a GPU's wait only orders its stream (groups.work)

    def barrier() -> None:
        finish(
            pg.allreduce([torch.zeros(1, device=device)]),
            "barrier",
            where,
            bounded=bounded,
            group=pg,
        )

    def broadcast(values: list[int], src: int) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64, device=device)
        finish(pg.broadcast(tensor, src), "broadcast", where, bounded=bounded, group=pg)
        return [int(v) for v in tensor.tolist()]

    return GroupSync(pg.rank(), pg.size(), barrier, broadcast)


def _stateless_sync(group: StatelessProcessGroup, timeout: float | None) -> GroupSync:
    """A StatelessProcessGroup: its bounded barrier and its store broadcast."""
    wait = _DEFAULT_BARRIER_TIMEOUT if timeout is None else float(timeout)
    return GroupSync(
        group.rank,
        group.world_size,
        lambda: group.barrier(timeout=wait),
        lambda values, src: group.broadcast_obj(values, src),
    )


SyncGroup: TypeAlias = ProcessGroup | StatelessProcessGroup | GroupCoordinator | None
"""What a gather synchronizes over (see the module docstring)."""


def as_group_sync(group: Any, timeout: float | None = None) -> GroupSync:
    """The :class:`GroupSync` of ``group`` (see the module docstring for the kinds accepted).

    ``timeout`` bounds each barrier of a StatelessProcessGroup (default 30 s); torch groups
    and GroupCoordinators use their own timeouts. Raises TypeError for anything else.
    """
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if group is None:
        if dist.is_available() and dist.is_initialized():
            world = dist.group.WORLD
            assert isinstance(world, ProcessGroup)
            return _torch_sync(world)
        return GroupSync(0, 1, lambda: None, lambda values, src: values)  # this process alone
    if isinstance(group, ProcessGroup):
        return _torch_sync(group)
    if isinstance(group, StatelessProcessGroup) or (
        hasattr(group, "broadcast_obj") and hasattr(group, "world_size")
    ):
        return _stateless_sync(group, timeout)
    cpu_group = getattr(group, "cpu_group", None)
    if callable(getattr(group, "barrier", None)) and cpu_group is not None:
        # A GroupCoordinator: its own barrier, over its CPU group's broadcast and rank.
        if isinstance(cpu_group, StatelessProcessGroup):
            sync = _stateless_sync(cpu_group, timeout)
        elif isinstance(cpu_group, ProcessGroup):
            sync = _torch_sync(cpu_group)
            sync = dataclasses.replace(sync, rank=int(getattr(group, "rank_in_group", sync.rank)))
        else:
            raise TypeError(
                f"group.cpu_group must be a torch ProcessGroup, got {type(cpu_group).__name__}"
            )
        return dataclasses.replace(sync, barrier=group.barrier)
    raise TypeError(
        "group must be a torch ProcessGroup, a StatelessProcessGroup, a GroupCoordinator "
        f"(barrier() and cpu_group) or None, got {type(group).__name__}"
    )
