"""MessageQueue's channel to readers on other nodes: plain TCP, one connection per reader.

The writer listens on ``connect_ip`` (an ephemeral port, so no port races) and publishes
``tcp://host:port`` in the queue's Handle. Each remote reader connects and introduces itself
with a fixed 24-byte hello (magic, the queue's random token, its rank); the writer accepts
exactly the expected readers in ``wait_until_ready`` and ignores strangers. Then the writer
sends the very chunks it writes to the shared-memory ring (``shm_ring.CHUNK``: total
message length, part index, bytes in this part, then the bytes), preceded by one empty
chunk, the READY signal. The writer never reads anything but the hello.

Both sides wait with ``shm.wait.wait_until``, sleeping on the socket: sockets are
non-blocking and what was sent or received stays buffered across timeouts, so a stream
never loses its framing. TCP keepalive (30 s idle, then 3 probes 10 s apart, where the
platform allows) turns a peer host that vanished without a reset into an error instead of
an endless wait.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket
import struct

from bridge_py.distributed.device_communicators.shm_ring import CHUNK, CHUNK_HEADER_BYTES
from bridge_py.distributed.errors import PeerGoneError
from bridge_py.distributed.shm.wait import Cancel, remaining, wait_until

__all__ = [
    "READY",
    "RemotePublisher",
    "RemoteSubscriber",
    "format_tcp_address",
    "parse_tcp_address",
]

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("!4s16sI")  # magic, queue token, reader rank
_HELLO_MAGIC = b"VBMR"
_HELLO_TIMEOUT_SECONDS = 10.0
READY = CHUNK.pack(0, 0, 0)  # an empty chunk: no message is empty
_RECV_BYTES = 1 << 20


def format_tcp_address(host: str, port: int) -> str:
    """``tcp://host:port``, with brackets around an IPv6 host."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def parse_tcp_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``tcp://host:port`` address."""
    rest = address.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a tcp://host:port address: {address!r}")
    return host.strip("[]"), int(port)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
    sock.setblocking(False)


class RemotePublisher:
    """Writer side: accepts the remote readers, then sends every chunk to all of them."""

    def __init__(self, host: str, token: bytes, n_reader: int, ranks: list[int] | None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.bind((host, 0))
            self._listener.listen(n_reader + 4)
        except OSError as exc:
            self._listener.close()
            raise OSError(f"cannot listen for remote readers on {host!r}: {exc}") from exc
        self._listener.setblocking(False)
        self.address = format_tcp_address(host, self._listener.getsockname()[1])
        self._token = token
        self._n_reader = n_reader
        self._ranks = ranks
        self._peers: dict[int, socket.socket] = {}
        self._pending: dict[int, collections.deque[memoryview]] = {}

    def accept(self, deadline: float | None, cancel: Cancel = None) -> None:
        """Accept connections until every expected remote reader has said hello, then stop
        listening."""
        expected = "" if self._ranks is None else f" of ranks {self._ranks}"
        wait_until(
            lambda: self._accept_one(deadline),
            lambda: (
                f"remote readers to connect to {self.address}: {len(self._peers)} of "
                f"{self._n_reader}{expected} connected ({sorted(self._peers)})"
            ),
            deadline,
            cancel=cancel,
            sleep=lambda seconds: select.select([self._listener], [], [], seconds),
        )
        with contextlib.suppress(OSError):
            self._listener.close()  # everyone is here: free the port

    def _accept_one(self, deadline: float | None) -> bool:
        """Take one waiting connection, if any; whether every reader is connected now."""
        try:
            conn, peer = self._listener.accept()
        except BlockingIOError:
            return len(self._peers) == self._n_reader
        try:
            left = remaining(deadline)
            conn.settimeout(_HELLO_TIMEOUT_SECONDS if left is None else max(min(left, 10), 1e-3))
            hello = b""
            while len(hello) < _HELLO.size:
                piece = conn.recv(_HELLO.size - len(hello))
                if not piece:
                    raise ConnectionError("connection closed during the hello")
                hello += piece
            magic, token, rank = _HELLO.unpack(hello)
            if magic != _HELLO_MAGIC or token != self._token:
                raise ValueError("not a reader of this queue")
            if self._ranks is not None and rank not in self._ranks:
                raise ValueError(f"rank {rank} is not a remote reader ({self._ranks})")
            if rank in self._peers:
                raise ValueError(f"rank {rank} is already connected")
        except (OSError, ValueError) as exc:
            logger.warning("refused a connection from %s to %s: %s", peer, self.address, exc)
            conn.close()
            return False
        _tune(conn)
        self._peers[rank] = conn
        self._pending[rank] = collections.deque()
        return len(self._peers) == self._n_reader

    def publish(self, header: bytes, payload: memoryview) -> None:
        """Queue one chunk for every remote reader; :meth:`flush` sends it."""
        for queue in self._pending.values():
            queue.append(memoryview(header))
            if len(payload):
                queue.append(payload)

    def flush(self, deadline: float | None, cancel: Cancel = None) -> None:
        """Send what is queued; on GroupTimeout the rest stays queued for the next call."""
        busy = [rank for rank, queue in self._pending.items() if queue]  # the queue's lock held
        wait_until(
            lambda: all([self._push(rank) for rank in busy]),
            lambda: (
                f"remote readers {[rank for rank in busy if self._pending[rank]]} to take a message"
            ),
            deadline,
            cancel=cancel,
            sleep=lambda seconds: select.select(
                [], [self._peers[rank] for rank in busy if self._pending[rank]], [], seconds
            ),
        )

    def _push(self, rank: int) -> bool:
        """Send as much of ``rank``'s queue as the socket takes; True when all is sent."""
        queue = self._pending[rank]
        while queue:
            try:
                sent = self._peers[rank].sendmsg(list(queue)[:64])
            except BlockingIOError:
                return False
            except OSError as exc:
                raise PeerGoneError(f"remote reader rank {rank} is gone: {exc}") from exc
            while sent:
                head = queue[0]
                if sent >= len(head):
                    sent -= len(head)
                    queue.popleft()
                else:
                    queue[0] = head[sent:]
                    sent = 0
        return True

    def close(self) -> None:
        """Close every connection (readers see the end of the stream) and stop listening."""
        for sock in [*self._peers.values(), self._listener]:
            with contextlib.suppress(OSError):
                sock.close()
        self._peers.clear()
        self._pending.clear()


class RemoteSubscriber:
    """Reader side: one connection to the writer, receiving its chunks into a buffer."""

    def __init__(self, address: str, token: bytes, rank: int, timeout: float | None) -> None:
        self.address = address
        self.rank = rank
        host, port = parse_tcp_address(address)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
            self._sock.sendall(_HELLO.pack(_HELLO_MAGIC, token, rank))
        except OSError as exc:
            raise PeerGoneError(
                f"cannot connect to the queue's writer at {address}: {exc}"
            ) from exc
        _tune(self._sock)
        self._rx = bytearray()  # received, not yet taken: chunks, the last maybe partial

    def _complete(self) -> int:
        """The bytes of the first chunk in the buffer, or 0 while it is not all there."""
        if len(self._rx) < CHUNK_HEADER_BYTES:
            return 0
        end = CHUNK_HEADER_BYTES + CHUNK.unpack_from(self._rx)[2]
        return end if len(self._rx) >= end else 0

    def _receive(self) -> bool:
        """Receive what has arrived (never blocks); whether a whole chunk is buffered.

        PeerGoneError once the writer is gone and no whole chunk is left to take.
        """
        if self._complete():
            return True
        try:
            data = self._sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise PeerGoneError(f"the writer at {self.address} is gone: {exc}") from exc
        if not data:
            raise PeerGoneError(f"the writer at {self.address} closed the queue")
        self._rx += data
        return self._complete() > 0

    def next_chunk(
        self, deadline: float | None, cancel: Cancel, log: bool, what: str
    ) -> tuple[int, int, memoryview]:
        """``(total, part, a view of the part)`` of the next chunk, waiting for it; the view
        must be released before :meth:`release`."""
        wait_until(
            self._receive,
            f"{what} from the writer at {self.address}",
            deadline,
            cancel=cancel,
            log=log,
            sleep=lambda seconds: select.select([self._sock], [], [], seconds),
        )
        total, part, size = CHUNK.unpack_from(self._rx)
        return total, part, memoryview(self._rx)[CHUNK_HEADER_BYTES : CHUNK_HEADER_BYTES + size]

    def release(self) -> None:
        """Drop the chunk :meth:`next_chunk` returned."""
        del self._rx[: self._complete()]

    def close(self) -> None:
        """Close the connection."""
        with contextlib.suppress(OSError):
            self._sock.close()
