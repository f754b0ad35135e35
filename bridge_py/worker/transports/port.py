"""The port transport: Request/Reply frames over stdin/stdout.

Each frame is a 4-byte big-endian length and that many bytes, as Erlang's
``{:packet, 4}`` writes and reads them. The transport is a loop: read a frame, hand
it to the dispatcher (``Dispatcher.admit``, which works out what it is and takes its
turn, then ``Dispatcher.run``, which answers it), write the reply. What is its own is
the threads: the thread that reads a request runs it; a call that blocks (a barrier, a
recv) is noticed within milliseconds and another thread reads on, so it never holds up
the requests behind it (see PortTransport). Replies are written whole under a lock, in
whatever order the calls finish.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Protocol

from bridge_py.worker import envelope as pb
from bridge_py.worker.dispatcher import Dispatcher, protocol_error

DEFAULT_MAX_FRAME = 1 << 31  # 2 GiB
DEFAULT_MAX_THREADS = 256
# Operations that run exported code, which may block (a barrier, a recv).
_MAY_BLOCK: frozenset[type[pb.Operation]] = frozenset(
    (pb.CallMethod, pb.CallFunction, pb.CreateInstance)
)
_HEADER = struct.Struct(">I")
_READ_SIZE = 1 << 16  # bytes asked for per read while frames are small
_SMALL_FRAME = 1 << 16  # frames up to this size are gathered from buffered reads
_JOIN_BELOW = 1 << 16  # a one-piece frame shorter than this is written as one buffer


class ByteSource(Protocol):
    """What frames are read from: a buffered binary file, or a
    :class:`~bridge_py.worker.transports.polling_input.PollingInput`."""

    def read1(self, size: int, /) -> bytes:
        """Up to ``size`` bytes once any are there; ``b""`` at end of input."""
        ...

    def read(self, size: int, /) -> bytes:
        """Up to ``size`` bytes; ``b""`` at end of input."""
        ...

    def readinto(self, buffer: memoryview, /) -> int:
        """Fill some of ``buffer``; 0 at end of input."""
        ...


class FrameWriter:
    """Writes whole frames to a file descriptor; safe to call from any thread."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    def write(self, payload: bytes | memoryview | list[bytes | memoryview]) -> None:
        """Write one frame (length prefix and payload, whole or in pieces) without
        interleaving with other threads' frames."""
        if isinstance(payload, list):
            if len(payload) != 1 or len(payload[0]) >= _JOIN_BELOW:
                self._write_pieces(payload)
                return
            whole = payload[0]
        elif len(payload) >= _JOIN_BELOW:
            self._write_pieces([payload])
            return
        else:
            whole = payload
        # A small frame (most replies): one buffer, one write. (acquire/release, not
        # ``with``: this is on every reply's path, and ``with`` costs ~0.3 us more here.)
        data = len(whole).to_bytes(4, "big") + whole
        self._lock.acquire()
        try:
            written = os.write(self._fd, data)
            if written < len(data):
                self._write_all([memoryview(data)[written:]])
        finally:
            self._lock.release()

    def _write_pieces(self, pieces: list[bytes | memoryview]) -> None:
        size = sum(len(p) for p in pieces)
        chunks = [memoryview(_HEADER.pack(size)), *(memoryview(p) for p in pieces if p)]
        with self._lock:
            self._write_all(chunks)

    def _write_all(self, chunks: list[memoryview]) -> None:
        while chunks:
            written = os.writev(self._fd, chunks)
            while chunks and written >= len(chunks[0]):
                written -= len(chunks[0])
                chunks.pop(0)
            if chunks and written:
                chunks[0] = chunks[0][written:]


class FrameReader:
    """Reads frames from a byte stream, taking several from one read when they are there.

    Small frames are sliced out of what one ``read1`` returned (one system call for
    all the requests that arrived together); a large frame is read straight into a
    buffer of its own size, with no copy in between.
    """

    def __init__(self, stream: ByteSource, max_frame: int) -> None:
        self._stream = stream
        self._max_frame = max_frame
        self._buf = b""  # bytes read and not yet handed out, from self._pos on
        self._pos = 0

    def read(self) -> bytes | bytearray | None:
        """The next frame's payload; None at end of input.

        Raises :class:`FrameTooLarge` for a frame over the limit, after skipping it.
        """
        buf, pos = self._buf, self._pos
        if pos == len(buf):
            # Nothing buffered, the usual case between sequential requests: one read,
            # and the frame is taken straight from it when it came whole.
            buf = self._stream.read1(_READ_SIZE)
            if not buf:
                return None
            self._buf, self._pos = buf, 0
            pos = 0
        if len(buf) - pos >= 4:
            size = int.from_bytes(buf[pos : pos + 4], "big")
            end = pos + 4 + size
            if end <= len(buf) and size <= self._max_frame:
                self._pos = end
                return buf[pos + 4 : end]
        return self._read_more()

    def _read_more(self) -> bytes | bytearray | None:
        header = self._take(4)
        if header is None:
            return None
        (size,) = _HEADER.unpack(header)
        if size > self._max_frame:
            self._skip(size)
            raise FrameTooLarge(size, self._max_frame)
        if size <= _SMALL_FRAME:
            return self._take(size)
        # A large frame: what is buffered, then the rest read in place.
        frame = bytearray(size)
        view = memoryview(frame)
        got = min(len(self._buf) - self._pos, size)
        view[:got] = self._buf[self._pos : self._pos + got]
        self._pos += got
        if self._pos == len(self._buf):
            self._buf, self._pos = b"", 0
        while got < size:
            k = self._stream.readinto(view[got:])
            if not k:
                return None
            got += k
        return frame

    def _take(self, n: int) -> bytes | None:
        """``n`` bytes, reading as needed; None if the input ends first."""
        while len(self._buf) - self._pos < n:
            chunk = self._stream.read1(_READ_SIZE)
            if not chunk:
                return None
            self._buf = self._buf[self._pos :] + chunk
            self._pos = 0
        data = self._buf[self._pos : self._pos + n]
        self._pos += n
        return data

    def _skip(self, n: int) -> None:
        buffered = min(n, len(self._buf) - self._pos)
        self._pos += buffered
        n -= buffered
        while n > 0:
            chunk = self._stream.read(min(n, 1 << 20))
            if not chunk:
                return
            n -= len(chunk)


class FrameTooLarge(Exception):
    """A frame longer than the worker accepts (it has been skipped)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")


class PortTransport:
    """Serves one dispatcher over a pair of byte streams until the input ends.

    The loop: read a frame, ``Dispatcher.admit`` it (which fixes its place in line on
    its object), ``Dispatcher.run`` it, write the reply. One thread, the leader, reads
    requests and runs each one itself, so a reply never waits for a hand-off between
    threads. A standby thread checks every ``takeover_after`` seconds whether the
    leader has been inside the same request since its last look; if so (a barrier, a
    recv), it becomes the leader and reads on, a new standby takes its place, and the
    old leader ends when its call returns. Calls on one object still run in arrival
    order: each takes its turn as the leader admits it.

    At most ``max_threads`` threads serve, the leader included. When all the others
    are blocked in calls, no standby is left to take over from the leader, so the
    leader runs no call that could block: it refuses calls, functions and constructors
    with a ``busy`` error (the gate it gives ``admit`` then) and still answers
    everything else (a ping, a release), until a blocked call returns and gives its
    thread back.

    The leader marks the start of a request without a lock (it alone writes those
    fields); the end of a request, where the leader learns whether it was replaced,
    and a takeover both hold ``_lock``, so exactly one thread reads at a time.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        infile: ByteSource,
        out_fd: int,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_threads: int = DEFAULT_MAX_THREADS,
        takeover_after: float = 0.01,
    ) -> None:
        self._dispatcher = dispatcher
        self._reader = FrameReader(infile, max_frame)
        self._out = FrameWriter(out_fd)
        self._max_threads = max_threads
        self._takeover_after = takeover_after
        self._lock = threading.Lock()
        self._leader: int | None = None  # thread ident
        self._running = False  # the leader is inside a request
        self._job = 0  # requests started by leaders so far
        self._threads = 0
        # Whether a standby stands behind the leader: not when max_threads are taken, and
        # then the leader runs no call that may block (see _refuse_blocking).
        self._spare = True
        self._done = threading.Event()
        self._busy = pb.Error(
            category="busy",
            message=f"the worker has {max_threads - 1} calls blocked (its limit, --max-threads "
            f"{max_threads}); this call was not run: try again once one returns",
        )

    def serve(self) -> None:
        """Serve until end of input; each request gets exactly one reply."""
        with self._lock:
            self._threads += 2
        threading.Thread(target=self._lead, name="bridge-leader", daemon=True).start()
        threading.Thread(target=self._stand_by, name="bridge-standby", daemon=True).start()
        self._done.wait()

    def _lead(self) -> None:
        me = threading.get_ident()
        with self._lock:
            self._leader = me
        admit, run, write = self._dispatcher.admit, self._dispatcher.run, self._out.write
        try:
            while True:
                if not self._spare:
                    self._rehire()
                try:
                    frame = self._reader.read()
                except FrameTooLarge as exc:
                    write(pb.encode_reply(protocol_error(0, str(exc))))
                    continue
                if frame is None:
                    self._done.set()
                    return
                job = admit(frame, None if self._spare else self._refuse_blocking)
                self._job += 1  # only the leader writes these two
                self._running = True
                write(run(job))
                with self._lock:
                    if self._leader != me:  # a standby took over while this call blocked
                        return
                    self._running = False
        except BaseException:
            # Only a broken output gets here (admit and run answer everything else):
            # nobody can hear us any more, so stop serving.
            self._done.set()
            raise
        finally:
            with self._lock:
                self._threads -= 1

    def _stand_by(self) -> None:
        seen = -1
        while not self._done.wait(self._takeover_after):
            with self._lock:
                if not self._running:
                    seen = -1
                    continue
                if self._job != seen:
                    seen = self._job  # a new request: give it its time
                    continue
                # The leader has been in one request for a whole period: take over.
                self._leader = threading.get_ident()
                self._running = False
                hire = self._spare = self._threads < self._max_threads
                if hire:
                    self._threads += 1
            if hire:
                threading.Thread(target=self._stand_by, name="bridge-standby", daemon=True).start()
            self._lead()
            return

    def _rehire(self) -> None:
        """Put a standby behind the leader again once a blocked call has given its thread
        back; runs as the leader."""
        with self._lock:
            hire = self._spare = self._threads < self._max_threads
            if hire:
                self._threads += 1
        if hire:
            threading.Thread(target=self._stand_by, name="bridge-standby", daemon=True).start()

    def _refuse_blocking(self, op: type[pb.Operation] | None, session: str) -> pb.Error | None:
        """The gate while no standby is left: a call that may block is refused as
        ``busy`` (it is not run); anything else is admitted."""
        return self._busy if op in _MAY_BLOCK else None
