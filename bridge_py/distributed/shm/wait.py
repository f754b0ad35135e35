"""The one way a rank waits for another: spin briefly, then sleep, never forever blindly.

Every wait on another process in shared memory or on a socket goes through
:func:`wait_until`: a MessageQueue's reader for the next message and its writer for a free
chunk, the CPU all-reduce's phases, and a StatelessProcessGroup's boards (a message, a
broadcast, a barrier's arrivals and departures). A wait first looks again and again,
yielding the CPU, which keeps latency low while messages are flowing, then sleeps in naps,
looking between them. How long it spins and naps is its :class:`Pace`:

* :data:`POLLING`, where nothing wakes a sleeper early (a MessageQueue, the all-reduce):
  spins for up to 2 ms, then naps growing from 20 us to at most 1 ms (at most 10 ms once
  the wait is a second old), so an idle queue does not keep a core busy (vLLM's spins on
  for seconds after each message);
* :data:`DOORBELL`, where the other side wakes a sleeper (a board's FIFO doorbell, rung by
  a writer that sees the waiter asleep): spins for up to 100 us (an answer that comes
  meanwhile needs no ring and wakes nobody), then sleeps until rung or until the next
  liveness check.

Every wait takes a deadline (``GroupTimeout``, a TimeoutError, names what was awaited),
optional ``cancel`` events (a caller's, a MessageQueue's ``shutdown``), and a liveness check
run every ``check_every`` seconds of its pace that raises :class:`PeerGoneError` when the
peer it waits for has exited, so a dead peer is reported even without a deadline. What can
be waited on with a file descriptor (a socket, a FIFO doorbell) passes a ``sleep`` that
blocks on it for at most the nap, so it wakes as soon as the other side acts.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from bridge_py.distributed.errors import GroupTimeout, PeerGoneError, WaitCancelled

__all__ = [
    "DOORBELL",
    "POLLING",
    "Cancel",
    "Pace",
    "PeerGoneError",
    "deadline_after",
    "fence",
    "pid_namespace",
    "process_alive",
    "remaining",
    "sched_yield",
    "wait_until",
]

logger = logging.getLogger(__name__)


class Pace(NamedTuple):
    """How a wait spends its time until it is over: it spins (yields the CPU and looks
    again) for ``spin`` seconds, then sleeps in naps that start at ``first_nap`` and double
    up to ``last_nap`` (``idle_nap`` once the wait is ``idle_after`` seconds old), and runs
    its liveness check every ``check_every`` seconds."""

    spin: float
    first_nap: float
    last_nap: float
    idle_after: float
    idle_nap: float
    check_every: float


# Nothing wakes the sleeper: short naps bound the latency.
POLLING = Pace(
    spin=2e-3, first_nap=2e-5, last_nap=1e-3, idle_after=1.0, idle_nap=1e-2, check_every=0.2
)
# The sleeper is woken when it is its turn (a doorbell): it sleeps until the next check.
DOORBELL = Pace(
    spin=1e-4, first_nap=1.0, last_nap=1.0, idle_after=1.0, idle_nap=1.0, check_every=1.0
)
# How often a long wait is logged.
LOG_INTERVAL_SECONDS = 60.0

# What ends a wait early: an event, or any of several (None: nothing).
Cancel = threading.Event | tuple[threading.Event | None, ...] | None

_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (taking and releasing a mutex), ordering shared-memory flag writes."""
    # Two calls rather than a with block: cheaper, and it runs several times per message.
    _fence_lock.acquire()
    _fence_lock.release()


def deadline_after(timeout: float | None) -> float | None:
    """The monotonic time ``timeout`` seconds from now (None: no deadline)."""
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout must not be negative, got {timeout}")
    return time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (never negative), or None without a deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def wait_until(
    ready: Callable[[], bool | None],
    what: str | Callable[[], str],
    deadline: float | None,
    *,
    check: Callable[[], None] | None = None,
    cancel: Cancel = None,
    log: bool = True,
    sleep: Callable[[float], object] = time.sleep,
    pace: Pace = POLLING,
) -> None:
    """Return once ``ready()`` is true; spin, then sleep (``sleep(seconds)``), between tries,
    as ``pace`` says. A ``ready()`` of None means "not yet, but look again at once" (the
    awaited thing is on its way): no sleep follows it.

    Raises GroupTimeout (a TimeoutError, naming ``what``, or what ``what()`` says then: who
    is late) at ``deadline``, WaitCancelled ("cancelled") within a nap (at most 10 ms with
    :data:`POLLING`) of ``cancel`` (an event, or any of a tuple of them) being set, and
    whatever ``check()`` raises (it runs every ``pace.check_every`` seconds, to notice a
    dead peer). With ``log``, a wait longer than ``LOG_INTERVAL_SECONDS`` is logged at that
    interval.
    """
    done = ready()
    if done:
        return
    stops = [e for e in (cancel if isinstance(cancel, tuple) else (cancel,)) if e is not None]
    start = time.monotonic()
    spin_until = start + pace.spin
    next_check = start + pace.check_every
    next_log = start + LOG_INTERVAL_SECONDS
    nap = pace.first_nap
    while True:
        now = time.monotonic()
        if stops and any(stop.is_set() for stop in stops):
            raise WaitCancelled("cancelled")
        if deadline is not None and now >= deadline:
            awaited = what() if callable(what) else what
            raise GroupTimeout(f"timed out after {now - start:.3g} s waiting for {awaited}")
        if check is not None and now >= next_check:
            check()
            next_check = now + pace.check_every
        elif done is None:
            pass  # on its way: look again at once
        elif now < spin_until:
            os.sched_yield()
        else:
            if log and now >= next_log:
                awaited = what() if callable(what) else what
                logger.info("still waiting for %s after %.0f s", awaited, now - start)
                next_log = now + LOG_INTERVAL_SECONDS
            wake = now + nap  # or sooner: at the deadline, or when the check is due
            if deadline is not None and deadline < wake:
                wake = deadline
            if check is not None and next_check < wake:
                wake = next_check
            sleep(max(0.0, wake - now))
            longest = pace.last_nap if now - start < pace.idle_after else pace.idle_nap
            nap = min(nap * 2, longest)
        done = ready()
        if done:
            return


def pid_namespace() -> int:
    """An id of this process's PID namespace (0 where unknown), to compare PIDs only within one."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
        return int(link[link.index("[") + 1 : -1])
    except (OSError, ValueError):
        return 0


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` (of this PID namespace) still runs; zombies count as gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return fields[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sched_yield() -> None:
    """Give up the CPU to another runnable thread or process (``os.sched_yield``, or a
    zero sleep where the platform has none), as spinning waits do between looks."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()
    else:
        time.sleep(0)
