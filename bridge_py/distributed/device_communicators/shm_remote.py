"""MessageQueue's channel to readers on other nodes: plain TCP, one connection per reader.

The writer listens on ``connect_ip`` (an ephemeral port, so no port races) and publishes
``tcp://host:port`` in the queue's Handle. Each remote reader connects and introduces itself
with a fixed 24-byte hello (magic, the queue's random token, its rank); the writer accepts
exactly the expected readers in ``wait_until_ready`` and ignores strangers. Then the writer
sends frames, each a 9-byte header (kind, payload length) and the payload: one READY frame,
then one DATA frame per message. The writer never unpickles anything it receives.

Both sides keep partial progress across timeouts: a send or receive interrupted by its
deadline resumes where it stopped on the next call, so a stream never loses its framing.
TCP keepalive (30 s idle, then 3 probes 10 s apart, where the platform allows) turns a peer
host that vanished without a reset into an error instead of an endless wait.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import selectors
import socket
import struct
import threading

from bridge_py.distributed.errors import DistributedError, GroupTimeout
from bridge_py.distributed.shm.wait import (
    PeerGoneError,
    deadline_after,
    remaining,
)

__all__ = [
    "KIND_DATA",
    "KIND_READY",
    "RemotePublisher",
    "RemoteSubscriber",
    "format_tcp_address",
    "parse_tcp_address",
]

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("!BQ")  # kind, payload length
_HELLO = struct.Struct("!4s16sI")  # magic, queue token, reader rank
_HELLO_MAGIC = b"VBMR"
KIND_READY = 1
KIND_DATA = 2
_MAX_FRAME_BYTES = 1 << 40
_HELLO_TIMEOUT_SECONDS = 10.0
_CANCEL_POLL_SECONDS = 0.1


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


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        piece = sock.recv(size - len(data))
        if not piece:
            raise ConnectionError("connection closed during the hello")
        data += piece
    return bytes(data)


class RemotePublisher:
    """Writer side: accepts the remote readers, then sends every frame to all of them."""

    def __init__(self, host: str, token: bytes, n_reader: int, ranks: list[int] | None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.bind((host, 0))
            self._listener.listen(n_reader + 4)
        except OSError as exc:
            self._listener.close()
            raise OSError(f"cannot listen for remote readers on {host!r}: {exc}") from exc
        self.address = format_tcp_address(host, self._listener.getsockname()[1])
        self._token = token
        self._n_reader = n_reader
        self._ranks = ranks
        self._peers: dict[int, socket.socket] = {}
        self._pending: dict[int, collections.deque[memoryview]] = {}
        self._lock = threading.Lock()

    @property
    def all_connected(self) -> bool:
        """Whether every expected remote reader has connected."""
        return len(self._peers) == self._n_reader

    def accept(self, deadline: float | None) -> None:
        """Accept connections until every expected remote reader has said hello, then stop
        listening."""
        while not self.all_connected:
            left = remaining(deadline)
            if left == 0:
                expected = "" if self._ranks is None else f" of ranks {self._ranks}"
                raise GroupTimeout(
                    f"timed out waiting for remote readers to connect to {self.address}: "
                    f"{len(self._peers)} of {self._n_reader}{expected} connected "
                    f"({sorted(self._peers)})"
                )
            self._listener.settimeout(left)
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            try:
                rank = self._hello(conn, deadline)
            except (OSError, ValueError) as exc:
                logger.warning("refused a connection from %s to %s: %s", peer, self.address, exc)
                conn.close()
                continue
            _tune(conn)
            conn.setblocking(False)
            self._peers[rank] = conn
            self._pending[rank] = collections.deque()
        with contextlib.suppress(OSError):
            self._listener.close()  # everyone is here: free the port

    def _hello(self, conn: socket.socket, deadline: float | None) -> int:
        left = remaining(deadline)
        conn.settimeout(_HELLO_TIMEOUT_SECONDS if left is None else min(left, 10.0) or 0.001)
        magic, token, rank = _HELLO.unpack(_recv_exactly(conn, _HELLO.size))
        if magic != _HELLO_MAGIC or token != self._token:
            raise ValueError("not a reader of this queue")
        if self._ranks is not None and rank not in self._ranks:
            raise ValueError(f"rank {rank} is not a remote reader ({self._ranks})")
        if rank in self._peers:
            raise ValueError(f"rank {rank} is already connected")
        return rank

    def publish(self, kind: int, payload: bytes) -> None:
        """Queue one frame for every remote reader; :meth:`flush` sends it."""
        header = memoryview(_FRAME.pack(kind, len(payload)))
        body = memoryview(payload)
        for queue in self._pending.values():
            queue.append(header)
            if len(body):
                queue.append(body)

    def flush(self, deadline: float | None) -> None:
        """Send what is queued; on TimeoutError the rest stays queued for the next call."""
        with self._lock:
            busy = {rank for rank, queue in self._pending.items() if queue}
            for rank in list(busy):
                if self._push(rank):
                    busy.discard(rank)
            if not busy:
                return
            with selectors.DefaultSelector() as selector:
                for rank in busy:
                    selector.register(self._peers[rank], selectors.EVENT_WRITE, rank)
                while busy:
                    left = remaining(deadline)
                    if left == 0:
                        raise GroupTimeout(
                            f"timed out sending a message to remote readers {sorted(busy)}"
                        )
                    for key, _ in selector.select(left):
                        rank = key.data
                        if self._push(rank):
                            selector.unregister(key.fileobj)
                            busy.discard(rank)

    def _push(self, rank: int) -> bool:
        """Send as much of ``rank``'s queue as the socket takes; True when all is sent."""
        queue = self._pending[rank]
        sock = self._peers[rank]
        while queue:
            try:
                sent = sock.sendmsg(list(queue)[:64])
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
    """Reader side: one connection to the writer, receiving frames."""

    def __init__(self, address: str, token: bytes, rank: int, timeout: float | None) -> None:
        self.address = address
        self.rank = rank
        host, port = parse_tcp_address(address)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerGoneError(
                f"cannot connect to the queue's writer at {address}: {exc}"
            ) from exc
        _tune(self._sock)
        self._sock.sendall(_HELLO.pack(_HELLO_MAGIC, token, rank))
        self._header = bytearray(_FRAME.size)
        self._header_filled = 0
        self._body: bytearray | None = None
        self._body_filled = 0

    def _fill(
        self,
        view: memoryview,
        deadline: float | None,
        cancel: threading.Event | None,
        what: str,
    ) -> int:
        """Receive into ``view`` once (some bytes), honouring deadline and cancel."""
        while True:
            left = remaining(deadline)
            if left == 0:
                raise GroupTimeout(
                    f"timed out waiting for {what} from the writer at {self.address}"
                )
            if cancel is not None:
                if cancel.is_set():
                    raise RuntimeError("cancelled")
                left = _CANCEL_POLL_SECONDS if left is None else min(left, _CANCEL_POLL_SECONDS)
            self._sock.settimeout(left)
            try:
                received = self._sock.recv_into(view)
            except TimeoutError:
                continue
            except OSError as exc:
                raise PeerGoneError(f"the writer at {self.address} is gone: {exc}") from exc
            if received == 0:
                raise PeerGoneError(f"the writer at {self.address} closed the queue")
            return received

    def recv_frame(
        self,
        deadline: float | None,
        cancel: threading.Event | None = None,
        what: str = "a message",
    ) -> tuple[int, bytearray]:
        """The next ``(kind, payload)``; a timeout keeps what was received for the next call."""
        while self._header_filled < _FRAME.size:
            view = memoryview(self._header)[self._header_filled :]
            self._header_filled += self._fill(view, deadline, cancel, what)
        kind, size = _FRAME.unpack(self._header)
        if kind not in (KIND_READY, KIND_DATA) or size > _MAX_FRAME_BYTES:
            raise DistributedError(
                f"remote reader rank {self.rank} received a corrupt frame (kind {kind}, "
                f"{size} bytes) while waiting for {what} from the writer at {self.address}"
            )
        if self._body is None:
            self._body = bytearray(size)
        while self._body_filled < size:
            view = memoryview(self._body)[self._body_filled :]
            self._body_filled += self._fill(view, deadline, cancel, what)
        body = self._body
        self._header_filled = 0
        self._body = None
        self._body_filled = 0
        return kind, body

    def wait_ready(self, timeout: float | None) -> None:
        """Wait for the writer's READY frame (sent once every reader has connected)."""
        kind, _ = self.recv_frame(deadline_after(timeout), what="the READY signal")
        if kind != KIND_READY:
            raise DistributedError(
                f"remote reader rank {self.rank} expected the READY signal from the writer "
                f"at {self.address}, got a frame of kind {kind}"
            )

    def close(self) -> None:
        """Close the connection."""
        with contextlib.suppress(OSError):
            self._sock.close()
