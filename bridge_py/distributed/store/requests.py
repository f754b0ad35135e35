"""One store request of a group, quiet, and a failure of it in the package's words.

Every request a group makes of its TCPStore that is not a bounded wait (those report
GroupTimeout or, with the time waited, a lost store: ``spg.common``) runs inside
``with StoreRequest(op, rank, key):``, which

* keeps torch's C++ logger quiet for it (:data:`~bridge_py.distributed.store.quiet.QUIET`:
  a failed request would otherwise print torch's stack trace on stderr), and
* turns its failure (torch's RuntimeError: the store's host exited, the connection broke)
  into a StoreError naming the operation, this rank and the key, chained to torch's error.

Errors of the package raised inside pass unchanged, but for a bare StoreError (of the
connection a wait opens: ``store.client``), which says what failed but not for whom: it
gets the operation, rank and key too.
"""

from __future__ import annotations

import time

from torch.distributed import Store

from bridge_py import deadline
from bridge_py.distributed.errors import DistributedError, StoreError
from bridge_py.distributed.store.quiet import QUIET
from bridge_py.distributed.store.torch_api import timeout_of
from bridge_py.distributed.store.watchdog import watched, why_lost

__all__ = ["MAX_VALUE_BYTES", "StoreRequest", "check_value"]

MAX_VALUE_BYTES = 8 << 20
"""The most bytes one request may carry in a value to a TCPStore: torch's server (on
libuv, its default) refuses a longer one by dropping the client's connection, after which
every request of that client fails (its group is dead), and logs why only on its own side."""


def check_value(op: str, rank: int, key: str, size: int) -> None:
    """Raise ValueError, naming ``op``, ``rank``, ``key`` and the sizes, when a value of
    ``size`` bytes is longer than one request to the store may carry (nothing is sent)."""
    if size > MAX_VALUE_BYTES:
        raise ValueError(
            f"{op} on rank {rank}: the value for {key!r} is {size:,} bytes, more than the "
            f"{MAX_VALUE_BYTES:,} a TCPStore takes in one request; nothing was sent. Send "
            "data this large as tensors (a device communicator), not as an object"
        )


class StoreRequest:
    """``with StoreRequest(op, rank, key, doing):`` (see the module docstring).

    The error reads "``op`` on rank ``rank`` lost the store``at`` while ``doing`` ``key``";
    ``at`` (" at host:port") names the store where the caller knows it. With ``store``
    the request is watched (``store.watchdog``): still unanswered past the store's
    timeout (or the running call's deadline, if sooner), its connections are shut.
    """

    __slots__ = ("_at", "_doing", "_key", "_op", "_rank", "_store", "_watch")

    def __init__(
        self,
        op: str,
        rank: int,
        key: str,
        doing: str = "writing",
        *,
        at: str = "",
        store: Store | None = None,
    ) -> None:
        self._op = op
        self._rank = rank
        self._key = key
        self._doing = doing
        self._at = at
        self._store = store
        self._watch: watched | None = None

    def __enter__(self) -> None:
        QUIET.__enter__()
        if self._store is not None:
            limit = deadline.clamp(timeout_of(self._store).total_seconds())
            self._watch = watched(self._store, time.monotonic() + limit)

    def __exit__(self, *info: object) -> None:  # (type, exception, traceback)
        QUIET.__exit__(None, None, None)
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
        exc = info[1]
        if isinstance(exc, RuntimeError) and (
            type(exc) is StoreError or not isinstance(exc, DistributedError)
        ):
            raise StoreError(
                f"{self._op} on rank {self._rank} lost the store{self._at} while {self._doing} "
                f"{self._key!r} {why_lost(exc)}"
            ) from exc
