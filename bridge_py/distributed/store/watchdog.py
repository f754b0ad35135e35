"""A hard bound on a store request, whatever torch's client does: connections shut at a deadline.

torch's TCPStore client keeps a request's timeout while it waits for the answer, but some
of its reads have no bound: the handshake of a new client, and the cancel it sends for a
wait that gave up, read until the server answers. When the store's host is frozen or the
network to it is cut, such a read blocks until TCP gives up, many minutes later.

A request that must end by a deadline runs inside ``with watched(store, deadline):``. If
it is still running :data:`GRACE` seconds after its deadline, one watchdog thread shuts
down every TCP connection of this process to that store's address (``shutdown(2)`` wakes
a read blocked on it); the request then fails at once, as for a store that went away, and
:func:`why_lost` says so, for the error to say that the store stopped answering. A request
that ends in time costs a lock and a list append.

A client being made (``watched((host, port), deadline)``) is watched alone: only the
connections to that address opened since the watch began are shut, so a handshake slowed
by a lossy network (a helper thread's new connection) does not cut the connections that
the process's groups are using, nor count as the store's silence for :func:`why_lost`.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore

__all__ = ["GRACE", "watched", "why_lost"]

GRACE = 2.0
"""Seconds a request may run past its deadline before its connections are shut."""

_lock = threading.Condition()
_due: list[tuple[float, int, _Watch]] = []  # a heap, earliest first
_ids = itertools.count()
_thread: threading.Thread | None = None
# Store addresses ("host", port) whose connections the watchdog shut, with when.
_shut: dict[tuple[str, int], float] = {}


def _address(store: Store | tuple[str, int]) -> tuple[str, int] | None:
    if isinstance(store, tuple):
        return store
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return (store.host, store.port) if isinstance(store, TCPStore) else None


class _Watch:
    __slots__ = ("address", "done", "spare")

    def __init__(self, address: tuple[str, int], spare: set[str] | None) -> None:
        self.address = address
        self.done = False
        # None: shut every connection to the address; else those not in ``spare`` (the
        # connections there were when a new client's watch began).
        self.spare = spare


class watched:
    """``with watched(store, deadline):`` (see the module docstring); ``deadline`` is a
    ``time.monotonic()`` value. ``store`` may be a ``(host, port)`` (a client being made);
    a store that is no TCPStore is not watched."""

    __slots__ = ("_watch",)

    def __init__(self, store: Store | tuple[str, int], deadline: float) -> None:
        address = _address(store)
        if address is None:
            self._watch = None
            return
        spare = _connections(address) if isinstance(store, tuple) else None
        self._watch = _Watch(address, spare)
        _add(deadline + GRACE, self._watch)

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._watch is not None:
            self._watch.done = True


def why_lost(exc: BaseException, since: float | None = None) -> str:
    """Why a store request failed with ``exc``, for its error, in parentheses: the store
    stopped answering if the watchdog shut connections since ``since`` (a
    ``time.monotonic()`` value; None: in the last minute), else it went away (torch's
    words follow)."""
    last = max(_shut.values(), default=None)
    if last is not None and last >= (time.monotonic() - 60 if since is None else since):
        return (
            f"(it stopped answering: no answer came {GRACE:g} s past the wait's end, so its "
            "host is frozen or the network to it is cut; this process closed its "
            "connections to it)"
        )
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return f"(did rank 0, which serves the store, exit?): {first}"


def _add(due: float, watch: _Watch) -> None:
    global _thread
    with _lock:
        heapq.heappush(_due, (due, next(_ids), watch))
        if _thread is None:
            _thread = threading.Thread(target=_run, name="bridge-store-watchdog", daemon=True)
            _thread.start()
        elif _due[0][2] is watch:
            _lock.notify()


def _run() -> None:
    while True:
        with _lock:
            while _due and _due[0][2].done:
                heapq.heappop(_due)
            if not _due:
                _lock.wait()
                continue
            wait = _due[0][0] - time.monotonic()
            if wait > 0:
                _lock.wait(wait)
                continue
            watch = heapq.heappop(_due)[2]
        if not watch.done:
            if watch.spare is None:
                _shut[watch.address] = time.monotonic()
            _shut_connections(watch.address, watch.spare)


def _peers(host: str, port: int) -> set[tuple[str, int]]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {(_plain(str(info[4][0])), port) for info in infos}


def _plain(ip: str) -> str:
    return ip.removeprefix("::ffff:")


def _connections(address: tuple[str, int]) -> set[str]:
    """The sockets (``socket:[inode]``) of this process connected to ``address`` now."""
    return {link for link, _sock in _connected(address)}


def _shut_connections(address: tuple[str, int], spare: set[str] | None) -> None:
    """Shut down the TCP sockets of this process connected to ``address``, but for those
    in ``spare``."""
    for link, sock in _connected(address):
        if spare is None or link not in spare:
            sock.shutdown(socket.SHUT_RDWR)


def _connected(address: tuple[str, int]) -> Iterator[tuple[str, socket.socket]]:
    """``(link, sock)`` for each TCP socket of this process connected to ``address``:
    ``sock`` is a duplicate of its descriptor, closed once the caller's turn is over."""
    peers = _peers(*address)
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
            try:
                inet = sock.family in (socket.AF_INET, socket.AF_INET6)
                peer: Any = sock.getpeername() if inet and sock.type == socket.SOCK_STREAM else None
                if peer and (_plain(peer[0]), peer[1]) in peers:
                    yield link, sock
            finally:
                sock.close()
