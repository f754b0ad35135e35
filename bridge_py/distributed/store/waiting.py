"""Waiting for store keys with a deadline, without harming the group's main connection.

``Store.wait(keys, timeout)`` honours its own timeout, but when the client gives up the server
still holds the wait and may answer it later on the same connection, where that late answer
would be read as the reply to some other request. The waits are therefore made on a second
connection, which is thrown away after a timeout and reopened when next needed; the group's
own connection never sees an abandoned wait. (torch 2.13's TCPStore client cancels an
abandoned ``get`` itself, which ``recv_obj`` relies on to wait on the main connection; the
barrier and gathers keep the separate connection, which holds on older torch too.)

Opening that connection is bounded by the same deadline: for a ``TCPStore`` it is a new client
whose connect timeout is what is left of the wait (``Store.clone()`` would retry for the
store's whole timeout, 300 s by default, when the server has died), so a wait ends on time
even when rank 0, which serves the store, is gone; a refused connection (the server has
exited) fails at once, as a StoreError.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence

from torch.distributed import DistStoreError, QueueEmptyError, Store, TCPStore

from bridge_py.distributed.errors import is_store_timeout
from bridge_py.distributed.store.client import connect_client
from bridge_py.distributed.store.torch_api import clone, timeout_of, uses_libuv
from bridge_py.distributed.store.watchdog import watched

__all__ = ["BoundedWaiter", "pop_before"]


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(value, 0.001))


class BoundedWaiter:
    """Deadline-bounded waits for keys of ``store``, on a connection of their own."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._connection: Store | None = None
        self._lock = threading.Lock()
        # The ``timeout`` of the last request, whose bound the connection still has.
        self._bound: float | None = None

    def _open(self, deadline: float) -> Store:
        """The waiting connection, connecting (by ``deadline``, if a TCPStore) when needed."""
        if self._connection is None:
            store = self._store
            if isinstance(store, TCPStore):
                # A refused connection: the server is gone, and fails at once.
                self._connection = connect_client(
                    store.host,
                    store.port,
                    deadline,
                    use_libuv=uses_libuv(store),
                    wait_for_server=False,
                )
            else:
                try:
                    self._connection = clone(store)
                except (AttributeError, NotImplementedError):
                    # A custom store without clone(): wait on the store itself.
                    self._connection = store
        return self._connection

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for all ``keys`` to exist; False if they did not.

        Errors other than the timeout (the server went away, it cannot be reached) propagate.
        """
        return self._bounded(keys, timeout, fetch=False) is not None

    def multi_get(self, keys: Sequence[str], timeout: float) -> list[bytes] | None:
        """The values of ``keys`` once all exist (torch's ``multi_get`` waits for all of them,
        then reads them: two round trips however many keys), or None if they did not within
        ``timeout`` seconds. Errors other than the timeout propagate."""
        return self._bounded(keys, timeout, fetch=True)

    def _bounded(self, keys: Sequence[str], timeout: float, fetch: bool) -> list[bytes] | None:
        deadline = time.monotonic() + max(timeout, 0.001)
        with self._lock, watched(self._store, deadline):
            try:
                opened = self._connection
                connection = self._open(deadline)
                if connection is self._store:
                    # A store without a second connection: wait (bounded), then read on it.
                    connection.wait(list(keys), _seconds(deadline - time.monotonic()))
                    return connection.multi_get(list(keys)) if fetch else []
                # The same timeout as last time on the same connection (a gather asks for
                # the store's timeout each time) is already set: no call needed.
                if connection is not opened or timeout != self._bound:
                    connection.set_timeout(_seconds(deadline - time.monotonic()))
                    self._bound = timeout
                if fetch:
                    return connection.multi_get(list(keys))
                connection.wait(list(keys))
                return []
            except DistStoreError as exc:
                self._connection = None  # may still receive the abandoned wait's answer
                if not is_store_timeout(exc):
                    raise
                return None
            except BaseException:
                self._connection = None
                raise


def pop_before(store: Store, queue: str, deadline: float) -> bytes | None:
    """The next item of the store queue ``queue``, or None if none comes by ``deadline``.

    ``deadline`` is a ``time.monotonic()`` value. Each pop waits at most what is left (a
    torch 2.13 TCPStore client that gives up a queue wait cancels it with the server, so the
    main connection stays in step); a wait woken for an item someone else took waits again.
    The store's timeout is restored afterwards. Store failures other than the timeout
    propagate.
    """
    original = timeout_of(store)
    try:
        with watched(store, deadline):
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                store.set_timeout(datetime.timedelta(seconds=left))
                try:
                    return store.queue_pop(queue)
                except QueueEmptyError:
                    continue
                except RuntimeError as exc:
                    if not is_store_timeout(exc):
                        raise
    finally:
        store.set_timeout(original)
