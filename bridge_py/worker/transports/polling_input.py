"""The port transport's input: a pipe read that spins briefly before it sleeps.

A worker behind an Erlang Port answers one request and usually gets the next within
tens of microseconds. If it sleeps in ``read`` in between, each request pays for a
wake-up, and on a virtual machine whose idle CPU has halted that wake-up alone costs
50-150 us, several times the work of a small call. So after each read that finds
nothing, the reader keeps trying for ``spin`` seconds (the BEAM's own schedulers
busy-wait before sleeping for the same reason), and only then sleeps in ``poll``.

The spin holds one CPU for at most ``spin`` seconds after each request, and never
while the worker is idle for longer; ``spin=0`` sleeps at once, as a plain blocking
read does. Spinning releases the GIL on every attempt, so other threads' calls run.
"""

from __future__ import annotations

import os
import select
import time

DEFAULT_SPIN = 200e-6  # seconds; covers the BEAM's turnaround between sequential calls


class PollingInput:
    """Reads from a pipe's file descriptor, spinning up to ``spin`` seconds for data.

    Offers the two reads :class:`~bridge_py.worker.transports.port.FrameReader` uses,
    ``read1`` and ``readinto``, with the semantics of a buffered file's: they wait for
    at least one byte and return ``b""``/0 only at end of input. The descriptor is made
    non-blocking; the caller keeps ownership of it.
    """

    def __init__(self, fd: int, spin: float = DEFAULT_SPIN) -> None:
        if spin < 0:
            raise ValueError(f"spin must be >= 0 seconds, got {spin}")
        os.set_blocking(fd, False)
        self._fd = fd
        self._spin = spin
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def read1(self, size: int) -> bytes:
        """Up to ``size`` bytes, as soon as there are any; ``b""`` at end of input."""
        try:
            return os.read(self._fd, size)
        except BlockingIOError:
            pass
        deadline = time.perf_counter() + self._spin
        while True:
            try:
                return os.read(self._fd, size)
            except BlockingIOError:
                self._pause(deadline)

    read = read1

    def readinto(self, view: memoryview) -> int:
        """Fill as much of ``view`` as is there once any is; 0 at end of input."""
        try:
            return os.readv(self._fd, [view])
        except BlockingIOError:
            pass
        deadline = time.perf_counter() + self._spin
        while True:
            try:
                return os.readv(self._fd, [view])
            except BlockingIOError:
                self._pause(deadline)

    def _pause(self, deadline: float) -> None:
        """Return at once while spinning; past the deadline, sleep until input comes."""
        if time.perf_counter() >= deadline:
            self._poll.poll()  # readable, or the writer closed (POLLHUP)
