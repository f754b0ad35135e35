"""torch.distribute utils: gather configs and tensors to one rank (ModelOpt's ``distribute``).

Same names, parameters and results as ``modelopt.torch.export.distribute``:
:class:`NFSWorkspace`, :func:`get_configs_parallel` and :func:`get_tensors_parallel` (context
managers), plus :func:`gather_configs` and :func:`gather_tensors`, which return the list
directly (for callers that cannot hold a context open, like the Elixir bridge).

A gather is a collective over ``group``: every rank of the group calls it, in the same order.
The ranks listed in ``ranks`` (group ranks) contribute a value; the first of them, the
*reader*, gets the list of their values in the order of ``ranks`` (``None`` configs
included); every other rank gets ``[]``. Ranks of the group that are not in ``ranks`` take
part in the synchronization only. ``ranks`` are ranks *in ``group``* (for a
GroupCoordinator, ``rank_in_group``), the only numbering a stateless group has; ModelOpt takes
global ranks, which are the same for the world group and for ``group=None``. The steps:

1. the reader draws a random token and the group broadcasts it; it names the call's
   shared-memory segments (``bpd<token>r<rank>``) or its folder in the workspace, so
   concurrent calls and jobs never collide (ModelOpt's fixed ``rank_<r>`` names do);
2. each other contributing rank writes its value (one segment, or one state file);
3. barrier; the reader reads every value (copies: nothing it yields points into shared
   memory) and removes every segment or file at once;
4. the body of the ``with`` runs; on exit (also when the body raises) a last barrier, as in
   ModelOpt, so that all ranks leave together.

Cleanup does not depend on the happy path: on any failure a writer removes its own segment
and the reader removes all of them (removal is idempotent), so a rank that dies leaves no
segment once the others have finished; they fail with a DistributedError naming the step (a
GroupTimeout, PeerGoneError, ... when the group's error says which), within the group's
timeout (for a StatelessProcessGroup, the ``timeout`` keyword, default 30 s).
A rank whose value cannot be written (say, a config that is not plain data) or, for the
reader, read, still joins both barriers, then raises; the others are not kept waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from bridge_py.distributed.distribute.codec import (
    config_from_bytes,
    config_to_bytes,
    tensor_from_view,
    tensor_header_and_body,
)
from bridge_py.distributed.distribute.group import GroupSync, as_group_sync
from bridge_py.distributed.distribute.nfs import NfsChannel, NFSWorkspace
from bridge_py.distributed.distribute.shm import ShmChannel
from bridge_py.distributed.errors import (
    AuthenticationError,
    BarrierFailure,
    BarrierTimeout,
    CollectiveMismatchError,
    DistributedError,
    GroupTimeout,
    PeerGoneError,
    SharedMemoryError,
    StoreError,
)

__all__ = [
    "NFSWorkspace",
    "gather_configs",
    "gather_tensors",
    "get_configs_parallel",
    "get_tensors_parallel",
]


def _check_ranks(ranks: Sequence[int], size: int) -> list[int]:
    """``ranks`` as a list, or ValueError/TypeError (raised alike on every rank)."""
    checked = list(ranks)
    if not checked:
        raise ValueError("ranks must name at least one rank")
    for rank in checked:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"ranks must be ints, got {type(rank).__name__}")
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} in ranks is not in the group [0, {size})")
    if len(set(checked)) != len(checked):
        raise ValueError(f"ranks must be distinct, got {checked}")
    return checked


# What a failed step raises: the first of these that the group's error is (most specific
# first), else DistributedError.
_STEP_ERRORS: tuple[type[DistributedError], ...] = (
    BarrierTimeout,
    GroupTimeout,
    BarrierFailure,
    PeerGoneError,
    StoreError,
    AuthenticationError,
    CollectiveMismatchError,
    SharedMemoryError,
)


def _step(sync: GroupSync, what: str, name: str, action: Callable[[], Any]) -> Any:
    """Run a group operation; if it fails, a DistributedError of the same kind (a timeout
    stays a GroupTimeout) that says which gather, rank and step failed."""
    try:
        return action()
    except Exception as exc:
        kind = next((k for k in _STEP_ERRORS if isinstance(exc, k)), DistributedError)
        raise kind(f"{name}: rank {sync.rank} failed at {what}: {exc}") from exc


class _Channel:
    """What the protocol needs from a transport (shared memory or a workspace folder)."""

    def publish(self, rank: int, value: Any) -> None: ...
    def take(self, rank: int) -> Any: ...
    def remove(self, rank: int) -> None: ...
    def remove_all(self, ranks: Sequence[int]) -> None: ...


class _ShmTensors(_Channel):
    def __init__(self, token: int) -> None:
        self.shm = ShmChannel(token)

    def publish(self, rank: int, value: Any) -> None:
        header, body = tensor_header_and_body(value)
        self.shm.publish(rank, header, body)

    def take(self, rank: int) -> Any:
        return self.shm.take(rank, tensor_from_view)

    def remove(self, rank: int) -> None:
        self.shm.remove(rank)

    def remove_all(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            self.shm.remove(rank)


class _ShmConfigs(_ShmTensors):
    def publish(self, rank: int, value: Any) -> None:
        self.shm.publish(rank, {}, config_to_bytes(value))

    def take(self, rank: int) -> Any:
        return self.shm.take(rank, lambda _header, view: config_from_bytes(bytes(view)))


class _NfsConfigs(_Channel):
    def __init__(self, root: Path | str, token: int, rank: int) -> None:
        self.nfs = NfsChannel(root, token, rank)

    def publish(self, rank: int, value: Any) -> None:
        self.nfs.publish(value)

    def take(self, rank: int) -> Any:
        return self.nfs.take(rank)

    def remove(self, rank: int) -> None:
        self.nfs.remove(rank)

    def remove_all(self, ranks: Sequence[int]) -> None:
        self.nfs.remove_all()


@contextlib.contextmanager
def _gather(
    name: str,
    value: Any,
    ranks: Sequence[int],
    sync: GroupSync,
    open_channel: Callable[[int, int], _Channel],
) -> Iterator[list[Any]]:
    """The protocol of the module docstring, for one value per rank of ``ranks``."""
    ranks = _check_ranks(ranks, sync.size)
    me, reader = sync.rank, ranks[0]
    token = _step(sync, "agreeing on the call's token", name, lambda: sync.agree_token(reader))
    if me not in ranks:
        _step(sync, "the barrier after writing", name, sync.barrier)
        try:
            yield []
        finally:
            _step(sync, "the barrier on exit", name, sync.barrier)
        return
    writers = [rank for rank in ranks if rank != reader]
    channel: _Channel | None = None
    failure: BaseException | None = None
    try:
        # A failure to open or write is raised only after both barriers, so that no other
        # rank waits in vain; the reader then reports the value as missing.
        try:
            channel = open_channel(token, me)
            if me != reader:
                channel.publish(me, value)
        except Exception as exc:
            failure = exc
        _step(sync, "the barrier after writing", name, sync.barrier)
        gathered: list[Any] = []
        if me == reader and channel is not None and failure is None:
            try:
                gathered = [value if rank == reader else channel.take(rank) for rank in ranks]
            except Exception as exc:
                failure = exc
            finally:
                channel.remove_all(writers)
        if failure is not None:
            _step(sync, "the barrier on exit", name, sync.barrier)
            raise failure
        try:
            yield gathered
        finally:
            _step(sync, "the barrier on exit", name, sync.barrier)
    finally:
        # Idempotent: normally everything is gone already; after a failure, whoever is left
        # removes what it can (a writer its own, the reader everyone's).
        if channel is not None:
            if me == reader:
                channel.remove_all(writers)
            else:
                channel.remove(me)


@contextlib.contextmanager
def get_configs_parallel(
    config: Any,
    ranks: list[int],
    group: Any,
    workspace_path: Path | str | None = None,
    *,
    timeout: float | None = None,
) -> Iterator[list[Any]]:
    """Gathers the layer config across distributed processes using shm or NFS.

    Args:
        config: the config (nullable) that each rank want to pass to the first rank: ``None``
            or a dict of plain data (None, bool, int, float, str, list, tuple, dict) and
            tensors.
        ranks: the list of the ranks (ranks in ``group``)
        group: the barrier sync group: a torch ProcessGroup, a StatelessProcessGroup, a
            GroupCoordinator, or None (torch.distributed's default group if initialized).
        workspace_path: the path to the NFS directory for postprocess cross rank
            communication.
        timeout: (keyword only, an extension) seconds each barrier of a
            StatelessProcessGroup may wait (default 30).

    Yields:
        the first rank in the ranks has the full access of the configs across all the ranks
        (in the order of ``ranks``, ``None`` included). the other ranks returns an empty list

    When workspace_path is provided, an NFSWorkspace object (in a folder of its own for this
    call) is created to perform communication across ranks. Otherwise, SharedMemory is used
    for local multi-process communication. The shm will be destroyed after consumption.
    """
    sync = as_group_sync(group, timeout)
    if workspace_path is not None:
        root = workspace_path

        def open_channel(token: int, rank: int) -> _Channel:
            return _NfsConfigs(root, token, rank)

    else:

        def open_channel(token: int, rank: int) -> _Channel:
            return _ShmConfigs(token)

    with _gather("get_configs_parallel", config, ranks, sync, open_channel) as configs:
        yield configs


@contextlib.contextmanager
def get_tensors_parallel(
    tensor: torch.Tensor,
    ranks: list[int],
    group: Any = None,
    *,
    timeout: float | None = None,
) -> Iterator[list[torch.Tensor]]:
    """Gathers the tensors across distributed processes using shm.

    Args:
        tensor: the tensor that each rank want to pass to the first rank. Unlike ModelOpt's,
            the tensors may differ in dtype and shape across the ranks.
        ranks: the list of the ranks (ranks in ``group``)
        group: the barrier sync group: a torch ProcessGroup, a StatelessProcessGroup, a
            GroupCoordinator, or None (torch.distributed's default group if initialized).
        timeout: (keyword only, an extension) seconds each barrier of a
            StatelessProcessGroup may wait (default 30).

    Yields:
        the first rank in the ranks has the full access of the tensors across all the ranks
        (CPU tensors, in the order of ``ranks``). the other ranks returns an empty list

    The shm will be destroyed after consumption.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    sync = as_group_sync(group, timeout)
    with _gather("get_tensors_parallel", tensor.cpu(), ranks, sync, _open_shm_tensors) as out:
        yield out


def _open_shm_tensors(token: int, rank: int) -> _Channel:
    return _ShmTensors(token)


def gather_configs(
    config: Any,
    ranks: list[int],
    group: Any,
    workspace_path: Path | str | None = None,
    *,
    timeout: float | None = None,
) -> list[Any]:
    """Gathers the layer config across distributed processes using shm or NFS.

    What ModelOpt's ``get_configs_parallel`` context manager yields, as a plain call that
    returns once every resource of the gather is released. A collective: every rank of
    ``group`` calls it, in the same order.

    Args:
        config: the config (nullable) that each rank want to pass to the first rank: ``None``
            or a dict of plain data (None, bool, int, float, str, list, tuple, dict) and
            tensors.
        ranks: the ranks (ranks in ``group``) that contribute a config; the first of them
            receives them all. Ranks of the group not listed only synchronize.
        group: the barrier sync group: a torch ProcessGroup, a StatelessProcessGroup, a
            GroupCoordinator, or None (torch.distributed's default group if initialized).
        workspace_path: a directory that every rank of ``ranks`` shares (NFS); None: the
            ranks share one node's memory instead.
        timeout: (keyword only, an extension) seconds each barrier of a
            StatelessProcessGroup may wait (default 30).

    Returns:
        On the first rank of ``ranks``, the configs of all ``ranks`` in their order
        (``None`` included); ``[]`` on every other rank.

    Raises:
        ValueError: ``ranks`` is empty, names a rank twice or one outside the group.
        TypeError: ``ranks`` holds something else than ints, or (on the rank whose config
            it is) a config that is not plain data.
        DistributedError: a rank failed at a step of the gather, or a config is missing
            on the first rank (the message names the gather, the rank and the step);
            GroupTimeout, PeerGoneError and the like when that is what happened. Every
            rank fails within the group's timeout; none is left waiting.
    """
    with get_configs_parallel(config, ranks, group, workspace_path, timeout=timeout) as got:
        return list(got)


def gather_tensors(
    tensor: torch.Tensor,
    ranks: list[int],
    group: Any = None,
    *,
    timeout: float | None = None,
) -> list[torch.Tensor]:
    """Gathers the tensors across distributed processes using shm.

    What ModelOpt's ``get_tensors_parallel`` context manager yields, as a plain call that
    returns once every resource of the gather is released. A collective: every rank of
    ``group`` calls it, in the same order; the ranks of ``ranks`` must share one node.

    Args:
        tensor: the tensor that each rank want to pass to the first rank. Unlike ModelOpt's,
            the tensors may differ in dtype and shape across the ranks.
        ranks: the ranks (ranks in ``group``) that contribute a tensor; the first of them
            receives them all. Ranks of the group not listed only synchronize.
        group: the barrier sync group: a torch ProcessGroup, a StatelessProcessGroup, a
            GroupCoordinator, or None (torch.distributed's default group if initialized).
        timeout: (keyword only, an extension) seconds each barrier of a
            StatelessProcessGroup may wait (default 30).

    Returns:
        On the first rank of ``ranks``, the tensors of all ``ranks`` in their order, as new
        CPU tensors (none shares memory with anything else); ``[]`` on every other rank.

    Raises:
        ValueError: ``ranks`` is empty, names a rank twice or one outside the group.
        TypeError: ``tensor`` is not a tensor, or ``ranks`` holds something else than ints.
        DistributedError: a rank failed at a step of the gather, or a tensor is missing
            on the first rank (the message names the gather, the rank and the step);
            GroupTimeout, PeerGoneError and the like when that is what happened. Every
            rank fails within the group's timeout; none is left waiting.
    """
    with get_tensors_parallel(tensor, ranks, group, timeout=timeout) as got:
        return [t.clone() for t in got]
