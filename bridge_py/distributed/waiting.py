"""Waiting for store keys with a deadline, without harming the group's main connection.

``Store.wait(keys, timeout)`` honours its own timeout, but when the client gives up the server
still holds the wait and may answer it later on the same connection, where that late answer
would be read as the reply to some other request. The waits are therefore made on a second
connection (``store.clone()``), which is thrown away after a timeout and reopened when next
needed; the group's own connection never sees an abandoned wait.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence

from torch.distributed import DistStoreError, Store

__all__ = ["BoundedWaiter"]


class BoundedWaiter:
    """Deadline-bounded waits for keys of ``store``, on a connection of their own."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._connection: Store | None = None
        self._lock = threading.Lock()

    def _open(self) -> Store:
        if self._connection is None:
            try:
                self._connection = self._store.clone()
            except (AttributeError, NotImplementedError):
                # A custom store without clone(): wait on the store itself.
                self._connection = self._store
        return self._connection

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for all ``keys`` to exist; False if they did not.

        Errors other than the timeout (the server went away, ...) propagate.
        """
        delta = datetime.timedelta(seconds=max(timeout, 0.001))
        with self._lock:
            connection = self._open()
            try:
                connection.wait(list(keys), delta)
            except DistStoreError as exc:
                self._connection = None  # may still receive the abandoned wait's answer
                if "timeout" not in str(exc).lower():
                    raise
                return False
            except BaseException:
                self._connection = None
                raise
            return True
