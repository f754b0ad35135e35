"""The little that the ``distribute`` gathers need from a group, for every kind of group.

ModelOpt's gathers only call ``barrier(group)``. Ours also agree on a random token per call
(it names the call's shared-memory segments and workspace folder, so that two calls, or two
jobs on one node, never collide), so a group must offer three things: this process's rank in
the group, a barrier, and a broadcast of one 63-bit integer. :func:`as_group_sync` provides
them for:

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

import secrets
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from bridge_py.distributed.spg.group import StatelessProcessGroup

__all__ = ["GroupSync", "as_group_sync"]

# StatelessProcessGroup.barrier's own default, used when the caller gives no timeout.
_DEFAULT_BARRIER_TIMEOUT = 30.0


class GroupSync(Protocol):
    """Rank, size, barrier and a token broadcast: what one gather needs from its group."""

    rank: int
    size: int

    def barrier(self) -> None:
        """Return once every rank of the group has called it (raise if that cannot happen)."""

    def agree_token(self, src: int) -> int:
        """Return the same random non-negative int on every rank, drawn by rank ``src``."""


def _draw_token() -> int:
    return secrets.randbits(63)


class _Alone:
    """A group of this process alone (no torch.distributed, no group given)."""

    rank = 0
    size = 1

    def barrier(self) -> None:
        return None

    def agree_token(self, src: int) -> int:
        return _draw_token()


def _pg_device(pg: ProcessGroup) -> torch.device:
    """The device of the tensors that ``pg``'s collectives take: CPU when it can, else CUDA."""
    device_types = getattr(pg, "_device_types", None)
    if device_types is None or any(d.type == "cpu" for d in device_types):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class _TorchGroup:
    """A torch ProcessGroup: the barrier is a one-element all-reduce (any backend has one)."""

    def __init__(self, pg: ProcessGroup, barrier_fn: Any = None, rank: int | None = None) -> None:
        self._pg = pg
        self._device = _pg_device(pg)
        self._barrier_fn = barrier_fn
        self.rank = pg.rank() if rank is None else int(rank)
        self.size = pg.size()

    def barrier(self) -> None:
        if self._barrier_fn is not None:
            self._barrier_fn()
            return
        self._pg.allreduce([torch.zeros(1, device=self._device)]).wait()

    def agree_token(self, src: int) -> int:
        value = _draw_token() if self.rank == src else 0
        token = torch.tensor([value], dtype=torch.int64, device=self._device)
        self._pg.broadcast(token, src).wait()
        return int(token.item())


class _Stateless:
    """A StatelessProcessGroup: its bounded barrier and its store broadcast."""

    def __init__(
        self, group: StatelessProcessGroup, timeout: float | None, barrier_fn: Any = None
    ) -> None:
        self._group = group
        self._timeout = _DEFAULT_BARRIER_TIMEOUT if timeout is None else float(timeout)
        self._barrier_fn = barrier_fn
        self.rank = group.rank
        self.size = group.world_size

    def barrier(self) -> None:
        if self._barrier_fn is not None:
            self._barrier_fn()
        else:
            self._group.barrier(timeout=self._timeout)

    def agree_token(self, src: int) -> int:
        return int(self._group.broadcast_obj(_draw_token() if self.rank == src else None, src))


def _default_group() -> GroupSync:
    if dist.is_available() and dist.is_initialized():
        world = dist.group.WORLD
        assert isinstance(world, ProcessGroup)
        return _TorchGroup(world)
    return _Alone()


def as_group_sync(group: Any, timeout: float | None = None) -> GroupSync:
    """The :class:`GroupSync` of ``group`` (see the module docstring for the kinds accepted).

    ``timeout`` bounds each barrier of a StatelessProcessGroup (default 30 s); torch groups
    and GroupCoordinators use their own timeouts. Raises TypeError for anything else.
    """
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if group is None:
        return _default_group()
    if isinstance(group, ProcessGroup):
        return _TorchGroup(group)
    if isinstance(group, StatelessProcessGroup) or (
        hasattr(group, "broadcast_obj") and hasattr(group, "world_size")
    ):
        return _Stateless(group, timeout)
    cpu_group = getattr(group, "cpu_group", None)
    if callable(getattr(group, "barrier", None)) and cpu_group is not None:
        if isinstance(cpu_group, StatelessProcessGroup):
            return _Stateless(cpu_group, timeout, group.barrier)
        if not isinstance(cpu_group, ProcessGroup):
            raise TypeError(
                f"group.cpu_group must be a torch ProcessGroup, got {type(cpu_group).__name__}"
            )
        return _TorchGroup(cpu_group, group.barrier, getattr(group, "rank_in_group", None))
    raise TypeError(
        "group must be a torch ProcessGroup, a StatelessProcessGroup, a GroupCoordinator "
        f"(barrier() and cpu_group) or None, got {type(group).__name__}"
    )
