"""The caller's deadline: how long whoever asked for the running call will wait for it.

A worker (``python -m bridge_py.worker``) runs each request under the deadline its
caller sent (``Request.deadline_ms``, see docs/protocol.md): the dispatcher sets it here
for the length of the call, as a ``time.monotonic()`` value, on the thread that runs the
call (a thread-local: an attribute write and a read, cheaper than a ContextVar's set and
reset on every call; a call's own threads start without one). The blocking waits of the
distributed code (``StatelessProcessGroup.recv_obj``, ``broadcast_obj``,
``all_gather_obj``, ``barrier``, ``MessageQueue.enqueue``/``dequeue``/``wait_until_ready``,
the collectives of the device communicators) clamp their own timeouts to it with
:func:`clamp`, so a call its caller gave up on gives up too, as a timeout of the wait would
(a receive that gives up takes nothing: the message stays for the next one; a collective
that gives up leaves its group unusable), instead of holding its group until the store's
or the group's timeout.

Without a deadline set (every Python user of the package, and requests without one)
:func:`clamp` returns its argument: nothing changes. This module imports nothing of the
package, so any layer may use it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import overload

__all__ = ["CURRENT", "clamp", "clamp_until", "current", "remaining", "until"]


class _Current(threading.local):
    at = 0.0
    """The running call's deadline, a ``time.monotonic()`` value; 0.0 when it has none."""


CURRENT = _Current()
"""Where the running call's deadline is (``CURRENT.at``), per thread; the dispatcher
sets it around each call and puts back what was there."""


def current() -> float:
    """The running call's deadline (a ``time.monotonic()`` value), or 0.0 when it has none."""
    return CURRENT.at


# What a clamped wait gets when the deadline has passed already: one quick look (a wait
# of 0 would mean "no timeout" to some stores).
_AT_LEAST = 0.001


def remaining() -> float | None:
    """Seconds left before the running call's deadline (0 or less once it has passed);
    None when it has none."""
    deadline = CURRENT.at
    return None if not deadline else deadline - time.monotonic()


def clamp(timeout: float) -> float:
    """``timeout`` (seconds), or what is left of the running call's deadline when that is
    less (at least a millisecond); ``timeout`` unchanged when there is no deadline."""
    deadline = CURRENT.at
    if not deadline:
        return timeout
    return min(timeout, max(deadline - time.monotonic(), _AT_LEAST))


@overload
def clamp_until(when: float) -> float: ...
@overload
def clamp_until(when: None) -> float | None: ...
def clamp_until(when: float | None) -> float | None:
    """``when`` (a ``time.monotonic()`` value; None: never), or the running call's
    deadline when that comes first."""
    deadline = CURRENT.at
    if not deadline:
        return when
    return deadline if when is None else min(when, deadline)


@contextlib.contextmanager
def until(deadline: float) -> Iterator[None]:
    """Run the block under ``deadline`` (a ``time.monotonic()`` value; 0 for none), as the
    worker runs a request under its caller's."""
    before = CURRENT.at
    CURRENT.at = deadline
    try:
        yield
    finally:
        CURRENT.at = before
