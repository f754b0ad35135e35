"""The port transport: Request/Reply frames over stdin/stdout.

Each frame is a 4-byte big-endian length and that many bytes, as Erlang's
``{:packet, 4}`` writes and reads them. The thread that reads a request runs it;
a call that blocks (a barrier, a recv) is noticed within milliseconds and another
thread reads on, so it never holds up the requests behind it (see PortTransport).
Replies are written whole under a lock, in whatever order the calls finish.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import BinaryIO

from bridge_py.worker import envelope as pb
from bridge_py.worker.dispatcher import Dispatcher, protocol_error
from bridge_py.worker.sequencer import Turn

DEFAULT_MAX_FRAME = 1 << 31  # 2 GiB
_HEADER = struct.Struct(">I")


class FrameWriter:
    """Writes whole frames to a file descriptor; safe to call from any thread."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    def write(self, payload: bytes | list[bytes]) -> None:
        """Write one frame (length prefix and payload, whole or in pieces) without
        interleaving with other threads' frames."""
        pieces = payload if isinstance(payload, list) else [payload]
        size = sum(len(p) for p in pieces)
        chunks = [memoryview(_HEADER.pack(size)), *(memoryview(p) for p in pieces if p)]
        with self._lock:
            while chunks:
                written = os.writev(self._fd, chunks)
                while chunks and written >= len(chunks[0]):
                    written -= len(chunks[0])
                    chunks.pop(0)
                if chunks and written:
                    chunks[0] = chunks[0][written:]


def read_frame(stream: BinaryIO, max_frame: int) -> bytearray | None:
    """The next frame's payload; None at end of input. Oversized frames are skipped."""
    header = _read_exact(stream, 4)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > max_frame:
        _skip(stream, size)
        raise FrameTooLarge(size, max_frame)
    return _read_exact(stream, size)


class FrameTooLarge(Exception):
    """A frame longer than the worker accepts (it has been skipped)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")


def _read_exact(stream: BinaryIO, n: int) -> bytearray | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = stream.readinto(view[got:])
        if not k:
            return None
        got += k
    return buf


def _skip(stream: BinaryIO, n: int) -> None:
    while n > 0:
        chunk = stream.read(min(n, 1 << 20))
        if not chunk:
            return
        n -= len(chunk)


class PortTransport:
    """Serves one dispatcher over a pair of byte streams until the input ends.

    One thread, the leader, reads requests and runs each one itself, so a reply
    never waits for a hand-off between threads. A standby thread checks every
    ``takeover_after`` seconds whether the leader has been inside the same request
    since its last look; if so (a barrier, a recv), it becomes the leader and reads
    on, a new standby takes its place, and the old leader ends when its call returns.
    Method calls on one object still run in arrival order: each takes its turn
    (``Dispatcher.reserve``) when the leader reads it.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        infile: BinaryIO,
        out_fd: int,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_threads: int = 256,
        takeover_after: float = 0.01,
    ) -> None:
        self._dispatcher = dispatcher
        self._in = infile
        self._out = FrameWriter(out_fd)
        self._max_frame = max_frame
        self._max_threads = max_threads
        self._takeover_after = takeover_after
        self._state = threading.Condition(threading.Lock())
        self._leader: int | None = None  # thread ident
        self._running = False  # the leader is inside a request
        self._job = 0  # requests started by leaders so far
        self._threads = 0
        self._done = threading.Event()

    def serve(self) -> None:
        """Serve until end of input; each request gets exactly one reply."""
        with self._state:
            self._threads += 2
        threading.Thread(target=self._lead, name="bridge-leader", daemon=True).start()
        threading.Thread(target=self._stand_by, name="bridge-standby", daemon=True).start()
        self._done.wait()
        with self._state:
            self._state.notify_all()

    def _lead(self) -> None:
        me = threading.get_ident()
        with self._state:
            self._leader = me
        while True:
            job = self._next_job()
            if job is None:
                self._done.set()
                return
            with self._state:
                self._running = True
                self._job += 1
            self._run(job)
            with self._state:
                if self._leader != me:  # a standby took over while this call blocked
                    self._threads -= 1
                    return
                self._running = False

    def _stand_by(self) -> None:
        seen = -1
        with self._state:
            while not self._done.is_set():
                self._state.wait(self._takeover_after)
                if not self._running:
                    seen = -1
                    continue
                if self._job != seen:
                    seen = self._job  # a new request: give it its time
                    continue
                # The leader has been in one request for a whole period: take over.
                self._leader = threading.get_ident()
                self._running = False
                hire = self._threads < self._max_threads
                if hire:
                    self._threads += 1
                break
            else:
                return
        if hire:
            threading.Thread(target=self._stand_by, name="bridge-standby", daemon=True).start()
        self._lead()

    def _next_job(self) -> tuple[pb.Request | pb.Reply, Turn | None] | None:
        """Read and decode the next frame (None at end of input); runs as the leader."""
        try:
            frame = read_frame(self._in, self._max_frame)
        except FrameTooLarge as exc:
            return protocol_error(0, str(exc)), None
        if frame is None:
            return None
        try:
            req = pb.decode_request(frame)
        except pb.EnvelopeError as exc:
            return protocol_error(pb.peek_request_id(frame), f"malformed request: {exc}"), None
        return req, self._dispatcher.reserve(req)

    def _run(self, job: tuple[pb.Request | pb.Reply, Turn | None]) -> None:
        message, turn = job
        if isinstance(message, pb.Reply):  # an error found while reading
            self._out.write(pb.encode_reply(message))
        else:
            self._out.write(pb.encode_reply_chunks(self._dispatcher.dispatch(message, turn)))
