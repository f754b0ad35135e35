"""Bounded waits that also fetch: ``multi_get`` of keys once they all exist, in two round trips.

:class:`FetchingWaiter` is a :class:`~bridge_py.distributed.store.waiting.BoundedWaiter` (waits on a
connection of its own, thrown away after a timeout) that can also read the keys it waited for
on that connection: torch's ``multi_get`` waits for every key (one round trip that returns when
the last one is written) and then reads them all (one more), so an all_gather reads every other
rank's value in two round trips, however many ranks there are.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

from torch.distributed import DistStoreError, Store

from bridge_py.distributed.errors import is_store_timeout
from bridge_py.distributed.store.waiting import BoundedWaiter

__all__ = ["FetchingWaiter"]


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(value, 0.001))


class FetchingWaiter(BoundedWaiter):
    """A BoundedWaiter that can fetch several keys once they exist, within a deadline."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        # The ``timeout`` of the last fetch, whose bound the connection still has.
        self._bound: float | None = None

    def multi_get(self, keys: Sequence[str], timeout: float) -> list[bytes] | None:
        """The values of ``keys`` once all exist, or None if they did not within ``timeout`` s.

        Errors other than the timeout (the server went away) propagate.
        """
        deadline = time.monotonic() + max(timeout, 0.001)
        with self._lock:
            try:
                opened = self._connection
                connection = self._open(deadline)
                if connection is not self._store:
                    # The same timeout as last time on the same connection (a gather asks
                    # for the store's timeout each time) is already set: no call needed.
                    if connection is not opened or timeout != self._bound:
                        connection.set_timeout(_seconds(deadline - time.monotonic()))
                        self._bound = timeout
                    return connection.multi_get(list(keys))
            except DistStoreError as exc:
                self._connection = None  # may still receive the abandoned wait's answer
                if not is_store_timeout(exc):
                    raise
                return None
            except BaseException:
                self._connection = None
                raise
        # A store without a second connection: wait (bounded), then read on the store itself.
        if not self.wait(keys, max(deadline - time.monotonic(), 0.001)):
            return None
        return self._store.multi_get(list(keys))
