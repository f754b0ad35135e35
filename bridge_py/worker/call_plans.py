"""Call plans: a call made before is run again without decoding or resolving it again.

Most traffic is the same few calls over and over (``incr``, ``rank``, ``broadcast_obj``
on one object, a getter, a function), each time with another id and deadline and often
other arguments. Decoding the envelope, resolving the handle, checking the export table
and looking up the method cost more than the rest of a small call, all to get the same
answer as last time. So once a call has gone the full way and succeeded, the dispatcher
keeps a plan for it under the key :func:`~bridge_py.worker.envelope.split_call` finds in
the request's bytes (its session, its operation and what it names: a handle and a
method, a function, a handle and an attribute). The next request with the same key is
read as that key, its id, its deadline and its argument bytes, and a dictionary lookup
(``Dispatcher.admit``); the plan's ``run`` decodes and checks the arguments as the full
way does, and makes the call. Its reply starts with the request's own id field.

A plan is only as good as the registry it was made from: every release moves the
registry's ``epoch``, and a plan made under another epoch is not used (the call takes
the full way, which says what became of the handle); the dispatcher also drops all plans
when it releases anything, so that no plan keeps a released object alive. A plan also
says what the request is (its operation and session) so that a transport's own checks
(``Dispatcher.admit``'s ``gate``) see a planned request as they see a decoded one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import Codec
from bridge_py.worker.sequencer import Sequencer

MAX_PLANS = 1024  # a worker serving more distinct calls starts over rather than grow
# Longer requests (large arguments) are decoded the full way: slicing their arguments out
# of the frame would copy them, and the work of the call dwarfs the decoding.
MAX_PLANNED_BYTES = 1 << 16

Run = Callable[[bytes, bytes], Any]
"""A plan's call: given the request's argument bytes (args and kwargs, or a ping's
payload), its result; raises ``operations.Failure`` (or what the full way's failures
are made from, see ``operations.as_failure``) when it fails."""


@final
@dataclass(frozen=True, slots=True)
class CallPlan:
    """What a known call needs: see the module docstring."""

    run: Run
    sequencer: Sequencer | None  # the object's, for a method call: it still takes its turn
    codec: Codec  # the session's, for the result
    epoch: int  # the registry's epoch when the plan was made
    session: str = ""  # the session as the request names it ("" for the default one)
    op: type[pb.Operation] = pb.CallMethod  # the request's operation


class CallPlans:
    """Plans by their key (``envelope.split_call``); bounded, safe to share by threads.

    Lookups and stores are single dictionary operations, atomic under the GIL; two
    threads learning the same call store equal plans.
    """

    def __init__(self, limit: int = MAX_PLANS) -> None:
        self._plans: dict[bytes, CallPlan] = {}
        self._limit = limit
        # The plan for a key, or None: the dictionary's own ``get``, one C call on the hot
        # path. (``clear`` empties this same dictionary, so the bound method stays good.)
        self.get: Callable[[bytes], CallPlan | None] = self._plans.get

    def learn(self, key: bytes, plan: CallPlan) -> None:
        """Keep ``plan`` for requests whose key is ``key``."""
        if len(self._plans) >= self._limit:
            self._plans.clear()
        self._plans[key] = plan

    def clear(self) -> None:
        """Forget every plan (they hold their objects alive)."""
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
