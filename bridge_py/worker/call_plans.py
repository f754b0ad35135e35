"""Call plans: a call made before is run again without decoding or resolving it again.

Most traffic is the same few calls over and over (``incr``, ``rank``, ``broadcast_obj``
on one object, a getter, a function), each time with another id and deadline and often
other arguments. Decoding the envelope, resolving the handle, checking the export table
and looking up the method cost more than the rest of a small call, all to get the same
answer as last time. So once a call has gone the full way and succeeded, the dispatcher
keeps a plan for it under the key :func:`split_call` finds in the request's bytes (its
session, its operation and what it names: a handle and a method, a function, a handle
and an attribute). The next request with the same key is read as that key, its id, its
deadline and its argument bytes, and a dictionary lookup (``Dispatcher.admit``); the
plan's ``run`` decodes and checks the arguments as the full way does, and makes the
call. Its reply starts with the request's own id field.

A plan is only as good as what it was worked out from: the object it calls (a method
call, an attribute read) or, for the others, the session. Each has a
:class:`~bridge_py.worker.registry.Lifetime`, marked when it is released; a plan whose
lifetime is over is not used (the call takes the full way, which says what became of
the handle). A release of some handles drops the plans of those handles alone, so that
no plan keeps a released object alive while the calls on every other object stay
planned; a session's release drops that session's plans. A plan also says what the
request is (its operation and session) so that a transport's own checks
(``Dispatcher.admit``'s ``gate``) see a planned request as they see a decoded one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, final

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import Codec
from bridge_py.worker.envelope import EnvelopeError, read_varint
from bridge_py.worker.registry import Lifetime
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
    lifetime: Lifetime  # the object's (a method call, an attribute read), else the session's
    session: str = ""  # the session as the request names it ("" for the default one)
    op: type[pb.Operation] = pb.CallMethod  # the request's operation
    handle: int = 0  # the object's handle, for a method call or an attribute read


class CallPlans:
    """Plans by their key (:func:`split_call`); bounded, safe to share by threads.

    A lookup is one dictionary operation, atomic under the GIL; the rest (learning,
    forgetting) takes a lock. Two threads learning the same call store equal plans.
    """

    def __init__(self, limit: int = MAX_PLANS) -> None:
        self._plans: dict[bytes, CallPlan] = {}
        self._keys_of: dict[int, set[bytes]] = {}  # the keys of each handle's plans
        self._limit = limit
        self._lock = threading.Lock()
        # The plan for a key, or None: the dictionary's own ``get``, one C call on the hot
        # path. (``clear`` empties this same dictionary, so the bound method stays good.)
        self.get: Callable[[bytes], CallPlan | None] = self._plans.get

    def learn(self, key: bytes, plan: CallPlan) -> None:
        """Keep ``plan`` for requests whose key is ``key``; not one whose lifetime is
        already over (checked once it is kept: a release that marked it before it was
        kept may have looked for it to drop too soon)."""
        with self._lock:
            if len(self._plans) >= self._limit:
                self._clear()
            self._plans[key] = plan
            if plan.handle:
                self._keys_of.setdefault(plan.handle, set()).add(key)
        if plan.lifetime.released:
            with self._lock:
                if self._plans.get(key) is plan:
                    del self._plans[key]
                    self._keys_of.pop(plan.handle, None)

    def forget(self, handles: Iterable[int]) -> None:
        """Drop the plans of ``handles`` (released: a plan holds its object alive)."""
        with self._lock:
            for handle in handles:
                for key in self._keys_of.pop(handle, ()):
                    self._plans.pop(key, None)

    def forget_if(self, released: Callable[[CallPlan], bool]) -> None:
        """Drop every plan for which ``released(plan)`` is true (a session's: one pass over
        all plans, for what is rare)."""
        with self._lock:
            for key, plan in list(self._plans.items()):
                if released(plan):
                    del self._plans[key]
                    keys = self._keys_of.get(plan.handle)
                    if keys is not None:
                        keys.discard(key)
                        if not keys:  # (handles are never reused: nothing may stay)
                            del self._keys_of[plan.handle]

    def clear(self) -> None:
        """Forget every plan (they hold their objects alive)."""
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        self._plans.clear()
        self._keys_of.clear()

    def __len__(self) -> int:
        return len(self._plans)


def id_field_end(frame: bytes) -> int:
    """Where a Request's id field ends when it is the frame's first field, else 0.

    Every encoder writes the id first (``08`` and a varint; docs/protocol.md), so for
    the requests they write ``frame[:end]`` is the id field exactly as it arrived, which
    is also the id field of the request's reply, and ``frame[end:]`` is the rest of the
    request (its session and operation), the same for every request that makes the
    same call. Ids of up to 63 bits (a varint of at most 9 bytes) are found; longer
    ones, an id of another field, or a frame too short for one, give 0.

    A few byte tests, unrolled for ids of one to four bytes (below 2^28): the Elixir
    runtime's ids count up from 1, one per request in its VM.
    """
    try:
        if frame[0] != 0x08:
            return 0
        if frame[1] < 0x80:
            return 2
        if frame[2] < 0x80:
            return 3
        if frame[3] < 0x80:
            return 4
        if frame[4] < 0x80:
            return 5
        for end in range(6, 11):
            if frame[end - 1] < 0x80:
                return end
    except IndexError:  # the frame ends inside the varint
        pass
    return 0


# The keys id_field_end and split_call test, written there as constants (cheaper than
# names looked up on every call), checked against the schema's once, here.
pb.check_keys(
    "call_plans.split_call",
    (
        (0x08, "Request", "id"),
        (0x12, "Request", "session"),
        (0x18, "Request", "deadline_ms"),
        (0x52, "Request", "create"),
        (0x5A, "Request", "call"),
        (0x62, "Request", "call_function"),
        (0x6A, "Request", "get_attr"),
        (0x8A, "Request", "ping"),  # two bytes: 8a 01
        (0x0A, "CreateInstance", "class_name"),  # a constructor is split as a function call
        (0x12, "CreateInstance", "args"),
        (0x1A, "CreateInstance", "kwargs"),
        (0x0A, "CallFunction", "function"),
        (0x12, "CallFunction", "args"),
        (0x1A, "CallFunction", "kwargs"),
        (0x08, "CallMethod", "handle"),
        (0x12, "CallMethod", "method"),
        (0x1A, "CallMethod", "args"),
        (0x22, "CallMethod", "kwargs"),
        (0x08, "GetAttribute", "handle"),
        (0x12, "GetAttribute", "name"),
        (0x0A, "Ping", "payload"),
    ),
)


Split = tuple[int, bytes, int, bytes, bytes]
"""What :func:`split_call` finds in a request: where its id field ends, the key of its
call, its ``deadline_ms`` (0: none), and its argument bytes (args, kwargs; a ping's
payload and b"")."""


def split_call(frame: bytes) -> Split | None:
    """A request laid out the way every encoder writes one, split into what varies from
    one call of the same thing to the next and the key that names that thing; or None.

    The layout: the id first (see :func:`id_field_end`), maybe a session (shorter than
    128 bytes), maybe a ``deadline_ms``, then a method call, a function call or a
    constructor, an attribute read or a ping to the end, each field once and in order,
    none empty. The key is the session field, the operation's field key and the fields
    that name the target (handle and method, function or class, handle and attribute):
    two requests with the same key call the same thing in the same session. Anything
    else returns None (the general decoder reads it, or says what is wrong with it); no
    text is decoded here, so a frame with invalid text may be split (its key is then no
    valid frame's key).

    On the hot path of every planned call: the operation's length, the handle, the
    name's length and the args' length read inline when they take one byte, and the
    deadline when it takes up to three (a call to :func:`read_varint` costs a fifth of the
    whole split), everything else by :func:`read_varint`.
    """
    n = len(frame)
    try:
        pos = id_field_end(frame)
        if not pos:
            return None
        end = pos
        byte = frame[pos]
        if byte == 0x12:  # the session: its length, then its bytes
            size = frame[pos + 1]
            if size & 0x80:
                return None
            pos += 2 + size
            byte = frame[pos]
        session_end = pos
        deadline = 0
        if byte == 0x18:  # a deadline: its varint read inline up to three bytes (34 min;
            deadline = frame[pos + 1]  # the Elixir runtime's default is 120,000 ms)
            if deadline < 0x80:
                pos += 2
            elif frame[pos + 2] < 0x80:
                deadline = deadline & 0x7F | frame[pos + 2] << 7
                pos += 3
            elif frame[pos + 3] < 0x80:
                deadline = deadline & 0x7F | (frame[pos + 2] & 0x7F) << 7 | frame[pos + 3] << 14
                pos += 4
            else:
                deadline, pos = read_varint(frame, pos + 1, n)
            byte = frame[pos]
        op_at = pos
        if byte == 0x52:  # a constructor (field 10): laid out as a function call (12)
            byte = 0x62
        if byte == 0x8A:  # ping, field 17: two bytes
            if frame[pos + 1] != 0x01:
                return None
            pos += 1
        elif byte != 0x5A and byte != 0x62 and byte != 0x6A:
            return None
        op_end = pos + 1
        size = frame[op_end]
        if size < 0x80:
            body = op_end + 1
        else:
            size, body = read_varint(frame, op_end, n)
        if body + size != n:
            return None
        pos = body
        # The fields that name the target: a handle (call, get_attr), then a name.
        if byte == 0x5A or byte == 0x6A:
            if frame[pos] != 0x08:
                return None
            handle = frame[pos + 1]
            if handle < 0x80:
                pos += 2
            else:
                handle, pos = read_varint(frame, pos + 1, n)
            if not handle:
                return None
            if frame[pos] != 0x12:
                return None
        elif byte == 0x62 and frame[pos] != 0x0A:
            return None
        if byte != 0x8A:
            size = frame[pos + 1]
            if size < 0x80:
                pos += 2 + size
            else:
                size, pos = read_varint(frame, pos + 1, n)
                pos += size
            if not size:
                return None
        named = pos
        # The fields that carry arguments, each maybe: (args, kwargs) or (payload,).
        args = kwargs = b""
        if pos < n:
            if byte == 0x6A:
                return None
            first = 0x1A if byte == 0x5A else 0x12 if byte == 0x62 else 0x0A
            if frame[pos] == first:
                size = frame[pos + 1]
                if size < 0x80:
                    pos += 2
                else:
                    size, pos = read_varint(frame, pos + 1, n)
                args = frame[pos : pos + size]
                pos += size
            if pos < n and frame[pos] == first + 8 and byte != 0x8A:
                size, pos = read_varint(frame, pos + 1, n)
                kwargs = frame[pos : pos + size]
                pos += size
    except (IndexError, EnvelopeError):
        return None
    if pos != n:
        return None
    return (
        end,
        frame[end:session_end] + frame[op_at:op_end] + frame[body:named],
        deadline,
        args,
        kwargs,
    )
