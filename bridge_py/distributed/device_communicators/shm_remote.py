"""MessageQueue's channel to readers on other nodes: plain TCP, one connection per reader.

The writer listens on ``connect_ip`` (an ephemeral port, so no port races) and publishes
``tcp://host:port`` in the queue's Handle. Each remote reader connects and introduces itself
with a fixed 24-byte hello (magic, the queue's random token, its rank); the writer accepts
exactly the expected readers in ``wait_until_ready`` and ignores strangers. Then the writer
sends the very chunks it writes to the shared-memory ring (``shm_ring.CHUNK``: total
message length, part index, bytes in this part, then the bytes), preceded by one empty
chunk, the READY signal. The writer reads nothing but the hello (peeked until whole).

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
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore

from bridge_py.distributed.device_communicators.shm_ring import CHUNK, CHUNK_HEADER_BYTES
from bridge_py.distributed.errors import DistributedError, PeerGoneError
from bridge_py.distributed.groups.torch_group import store_of
from bridge_py.distributed.shm.wait import Cancel, wait_until
from bridge_py.distributed.store.client import format_address

__all__ = [
    "READY",
    "RemotePublisher",
    "RemoteSubscriber",
    "address_toward",
    "address_toward_group",
    "parse_tcp_address",
]

logger = logging.getLogger(__name__)


def address_toward_group(pg: Any) -> str | None:
    """:func:`address_toward` the store of ``pg`` (or of its ``cpu_group``), if it has one
    that tells (a writer's address for the readers of a group on other hosts)."""
    try:
        return address_toward(store_of(getattr(pg, "cpu_group", pg)))
    except (ValueError, AttributeError):
        return None


def address_toward(store: Store) -> str | None:
    """This host's address on the route to ``store``'s host (a TCPStore, also under a
    PrefixStore): the one other hosts reach it by as well. A UDP socket connected toward
    the store tells, sending nothing. None for another store, or no route."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if not isinstance(store, TCPStore):
        return None
    try:
        infos = socket.getaddrinfo(store.host, store.port, type=socket.SOCK_DGRAM)
        with socket.socket(infos[0][0], socket.SOCK_DGRAM) as probe:
            probe.connect(infos[0][4])
            return str(probe.getsockname()[0])
    except (OSError, IndexError):
        return None


_HELLO = struct.Struct("!4s16sI")  # magic, queue token, reader rank
_HELLO_MAGIC = b"VBMR"
READY = CHUNK.pack(0, 0, 0)  # an empty chunk: no message is empty
_RECV_BYTES = 1 << 20


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
        self.address = f"tcp://{format_address(host, self._listener.getsockname()[1])}"
        self._token = token
        self._n_reader = n_reader
        self._ranks = ranks
        self._greeting: list[socket.socket] = []  # connected, their hello not all in yet
        self._peers: dict[int, socket.socket] = {}
        self._pending: dict[int, collections.deque[memoryview]] = {}

    def join(self, deadline: float | None, cancel: Cancel = None) -> None:
        """Accept connections until every expected remote reader has said hello, stop
        listening, and send them all the READY signal."""
        expected = "" if self._ranks is None else f" of ranks {self._ranks}"
        wait_until(
            self._admit,
            lambda: (
                f"remote readers to connect to {self.address}: {len(self._peers)} of "
                f"{self._n_reader}{expected} connected ({sorted(self._peers)})"
            ),
            deadline,
            cancel=cancel,
            sleep=lambda seconds: select.select([self._listener, *self._greeting], [], [], seconds),
        )
        for sock in [self._listener, *self._greeting]:
            with contextlib.suppress(OSError):
                sock.close()  # everyone is here: free the port, drop strangers
        self._greeting.clear()
        self.put(0, 0, memoryview(b""), deadline, cancel)  # READY: an empty chunk
        self.flush(deadline, cancel)

    def _admit(self) -> bool:
        """Take the connections and hellos that have arrived (never blocks); whether every
        reader is connected now."""
        with contextlib.suppress(BlockingIOError):
            while True:
                conn, _ = self._listener.accept()
                _tune(conn)
                self._greeting.append(conn)
        for conn in list(self._greeting):
            try:  # a hello stays in the socket until all of it is there: nothing else comes
                hello = conn.recv(_HELLO.size, socket.MSG_PEEK)
                if len(hello) < _HELLO.size:
                    if hello:
                        continue
                    raise ConnectionError("connection closed during the hello")
                magic, token, rank = _HELLO.unpack(hello)
                if magic != _HELLO_MAGIC or token != self._token:
                    raise ValueError("not a reader of this queue")
                if self._ranks is not None and rank not in self._ranks:
                    raise ValueError(f"rank {rank} is not a remote reader ({self._ranks})")
                if rank in self._peers:
                    raise ValueError(f"rank {rank} is already connected")
            except BlockingIOError:
                continue
            except (OSError, ValueError) as exc:
                logger.warning("refused a connection to %s: %s", self.address, exc)
                conn.close()
                self._greeting.remove(conn)
                continue
            self._greeting.remove(conn)
            self._peers[rank] = conn
            self._pending[rank] = collections.deque()
        return len(self._peers) == self._n_reader

    def put(
        self, total: int, part: int, payload: memoryview, deadline: float | None, cancel: Cancel
    ) -> None:
        """Queue one chunk for every remote reader (never waits); :meth:`flush` sends it."""
        header = memoryview(CHUNK.pack(total, part, len(payload)))
        for queue in self._pending.values():
            queue.append(header)
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
        for sock in [*self._peers.values(), self._listener, *self._greeting]:
            with contextlib.suppress(OSError):
                sock.close()
        self._peers.clear()
        self._pending.clear()
        self._greeting.clear()


class RemoteSubscriber:
    """Reader side: one connection to the writer, receiving its chunks into a buffer."""

    def __init__(self, address: str, token: bytes, rank: int, timeout: float | None) -> None:
        self.address = address
        self.rank = rank
        host, port = parse_tcp_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            sock.sendall(_HELLO.pack(_HELLO_MAGIC, token, rank))
        except OSError as exc:
            raise PeerGoneError(
                f"cannot connect to the queue's writer at {address}: {exc}"
            ) from exc
        _tune(sock)
        self._sock = sock
        self._rx = bytearray()  # received, not yet taken: chunks, the last maybe partial

    def _complete(self) -> int:
        """The bytes of the first chunk in the buffer, or 0 while it is not all there."""
        if len(self._rx) < CHUNK_HEADER_BYTES:
            return 0
        end = CHUNK_HEADER_BYTES + CHUNK.unpack_from(self._rx)[2]
        return end if len(self._rx) >= end else 0

    def readable(self) -> bool:
        """Whether a whole chunk has arrived (receives what there is; never blocks)."""
        return self._receive()

    def wait_readable(self, seconds: float) -> None:
        """Sleep up to ``seconds`` for the writer to send something (the GIL released)."""
        if not self._complete():
            select.select([self._sock], [], [], max(seconds, 0.0))

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

    def join(self, deadline: float | None, cancel: Cancel) -> None:
        """Wait for the writer's READY signal."""
        total, _, view = self.take(deadline, cancel, True, "the READY signal")
        view.release()
        if total != 0:
            raise DistributedError(
                f"remote reader rank {self.rank} expected the READY signal from the "
                f"writer at {self.address}, got a part of a message"
            )
        self.release()

    def take(
        self, deadline: float | None, cancel: Cancel, log: bool, what: str = "a message"
    ) -> tuple[int, int, memoryview]:
        """``(total, part, a view of the part)`` of the next chunk, waiting for it (for
        ``what``); the view must be released before :meth:`release`."""
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
        """Drop the chunk :meth:`take` returned."""
        del self._rx[: self._complete()]

    def broken(self, what: str) -> DistributedError:
        """The error for the chunk :meth:`take` returned, that ``what`` (it breaks the stream)."""
        where = f"remote reader rank {self.rank}: a chunk from the writer at {self.address}"
        return DistributedError(f"{where} {what}")

    def close(self) -> None:
        """Close the connection."""
        with contextlib.suppress(OSError):
            self._sock.close()
