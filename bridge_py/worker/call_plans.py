"""Call plans: a repeated method call without arguments, run without decoding it again.

Most traffic is the same few calls over and over (``incr``, ``rank``, ``barrier`` on one
object), and for a call without arguments a request differs from the last one only in
its id. Decoding the envelope, resolving the handle, checking the export table and
looking up the method cost about twice what the rest of such a call costs, all to get
the same answer as last time. So once a call has gone the full way
(:meth:`Dispatcher.dispatch`) and succeeded, the dispatcher keeps a plan under the
request's bytes after its id (the session and the call): the bound method, the object's
sequencer and the session's codec. The next request with the same bytes is read as its
id and a dictionary lookup.

A plan is only as good as the registry it was made from: every release moves the
registry's ``epoch``, and a plan made under another epoch is not used (the call takes
the full way, which says what became of the handle). Plans are made only for calls the
full way would run without any argument check (``_Method.bare``), so running one skips
no check the full way makes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bridge_py.worker.codec import Codec
from bridge_py.worker.sequencer import Sequencer

MAX_PLANS = 1024  # a worker serving more distinct calls starts over rather than grow


@dataclass(frozen=True, slots=True)
class CallPlan:
    """What a known call without arguments needs: see the module docstring."""

    method: Callable[[], Any]  # the bound method
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
        """``(request id, plan)`` for a request whose call has a plan, else None."""
        if type(frame) is not bytes or frame[:1] != b"\x08":
            return None
        split = _after_id(frame)
        if split is None:
            return None
        request_id, pos = split
        plan = self._plans.get(frame[pos:])
        return None if plan is None else (request_id, plan)

    def learn(self, frame: bytes | bytearray | memoryview, plan: CallPlan) -> None:
        """Keep ``plan`` for requests whose bytes after the id are ``frame``'s."""
        if type(frame) is not bytes or frame[:1] != b"\x08":
            return
        split = _after_id(frame)
        if split is None:
            return
        if len(self._plans) >= self._limit:
            self._plans.clear()
        self._plans[frame[split[1] :]] = plan

    def __len__(self) -> int:
        return len(self._plans)


def _after_id(frame: bytes) -> tuple[int, int] | None:
    """The request id (field 1, a varint, first in every request we plan) and where the
    rest begins; None when the varint does not end within 10 bytes."""
    value = shift = 0
    for pos in range(1, min(len(frame), 11)):
        byte = frame[pos]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos + 1
        shift += 7
    return None
