"""The dispatcher: one request frame in, one reply out, whatever the transport.

Both transports (the stdin/stdout port and gRPC) are thin loops over two calls:

* :meth:`Dispatcher.admit` takes the bytes of one request, on the thread that read it,
  and works out what they are: a call it has a plan for (``call_plans``: only its key,
  id, deadline and argument bytes read), a decoded request, or the error reply to
  bytes that are not a request. A
  method call also takes its turn on its object here (``sequencer``), which is what
  makes calls on one object run in the order they were admitted, whichever threads
  run them. A transport's own checks come in as a ``gate``, called before any turn is
  taken: it sees the request's operation and session, and may refuse it.
* :meth:`Dispatcher.run` runs what ``admit`` returned, on any thread, and returns the
  reply's bytes. It never raises, and it uses up the turn the job holds.

So planning (which requests skip decoding) and ordering (turns) live here, the same for
every transport, and what each operation does lives in ``operations.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bridge_py.deadline import CURRENT
from bridge_py.worker import envelope as pb
from bridge_py.worker.call_plans import MAX_PLANNED_BYTES, CallPlan, CallPlans, split_call
from bridge_py.worker.exports import ExportTable
from bridge_py.worker.operations import (
    DEFAULT_SESSION,
    EXPECTED,
    Failure,
    Operations,
    as_failure,
    encode_failure,
    error_reply,
    expired_failure,
    internal_failure,
    late_failure,
    protocol_error,
)
from bridge_py.worker.registry import HandleNotFound, HandleRegistry
from bridge_py.worker.sequencer import Turn

__all__ = ["DEFAULT_SESSION", "Dispatcher", "Frame", "Gate", "Job", "protocol_error"]

Frame = bytes | bytearray | memoryview
"""The bytes of one request, as a transport read them."""

Gate = Callable[[type[pb.Operation] | None, str], pb.Error | None]
"""A transport's check of a request before it is admitted: called with the request's
operation (its class; None when it has none) and its session as the request names it.
It returns None to admit the request, or the error to answer instead (the request is
then not run); it may also raise, and then ``admit`` raises that, having taken nothing."""

Job = (
    tuple[CallPlan, bytes, int, int, float, bytes, bytes]
    | tuple[pb.Request, Turn | None, Frame, float]
    | tuple[pb.Reply, None, None]
)
"""What :meth:`Dispatcher.admit` made of a frame, for :meth:`Dispatcher.run`: a planned
call (its plan, the frame, where the frame's id field ends, the number of its turn on
the plan's sequencer (-1 for none), its deadline, its argument bytes), a decoded
request (with the turn it holds, if it
takes one, its frame and its deadline), or a reply known already (an error). A deadline
is the ``time.monotonic()`` value the request's ``deadline_ms`` names, counted from when
it was admitted; 0.0 for none."""


def _deadline(ms: int) -> float:
    """The ``time.monotonic()`` value ``ms`` milliseconds from now; 0.0 for 0 (none)."""
    return time.monotonic() + ms * 0.001 if ms else 0.0


class Dispatcher:
    """Admits and runs requests against an export table and a handle registry."""

    def __init__(self, exports: ExportTable, registry: HandleRegistry | None = None) -> None:
        self.exports = exports
        self.registry = registry if registry is not None else HandleRegistry()
        # Calls seen before, by what they name (call_plans).
        self.plans = CallPlans()
        # A release drops the plans of what it released: they hold their objects alive.
        self.operations = Operations(exports, self.registry, on_release=self._released)
        self._plan_for = self.plans.get
        self._planned = self.operations.planned
        # Methods that some class lets run out of turn (``ExportedClass.unordered``): only
        # a call of one of these names needs its object looked up before it takes a turn.
        self._unordered = {name for entry in exports.classes.values() for name in entry.unordered}

    # -- the transports' two calls --------------------------------------------------

    def admit(self, frame: Frame, gate: Gate | None = None) -> Job:
        """What one request frame is (see the module docstring); a method call takes its
        turn now. Never raises, unless ``gate`` does (then nothing was taken)."""
        if type(frame) is bytes and len(frame) <= MAX_PLANNED_BYTES:
            split = split_call(frame)
            if split is not None:
                end, key, deadline_ms, args, kwargs = split
                plan = self._plan_for(key)
                if plan is not None:
                    if gate is not None:
                        refused = gate(plan.op, plan.session)
                        if refused is not None:
                            return pb.Reply(pb.peek_request_id(frame), error=refused), None, None
                    deadline = time.monotonic() + deadline_ms * 0.001 if deadline_ms else 0.0
                    sequencer = plan.sequencer
                    number = -1 if sequencer is None else sequencer.take()
                    return plan, frame, end, number, deadline, args, kwargs
        try:
            req = pb.decode_request(frame)
        except Exception as exc:  # EnvelopeError, or a bug: a reply either way
            reply = protocol_error(pb.peek_request_id(frame), f"malformed request: {_why(exc)}")
            return reply, None, None
        if gate is not None:
            refused = gate(None if req.op is None else type(req.op), req.session)
            if refused is not None:
                return pb.Reply(req.id, error=refused), None, None
        ms = req.deadline_ms
        return req, self._reserve(req), frame, time.monotonic() + ms * 0.001 if ms else 0.0

    def run(self, job: Job) -> list[bytes | memoryview]:
        """Run a job from :meth:`admit` and return its reply's bytes, in pieces (a large
        tensor is a view of its own memory; write them in order). Every job gets exactly
        one reply: should anything but the call itself fail, the reply is an error, and
        a turn the job holds is given back."""
        if type(job[0]) is CallPlan:  # the most common request
            return self._run_planned(*job)
        if type(job[0]) is pb.Reply:  # worked out by admit (an error)
            known, _, _ = job
            return pb.encode_reply_chunks(known)
        req, turn, frame, deadline = job
        try:
            reply = self._answer(req, turn, deadline)  # uses the turn up, whatever happens
            if reply.error is None and type(frame) is bytes:
                self._learn(frame, req)
            return pb.encode_reply_chunks(reply)
        except Exception as exc:  # a bug of ours: the caller still hears
            failed = protocol_error(req.id, f"internal error: {_why(exc)}")
            return pb.encode_reply_chunks(failed)

    def dispatch(self, req: pb.Request) -> pb.Reply:
        """Run one decoded request now, in its turn; always returns a Reply (errors
        included), never raises. (For callers that hold a Request rather than bytes;
        a large tensor result is left in pieces: write it with
        ``envelope.encode_reply_chunks``.)"""
        return self._answer(req, self._reserve(req), _deadline(req.deadline_ms))

    # -- ordering ------------------------------------------------------------------

    def _reserve(self, req: pb.Request) -> Turn | None:
        """The request's place in line when it is a method call on a live handle that
        waits for its turn."""
        op = req.op
        if type(op) is not pb.CallMethod:
            return None
        session = req.session or DEFAULT_SESSION
        try:
            if not self._takes_turn(op, session):
                return None
            return self.registry.turn(op.handle, session)
        except HandleNotFound:
            return None  # the call reports it

    def _takes_turn(self, op: pb.CallMethod, session: str) -> bool:
        """Whether the method call ``op`` waits for its turn on its object; raises
        HandleNotFound when the handle is not ``session``'s."""
        if op.method not in self._unordered:
            return True
        return self.exports.takes_turn(self.registry.get(op.handle, session), op.method)

    def _answer(self, req: pb.Request, turn: Turn | None, deadline: float) -> pb.Reply:
        """Run ``req`` in ``turn`` (entered here, and always left), under ``deadline``;
        never raises."""
        try:
            if not deadline:
                if turn is None:
                    return self.operations.reply(req)
                with turn:
                    return self.operations.reply(req)
            if turn is None:
                return self._reply(req, deadline)
            with turn:
                return self._reply(req, deadline)
        except BaseException as exc:  # one reply per request, whatever happened
            # Only a bug of ours gets here (the call's own exceptions are caught below it).
            return error_reply(req.id, internal_failure(exc))

    def _reply(self, req: pb.Request, deadline: float) -> pb.Reply:
        """Run ``req`` now, under ``deadline``; not at all once it has passed."""
        late = time.monotonic() - deadline
        if late >= 0:
            return error_reply(req.id, expired_failure(late))
        before = CURRENT.at
        CURRENT.at = deadline
        try:
            return self.operations.reply(req)
        finally:
            CURRENT.at = before

    # -- planned calls ---------------------------------------------------------------

    def _run_planned(
        self,
        plan: CallPlan,
        frame: bytes,
        id_end: int,
        number: int,
        deadline: float,
        args: bytes,
        kwargs: bytes,
    ) -> list[bytes | memoryview]:
        """The reply to a planned call: the one the full way would give. A method call
        runs in its turn ``number`` on ``plan.sequencer`` (and always leaves it); all run
        under ``deadline``, and not at all once it has passed; if a release has made the
        plan stale, the request takes the full way instead."""
        # One function on purpose: this is the hot path of every planned call, and each
        # Python call level costs about a tenth of a microsecond.
        sequencer = plan.sequencer
        current = CURRENT
        before = current.at
        try:
            if sequencer is not None and sequencer.serving != number:
                sequencer.wait_for(number)
            try:
                if plan.lifetime.released:
                    answer = self._answer(pb.decode_request(frame), None, deadline)
                    return pb.encode_reply_chunks(answer)
                if deadline:
                    late = time.monotonic() - deadline
                    if late >= 0:
                        return _error_chunks(frame, expired_failure(late))
                    current.at = deadline
                try:
                    value = plan.run(args, kwargs)
                except EXPECTED as exc:
                    return _error_chunks(frame, as_failure(exc))
                finally:
                    current.at = before
                if deadline and (late := time.monotonic() - deadline) > 0:
                    return _error_chunks(frame, late_failure(late))
                try:
                    data = plan.codec.encode_pieces(value)
                except Exception as exc:  # CodecError, or what a result's own methods raised
                    return _error_chunks(frame, encode_failure(exc))
                return pb.value_reply_chunks(frame[:id_end], data)
            finally:
                if sequencer is not None:
                    sequencer.done()
        except BaseException as exc:  # one reply per request, whatever happened
            return _error_chunks(frame, internal_failure(exc))

    def _learn(self, frame: bytes, req: pb.Request) -> None:
        """Make a plan for ``req``, which has just succeeded, if its frame is in the layout
        every encoder writes (so that its key names the call alone: ``split_call``).
        A frame longer than :data:`MAX_PLANNED_BYTES` is never looked up, so it teaches
        nothing: splitting and re-encoding it would copy its (large) arguments twice; nor
        does an operation that gets no plans (a release, a describe)."""
        if len(frame) > MAX_PLANNED_BYTES or type(req.op) not in self._planned:
            return
        split = split_call(frame)
        op = req.op
        if split is None or op is None:
            return
        session = req.session or DEFAULT_SESSION
        # What the plan is worked out from, read first: a release from here on voids it.
        handle = op.handle if isinstance(op, (pb.CallMethod, pb.GetAttribute)) else 0
        try:
            lifetime = (
                self.registry.lifetime(handle, session)
                if handle
                else self.registry.session_lifetime(session)
            )
            run = self.operations.plan(req)
            sequencer = (
                self.registry.sequencer(op.handle, session)
                if isinstance(op, pb.CallMethod) and self._takes_turn(op, session)
                else None
            )
        except EXPECTED:
            return  # released since
        if run is None or pb.encode_request(req) != frame:
            return  # not an operation with plans, or not its canonical bytes
        codec = self.operations.codec(session)
        plan = CallPlan(run, sequencer, codec, lifetime, req.session, type(op), handle)
        self.plans.learn(split[1], plan)

    def _released(self, handles: list[int] | None, session: str) -> None:
        """Drop the plans of released ``handles``, or of all ``session`` (None)."""
        if handles is None:
            self.plans.forget_if(lambda plan: (plan.session or DEFAULT_SESSION) == session)
        else:
            self.plans.forget(handles)


def _error_chunks(frame: bytes, failure: Failure) -> list[bytes | memoryview]:
    """The error reply to the request in ``frame`` (a planned one: its id is readable)."""
    return pb.encode_reply_chunks(error_reply(pb.peek_request_id(frame), failure))


def _why(exc: BaseException) -> str:
    """An exception as a short reason: its message, or its type when it has none."""
    return str(exc) or type(exc).__name__
