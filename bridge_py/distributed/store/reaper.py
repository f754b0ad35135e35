"""Deleting a StatelessProcessGroup's read store keys off the caller's path.

Every value a collective wrote must be deleted once all its readers have read it (no key
build-up), and each ``delete_key`` is a round trip to the store: on 4 ranks sharing 2 cores,
the delete of the previous all_gather value took a quarter of each gather. The keys a group
has to delete are never written again (their names carry sequence numbers), so nothing waits
for the delete itself: a :class:`KeyReaper` takes them on a daemon thread, over a store
connection of its own, while the caller goes on (to the next wait, where it would sit idle
anyway).

:meth:`KeyReaper.drain` waits until every key handed over is gone, for the places that must
see the store clean (a barrier, ``expire_data``). Deletes are best effort: one that fails
(the store's server is gone) is dropped, and the group's own next request reports the lost
store. A store that is not a ``TCPStore`` gets its deletes on the caller's thread, as before.

At interpreter exit the threads are stopped and joined (within their connect timeout and
the watchdog's grace): a daemon thread still inside torch's client when Python finalizes
is ended by an unwind that C++ turns into ``std::terminate``, and the process aborted
("terminate called without an active exception") after it had done its work.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable

from torch.distributed import Store, TCPStore

from bridge_py.distributed.store.client import connect_client
from bridge_py.distributed.store.quiet import QUIET
from bridge_py.distributed.store.torch_api import uses_libuv
from bridge_py.distributed.store.watchdog import GRACE, watched

__all__ = ["KeyReaper"]

logger = logging.getLogger(__name__)

_CONNECT_SECONDS = 5.0

# This process's reaper threads still running, with their work (see _join_all).
_threads: list[tuple[_Work, threading.Thread, float]] = []
_threads_lock = threading.Lock()


class _Work:
    """What the caller and the thread share: the keys to delete, and how many are not yet."""

    def __init__(self) -> None:
        self.keys: deque[str] = deque()
        self.pending = 0  # handed over and not yet deleted (or dropped)
        self.cond = threading.Condition()

    def add(self, keys: Iterable[str]) -> int:
        """Queue ``keys`` (lock held by the caller); how many."""
        before = len(self.keys)
        self.keys.extend(keys)
        added = len(self.keys) - before
        self.pending += added
        return added

    def stop(self) -> None:
        """Let the thread end once the keys queued before are deleted."""
        with self.cond:
            self.add([_STOP])
            self.cond.notify_all()


_STOP = ""  # no key is empty


class KeyReaper:
    """Deletes store keys on a thread of its own; :meth:`drain` waits until they are gone.

    The thread starts with the first keys (again in a forked child, which has none) and ends
    when the reaper is garbage-collected, after deleting what it was given.
    """

    def __init__(self, store: Store, connect_timeout: float = _CONNECT_SECONDS) -> None:
        """``connect_timeout``: how long the thread tries to connect to the store's server
        (each time after a failure), in seconds."""
        self._store = store
        self._connect_timeout = connect_timeout
        # The server the thread connects to; None: deletes run on the caller's thread.
        self._tcp = store if isinstance(store, TCPStore) else None
        self._work = _Work()
        self._pid = -1  # the process whose thread runs (none yet)
        weakref.finalize(self, self._work.stop)

    @property
    def pending(self) -> int:
        """Keys handed over and not yet deleted."""
        return self._work.pending

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` soon (now, on this thread, for a store that is not a TCPStore)."""
        tcp = self._tcp
        if tcp is None:
            for key in keys:
                self._store.delete_key(key)
            return
        if self._pid != os.getpid():  # no thread yet, or this is a forked child
            self._start(tcp)
        work = self._work
        with work.cond:
            if work.add(keys):
                work.cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every key handed over is deleted; whether
        that happened."""
        deadline = time.monotonic() + timeout
        work = self._work
        with work.cond:
            while work.pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                work.cond.wait(left)
        return True

    def _start(self, store: TCPStore) -> None:
        if self._pid != -1:
            # A forked child: the parent's thread is not here, and its lock may be held.
            self._work = _Work()
            weakref.finalize(self, self._work.stop)
        self._pid = os.getpid()
        thread = threading.Thread(
            target=_reap,
            args=(self._work, store.host, store.port, uses_libuv(store), self._connect_timeout),
            name="spg-key-reaper",
            daemon=True,
        )
        thread.start()
        with _threads_lock:
            _threads[:] = [t for t in _threads if t[1].is_alive()]
            _threads.append((self._work, thread, self._connect_timeout))


def _join_all() -> None:
    """At exit: stop every reaper thread of this process and wait for it, each within its
    connect timeout and the watchdog's grace (see the module docstring)."""
    with _threads_lock:
        running = [t for t in _threads if t[1].is_alive()]
        _threads.clear()
    for work, _thread, _timeout in running:
        work.stop()
    for _work, thread, timeout in running:
        thread.join(timeout + GRACE + 0.5)


atexit.register(_join_all)


def _reap(work: _Work, host: str, port: int, use_libuv: bool, connect_timeout: float) -> None:
    """The thread: delete keys as they come, on a connection of its own, until stopped."""
    connection: Store | None = None
    while True:
        with work.cond:
            while not work.keys:
                work.cond.wait()
            key = work.keys.popleft()
        try:
            if key == _STOP:
                return
            if connection is None:
                connection = connect_client(
                    host,
                    port,
                    time.monotonic() + connect_timeout,
                    use_libuv=use_libuv,
                    wait_for_server=False,
                )
            with QUIET, watched(connection, time.monotonic() + connect_timeout):
                connection.delete_key(key)
        except Exception as exc:  # the store is gone: the group's own requests will say so
            logger.debug("could not delete %r: %s", key, exc)
            connection = None
            with work.cond:  # the keys queued now would fail the same way: drop them
                dropped = [k for k in work.keys if k != _STOP]
                stop = len(dropped) < len(work.keys)
                work.keys.clear()
                if stop:
                    work.keys.append(_STOP)
                work.pending -= len(dropped)
        finally:
            with work.cond:
                work.pending -= 1
                work.cond.notify_all()
