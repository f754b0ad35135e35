"""Frames of the port transport: a 4-byte big-endian length, then that many bytes.

That is what Erlang's ``{:packet, 4}`` writes and reads. :class:`FrameReader` takes
frames from a byte stream, several from one read when they are there; :class:`FrameWriter`
writes whole frames from any thread without interleaving them.

A pipe holds 64 KiB by default, so a frame of 64 MiB crosses it in a thousand pieces,
each a hand-over between the two processes (a wake-up each, where the other side
slept). The first frame larger than that widens the pipe it crosses to 1 MiB
(:func:`widen_pipe`): a worker that only makes small calls keeps the default, since
the pages a user's pipes may hold are limited (``/proc/sys/fs/pipe-user-pages-soft``).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import threading
from collections.abc import Callable
from typing import Protocol

_HEADER = struct.Struct(">I")
_READ_SIZE = 1 << 16  # bytes asked for per read while frames are small
_SMALL_FRAME = 1 << 16  # frames up to this size are gathered from buffered reads
_JOIN_BELOW = 1 << 16  # a one-piece frame shorter than this is written as one buffer
_PLACE_PREFIX = 1 << 12  # bytes of a large frame a Placement sees
_ALIGN = 64  # where a Placement says, a large frame's memory is aligned this far
WIDE_PIPE = 1 << 20  # a pipe's capacity once a frame has not fit in it (the usual maximum)

Placement = Callable[[bytes, int], int]
"""Given the first bytes of a large frame and its size, the offset in the frame that
should lie on an aligned address (0: the frame's start)."""


def widen_pipe(fd: int) -> None:
    """Let the pipe behind ``fd`` hold :data:`WIDE_PIPE` bytes; nothing if ``fd`` is
    not a pipe, or the system refuses (a user over its pipe pages, a platform
    without ``F_SETPIPE_SZ``): frames cross it either way."""
    setpipe = getattr(fcntl, "F_SETPIPE_SZ", None)
    if setpipe is None:
        return
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, setpipe, WIDE_PIPE)


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

    def fileno(self) -> int:
        """The file descriptor read (OSError where there is none)."""
        ...


class FrameWriter:
    """Writes whole frames to a file descriptor; safe to call from any thread."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._widened = False

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
        if size > _SMALL_FRAME and not self._widened:
            self._widened = True
            widen_pipe(self._fd)
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
    all the requests that arrived together); a large frame is read straight into
    memory of its own (a fresh anonymous ``mmap``, never reused, so what is decoded as
    a view of one frame is never overwritten by the next), with no copy in between
    and no pass to zero it first. ``place`` (see :data:`Placement`) picks the offset
    in the frame that lands on a 64-byte boundary: the codec's guess at where a tensor's
    elements start, so that tensor can be a view of the frame.
    """

    def __init__(self, stream: ByteSource, max_frame: int, place: Placement | None = None) -> None:
        self._stream = stream
        self._max_frame = max_frame
        self._place = place
        self._buf = b""  # bytes read and not yet handed out, from self._pos on
        self._pos = 0
        self._widened = False

    def read(self) -> bytes | memoryview | None:
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
            (size,) = _HEADER.unpack_from(buf, pos)  # (no slice, unlike int.from_bytes)
            end = pos + 4 + size
            if end <= len(buf) and size <= self._max_frame:
                self._pos = end
                return buf[pos + 4 : end]
        return self._read_more()

    def _read_more(self) -> bytes | memoryview | None:
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
        if not self._widened:
            self._widened = True
            self._widen()
        shift = 0
        if self._place is not None:
            seen = min(size, _PLACE_PREFIX)
            if not self._fill(seen):
                return None
            shift = -self._place(self._buf[self._pos : self._pos + seen], size) % _ALIGN
        view = memoryview(mmap.mmap(-1, shift + size))[shift:]  # (page-aligned, zeroed lazily)
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
        return view

    def _widen(self) -> None:
        try:
            fd = self._stream.fileno()
        except (OSError, ValueError):  # a stream with no descriptor
            return
        widen_pipe(fd)

    def _take(self, n: int) -> bytes | None:
        """``n`` bytes, reading as needed; None if the input ends first."""
        if not self._fill(n):
            return None
        data = self._buf[self._pos : self._pos + n]
        self._pos += n
        return data

    def _fill(self, n: int) -> bool:
        """Read until ``n`` bytes are buffered; False if the input ends first."""
        while len(self._buf) - self._pos < n:
            chunk = self._stream.read1(_READ_SIZE)
            if not chunk:
                return False
            self._buf = self._buf[self._pos :] + chunk
            self._pos = 0
        return True

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
