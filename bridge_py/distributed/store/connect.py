"""Open (rank 0: serve) or join the TCPStore behind a group, with errors that say what went wrong.

Every group in this package talks through one ``torch.distributed.TCPStore``. Rank 0 serves
it on a socket it binds itself (so the store listens only on the interface it was given, and
"address in use" is reported as such), the other ranks connect to it. torch's own errors for
these cases are generic timeouts; the functions here turn them into messages naming the
address, the rank and the time waited, chained (``raise ... from``) to the original error.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import re
import socket
import time

from torch.distributed import HashStore, PrefixStore, Store, TCPStore

from bridge_py.distributed.errors import StoreError
from bridge_py.distributed.store.client import (
    connect_client,
    first_line,
    format_address,
    plain_host,
)
from bridge_py.distributed.store.quiet import QUIET
from bridge_py.distributed.store.requests import StoreRequest
from bridge_py.distributed.store.torch_api import set_bytes
from bridge_py.distributed.store.waiting import BoundedWaiter
from bridge_py.distributed.store.watchdog import watched

__all__ = [
    "StoreError",
    "bind_listen_socket",
    "connect_client",
    "format_address",
    "format_seconds",
    "join_group",
    "open_store",
    "plain_host",
    "remaining",
    "require_queues",
]


def require_queues(store: Store) -> None:
    """Raise TypeError unless ``store`` has queues (``queue_push`` and ``queue_pop``).

    A group's messages and barriers travel on store queues. TCPStore and HashStore have them
    (also under a PrefixStore); FileStore does not, and would otherwise fail at the first
    send or barrier with torch's bare "queue support is not implemented". Other stores are
    asked once (``queue_len`` of a key nobody uses).
    """
    inner = store
    while isinstance(inner, PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, (TCPStore, HashStore)):
        return
    try:
        store.queue_len("vllm_bridge/queue_probe")
    except NotImplementedError as exc:
        raise TypeError(
            f"StatelessProcessGroup needs a store with queues (TCPStore or HashStore, also "
            f"under a PrefixStore); {type(inner).__name__} has none: {exc}"
        ) from exc


def _resolve(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The address family and socket address of ``host`` (IPv4 or IPv6, first answer wins)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise StoreError(f"cannot resolve the store host {host!r}: {exc.strerror}") from exc
    family, _type, _proto, _name, sockaddr = infos[0]
    return family, sockaddr


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` only and listening, for rank 0's store server.

    ``SO_REUSEADDR`` lets a port left in TIME_WAIT by an earlier group be reused; Linux still
    refuses a port that another socket is listening on, which is reported as "in use".
    """
    family, sockaddr = _resolve(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen()
    except OSError as exc:
        with contextlib.suppress(OSError):
            sock.close()
        address = format_address(host, port)
        if exc.errno == errno.EADDRINUSE:
            raise StoreError(f"cannot serve the store: {address} is already in use") from exc
        if exc.errno == errno.EADDRNOTAVAIL:
            raise StoreError(
                f"cannot serve the store on {address}: {host} is not an address of this machine"
            ) from exc
        raise StoreError(f"cannot serve the store on {address}: {exc.strerror or exc}") from exc
    return sock


def _adopt_listen_socket(sock: socket.socket, port: int) -> int:
    """Check a caller's socket for rank 0, make it listen, and return its port."""
    if sock.type != socket.SOCK_STREAM:
        raise ValueError("listen_socket must be a TCP (SOCK_STREAM) socket")
    bound_port = sock.getsockname()[1]
    if bound_port == 0:
        raise ValueError("listen_socket must already be bound (bind it to (host, 0) for any port)")
    if port not in (0, bound_port):
        raise ValueError(f"port={port} but listen_socket is bound to port {bound_port}")
    sock.listen()  # a no-op apart from the backlog when it already listens
    return bound_port


def open_store(
    host: str,
    port: int,
    rank: int,
    timeout: float,
    *,
    listen_socket: socket.socket | None = None,
    torch_join: int | None = None,
    within: float | None = None,
) -> tuple[TCPStore, socket.socket | None]:
    """Serve (rank 0) or connect to (other ranks) the store at ``host:port``.

    Returns the store and, on rank 0, the listening socket (``listen_socket`` itself when
    given). The store server receives a duplicate of the socket's descriptor because it closes
    the descriptor it serves on when it is destroyed; the returned socket stays the caller's
    to close. ``timeout`` (seconds) bounds connecting and is the store's default timeout for
    blocking operations.

    ``torch_join`` (a world size) joins as vLLM's ranks do, through torch's own count of a
    store's clients: every rank counts itself in, rank 0 (whose server then runs without
    libuv, as vLLM's) returns once all have, within ``timeout``, else StoreError saying how
    many did. Without it nobody counts (``join_group`` is this package's join).

    ``within`` (seconds, at most ``timeout``) bounds connecting and that wait instead, for a
    caller with less time than the store's timeout (a deadline); the store keeps ``timeout``.
    """
    if timeout <= 0:
        raise ValueError(f"store timeout must be positive, got {timeout}")
    if not 0 <= port <= 65535 or (port == 0 and rank != 0):
        raise ValueError(
            f"port must be a TCP port, 1 to 65535 (0 too on rank 0: a free port), got {port} "
            f"on rank {rank}"
        )
    delta = datetime.timedelta(seconds=timeout)
    within = timeout if within is None else min(within, timeout)
    address = format_address(host, port)
    if rank != 0:
        if listen_socket is not None:
            raise ValueError("listen_socket is only used by rank 0, which serves the store")
        _resolve(host, port)  # an unknown host fails now, with its own message
        try:
            store = connect_client(host, port, time.monotonic() + within, count_in=torch_join)
        except StoreError as exc:
            raise StoreError(
                f"rank {rank} could not reach the store at {address} within "
                f"{format_seconds(within)} s (is rank 0 serving it there?): {exc}"
            ) from exc
        store.set_timeout(delta)  # the store's timeout for requests, not what was left
        return store, None

    owned = listen_socket is None
    sock = bind_listen_socket(host, port) if listen_socket is None else listen_socket
    try:
        port = _adopt_listen_socket(sock, port)
        address = format_address(host, port)
        served_fd = os.dup(sock.fileno())
    except BaseException:
        if owned:
            with contextlib.suppress(OSError):
                sock.close()
        raise
    try:
        with QUIET:
            store = TCPStore(
                host,
                port,
                torch_join,
                True,
                timeout=datetime.timedelta(seconds=within),
                wait_for_workers=torch_join is not None,
                master_listen_fd=served_fd,
                use_libuv=torch_join is None,
            )
    except RuntimeError as exc:
        with contextlib.suppress(OSError):
            os.close(served_fd)
        if owned:
            with contextlib.suppress(OSError):
                sock.close()
        joined = _CLIENTS_JOINED.search(str(exc))
        if torch_join is not None and joined:
            raise StoreError(
                f"{joined[1]} of {torch_join} ranks joined {address} within "
                f"{format_seconds(within)} s (rank 0 gave up waiting for the others)"
            ) from exc
        raise StoreError(
            f"rank 0 could not serve the store on {address}: {first_line(exc)}"
        ) from exc
    store.set_timeout(delta)
    return store, sock


def format_seconds(seconds: float) -> str:
    """Seconds for a message, to a tenth: a deadline's 1.99995 reads as 2."""
    return f"{seconds:.1f}".removesuffix(".0")


# torch's message when its server's wait for its clients runs out.
_CLIENTS_JOINED = re.compile(r"(\d+)/\d+ clients joined")


_JOIN_COUNT = "join/count"
_JOIN_DONE = "join/done"


def join_group(
    store: TCPStore,
    rank: int,
    world_size: int,
    address: str,
    timeout: float,
    deadline: float | None = None,
) -> None:
    """Return once all ``world_size`` ranks have joined the store, or raise ``StoreError``.

    Waits until ``deadline`` (a ``time.monotonic()`` value) when given, else for ``timeout``
    seconds; errors quote ``timeout`` (the caller's whole budget, connecting included).
    Each rank adds one to a counter; the rank that brings it to ``world_size`` sets a "done"
    key that everyone waits for (on a separate connection, with a deadline, see
    :class:`BoundedWaiter`). These two keys stay in the store for the group's life: a rank
    that joins late must still find them.
    """
    at = f" at {address}"
    until = time.monotonic() + timeout if deadline is None else deadline
    with StoreRequest("the join", rank, _JOIN_COUNT, "counting in", at=at), watched(store, until):
        joined = store.add(_JOIN_COUNT, 1)
    if joined == world_size:
        with StoreRequest("the join", rank, _JOIN_DONE, at=at):
            set_bytes(store, _JOIN_DONE, b"1")
        return
    if joined < world_size:
        wait_for = timeout if deadline is None else remaining(deadline)
        with StoreRequest("the join", rank, _JOIN_DONE, "waiting for", at=at):
            if BoundedWaiter(store).wait([_JOIN_DONE], wait_for):
                return
            with watched(store, time.monotonic() + timeout):  # a store gone silent since
                seen = store.add(_JOIN_COUNT, 0)
    if joined > world_size:
        raise StoreError(
            f"rank {rank} is rank number {joined} to join {address}, but world_size is "
            f"{world_size}: another group uses this address, or ranks disagree on world_size"
        )
    raise StoreError(
        f"{seen} of {world_size} ranks joined {address} within {format_seconds(timeout)} s "
        f"(rank {rank} gave up waiting for the others)"
    )


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` value), at least 1 ms."""
    return max(deadline - time.monotonic(), 0.001)
