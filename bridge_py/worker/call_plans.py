"""Call plans: a repeated method call without arguments, run without decoding it again.

Most traffic is the same few calls over and over (``incr``, ``rank``, ``barrier`` on one
object), and for a call without arguments a request differs from the last one only in
its id. Decoding the envelope, resolving the handle, checking the export table and
looking up the method cost about twice what the rest of such a call costs, all to get
the same answer as last time. So once a call has gone the full way
(:meth:`Dispatcher.dispatch_frame`) and succeeded, the dispatcher keeps a plan under the
request's bytes after its id (the session and the call): the object and method name, its
sequencer and the session's codec. The next request with the same bytes is read as its
id field and a dictionary lookup, and its reply starts with the same id field's bytes.

A plan is only as good as the registry it was made from: every release moves the
registry's ``epoch``, and a plan made under another epoch is not used (the call takes
the full way, which says what became of the handle); the dispatcher also drops all plans
when it releases anything, so that no plan keeps a released object alive. Plans are made
only for calls the full way would run without any argument check (``_Method.bare``), so
running one skips no check the full way makes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from bridge_py.worker.codec import Codec
from bridge_py.worker.sequencer import Sequencer

MAX_PLANS = 1024  # a worker serving more distinct calls starts over rather than grow

# A request's id field, first in every request the encoders write: its tag (field 1, a
# varint) and a varint of at most 9 bytes (63 bits; longer ones take the full way).
_ID_FIELD = re.compile(rb"\x08[\x80-\xff]{0,8}[\x00-\x7f]")


@dataclass(frozen=True, slots=True)
class CallPlan:
    """What a known call without arguments needs: see the module docstring."""

    obj: Any  # the object; its method is looked up on each call, as the full way does
    method: str  # the method's name
    sequencer: Sequencer  # the object's: the call still takes its turn
    codec: Codec  # the session's, for the result
    epoch: int  # the registry's epoch when the plan was made


class CallPlans:
    """Plans by the bytes of a request after its id; bounded, safe to share by threads.

    Lookups and stores are single dictionary operations, atomic under the GIL; two
    threads learning the same call store equal plans.
    """

    def __init__(self, limit: int = MAX_PLANS) -> None:
        self._plans: dict[bytes, CallPlan] = {}
        self._limit = limit

    def find(self, frame: bytes | bytearray | memoryview) -> tuple[int, CallPlan] | None:
        """For a request whose call has a plan: where its id field ends (``frame[:end]``
        is also its reply's id field) and the plan; else None."""
        if type(frame) is not bytes:
            return None
        head = _ID_FIELD.match(frame)
        if head is None:
            return None
        end = head.end()
        plan = self._plans.get(frame[end:])
        return None if plan is None else (end, plan)

    def learn(self, frame: bytes | bytearray | memoryview, plan: CallPlan) -> None:
        """Keep ``plan`` for requests whose bytes after the id field are ``frame``'s."""
        head = _ID_FIELD.match(frame) if type(frame) is bytes else None
        if head is None:
            return
        if len(self._plans) >= self._limit:
            self._plans.clear()
        self._plans[frame[head.end() :]] = plan

    def clear(self) -> None:
        """Forget every plan (they hold their objects alive)."""
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
