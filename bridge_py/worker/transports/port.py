"""The port transport: Request/Reply frames over stdin/stdout.

Each frame is a 4-byte big-endian length and that many bytes, as Erlang's
``{:packet, 4}`` writes and reads them. The reader (the main thread) decodes
envelopes and runs cheap operations inline; calls go to a thread pool, so a blocking
call (a barrier, a recv) never holds up requests behind it. Replies are written
whole under a lock, in whatever order the calls finish.
"""

from __future__ import annotations

import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

from bridge_py.worker import envelope as pb
from bridge_py.worker.dispatcher import INLINE_OPS, Dispatcher, protocol_error

DEFAULT_MAX_FRAME = 1 << 31  # 2 GiB
_HEADER = struct.Struct(">I")


class FrameWriter:
    """Writes whole frames to a file descriptor; safe to call from any thread."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    def write(self, payload: bytes) -> None:
        """Write one frame (length prefix and payload) without interleaving."""
        chunks = [memoryview(_HEADER.pack(len(payload))), memoryview(payload)]
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
    """Serves one dispatcher over a pair of byte streams until the input ends."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        infile: BinaryIO,
        out_fd: int,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_threads: int = 256,
    ) -> None:
        self._dispatcher = dispatcher
        self._in = infile
        self._out = FrameWriter(out_fd)
        self._max_frame = max_frame
        # Threads start lazily and are reused; the cap is far above the number of
        # calls that can usefully block at once in one worker.
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="bridge-call")

    def serve(self) -> None:
        """Read frames until end of input; each gets exactly one reply."""
        while True:
            try:
                frame = read_frame(self._in, self._max_frame)
            except FrameTooLarge as exc:
                self._out.write(pb.encode_reply(protocol_error(0, str(exc))))
                continue
            if frame is None:
                return
            try:
                req = pb.decode_request(frame)
            except pb.EnvelopeError as exc:
                reply = protocol_error(pb.peek_request_id(frame), f"malformed request: {exc}")
                self._out.write(pb.encode_reply(reply))
                continue
            if isinstance(req.op, INLINE_OPS):
                self._reply(req)
            else:
                self._pool.submit(self._reply, req)

    def _reply(self, req: pb.Request) -> None:
        self._out.write(pb.encode_reply(self._dispatcher.dispatch(req)))
