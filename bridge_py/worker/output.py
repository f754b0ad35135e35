"""The worker's stdout and stderr, sent to its client as frames (``--output frames``).

The Elixir runtime starts every worker this way, so that what Python and C code print
(a traceback, torch's C++ warnings) reaches it attributed to the worker, instead of
landing unattributed on the BEAM's stderr. :func:`capture` points file descriptors 1
and 2 at a pipe; a thread reads the pipe, cuts what it reads into lines, bounds them
(:class:`LineLimiter`) and writes them as ``Reply`` frames with id 0 and an ``Output``
(docs/protocol.md), through the same :class:`FrameWriter` as the replies, so frames
never interleave.

Bounds, so that a flood of output neither grows the worker's memory nor holds up its
replies: a line keeps its first :data:`MAX_LINE` bytes (the rest is counted and noted
on the line); at most :data:`BURST` lines at once and :data:`LINES_PER_SECOND` after
that are sent, the others are dropped and counted (``Output.dropped``, reported with
the next lines sent, or after :data:`REPORT_AFTER` seconds). The reader keeps up with
any writer: dropping a line costs no more than finding its end.

Writers are never blocked for long by the reader, with one exception: code that holds
the GIL while it writes more than the pipe holds (:data:`PIPE_SIZE`, 1 MiB where Linux
allows it) waits until it releases the GIL, since the reader needs it.

At exit (an ``atexit`` hook, which ``_exit_promptly`` runs too) fds 1 and 2 go back to
the original stderr, and what is left in the pipe is sent, the last unfinished line
included, so that the traceback of a worker that fails to start reaches the client.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import sys
import threading
import time
from collections.abc import Callable

from bridge_py.worker import envelope as pb
from bridge_py.worker.transports.frames import FrameWriter

MAX_LINE = 4096
"""Bytes kept of one line."""
LINES_PER_SECOND = 100.0
"""Lines sent per second once a burst is spent."""
BURST = 1000
"""Lines sent at once after a quiet time."""
REPORT_AFTER = 1.0
"""Seconds after which dropped lines are reported even when no line follows them."""
PIPE_SIZE = 1 << 20
_READ_SIZE = 1 << 16


class LineLimiter:
    """Cuts bytes into lines and bounds them: line length, lines per second.

    Holds at most one unfinished line of :data:`MAX_LINE` bytes, whatever it is fed.
    """

    def __init__(
        self, max_line: int = MAX_LINE, rate: float = LINES_PER_SECOND, burst: int = BURST
    ) -> None:
        self._max_line = max_line
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._last: float | None = None
        self._partial = bytearray()
        self._cut = 0  # bytes of the unfinished line beyond max_line
        self.dropped = 0
        """Lines dropped since the last :meth:`take_dropped`."""

    def feed(self, data: bytes, now: float) -> list[bytes]:
        """The lines that ``data`` finishes and the rate lets through, each ending in a
        newline; the lines over the rate are counted in :attr:`dropped`."""
        if self._last is not None:
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        pieces = data.split(b"\n")
        lines: list[bytes] = []
        finished = len(pieces) - 1
        if finished:
            allowed = min(finished, int(self._tokens))
            self._tokens -= allowed
            if allowed:
                self._append(pieces[0])
                lines.append(self._take())
                for piece in pieces[1:allowed]:
                    self._append(piece)
                    lines.append(self._take())
            self.dropped += finished - allowed
            self._partial.clear()
            self._cut = 0
        self._append(pieces[-1])
        return lines

    def finish(self) -> bytes:
        """The unfinished line, ended with a newline (b"" when there is none)."""
        if not self._partial and not self._cut:
            return b""
        return self._take()

    def take_dropped(self) -> int:
        """:attr:`dropped`, which starts again from 0."""
        dropped, self.dropped = self.dropped, 0
        return dropped

    def _append(self, piece: bytes) -> None:
        room = self._max_line - len(self._partial)
        if len(piece) > room:
            self._cut += len(piece) - room
            piece = piece[:room]
        self._partial += piece

    def _take(self) -> bytes:
        line = bytes(self._partial)
        if self._cut:
            line += f" [... {self._cut} more bytes of this line left out]".encode()
        self._partial.clear()
        self._cut = 0
        return line + b"\n"


class OutputPump:
    """A daemon thread that sends what is written to ``read_fd`` as ``Output`` frames."""

    def __init__(
        self,
        read_fd: int,
        send: Callable[[pb.Output], None],
        limiter: LineLimiter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fd = read_fd
        self._send = send
        self._limiter = limiter or LineLimiter()
        self._clock = clock
        self._busy = threading.Lock()  # held while a chunk read is being sent
        self._reported = clock()
        self._thread = threading.Thread(target=self._run, name="bridge-output", daemon=True)

    def start(self) -> None:
        """Start reading."""
        self._thread.start()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        while True:
            wait = None if not self._limiter.dropped else REPORT_AFTER * 1000
            if not poller.poll(wait):  # quiet: report what was dropped
                with self._busy:
                    self._emit([], self._clock())
                continue
            with self._busy:
                data = os.read(self._fd, _READ_SIZE)
                if not data:
                    return
                now = self._clock()
                self._emit(self._limiter.feed(data, now), now)

    def _emit(self, lines: list[bytes], now: float) -> None:
        if not lines and not (self._limiter.dropped and now - self._reported >= REPORT_AFTER):
            return
        self._reported = now
        try:
            self._send(pb.Output(b"".join(lines), self._limiter.take_dropped()))
        except OSError:  # the client is gone: read on, so writers never block
            self._send = _discard

    def drain(self, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) until what was written so far is sent, then
        send the unfinished line. For the exit, once nothing more is written."""
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        while self._thread.is_alive() and poller.poll(0) and time.monotonic() < deadline:
            time.sleep(0.002)
        if not self._busy.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            return
        try:
            last = self._limiter.finish()
            if last or self._limiter.dropped:
                self._reported = -REPORT_AFTER  # report the dropped lines now
                self._emit([last] if last else [], self._clock())
        finally:
            self._busy.release()


def _discard(_output: pb.Output) -> None:
    pass


def capture(writer: FrameWriter, drain_timeout: float = 1.0) -> OutputPump:
    """Point fds 1 and 2 at a pipe whose lines go to ``writer`` as ``Output`` frames.

    Child processes inherit the pipe as their stdout and stderr, so what they print
    is sent too. At exit, fds 1 and 2 go back to the original stderr and the pipe is
    drained (see the module documentation).
    """
    read_fd, write_fd = os.pipe()
    with contextlib.suppress(AttributeError, OSError):  # Linux only; best effort
        import fcntl

        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    original = os.dup(2)
    _flush_python_streams()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)

    def send(output: pb.Output) -> None:
        writer.write(pb.encode_reply(pb.Reply(0, output=output)))

    pump = OutputPump(read_fd, send)
    pump.start()

    def restore() -> None:
        _flush_python_streams()
        os.dup2(original, 1)
        os.dup2(original, 2)
        pump.drain(drain_timeout)

    atexit.register(restore)
    return pump


__all__ = ["BURST", "LINES_PER_SECOND", "MAX_LINE", "LineLimiter", "OutputPump", "capture"]


def _flush_python_streams() -> None:
    """Write out what Python buffered for fds 1 and 2 before they are pointed elsewhere."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
