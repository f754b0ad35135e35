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

1. the reader draws a random token and the group broadcasts it with the reader's PID; they
   name the call's shared-memory segments (``distribute.shm``) or its folder in the
   workspace, so concurrent calls and jobs never collide (ModelOpt's fixed ``rank_<r>``
   names do), and segments whose reader has exited can be told apart;
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

from bridge_py.distributed.distribute.codec import CONFIGS, TENSORS, GatherCodec
from bridge_py.distributed.distribute.group import CallId, GroupSync, SyncGroup, as_group_sync
from bridge_py.distributed.distribute.nfs import NfsChannel, NFSWorkspace
from bridge_py.distributed.distribute.shm import ShmChannel
from bridge_py.distributed.errors import DistributedError

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


def _step(sync: GroupSync, what: str, name: str, action: Callable[[], Any]) -> Any:
    """Run a group operation; if it fails, an error of the same class when it is a
    DistributedError (a timeout stays a GroupTimeout), else a DistributedError, that says
    which gather, rank and step failed."""
    try:
        return action()
    except Exception as exc:
        kind = type(exc) if isinstance(exc, DistributedError) else DistributedError
        raise kind(f"{name}: rank {sync.rank} failed at {what}: {exc}") from exc


@contextlib.contextmanager
def _gather(
    name: str,
    value: Any,
    ranks: Sequence[int],
    group: SyncGroup,
    timeout: float | None,
    codec: GatherCodec,
    open_carrier: Callable[[CallId], ShmChannel | NfsChannel],
) -> Iterator[list[Any]]:
    """The protocol of the module docstring, for one value per rank of ``ranks``, moved by
    ``codec`` through the carrier that ``open_carrier(call)`` opens (shared memory or a
    workspace folder: both publish, take and remove one value per rank)."""
    sync = as_group_sync(group, timeout)
    ranks = _check_ranks(ranks, sync.size)
    me, reader = sync.rank, ranks[0]
    writers = [rank for rank in ranks if rank != reader]
    call = _step(sync, "agreeing on the call's token", name, lambda: sync.agree_call(reader))
    carrier = open_carrier(call)
    failure: Exception | None = None
    try:
        # A failure to write or read is raised only after both barriers, so that no other
        # rank waits in vain; the reader then reports the value as missing.
        if me in writers:
            try:
                carrier.publish(me, codec.encode(value))
            except Exception as exc:
                failure = exc
        _step(sync, "the barrier after writing", name, sync.barrier)
        gathered: list[Any] = []
        if me == reader:
            try:
                gathered = [value if r == reader else carrier.take(r, codec.decode) for r in ranks]
            except Exception as exc:
                failure = exc
        try:
            if failure is None:
                yield gathered
        finally:
            _step(sync, "the barrier on exit", name, sync.barrier)
        if failure is not None:
            raise failure
    finally:
        # Idempotent: normally the reader took (and so removed) everything already; after a
        # failure, whoever is left removes what it can (a writer its own, the reader all).
        for rank in writers if me == reader else [me] if me in writers else []:
            carrier.remove(rank)


@contextlib.contextmanager
def get_configs_parallel(
    config: Any,
    ranks: list[int],
    group: SyncGroup,
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

    When workspace_path is provided, each rank writes its config to a file (atomically, in a
    folder of its own for this call) to perform communication across ranks. Otherwise,
    SharedMemory is used for local multi-process communication. The shm or the files will be
    destroyed after consumption.
    """

    def open_carrier(call: CallId) -> ShmChannel | NfsChannel:
        if workspace_path is None:
            return ShmChannel(call)
        return NfsChannel(workspace_path, call.token)

    with _gather("get_configs_parallel", config, ranks, group, timeout, CONFIGS, open_carrier) as c:
        yield c


@contextlib.contextmanager
def get_tensors_parallel(
    tensor: torch.Tensor,
    ranks: list[int],
    group: SyncGroup = None,
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
    with _gather(
        "get_tensors_parallel", tensor.cpu(), ranks, group, timeout, TENSORS, ShmChannel
    ) as tensors:
        yield tensors


def gather_configs(
    config: Any,
    ranks: list[int],
    group: SyncGroup,
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
    group: SyncGroup = None,
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
        # Only the first is the caller's own; the others were read into new tensors.
        return [got[0].clone(), *got[1:]] if got else []
