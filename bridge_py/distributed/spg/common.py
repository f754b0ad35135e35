"""What both transports of a StatelessProcessGroup share: the errors of a wait, barrier hooks.

Every wait of a group ends in one of three errors, whichever transport it took, and their
messages are built here so that they read alike: GroupTimeout (the time ran out),
PeerGoneError (the rank waited for has exited, seen on one node) and StoreError (the store
went away). Each names the operation, this rank, the rank(s) waited for and what was awaited
(a key, a message's name).
"""

from __future__ import annotations

import errno
import os
import resource
import time
from collections.abc import Callable
from typing import NamedTuple

from torch.distributed import Store

from bridge_py.distributed.errors import GroupTimeout, PeerGoneError, StoreError
from bridge_py.distributed.store.torch_api import timeout_of
from bridge_py.distributed.store.watchdog import why_lost

__all__ = [
    "BarrierHooks",
    "arrival_timeout",
    "exited",
    "lost",
    "store_seconds",
    "timed_out",
    "wait_limit",
]


def store_seconds(store: Store) -> float:
    """The store's timeout, in seconds (300 when it has none)."""
    try:
        return timeout_of(store).total_seconds()
    except AttributeError:  # a store without a timeout of its own
        return 300.0


def wait_limit(store: Store, timeout: float | None) -> float:
    """A wait's ``timeout`` (None: the store's), checked to be a positive number of
    seconds (ValueError naming it otherwise)."""
    limit = store_seconds(store) if timeout is None else timeout
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return limit


def _whom(src: int | list[int]) -> str:
    return f"rank {src}" if isinstance(src, int) else f"ranks {src}"


def timed_out(
    op: str, rank: int, what: str, src: int | list[int], start: float, limit: float
) -> GroupTimeout:
    """A wait of ``op`` on ``rank`` for ``what`` from ``src`` (a list: the values of a
    collective from those ranks) that ran out after ``limit`` seconds, begun at ``start``."""
    if isinstance(src, int):
        awaited = f"{what} from rank {src}: rank {src} did not send it (did it exit"
    else:
        awaited = f"the values of ranks {src} ({what}): they did not call {op} (did they exit"
    return GroupTimeout(
        f"{op} on rank {rank} timed out after {time.monotonic() - start:.1f} s (timeout "
        f"{limit:g} s) waiting for {awaited}, or call something else?){_descriptors()}"
    )


def _descriptors() -> str:
    """What to add to a wait's error when this process is out of file descriptors (or all
    but out): a store server (rank 0's) that cannot accept looks like ranks that never came,
    and a rank that cannot connect like a store that is gone. Empty otherwise."""
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # (less the listing's own)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            return ""  # no /proc: nothing to say
        used = soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or used < soft - 8:
        return ""
    return (
        f"; this process has {used} of its {soft} file descriptors open (RLIMIT_NOFILE), "
        "so it may not be able to accept or open the connections its group needs"
    )


def exited(op: str, rank: int, what: str, src: int | list[int], start: float) -> PeerGoneError:
    """A wait of ``op`` on ``rank`` for ``what`` that ``src`` will never send: it exited."""
    return PeerGoneError(
        f"{op} on rank {rank}: {_whom(src)} exited after {time.monotonic() - start:.1f} s "
        f"without sending {what}"
    )


def lost(op: str, rank: int, what: str, src: int, start: float, exc: Exception) -> StoreError:
    """A wait of ``op`` on ``rank`` for ``what`` (from ``src``; -1: several) that lost the
    store."""
    source = "" if src < 0 else f" from rank {src}"
    return StoreError(
        f"{op} on rank {rank} lost the store after {time.monotonic() - start:.1f} s while "
        f"waiting for {what}{source} {why_lost(exc, start)}{_descriptors()}"
    )


def arrival_timeout(
    rank: int, timeout: float, arrived: int, world_size: int, missing: list[int] | None
) -> str:
    """The verdict of a rank that gave up waiting for the others to arrive at a barrier;
    ``missing``: the ranks that did not arrive, where the transport knows them."""
    verdict = (
        f"rank {rank} timed out after {timeout:g} s in phase 1 (arrival): "
        f"{arrived} of {world_size} ranks arrived"
    )
    if missing:
        whom = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        verdict += f", {whom} did not"
    return verdict


class BarrierHooks(NamedTuple):
    """The group's own work at fixed points of one barrier (either transport's); a named
    tuple, made on every barrier (cheaper than a frozen dataclass)."""

    # After arriving, when other ranks are still to come (the rank would only wait):
    # deferred deletes, off the critical path.
    while_waiting: Callable[[], None] | None = None
    # Once all ranks have arrived (and before this rank departs): every rank has finished
    # everything it did before the barrier, so the values they read can go.
    all_arrived: Callable[[], None] | None = None
