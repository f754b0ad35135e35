"""The port transport's input: a pipe read that spins briefly before it sleeps.

A worker behind an Erlang Port answers one request and, under a sequential caller,
gets the next within tens of microseconds. If it sleeps in ``read`` in between, each
request pays for a wake-up, and on a virtual machine whose idle CPU has halted that
wake-up alone can cost more than the work of a small call (bench/README.md). So after a read
that finds nothing, the reader keeps trying for ``spin`` seconds (the BEAM's own
schedulers busy-wait before sleeping for the same reason), and only then sleeps in
``poll``.

Whether to spin at all is measured (``measured=True``, the worker's default): where
wake-ups are fast, a spinning worker only takes a CPU from the BEAM and every call gets
slower, so :class:`~bridge_py.worker.transports.spin_policy.SpinPolicy` times the waits
in both modes and keeps the faster; it also ends each spin once it has lasted as long
as a sleeping wait usually does, since a longer spin gains nothing and can hold the CPU
the BEAM needs to write the request. And it sleeps while the reader itself keeps
waiting for a CPU (:class:`~bridge_py.worker.transports.run_delay.RunDelay`): every CPU
is taken then, so a spin takes one from a process with work to do. Either way the spin
is skipped after a wait that outlasted it (requests are sparse, so spinning would only
burn a CPU) and resumes after a wait shorter than it (requests are coming back to back
again). An idle worker therefore never spins, and a busy one spends at most ``spin``
seconds of one CPU per request. ``spin=0`` always sleeps at once, as a plain blocking
read does. Each attempt releases the GIL, so other threads' calls run meanwhile.
"""

from __future__ import annotations

import os
import select
import stat
import time
from collections.abc import Callable
from typing import TypeVar

from bridge_py.worker.transports.run_delay import RunDelay
from bridge_py.worker.transports.spin_policy import SpinPolicy

_A = TypeVar("_A")
_R = TypeVar("_R")

DEFAULT_SPIN = 200e-6  # seconds; covers the BEAM's turnaround between sequential calls


class PollingInput:
    """Reads from a pipe's file descriptor, spinning up to ``spin`` seconds for data.

    Offers the reads :class:`~bridge_py.worker.transports.frames.FrameReader` uses,
    ``read1`` and ``readinto``, with a buffered file's semantics: they wait for at least
    one byte and return ``b""``/0 only at end of input. A pipe or socket is made
    non-blocking; anything else (a terminal, a file) is read blocking, with no spin. A
    process that may run on one CPU only never spins either. The caller keeps ownership
    of the descriptor. One thread reads at a time. With ``measured=False`` it spins
    whenever requests come back to back, on any machine with more than one CPU.
    """

    def __init__(self, fd: int, spin: float = DEFAULT_SPIN, *, measured: bool = True) -> None:
        if not spin >= 0:  # also refuses nan
            raise ValueError(f"spin must be >= 0 seconds, got {spin}")
        mode = os.fstat(fd).st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            os.set_blocking(fd, False)
        else:
            # A terminal or a file: its open file may be a shell's too, which must not be
            # left non-blocking. Read it blocking, without a spin.
            spin = 0.0
        if len(os.sched_getaffinity(0)) < 2:
            # One CPU: the writer cannot run while this process spins on it, so a
            # spin only delays the next request (by up to ``spin``, measured).
            spin = 0.0
        self._fd = fd
        self._spin = spin
        self._spinning = spin > 0
        self._policy = SpinPolicy() if measured and spin > 0 else None
        self._run_delay = RunDelay()
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @property
    def spinning(self) -> bool:
        """Whether the next read that finds nothing spins before it sleeps."""
        return self._spinning and (self._policy is None or self._policy.spinning)

    @property
    def policy(self) -> SpinPolicy | None:
        """The measurement that decides whether to spin (None when the choice is fixed)."""
        return self._policy

    def fileno(self) -> int:
        """The descriptor read."""
        return self._fd

    def read1(self, size: int) -> bytes:
        """Up to ``size`` bytes, as soon as there are any; ``b""`` at end of input."""
        return self._read(os.read, size)

    read = read1

    def readinto(self, view: memoryview) -> int:
        """Fill as much of ``view`` as is there once any is; 0 at end of input."""
        return self._read(_readv_into, view)

    def _read(self, attempt: Callable[[int, _A], _R], arg: _A) -> _R:
        """``attempt(fd, arg)`` once input is there (at once if it already is)."""
        try:
            got = attempt(self._fd, arg)
        except BlockingIOError:
            return self._wait_for(attempt, arg)
        self._spinning = self._spin > 0  # it was already there: requests come fast
        return got

    def _wait_for(self, attempt: Callable[[int, _A], _R], arg: _A) -> _R:
        """Retry ``attempt`` (which found nothing) until it gets input, spinning first
        if :attr:`spinning`; then learn from how long that took."""
        start = time.perf_counter()
        spin = 0.0
        if self.spinning:
            spin = self._spin if self._policy is None else self._policy.spin_time(self._spin)
        while True:
            # Retry at once while spinning; otherwise sleep until input comes.
            if not (spin and time.perf_counter() - start < spin):
                self._poll.poll()  # readable, or the writer closed (POLLHUP)
            try:
                got = attempt(self._fd, arg)
            except BlockingIOError:
                continue
            # Spin next time only if this wait was short enough for a spin to catch.
            waited = time.perf_counter() - start
            self._spinning = self._spin > 0 and waited < self._spin
            if self._policy is not None and self._policy.record(waited):
                share = self._run_delay.share()
                if share is not None:
                    self._policy.crowding(share)
            return got


def _readv_into(fd: int, view: memoryview) -> int:
    return os.readv(fd, [view])
