"""Turns: calls on one object run one at a time, in the order they arrived.

vLLM's objects are not thread-safe, and a client that sends ``send_obj`` then
``recv_obj`` on one group expects them to run in that order. A lock alone does not
give that (threads race for it), so each call takes a numbered turn when its request
is read, and runs when its number comes up.

Most turns find nobody ahead of them; those cost two counter updates and no
condition variable. Only a turn that must wait sleeps, and only then does leaving a
turn wake anyone.
"""

from __future__ import annotations

import threading
from types import TracebackType


class Sequencer:
    """Hands out turns in order and lets them run one at a time, in that order."""

    __slots__ = ("_cond", "_lock", "_next", "_serving", "_sleepers")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._next = 0  # the number the next turn gets
        self._serving = 0  # the number whose turn it is
        self._sleepers = 0  # turns waiting on the condition

    def turn(self) -> Turn:
        """The next turn. It must be entered and left exactly once (``with turn:``)."""
        with self._lock:
            number = self._next
            self._next = number + 1
        return Turn(self, number)

    def _wait_for(self, number: int) -> None:
        if self._serving == number:  # only the previous turn's leaving changes this
            return
        with self._lock:
            self._sleepers += 1
            try:
                while self._serving != number:
                    self._cond.wait()
            finally:
                self._sleepers -= 1

    def _done(self) -> None:
        with self._lock:
            self._serving += 1
            if self._sleepers:
                self._cond.notify_all()


class Turn:
    """One call's place in line: ``with turn:`` waits for it, then runs alone."""

    __slots__ = ("_number", "_sequencer")

    def __init__(self, sequencer: Sequencer, number: int) -> None:
        self._sequencer = sequencer
        self._number = number

    def __enter__(self) -> Turn:
        sequencer = self._sequencer
        if sequencer._serving != self._number:
            sequencer._wait_for(self._number)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._sequencer._done()
