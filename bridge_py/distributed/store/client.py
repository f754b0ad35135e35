"""New TCPStore clients, connected within a deadline and without torch's log lines.

torch's TCPStore client retries a refused connect until its timeout, then once more after a
random delay of up to several seconds (so it overruns its timeout), logging each try with
a C++ stack trace. :func:`connect_client` first tries the port with a plain socket, closed
at once (the server drops it), until something accepts or the deadline passes; the client
then connects on its first try.
"""

from __future__ import annotations

import datetime
import socket
import time

from torch.distributed import TCPStore

from bridge_py.distributed.errors import StoreError
from bridge_py.distributed.store.quiet import QUIET
from bridge_py.distributed.store.watchdog import watched

__all__ = ["connect_client", "first_line", "format_address", "plain_host"]


def plain_host(host: str) -> str:
    """``host`` without the brackets of an IPv6 literal written as in a URL (``"[::1]"``
    is ``"::1"``), which is how torch and vLLM users write it; any other host unchanged."""
    if len(host) > 2 and host[0] == "[" and host[-1] == "]" and ":" in host:
        return host[1:-1]
    return host


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around IPv6 literals (``[::1]:29500``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (torch's may go on with a stack trace)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# Between connect attempts to a port nobody listens on yet: first, and at most.
_RETRY_FIRST = 0.01
_RETRY_MAX = 0.25


def _await_listener(host: str, port: int, deadline: float, wait_for_server: bool) -> None:
    """Return once something accepts TCP connections on ``host:port`` (any of its
    addresses, as the client tries them all); StoreError when nothing does by ``deadline``
    (a ``time.monotonic()`` value), or at once when every address refuses and not
    ``wait_for_server``."""
    address = format_address(host, port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise StoreError(f"cannot resolve the store host {host!r}: {exc.strerror}") from exc
    delay = _RETRY_FIRST
    while True:
        refused = 0
        for family, _type, _proto, _name, sockaddr in infos:  # as the client: every address
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError(f"nothing accepted connections on {address} in time")
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(left)
                sock.connect(sockaddr)
                return
            except ConnectionRefusedError:
                refused += 1
            except OSError as exc:  # timed out, or unreachable: the deadline decides
                if isinstance(exc, TimeoutError) or deadline - time.monotonic() <= 0:
                    raise StoreError(f"no answer from {address} in time: {exc}") from exc
            finally:
                sock.close()
        if refused == len(infos) and not wait_for_server:
            raise StoreError(f"{address} refused the connection (no server there)")
        time.sleep(max(min(delay, deadline - time.monotonic()), 0))
        delay = min(2 * delay, _RETRY_MAX)


def connect_client(
    host: str,
    port: int,
    deadline: float,
    *,
    use_libuv: bool = True,
    wait_for_server: bool = True,
    count_in: int | None = None,
) -> TCPStore:
    """A new TCPStore client of the server at ``host:port``, connected by ``deadline`` (a
    ``time.monotonic()`` value), which then bounds its requests too.

    ``wait_for_server``: keep trying while the port refuses connections (a server that is
    still to come: joining a group); otherwise a refusal means that the server is gone (a
    group's further connections) and fails at once. ``count_in`` (a world size): count this
    client in torch's join of the store's clients, as vLLM's ranks do (a client does not
    wait for the others). Raises StoreError (the torch error it comes from, if any,
    chained), and nothing is logged by torch.
    """
    _await_listener(host, port, deadline, wait_for_server)
    left = max(deadline - time.monotonic(), 0.001)
    try:
        with QUIET, watched((host, port), deadline):  # its handshake reads without a bound
            return TCPStore(
                host,
                port,
                count_in,
                False,
                timeout=datetime.timedelta(seconds=left),
                wait_for_workers=count_in is not None,
                use_libuv=use_libuv,
            )
    except RuntimeError as exc:
        raise StoreError(
            f"could not connect to the store at {format_address(host, port)}: {first_line(exc)}"
        ) from exc
