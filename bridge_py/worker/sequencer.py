"""Turns: calls on one object run one at a time, in the order they arrived.

vLLM's objects are not thread-safe, and a client that sends ``send_obj`` then
``recv_obj`` on one group expects them to run in that order. A lock alone does not
give that (threads race for it), so each call takes a numbered turn when its request
is read, and runs when its number comes up.
"""

from __future__ import annotations

import threading
from types import TracebackType


class Sequencer:
    """Hands out turns in order and lets them run one at a time, in that order."""

    __slots__ = ("_cond", "_next", "_serving")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0
        self._serving = 0

    def turn(self) -> Turn:
        """The next turn. It must be entered and left exactly once (``with turn:``)."""
        with self._cond:
            number = self._next
            self._next += 1
        return Turn(self, number)

    def _wait_for(self, number: int) -> None:
        with self._cond:
            while self._serving != number:
                self._cond.wait()

    def _done(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


class Turn:
    """One call's place in line: ``with turn:`` waits for it, then runs alone."""

    __slots__ = ("_number", "_sequencer")

    def __init__(self, sequencer: Sequencer, number: int) -> None:
        self._sequencer = sequencer
        self._number = number

    def __enter__(self) -> Turn:
        self._sequencer._wait_for(self._number)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._sequencer._done()
