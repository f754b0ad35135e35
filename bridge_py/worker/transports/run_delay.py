"""How much of the time the calling thread was ready to run but had no CPU.

Linux counts, per thread, the time it spent waiting in a run queue (the second field of
``/proc/thread-self/schedstat``). Over a stretch of wall time, that share says whether
the machine's CPUs are all taken: a thread that sleeps between requests and finds a
free CPU each time it wakes seldom waits there, while one of more busy threads than CPUs
waits there a large share of the time (bench/README.md has the shares seen). The port reader
uses it to stop spinning where a spin can only take a CPU from someone else (see
:mod:`~bridge_py.worker.transports.spin_policy`).
"""

from __future__ import annotations

import threading
import time

__all__ = ["RunDelay"]

_SCHEDSTAT = "/proc/thread-self/schedstat"


class RunDelay:
    """Samples the calling thread's run-queue time, at most once per ``period`` seconds.

    :meth:`share` returns the share of the wall time since the previous sample that the
    thread spent waiting for a CPU, or None: too soon after the previous sample, the
    first sample of a thread (the port transport's reading thread can change), or a
    kernel that does not say.
    """

    __slots__ = ("_delay", "_period", "_since", "_thread")

    def __init__(self, period: float = 10e-3) -> None:
        self._period = period
        self._thread: int | None = None
        self._since = 0.0
        self._delay = 0

    def share(self) -> float | None:
        """The share of the time since the last sample spent waiting for a CPU, in [0, 1]
        up to the clocks' rounding; None when there is no new figure."""
        now = time.perf_counter()
        thread = threading.get_ident()
        same = thread == self._thread
        if same and now - self._since < self._period:
            return None
        delay = _run_queue_ns()
        if delay is None:
            return None
        share = (delay - self._delay) * 1e-9 / (now - self._since) if same else None
        self._thread, self._since, self._delay = thread, now, delay
        return share


def _run_queue_ns() -> int | None:
    """The calling thread's total time in a run queue (ns), or None if the kernel does
    not keep it."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
