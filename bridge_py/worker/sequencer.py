"""Turns: calls on one object run one at a time, in the order they arrived.

vLLM's objects are not thread-safe, and a client that sends ``send_obj`` then
``recv_obj`` on one group expects them to run in that order. A lock alone does not
give that (threads race for it), so each call takes a numbered turn when its request
is read, and runs when its number comes up.

Most turns find nobody ahead of them; those take no lock at all: a number from an
``itertools.count`` (one C call, atomic under the GIL) and, on leaving, one counter
update that only the turn's holder makes. Only a turn that must wait takes the lock and
sleeps, and only then does leaving a turn take the lock to wake it. The lock and its
condition are made by the first turn that waits (every object the worker holds has a
sequencer, and making a condition is most of the cost of making one).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from types import TracebackType


class Sequencer:
    """Hands out turns in order and lets them run one at a time, in that order."""

    __slots__ = ("_cond", "_numbers", "_sleepers", "serving", "take")

    def __init__(self) -> None:
        self._cond: threading.Condition | None = None  # made by the first turn that waits
        self._numbers = itertools.count()  # the numbers turns get, in order
        # The number whose turn it is (read-only outside: only its holder moves it on).
        self.serving = 0
        self._sleepers = 0  # turns waiting on the condition (changed under its lock)
        # The next turn's number: a turn without a Turn object (on the hot path of call
        # plans), one C call. Its holder waits for it (``serving == number``, else
        # :meth:`wait_for`) and leaves it (:meth:`done`) exactly once.
        self.take: Callable[[], int] = self._numbers.__next__

    def turn(self) -> Turn:
        """The next turn. It must be entered and left exactly once (``with turn:``)."""
        return Turn(self, next(self._numbers))

    def wait_for(self, number: int) -> None:
        """Sleep until it is turn ``number``'s (from :attr:`take`) turn."""
        # A sleeper counts itself before it looks at serving, and done moves serving
        # on before it looks at the count: either this sees the new number, or done
        # sees the sleeper and wakes it (under the lock, so not before it waits).
        cond = self._cond
        if cond is None:
            with _MAKING:  # two first waiters make one condition
                cond = self._cond
                if cond is None:
                    cond = self._cond = threading.Condition(threading.Lock())
        with cond:
            self._sleepers += 1
            try:
                while self.serving != number:
                    cond.wait()
            finally:
                self._sleepers -= 1

    def done(self) -> None:
        """Leave the turn being served: the next one's may run."""
        self.serving += 1
        if self._sleepers:  # a sleeper made the condition before it counted itself
            cond = self._cond
            assert cond is not None
            with cond:
                cond.notify_all()


_MAKING = threading.Lock()


class Turn:
    """One call's place in line: ``with turn:`` waits for it, then runs alone."""

    __slots__ = ("_number", "_sequencer")

    def __init__(self, sequencer: Sequencer, number: int) -> None:
        self._sequencer = sequencer
        self._number = number

    def __enter__(self) -> Turn:
        sequencer = self._sequencer
        if sequencer.serving != self._number:
            sequencer.wait_for(self._number)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._sequencer.done()
