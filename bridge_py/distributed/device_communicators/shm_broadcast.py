"""vLLM's MessageQueue without vLLM: one writer broadcasting objects to many readers.

Readers on the writer's node read from a shared-memory ring (:class:`ShmRingBuffer`, see
``shm_ring.py`` for its layout); readers on other nodes get the same chunks over TCP
(``shm_remote.py``, stdlib sockets, no ZeroMQ), and both reassemble them alike. Names,
signatures and behaviour follow ``vllm.distributed.device_communicators.shm_broadcast``;
it does better in these ways:

* a message larger than a chunk streams through consecutive chunks (readers copy each part
  out and free the chunk at once), so any size works with any ring, without a side channel;
* every wait is bounded by its ``timeout`` (``TimeoutError`` says what it waited for, and a
  timeout in the middle of a message resumes, never corrupts the stream), and with
  ``timeout=None`` a wait still ends with :class:`PeerGoneError` when the peer it waits for
  closes its end or its process exits (local peers: their PID is checked a few times a
  second while sleeping; remote ones: the connection closes or TCP keepalive gives up);
* waiting spins for 2 ms, then sleeps in naps of at most 1 ms (10 ms after a second idle),
  so an idle queue does not keep a core busy (vLLM's spins on for seconds after each
  message);
* :meth:`MessageQueue.shutdown` ends every wait of that end within 10 ms (vLLM's wakes only
  a local reader's): a reader's dequeue, shared memory or TCP, and a writer's enqueue;
* clear errors: a rank that is not a reader, a local handle used on another host, a reader
  slot held twice, a writer or reader used the wrong way round;
* :meth:`MessageQueue.close` (and garbage collection, and interpreter exit) unlinks the
  segment; segment names carry a random token; readers never unlink;
* a ``/dev/shm`` too small for a message (a container's 64 MiB default) is a
  SharedMemoryError from ``enqueue``, with nothing sent, not a SIGBUS that kills the
  writer's process.

Messages are pickled (``auth.seal_object``): connect only processes that trust each other,
or give the writer and every reader the same ``auth_key`` (or ``$VLLM_BRIDGE_AUTH_KEY``): each
message then carries an HMAC-SHA256 tag bound to the queue's token and the message's number,
checked before unpickling (``auth.py``), and so does the handle exchanged by
:meth:`MessageQueue.create_from_process_group`. Each end resolves its key once, when it is
made (``auth.resolve_key``: a key that differs from the operator's ``$VLLM_BRIDGE_AUTH_KEY`` is
refused, and so is no key at all under ``$VLLM_BRIDGE_REQUIRE_AUTH_KEY=1``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Sized
from typing import Any

from bridge_py.deadline import clamp_until
from bridge_py.distributed.auth import AuthKey, open_object, resolve_key, seal_object
from bridge_py.distributed.device_communicators.shm_helpers import (
    SHM_PATH,
    check_shm_free_space,
    from_bytes_big,
    memory_fence,
    to_bytes_big,
)
from bridge_py.distributed.device_communicators.shm_remote import (
    RemotePublisher,
    RemoteSubscriber,
    address_toward_group,
)
from bridge_py.distributed.device_communicators.shm_ring import (
    CHUNK_HEADER_BYTES,
    RAW_PART,
    ShmRingBuffer,
)
from bridge_py.distributed.device_communicators.shm_slots import QueueSlots
from bridge_py.distributed.errors import (
    PeerGoneError,
    SharedMemoryError,
    StateError,
    WaitCancelled,
)
from bridge_py.distributed.groups.node import same_node_as
from bridge_py.distributed.groups.objects import object_group
from bridge_py.distributed.shm.wait import deadline_after, sched_yield

__all__ = [
    "SHM_PATH",
    "Handle",
    "MessageQueue",
    "PeerGoneError",
    "ShmRingBuffer",
    "check_shm_free_space",
    "from_bytes_big",
    "memory_fence",
    "to_bytes_big",
]

logger = logging.getLogger(__name__)

# How long a reader tries to connect to the writer, and wait_until_ready's default bound.
CONNECT_TIMEOUT_SECONDS = 60.0
READY_TIMEOUT_SECONDS = 300.0
_CLOSED = "this end of the message queue is closed"
# The largest message a reader allocates room for (a corrupt length fails instead).
MAX_MESSAGE_BYTES = 1 << 40


@dataclasses.dataclass
class Handle:
    """What a reader needs to join a queue; the writer's :meth:`MessageQueue.export_handle`.

    The first five fields are vLLM's (``local_subscribe_addr`` stays None: large messages go
    through the ring itself); the rest let readers check that they belong to this queue.
    """

    local_reader_ranks: list[int] = dataclasses.field(default_factory=list)
    buffer_handle: tuple[int, int, int, str] | None = None
    local_subscribe_addr: str | None = None
    remote_subscribe_addr: str | None = None
    remote_addr_ipv6: bool = False
    # The ranks that may connect as remote readers (None: any rank not local).
    remote_reader_ranks: list[int] | None = None
    # A random token that remote readers present when they connect.
    token: bytes = b""
    # The writer's host name, for error messages.
    writer_host: str = ""


@dataclasses.dataclass
class _Incoming:
    """A multi-chunk message being read; kept when a timeout interrupts it. ``data`` grows
    with the parts that came: the ``total`` a chunk claims is only checked against them,
    never allocated ahead (a corrupt length would otherwise take that much memory)."""

    total: int
    data: bytearray = dataclasses.field(default_factory=bytearray)
    part: int = 0


def _handle_context(writer_rank: int) -> str:
    """What the tag of a handle broadcast by ``create_from_process_group`` is bound to."""
    return f"mq/handle/{writer_rank}"


def _check_ranks(ranks: list[int], what: str, count: int, expected: str) -> list[int]:
    ranks = list(ranks)
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"{what} must be non-negative ints, got {ranks}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{what} must be distinct, got {ranks}")
    if len(ranks) != count:
        raise ValueError(f"{what} has {len(ranks)} ranks, {expected} is {count}")
    return ranks


class MessageQueue(QueueSlots):
    """A one-writer, many-reader queue of picklable objects (shared memory, and TCP).

    The writer constructs it and hands :meth:`export_handle` to the readers, who call
    :meth:`create_from_handle`; everyone then calls :meth:`wait_until_ready`. Or every rank
    of a group calls :meth:`create_from_process_group`, which does all of that.
    """

    buffer: ShmRingBuffer | None = None
    # Where chunks go (the writer's ring, then its remote readers) or come from (a reader's
    # ring or connection): ends of one interface, see shm_ring's ShmRingBuffer.join.
    _sinks: list[ShmRingBuffer | RemotePublisher]
    _source: ShmRingBuffer | RemoteSubscriber | None = None

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = 1024 * 1024 * 24,
        max_chunks: int = 10,
        connect_ip: str | None = None,
        enable_shm_tensor_arena: bool = False,
        *,
        remote_reader_ranks: list[int] | None = None,
        auth_key: AuthKey | None = None,
    ) -> None:
        """The writer's end: ``n_reader`` readers, ``n_local_reader`` of them on this node.

        ``local_reader_ranks`` (default ``range(n_local_reader)``) are the ranks that read
        through shared memory, on this node; the others connect over TCP to ``connect_ip``
        (default: ``VLLM_HOST_IP`` from the environment, else 127.0.0.1).
        ``remote_reader_ranks`` (default: the ranks after the local ones when
        ``local_reader_ranks`` is None, else any rank) limits who may connect. Ranks are
        those readers pass to :meth:`create_from_handle`. The queue holds ``max_chunks``
        chunks of ``max_chunk_bytes`` bytes (vLLM's default: 24 MiB, so 240 MiB of shared
        memory, whose pages are used only once written) for the local readers; a message
        larger than a chunk spans several. :meth:`enqueue` waits while they all hold
        messages some local reader has not read.
        ``enable_shm_tensor_arena`` is accepted for vLLM's signature and changes nothing:
        vLLM's opt-in arena copies large CPU tensors once into a second shared-memory
        region that every reader views without copying; here every message, tensors
        included, streams through the ring's chunks. ``auth_key`` (None:
        ``$VLLM_BRIDGE_AUTH_KEY`` if set, read now) authenticates every message; readers
        must be given the same key.

        Raises:
            ValueError: reader counts or ranks that do not fit together (the message says
                which).
            AuthenticationError: the operator's policy refuses the key: one that differs
                from ``$VLLM_BRIDGE_AUTH_KEY``, or none at all while
                ``$VLLM_BRIDGE_REQUIRE_AUTH_KEY`` is set.
        """
        if not 0 <= n_local_reader <= n_reader:
            raise ValueError(
                f"need 0 <= n_local_reader <= n_reader, got {n_local_reader} and {n_reader}"
            )
        if not CHUNK_HEADER_BYTES < max_chunk_bytes < 2**32:
            raise ValueError(
                f"max_chunk_bytes must be in ({CHUNK_HEADER_BYTES}, 2**32), got {max_chunk_bytes}"
            )
        n_remote_reader = n_reader - n_local_reader
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
            if remote_reader_ranks is None:
                remote_reader_ranks = list(range(n_local_reader, n_reader))
        local_reader_ranks = _check_ranks(
            local_reader_ranks, "local_reader_ranks", n_local_reader, "n_local_reader"
        )
        if remote_reader_ranks is None and n_remote_reader == 0:
            remote_reader_ranks = []
        if remote_reader_ranks is not None:
            remote_reader_ranks = _check_ranks(
                remote_reader_ranks,
                "remote_reader_ranks",
                n_remote_reader,
                "n_reader - n_local_reader",
            )
            if set(remote_reader_ranks) & set(local_reader_ranks):
                raise ValueError("a rank cannot be both a local and a remote reader")
        key = resolve_key(auth_key)
        token = secrets.token_bytes(16)
        self._part_bytes = max_chunk_bytes - CHUNK_HEADER_BYTES
        sinks: list[ShmRingBuffer | RemotePublisher] = []
        if n_local_reader > 0:
            self.buffer = ShmRingBuffer(
                n_local_reader, max_chunk_bytes, max_chunks, ranks=local_reader_ranks
            )
            sinks.append(self.buffer)
        remote_address = None
        if n_remote_reader > 0:
            host = connect_ip or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
            try:
                publisher = RemotePublisher(host, token, n_remote_reader, remote_reader_ranks)
            except BaseException:
                if self.buffer is not None:
                    self.buffer.close()
                raise
            sinks.append(publisher)
            remote_address = publisher.address
        handle = Handle(
            local_reader_ranks=local_reader_ranks,
            buffer_handle=self.buffer.handle() if self.buffer is not None else None,
            remote_subscribe_addr=remote_address,
            remote_addr_ipv6=remote_address is not None and remote_address.startswith("tcp://["),
            remote_reader_ranks=remote_reader_ranks,
            token=token,
            writer_host=socket.gethostname(),
        )
        self._setup(handle, key, writer=True)
        self._sinks = sinks
        logger.debug("message queue handle: %s", self.handle)

    def _setup(self, handle: Handle, key: bytes | None, *, writer: bool) -> None:
        """The state every end has: the handle, the key, message counts, its role."""
        self.handle = handle
        self._auth_key = key
        self._sent = 0
        self._received = 0
        self.n_local_reader = len(handle.local_reader_ranks)
        remote = handle.remote_reader_ranks
        self.n_remote_reader = -1 if remote is None else len(remote)
        self.n_reader = -1 if remote is None else self.n_local_reader + self.n_remote_reader
        self.local_reader_rank = -1
        self._is_writer = writer
        self._is_local_reader = False
        self._is_remote_reader = False
        self._sinks = []
        self._ready = False
        self._closed = False
        # A message being written (its bytes, the next part to write): kept when a timeout
        # interrupts it (its parts or the streams' flush), finished by the next call.
        self._outgoing: tuple[memoryview, int] | None = None
        self._incoming: _Incoming | None = None
        self._slot_open = False  # acquire_write/acquire_read's block runs (shm_slots)
        self._lock = threading.Lock()
        self._shutdown = threading.Event()  # ends every wait of this end (shutdown())

    def export_handle(self) -> Handle:
        """The handle readers pass to :meth:`create_from_handle` (picklable)."""
        return self.handle

    @staticmethod
    def create_from_handle(
        handle: Handle, rank: int, *, auth_key: AuthKey | None = None
    ) -> MessageQueue:
        """A reader's end of the queue that ``handle`` describes, as reader ``rank``.

        ``rank`` reads shared memory if it is in ``handle.local_reader_ranks`` (the writer
        must then be on this host), else connects over TCP as a remote reader. ``auth_key``
        (None: ``$VLLM_BRIDGE_AUTH_KEY`` if set, read now) must be the writer's.

        Raises:
            ValueError: ``rank`` is not a reader of this queue.
            SharedMemoryError: ``rank`` is a local reader, but the queue's shared memory
                is not on this host (the writer runs on another node, or closed the queue).
            AuthenticationError: the operator's policy refuses the key: one that differs
                from ``$VLLM_BRIDGE_AUTH_KEY``, or none at all while
                ``$VLLM_BRIDGE_REQUIRE_AUTH_KEY`` is set.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        self = MessageQueue.__new__(MessageQueue)
        self._setup(handle, resolve_key(auth_key), writer=False)
        if rank in handle.local_reader_ranks:
            self._is_local_reader = True
            if handle.buffer_handle is None:
                raise ValueError(f"rank {rank} is a local reader but the handle has no ring buffer")
            try:
                self.buffer = ShmRingBuffer(*handle.buffer_handle)
            except FileNotFoundError:
                raise SharedMemoryError(
                    f"rank {rank} is a local reader of a queue whose writer runs on "
                    f"{handle.writer_host!r}, but its shared memory {handle.buffer_handle[3]!r} "
                    f"does not exist on this host ({socket.gethostname()!r}): readers on "
                    "another node must be remote readers (not in local_reader_ranks), or the "
                    "writer closed the queue"
                ) from None
            self.local_reader_rank = handle.local_reader_ranks.index(rank)
            self.buffer.attach_reader(self.local_reader_rank)
            self._source = self.buffer
            return self
        allowed = handle.remote_reader_ranks
        if handle.remote_subscribe_addr is None or (allowed is not None and rank not in allowed):
            raise ValueError(
                f"rank {rank} is not a reader of this queue: local readers are "
                f"{handle.local_reader_ranks}, remote readers are "
                f"{'any other rank' if allowed is None else allowed}"
            )
        self._is_remote_reader = True
        self._source = RemoteSubscriber(
            handle.remote_subscribe_addr, handle.token, rank, CONNECT_TIMEOUT_SECONDS
        )
        return self

    @property
    def current_idx(self) -> int:
        """The chunk of the ring this end writes or reads next (-1: it has no ring)."""
        return -1 if self.buffer is None else self.buffer.current_idx

    def wait_until_ready(self, timeout: float | None = READY_TIMEOUT_SECONDS) -> None:
        """This is a collective operation. All processes (including the
        readers and the writer) should call this function.

        The writer waits for every local reader to attach and every remote reader to
        connect, then tells them all to go; readers wait for that. Raises GroupTimeout (a
        TimeoutError) after ``timeout`` seconds (None: no limit) naming who is missing, and
        PeerGoneError on a reader when the writer has closed the queue or exited. Once it
        has returned, later calls return at once.
        """
        if self._ready:
            return
        deadline = clamp_until(deadline_after(timeout))  # the caller's, if sooner
        if self._closed:
            raise StateError(_CLOSED)
        # The writer waits for every reader (local ones attach, remote ones connect and are
        # sent READY), then lets the local ones go; a reader waits for its go.
        for end in self._ends():
            end.join(deadline, self._shutdown)
        if self._is_writer and self.buffer is not None:
            self.buffer.set_ready()
        self._ready = True

    # --- writing ---

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Write to message queue with optional timeout (in seconds).

        Waits while the queue is full (local readers have not yet read the earlier messages
        that fill it) and while remote readers' connections are backed up. ``timeout``
        bounds the whole call: on GroupTimeout (a TimeoutError, naming the readers that
        lag), a message already partly written is finished by the next ``enqueue`` (it is
        never torn) and ``obj`` was not sent if the interrupted message was an earlier one.
        Raises PeerGoneError when a reader it waits for has exited or closed its end,
        WaitCancelled ("cancelled") when it has to wait after :meth:`shutdown` (within
        10 ms for a wait under way), StateError on a reader's end, or before
        :meth:`wait_until_ready` when there are remote readers, and SharedMemoryError when
        ``/dev/shm`` has no room for the message (nothing of it is sent, and the queue goes
        on: a smaller message may fit).
        """
        if not self._is_writer:
            raise StateError("Only writers can enqueue")
        if not self._ready and len(self._sinks) > (self.buffer is not None):
            raise StateError("call wait_until_ready() before enqueue: remote readers join there")
        deadline = clamp_until(deadline_after(timeout))  # the caller's, if sooner
        with self._lock:
            self._enter_slot("enqueue")
            self._flush(deadline)  # a message an earlier timeout interrupted
            payload = seal_object(self._auth_key, self._context(self._sent), obj)
            if self.buffer is not None:
                self.buffer.reserve(len(payload))  # a full /dev/shm: an error, nothing sent
            self._sent += 1
            self._outgoing = (memoryview(payload), 0)
            self._flush(deadline)

    def _flush(self, deadline: float | None) -> None:
        """Write the parts of the outgoing message, each as one chunk into every sink (the
        ring first: only it waits, and a part it times out on is queued nowhere else), then
        send what the streams hold."""
        if self._outgoing is None:
            return
        payload, part = self._outgoing
        step = self._part_bytes
        while part * step < len(payload):
            piece = payload[part * step : (part + 1) * step]
            for sink in self._sinks:
                sink.put(len(payload), part, piece, deadline, self._shutdown)
            part += 1
            self._outgoing = (payload, part)
        for sink in self._sinks:
            sink.flush(deadline, self._shutdown)
        self._outgoing = None

    # --- reading ---

    def dequeue(
        self,
        timeout: float | None = None,
        indefinite: bool = False,
        *,
        cancel: threading.Event | None = None,
    ) -> Any:
        """Read from message queue with optional timeout (in seconds).

        Raises GroupTimeout (a TimeoutError) after ``timeout`` seconds (a message partly
        received by then is kept and completed by the next call), WaitCancelled
        ("cancelled") within 10 ms of :meth:`shutdown` or of ``cancel`` being set (then at
        once whenever there is nothing to read), and PeerGoneError once the writer has
        closed the queue or exited and every message it wrote has been read. With
        ``timeout=None`` it waits as long as the writer lives; ``indefinite`` only silences
        the periodic "still waiting" log, as in vLLM.
        """
        source = self._source
        if source is None:
            raise StateError("Only readers can dequeue")
        deadline = clamp_until(deadline_after(timeout))  # the caller's, if sooner
        with self._lock:
            self._enter_slot("dequeue")
            while True:  # one chunk at a time, from the ring or the writer's stream alike
                total, part, view = source.take(deadline, (cancel, self._shutdown), not indefinite)
                with view:
                    message = self._assemble(source, total, part, view)
                source.release()
                if message is not None:
                    return self._loads(message)

    @staticmethod
    def recv(socket: MessageQueue, timeout: float | None) -> Any:
        """The next message of a reader's end of a queue, within ``timeout`` seconds.

        vLLM's reads one whole message from a reader's ZeroMQ socket. This queue has no
        ZeroMQ: a reader's connection (the ring, or TCP to the writer) lives in its end of
        the queue, so ``socket`` is that end (the result of ``create_from_handle`` or of
        ``create_from_process_group`` on a reader). ``timeout`` as vLLM's: None waits as
        long as the writer lives, a negative one counts as 0 (a message already there is
        returned, none waited for); otherwise as :meth:`dequeue`.

        Raises:
            TypeError: ``socket`` is not a MessageQueue, or ``timeout`` not a number.
            StateError: ``socket`` is the writer's end, or is closed.
            GroupTimeout: a TimeoutError, when no message came within ``timeout``.
            PeerGoneError: the writer has closed the queue or exited, and every message
                it wrote has been read.
        """
        if not isinstance(socket, MessageQueue):
            raise TypeError(f"socket must be a MessageQueue, got {type(socket).__name__}")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"timeout must be a number or None, got {type(timeout).__name__}")
            timeout = max(0.0, float(timeout))
        return socket.dequeue(timeout)

    def readable(self) -> bool:
        """Whether a message (its first chunk) is there to dequeue, without waiting.

        WaitCancelled ("cancelled", a RuntimeError) once :meth:`shutdown` was called, and
        StateError on the writer, as vLLM's raises for both."""
        if self.shutting_down:
            raise WaitCancelled("cancelled")
        source = self._source
        if source is None:
            raise StateError("Only readers can check readability")
        if isinstance(source, ShmRingBuffer):
            return source.chunk_readable(source.current_idx, source.reader)
        return source.readable()

    def spin_until_readable(self, pending: Sized, deadline: float) -> None:
        """Wait until a message is there to dequeue, ``pending`` is not empty, or
        ``time.monotonic()`` reaches ``deadline``; the caller checks :meth:`readable` again.

        A local reader spins, yielding the CPU between looks; a remote one sleeps on its
        connection (without the GIL) a millisecond at a time."""
        source = self._source
        if source is None:
            raise StateError("Only readers can check readability")
        while not pending and time.monotonic() < deadline and not self.readable():
            if isinstance(source, ShmRingBuffer):
                sched_yield()
            else:
                source.wait_readable(min(0.001, deadline - time.monotonic()))

    def _assemble(
        self, source: ShmRingBuffer | RemoteSubscriber, total: int, part: int, view: memoryview
    ) -> bytes | bytearray | None:
        """Take one chunk: the whole message once its last part is in, else None."""
        incoming = self._incoming
        size = len(view)
        if incoming is None and part == 0 and 0 < size == total:
            return bytes(view)  # a message in one chunk: the common case
        if total == 0:
            raise source.broken("expected a message, got the READY signal")
        if part == RAW_PART:  # left unread, for acquire_read
            raise StateError("dequeue: the next chunk is a raw slot of acquire_write")
        expected = 0 if incoming is None else incoming.part
        if part != expected:
            raise source.broken(f"holds part {part} of a message, expected {expected}")
        if size > total or total > MAX_MESSAGE_BYTES:
            raise source.broken(f"is corrupt: it holds {size} bytes of a {total}-byte message")
        if incoming is None:
            incoming = self._incoming = _Incoming(total)
        if total != incoming.total:
            raise source.broken(
                f"holds part {part} of a {total}-byte message, expected one of {incoming.total}"
            )
        filled = len(incoming.data)
        if filled + size > total:
            raise source.broken(
                f"overflows its message: {size} more bytes after {filled} of {total}"
            )
        incoming.data += view
        incoming.part += 1
        if len(incoming.data) < total:
            return None
        self._incoming = None
        return incoming.data

    def _context(self, seq: int) -> str:
        """What message ``seq``'s tag is bound to: this queue (its random token) and ``seq``."""
        return f"mq/{self.handle.token.hex()}/{seq}"

    def _loads(self, data: bytes | bytearray | memoryview) -> Any:
        """The next message, checked (with a key) before it is unpickled."""
        seq = self._received
        self._received += 1  # consumed, whether or not it passes the check
        what = f"message {seq} of the queue written on {self.handle.writer_host!r}"
        return open_object(self._auth_key, self._context(seq), data, what)

    def broadcast_object(self, obj: Any = None, *, timeout: float | None = None) -> Any:
        """The writer enqueues ``obj`` and returns it; readers return what they dequeue."""
        if self._is_writer:
            self.enqueue(obj, timeout)
            return obj
        return self.dequeue(timeout)

    # --- lifecycle ---

    @property
    def shutting_down(self) -> bool:
        """Whether :meth:`shutdown` has been called on this end."""
        return self._shutdown.is_set()

    def shutdown(self) -> None:
        """Wake whatever waits on this end, so that its process can clean up and stop.

        Safe from any thread, and idempotent. A :meth:`dequeue` waiting on this end (a
        local or a remote reader) raises WaitCancelled ("cancelled", a RuntimeError as
        vLLM's) within 10 ms, as vLLM's local readers do; so do this end's :meth:`enqueue` and
        :meth:`wait_until_ready` (vLLM's writer keeps waiting). Later calls still return
        what is already there (a message to read, a free chunk to write) and raise
        WaitCancelled instead of waiting. The queue stays open: :meth:`close` releases it.
        A bridge worker runs this method at once, even while another call on the queue
        waits (it runs the other calls on one object one at a time).
        """
        self._shutdown.set()

    def close(self) -> None:
        """Release this end. The writer marks the queue closed (readers get PeerGoneError
        after the last message) and unlinks the shared memory; readers detach.

        Idempotent. Garbage collection and interpreter exit release the shared memory too.
        """
        self._closed = True
        for end in self._ends():
            end.close()
        self._outgoing = None
        self._incoming = None

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _ends(self) -> list[ShmRingBuffer | RemotePublisher | RemoteSubscriber]:
        """Every end of the queue that this end holds: its sinks, or its source."""
        return [*self._sinks, *([self._source] if self._source is not None else [])]

    @staticmethod
    def create_from_process_group(
        pg: Any,
        max_chunk_bytes: int,
        max_chunks: int,
        writer_rank: int = 0,
        external_writer_handle: Handle | None = None,
        blocking: bool = True,
        *,
        connect_ip: str | None = None,
        auth_key: AuthKey | None = None,
    ) -> MessageQueue:
        """Creates a MessageQueue for a distributed process group with one writer and
        multiple readers.

        A collective over ``pg`` (a StatelessProcessGroup, a torch ProcessGroup with a CPU
        backend, or anything with a ``cpu_group``): group rank ``writer_rank`` becomes the
        writer, every other rank a reader, local if it shares the writer's shared memory,
        else remote (over TCP to ``connect_ip``; default: ``$VLLM_HOST_IP``, else the
        writer's address on the route to the group's store, which the other hosts reach,
        else 127.0.0.1). The writer's handle is broadcast over
        ``pg``. With ``blocking`` every rank also calls :meth:`wait_until_ready`.
        ``auth_key`` (None: ``$VLLM_BRIDGE_AUTH_KEY`` if set) authenticates the handle and
        every message; all ranks must give the same key. The operator's policy refuses a
        key that differs from ``$VLLM_BRIDGE_AUTH_KEY``, or none at all while
        ``$VLLM_BRIDGE_REQUIRE_AUTH_KEY`` is set (AuthenticationError).

        With ``external_writer_handle`` (the :meth:`export_handle` of a queue written by a
        process outside the group, made for ``pg.world_size`` readers) no rank writes:
        group rank ``writer_rank`` is given that handle, passes it on over ``pg``, and every
        rank joins that queue as reader number ``group rank``. The outside writer takes part
        in :meth:`wait_until_ready`, so it is usually called with ``blocking=False`` and
        ``wait_until_ready`` later, once the writer is waiting too.
        """
        key = resolve_key(auth_key)
        group = object_group(pg, key)
        if not 0 <= writer_rank < group.world_size:
            raise ValueError(f"writer_rank must be in [0, {group.world_size}), got {writer_rank}")
        context = _handle_context(writer_rank)
        # Only rank writer_rank knows whether there is an outside writer: every rank probes.
        local = same_node_as(group, writer_rank)
        external = external_writer_handle is not None
        if group.rank == writer_rank:
            if not external:
                readers = [rank for rank in range(group.world_size) if rank != writer_rank]
                if not all(local) and connect_ip is None and not os.environ.get("VLLM_HOST_IP"):
                    connect_ip = address_toward_group(pg)
                queue = MessageQueue(
                    n_reader=len(readers),
                    n_local_reader=sum(local[rank] for rank in readers),
                    local_reader_ranks=[rank for rank in readers if local[rank]],
                    max_chunk_bytes=max_chunk_bytes,
                    max_chunks=max_chunks,
                    connect_ip=connect_ip,
                    remote_reader_ranks=[rank for rank in readers if not local[rank]],
                    auth_key=key,
                )
                handle: Handle | None = queue.export_handle()
            else:
                # A handle that is not one still goes out (as None), so that every rank
                # fails with the reason instead of waiting for a handle that never comes.
                is_handle = isinstance(external_writer_handle, Handle)
                handle = external_writer_handle if is_handle else None
            group.broadcast_obj(seal_object(key, context, (external, handle)), writer_rank)
        else:
            data = group.broadcast_obj(None, writer_rank)
            if not isinstance(data, bytes):
                raise TypeError(
                    f"expected the serialized queue handle from rank {writer_rank}, got "
                    f"{type(data).__name__}: is the writer running another version?"
                )
            external, handle = open_object(
                key, context, data, f"the queue handle from writer rank {writer_rank}"
            )
        if external or group.rank != writer_rank:
            # With an outside writer every rank, writer_rank too, reads its queue.
            if not isinstance(handle, Handle):
                why = (
                    f"the external_writer_handle given to rank {writer_rank} is not the Handle "
                    "of a MessageQueue (its export_handle())"
                    if external
                    else f"writer rank {writer_rank} sent {type(handle).__name__}, not the "
                    "Handle of a MessageQueue: is the writer running another version?"
                )
                raise TypeError(f"create_from_process_group on rank {group.rank}: {why}")
            queue = MessageQueue.create_from_handle(handle, group.rank, auth_key=key)
        if blocking:
            queue.wait_until_ready()
        return queue
