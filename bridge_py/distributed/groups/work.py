"""Waiting for a torch.distributed collective, within the caller's deadline.

A blocking collective of torch (``dist.all_reduce(t, group=g)``, ``pg.broadcast(t).wait()``)
waits for its ``Work`` until the group's timeout (gloo's default: 30 minutes), whatever the
caller of the running request will wait. Every blocking collective of the package runs as
``async_op=True`` (or on the group object, which returns the Work) and waits here instead:
:func:`finish` waits for what is left of the running call's deadline (``bridge_py.deadline``,
set by the worker from the request's ``deadline_ms``) when there is one, and as before,
``work.wait()``, when there is not (every Python user, and requests without one: no cost
but a thread-local read).

A collective that runs out of time, at that deadline or at the group's timeout, raises
:class:`~bridge_py.distributed.errors.CollectiveTimeout` naming the operation, the rank and
the group. It abandons the collective, it cannot cancel it (as torch's own timeouts): the
other ranks may still run it, the Work may still fill the tensors it was given, and the next
collective of this rank would be matched with the wrong one. The group is unusable from then
on, as it is in torch.distributed after a timeout; the error says so.

That state belongs to the torch group, not to whichever object waited: a wait given the
``group`` it runs on marks it (:func:`mark_unusable`), and every later operation of any of
the package's objects on that group (a GroupCoordinator's collectives, its objects and
tensor dictionaries, its shared-memory transport) is refused at once with StateError
(:func:`refuse_if_unusable`) instead of waiting again or pairing with what the other ranks
still run.
"""

from __future__ import annotations

import datetime
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed import Work

from bridge_py import deadline
from bridge_py.distributed.errors import CollectiveTimeout, unusable_group

__all__ = ["PendingWork", "finish", "mark_unusable", "refuse_if_unusable"]

# The torch groups whose ranks are out of step, with why (the first reason is kept).
_unusable: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def mark_unusable(group: Any, why: str) -> None:
    """Remember that an operation on ``group`` was abandoned (``why``: which, and how it
    ended), so that every later one is refused (:func:`refuse_if_unusable`)."""
    _unusable.setdefault(group, why)


def refuse_if_unusable(group: Any, op: str, where: str) -> None:
    """Raise StateError naming ``op`` and ``where`` (this rank and its group) when an
    earlier operation on ``group`` was abandoned: this rank's ``op`` would be matched with
    what the other ranks still run of that one."""
    why = _unusable.get(group) if _unusable else None
    if why is not None:
        raise unusable_group(op, where, why)


def finish(work: Work | None, op: str, where: str, *, group: Any, bounded: bool = True) -> None:
    """Wait for ``work`` (None: a group this rank is not in, nothing to wait for).

    ``op`` names the operation and ``where`` this rank and its group (``"rank 0 (global 2)
    of group 'tp'"``) in the error. ``bounded=False`` waits as torch does whatever the
    deadline: for a collective that does not block the CPU (NCCL's ``wait`` only orders
    the current stream; a wait with a timeout would block the CPU instead). ``group`` is the
    torch group whose order the work keeps: one already unusable is refused before the wait,
    and a wait that times out makes it so.
    """
    refuse_if_unusable(group, op, where)
    if work is None:
        return
    left = deadline.remaining() if bounded else None
    try:
        if left is None:
            work.wait()
            return
        # Whole milliseconds, rounded up (torch truncates): a wait that gives up does so at
        # the deadline, not just before it, where it would not count as the caller's.
        done = work.wait(
            timeout=datetime.timedelta(milliseconds=math.ceil(max(left, 0) * 1000) or 1)
        )
    except RuntimeError as exc:
        if "timed out" not in str(exc).lower():  # gloo's words; anything else is not ours
            raise
        raise _timed_out(op, where, left, group) from exc
    if done is False:  # a backend that says so rather than raise
        raise _timed_out(op, where, left, group)


def _timed_out(op: str, where: str, left: float | None, group: Any) -> CollectiveTimeout:
    mark_unusable(group, f"an earlier {op} timed out and was abandoned")
    # Under a deadline the group's own timeout may still come first.
    passed = left is not None and (deadline.remaining() or 0.0) < 0.05
    limit = f"at the caller's deadline, after {left:.1f} s" if passed else "at the group's timeout"
    return CollectiveTimeout(
        f"{op} on {where} timed out ({limit}) waiting for the other ranks (did they exit, or "
        "call something else?); the collective was abandoned, not cancelled, so the group is "
        "unusable now: destroy it and create it again on every rank"
    )


class PendingWork:
    """Sends or receives posted without waiting: vLLM's ``Handle`` (``is_completed``,
    ``wait``), as ``GroupCoordinator.isend_object`` and the tensor dictionaries' non-blocking
    forms return it.

    It keeps the tensors the works read from or fill (``keep``) alive until they are done,
    so that a caller may drop its own references at once; ``then`` runs once they are (a
    copy out of a wire tensor into the caller's). :meth:`wait` waits as :func:`finish` does
    (``op``, ``where``, ``group`` and ``bounded`` are its) and may be called again: each
    work is waited for once (a second wait on a gloo send never returns).
    """

    def __init__(
        self,
        works: Sequence[Work | None],
        op: str,
        where: str,
        *,
        group: Any,
        bounded: bool = True,
        keep: Sequence[Any] = (),
        then: Callable[[], object] | None = None,
    ) -> None:
        self._works = [work for work in works if work is not None]
        self._op, self._where, self._group, self._bounded = op, where, group, bounded
        self._keep: Sequence[Any] = keep
        self._then = then
        self._done = False

    def is_completed(self) -> bool:
        """Whether the works are done (and ``then`` has run), without waiting. A gloo send
        or receive says so only once waited for; NCCL's as soon as the GPU is done."""
        if not self._done and all(work.is_completed() for work in self._works):
            self.wait()
        return self._done

    def wait(self) -> None:
        """Wait for every work, then run ``then`` and let go of the kept tensors."""
        while self._works:
            finish(self._works[0], self._op, self._where, group=self._group, bounded=self._bounded)
            self._works.pop(0)
        if not self._done:
            then, self._then = self._then, None
            if then is not None:
                then()
            self._done = True
            self._keep = ()
