"""The one way a rank waits for another: spin briefly, then sleep, never forever blindly.

Every wait on another process in shared memory or on a socket (a MessageQueue's reader for
the next message or its writer for a free chunk; the CPU all-reduce) goes through
:func:`wait_until`; the StatelessProcessGroup's boards wait in their own short loop
(``spg.board``: a 100 us look, then a sleep on the doorbell that only a rank told to ring
it rings). :func:`wait_until` first spins on
``os.sched_yield`` for a couple of milliseconds, which keeps latency low while messages are
flowing, then sleeps with exponentially growing naps capped at one millisecond (ten once the
wait is a second old), so an idle queue costs about 1% of a core (vLLM keeps one core busy
for 10 s after each message, then sleeps 0.1 s at a time).

Every wait takes a deadline (``TimeoutError`` names what was awaited), optional ``cancel``
events (a caller's, a MessageQueue's ``shutdown``), and a liveness check run a few times a
second that raises :class:`PeerGoneError` when the peer it waits for has exited, so a dead
peer is reported even without a deadline. What can be waited on with a file descriptor (a
socket, a FIFO doorbell) passes a ``sleep`` that blocks on it for at most the nap, so it
wakes as soon as the other side acts.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from bridge_py.distributed.errors import GroupTimeout, PeerGoneError, WaitCancelled

__all__ = [
    "Cancel",
    "PeerGoneError",
    "deadline_after",
    "fence",
    "pid_namespace",
    "process_alive",
    "remaining",
    "wait_until",
]

logger = logging.getLogger(__name__)

# Spin (yielding the CPU to anyone runnable) this long before sleeping.
SPIN_SECONDS = 0.002
# Naps grow from the first to the last value, doubling; after a second of waiting they
# may grow to the idle value (an idle reader then costs ~1% of a core, for <= 10 ms latency).
FIRST_NAP_SECONDS = 2e-5
LAST_NAP_SECONDS = 1e-3
IDLE_AFTER_SECONDS = 1.0
IDLE_NAP_SECONDS = 1e-2
# How often the liveness check runs once sleeping, and how often a long wait is logged.
CHECK_INTERVAL_SECONDS = 0.2
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
    ready: Callable[[], bool],
    what: str | Callable[[], str],
    deadline: float | None,
    *,
    check: Callable[[], None] | None = None,
    cancel: Cancel = None,
    log: bool = True,
    sleep: Callable[[float], object] = time.sleep,
) -> None:
    """Return once ``ready()`` is true; spin, then sleep (``sleep(seconds)``), between tries.

    Raises GroupTimeout (a TimeoutError, naming ``what``, or what ``what()`` says then: who
    is late) at ``deadline``, WaitCancelled ("cancelled") within a nap (at most 10 ms) of
    ``cancel`` (an event, or any of a tuple of them) being set, and whatever ``check()``
    raises (it runs every ``CHECK_INTERVAL_SECONDS`` once sleeping, to notice a dead peer).
    With ``log``, a wait longer than ``LOG_INTERVAL_SECONDS`` is logged at that interval.
    """
    if ready():
        return
    stops = [e for e in (cancel if isinstance(cancel, tuple) else (cancel,)) if e is not None]
    start = time.monotonic()
    spin_until = start + SPIN_SECONDS
    next_check = start
    next_log = start + LOG_INTERVAL_SECONDS
    nap = FIRST_NAP_SECONDS
    while not ready():
        now = time.monotonic()
        if any(stop.is_set() for stop in stops):
            raise WaitCancelled("cancelled")
        if deadline is not None and now >= deadline:
            awaited = what() if callable(what) else what
            raise GroupTimeout(f"timed out after {now - start:.3g} s waiting for {awaited}")
        if now < spin_until:
            os.sched_yield()
            continue
        if check is not None and now >= next_check:
            check()
            next_check = now + CHECK_INTERVAL_SECONDS
            continue  # check() may have seen the last write before the peer left
        if log and now >= next_log:
            logger.info(
                "still waiting for %s after %.0f s", what() if callable(what) else what, now - start
            )
            next_log = now + LOG_INTERVAL_SECONDS
        sleep(nap if deadline is None else min(nap, max(0.0, deadline - now)))
        longest = LAST_NAP_SECONDS if now - start < IDLE_AFTER_SECONDS else IDLE_NAP_SECONDS
        nap = min(nap * 2, longest)


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
