"""Call plans: a repeated method call without arguments, run without decoding it again.

Most traffic is the same few calls over and over (``incr``, ``rank``, ``barrier`` on one
object), and for a call without arguments a request differs from the last one only in
its id. Decoding the envelope, resolving the handle, checking the export table and
looking up the method cost about twice what the rest of such a call costs, all to get
the same answer as last time. So once a call has gone the full way and succeeded, the
dispatcher keeps a plan under the request's bytes after its id field (the session and
the call; ``envelope.id_field_end`` finds where the id field ends), less its deadline
(``envelope.call_key``: that differs from call to call): the object and method name, its
sequencer and the session's codec. The next request with the same bytes is read as its
id field, its deadline and a dictionary lookup (``Dispatcher.admit``), and its reply starts
with the same id field's bytes.

A plan is only as good as the registry it was made from: every release moves the
registry's ``epoch``, and a plan made under another epoch is not used (the call takes
the full way, which says what became of the handle); the dispatcher also drops all plans
when it releases anything, so that no plan keeps a released object alive. Plans are made
only for calls the full way would run without any argument check (``_Method.bare``), so
running one skips no check the full way makes. A plan also says what the request is
(its operation and session) so that a transport's own checks (``Dispatcher.admit``'s
``gate``) see a planned request as they see a decoded one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import Codec
from bridge_py.worker.sequencer import Sequencer

MAX_PLANS = 1024  # a worker serving more distinct calls starts over rather than grow
# A call without arguments is far shorter (its session and method name are most of it):
# a longer frame is not looked up, so that its bytes are not copied and hashed for
# nothing (14 us for a 60 KB argument).
MAX_PLANNED_BYTES = 1024


@final
@dataclass(frozen=True, slots=True)
class CallPlan:
    """What a known call without arguments needs: see the module docstring."""

    obj: Any  # the object; its method is looked up on each call, as the full way does
    method: str  # the method's name
    sequencer: Sequencer  # the object's: the call still takes its turn
    codec: Codec  # the session's, for the result
    epoch: int  # the registry's epoch when the plan was made
    session: str = ""  # the session as the request names it ("" for the default one)
    op: type[pb.Operation] = pb.CallMethod  # the request's operation


class CallPlans:
    """Plans by the bytes of a request after its id field; bounded, safe to share by threads.

    Lookups and stores are single dictionary operations, atomic under the GIL; two
    threads learning the same call store equal plans.
    """

    def __init__(self, limit: int = MAX_PLANS) -> None:
        self._plans: dict[bytes, CallPlan] = {}
        self._limit = limit
        # The plan for a request's bytes after its id field, less its deadline (``call_key``),
        # or None: the dictionary's own ``get``, one C call on the hot path. (``clear``
        # empties this same dictionary, so the bound method stays good.)
        self.get: Callable[[bytes], CallPlan | None] = self._plans.get

    def learn(self, frame: bytes, plan: CallPlan) -> None:
        """Keep ``plan`` for requests whose bytes after the id field are ``frame``'s, their
        deadlines aside (``envelope.call_key``; a frame whose id is not its first field
        gets none)."""
        end = pb.id_field_end(frame)
        if not end or len(frame) > MAX_PLANNED_BYTES:
            return
        if len(self._plans) >= self._limit:
            self._plans.clear()
        self._plans[pb.call_key(frame, end)[0]] = plan

    def clear(self) -> None:
        """Forget every plan (they hold their objects alive)."""
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
