"""The dispatcher: one Request in, one Reply out, whatever the transport.

Both transports (the stdin/stdout port and gRPC) hand decoded requests here, so
there is one code path for resolving handles, checking the export table, checking
arguments, running the call and encoding the result. Every failure becomes an
``Error`` reply with a category (docs/protocol.md); none stops the worker.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bridge_py.worker import envelope as pb
from bridge_py.worker.arguments import BadArguments, accepts_no_arguments, prepare_call
from bridge_py.worker.call_plans import CallPlan, CallPlans
from bridge_py.worker.codec import Codec, CodecError, RefValue
from bridge_py.worker.exports import ExportTable, NotExported
from bridge_py.worker.registry import HandleNotFound, HandleRegistry, SessionResolver
from bridge_py.worker.sequencer import Turn

DEFAULT_SESSION = "default"
_MAX_CACHED_CODECS = 1024


class _Failure(Exception):
    """Carries an error reply up from wherever it was detected."""

    def __init__(self, category: str, message: str, exc: BaseException | None = None) -> None:
        super().__init__(message)
        self.category = category
        self.python_type = type(exc).__name__ if exc is not None else ""
        self.tb = (
            "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            if exc is not None and category == "python"
            else ""
        )


@dataclass(frozen=True, slots=True)
class _Method:
    """What the dispatcher needs to call one exported method, worked out once per class."""

    name: str  # "Class.method", for error messages
    bare: bool  # may be called with no arguments, so a call without any needs no checks


class Dispatcher:
    """Runs requests against an export table and a handle registry."""

    def __init__(self, exports: ExportTable, registry: HandleRegistry | None = None) -> None:
        self.exports = exports
        self.registry = registry if registry is not None else HandleRegistry()
        # One codec per session (it holds no per-call state): built once, not per call.
        self._codecs: dict[str, Codec] = {}
        # (class, method name) -> _Method, for exported methods met so far.
        self._methods: dict[tuple[type, str], _Method] = {}
        # Calls without arguments seen before, by their bytes (see call_plans).
        self.plans = CallPlans()
        self._ops: dict[type, Callable[[Any, str, Codec], Any]] = {
            pb.CallMethod: self._call_method,
            pb.CreateInstance: self._create,
            pb.CallFunction: self._call_function,
            pb.GetAttribute: self._get_attribute,
            pb.ReleaseHandles: self._release,
            pb.ReleaseSession: self._release_session,
            pb.Describe: self._describe,
            pb.Ping: self._ping,
        }

    def _codec(self, session: str) -> Codec:
        codec = self._codecs.get(session)
        if codec is None:
            if len(self._codecs) >= _MAX_CACHED_CODECS:
                self._codecs.clear()  # sessions come and go: keep the cache bounded
            codec = Codec(SessionResolver(self.registry, session, self.exports.class_name))
            self._codecs[session] = codec
        return codec

    def reserve(self, req: pb.Request) -> Turn | None:
        """Take the request's place in line when it is a method call on a live handle.

        Transports call this as they read requests, so calls on one object run in the
        order they arrived even when threads pick them up out of order. The turn must
        then be passed to :meth:`dispatch`, which always uses it up.
        """
        op = req.op
        if type(op) is not pb.CallMethod:
            return None
        try:
            return self.registry.turn(op.handle, req.session or DEFAULT_SESSION)
        except HandleNotFound:
            return None  # dispatch reports it

    def dispatch(self, req: pb.Request, turn: Turn | None = None) -> pb.Reply:
        """Run one request; always returns a Reply (errors included), never raises.

        A large tensor result is left in pieces (see ``Codec.encode_pieces``); use
        ``envelope.encode_reply`` or ``encode_reply_chunks`` to write the reply.
        """
        try:
            if turn is None and type(req.op) is pb.CallMethod:
                turn = self.reserve(req)
            if turn is None:
                return self._run(req)
            with turn:
                return self._run(req)
        except BaseException as exc:  # one reply per request, whatever happened
            # Only a bug of ours gets here (the call's own exceptions are caught in _run).
            failure = _Failure("python", f"internal error: {type(exc).__name__}: {exc}", exc)
            return _error_reply(req.id, failure)

    def _run(self, req: pb.Request) -> pb.Reply:
        """:meth:`dispatch`'s work, in the request's turn; failures as error replies."""
        op = req.op
        session = req.session or DEFAULT_SESSION
        try:
            run = self._ops.get(type(op))
            if run is None:
                raise _Failure("protocol", "request has no operation")
            codec = self._codec(session)
            return _value_reply(req.id, codec, run(op, session, codec))
        except _Failure as failure:
            return _error_reply(req.id, failure)
        except HandleNotFound as exc:
            return _error_reply(req.id, _Failure("not_found", str(exc)))
        except NotExported as exc:
            return _error_reply(req.id, _Failure("not_exported", str(exc)))

    def dispatch_frame(
        self, frame: bytes | bytearray | memoryview, req: pb.Request, turn: Turn | None = None
    ) -> pb.Reply:
        """:meth:`dispatch` of ``req``, decoded from ``frame``. A call without arguments
        that succeeds leaves a plan, so that the same call next time is run by
        :meth:`run_planned` without being decoded again (see ``call_plans``)."""
        reply = self.dispatch(req, turn)
        if reply.error is None and type(req.op) is pb.CallMethod:
            self._learn(frame, req)
        return reply

    def run_planned(self, frame: bytes, id_end: int, plan: CallPlan) -> list[bytes | memoryview]:
        """Run the request ``self.plans.find(frame)`` found (``id_end``, ``plan``) and
        return the reply's bytes. The call takes its turn from ``plan.sequencer`` now, so
        a transport runs it as soon as it reads it. The reply is the one :meth:`dispatch`
        would give; if a release has made the plan stale, dispatch gives it."""
        try:
            value, reply = plan.sequencer.run(self._run_plan, frame, plan)
            if reply is not None:
                return reply
            data = plan.codec.encode_pieces(value)
        except BaseException as exc:  # one reply per request, whatever happened
            if isinstance(exc, CodecError):
                failure = _Failure("encode", f"the result cannot cross the bridge: {exc}")
            else:
                failure = _Failure("python", f"internal error: {type(exc).__name__}: {exc}", exc)
            return pb.encode_reply_chunks(_error_reply(pb.peek_request_id(frame), failure))
        return pb.value_reply_chunks(frame[:id_end], data)

    def _run_plan(
        self, frame: bytes, plan: CallPlan
    ) -> tuple[Any, list[bytes | memoryview] | None]:
        """The planned call, in its turn: ``(result, None)``, or ``(None, reply)`` when it
        failed or the plan has gone stale."""
        if plan.epoch != self.registry.epoch:
            return None, pb.encode_reply_chunks(self.dispatch(pb.decode_request(frame), _HELD))
        try:
            return getattr(plan.obj, plan.method)(), None
        except BaseException as exc:  # SystemExit too: a call never ends the worker
            failure = _Failure("python", f"{type(exc).__name__}: {exc}", exc)
            return None, pb.encode_reply_chunks(_error_reply(pb.peek_request_id(frame), failure))

    def _learn(self, frame: bytes | bytearray | memoryview, req: pb.Request) -> None:
        """Make a plan for ``req`` if it is a call without arguments in the canonical
        layout (the id first and once, so the rest of the frame names the call alone)."""
        op = req.op
        if type(op) is not pb.CallMethod or op.args or op.kwargs or type(frame) is not bytes:
            return
        epoch = self.registry.epoch  # read first: a release from here on voids the plan
        session = req.session or DEFAULT_SESSION
        try:
            obj = self.registry.get(op.handle, session)
            sequencer = self.registry.sequencer(op.handle, session)
        except HandleNotFound:
            return  # released since
        target = self._methods.get((type(obj), op.method))
        if target is None or not target.bare or pb.decode_canonical_call(frame) != req:
            return
        self.plans.learn(frame, CallPlan(obj, op.method, sequencer, self._codec(session), epoch))

    # -- operations -----------------------------------------------------------------

    def _call_method(self, op: pb.CallMethod, session: str, codec: Codec) -> Any:
        obj = self.registry.get(op.handle, session)
        target = self._methods.get((type(obj), op.method)) or self._method(obj, op.method)
        method = getattr(obj, op.method)
        if op.args or op.kwargs or not target.bare:
            args, kwargs = self._arguments(codec, op.args, op.kwargs)
            return self._call(method, target.name, args, kwargs)
        try:
            return method()
        except BaseException as exc:  # SystemExit too: a call never ends the worker
            raise _Failure("python", f"{type(exc).__name__}: {exc}", exc) from exc

    def _method(self, obj: Any, name: str) -> _Method:
        """Look up an exported method (raises NotExported) and remember what it needs."""
        method = self.exports.method(obj, name)
        target = _Method(
            name=f"{self.exports.class_name(type(obj))}.{name}",
            bare=accepts_no_arguments(method),
        )
        self._methods[(type(obj), name)] = target
        return target

    def _create(self, op: pb.CreateInstance, session: str, codec: Codec) -> RefValue:
        cls = self.exports.constructor(op.class_name)
        args, kwargs = self._arguments(codec, op.args, op.kwargs)
        obj = self._call(cls, op.class_name, args, kwargs)
        class_name = self.exports.class_name(type(obj))
        return RefValue(self.registry.register(obj, session, class_name), class_name)

    def _call_function(self, op: pb.CallFunction, session: str, codec: Codec) -> Any:
        fn = self.exports.function(op.function)
        args, kwargs = self._arguments(codec, op.args, op.kwargs)
        return self._call(fn, op.function, args, kwargs)

    def _get_attribute(self, op: pb.GetAttribute, session: str, codec: Codec) -> Any:
        return self.exports.attribute(self.registry.get(op.handle, session), op.name)

    def _release(self, op: pb.ReleaseHandles, session: str, codec: Codec) -> int:
        freed = self.registry.release(list(op.handles), session)
        self.plans.clear()  # they hold their objects: let the released ones go
        return freed

    def _release_session(self, op: pb.ReleaseSession, session: str, codec: Codec) -> int:
        self._codecs.pop(session, None)
        freed = self.registry.release_session(session)
        self.plans.clear()
        return freed

    def _describe(self, op: pb.Describe, session: str, codec: Codec) -> dict[str, Any]:
        return self.exports.describe()

    def _ping(self, op: pb.Ping, session: str, codec: Codec) -> Any:
        return self._decode(codec, op.payload, "ping payload") if op.payload else None

    # -- arguments and calls --------------------------------------------------------

    def _arguments(
        self, codec: Codec, args: bytes, kwargs: bytes
    ) -> tuple[list[Any], dict[str, Any]]:
        pos = self._decode(codec, args, "args") if args else []
        kw = self._decode(codec, kwargs, "kwargs") if kwargs else {}
        if type(pos) is not list:
            raise _Failure("bad_args", f"args must be a msgpack array, got {type(pos).__name__}")
        if type(kw) is not dict or not all(isinstance(k, str) for k in kw):
            raise _Failure("bad_args", "kwargs must be a msgpack map with string keys")
        return pos, kw

    @staticmethod
    def _decode(codec: Codec, data: bytes, what: str) -> Any:
        try:
            return codec.decode(data)
        except HandleNotFound as exc:
            raise _Failure("not_found", str(exc)) from None
        except CodecError as exc:
            raise _Failure("bad_args", f"cannot decode {what}: {exc}") from None
        except Exception as exc:  # the codec turns every error into CodecError: a bug
            why = f"{type(exc).__name__}: {exc}"
            raise _Failure("bad_args", f"cannot decode {what}: {why}") from None

    @staticmethod
    def _call(fn: Callable[..., Any], name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        try:
            args, kwargs = prepare_call(fn, name, args, kwargs)
        except BadArguments as exc:
            raise _Failure("bad_args", str(exc)) from None
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:  # SystemExit too: a call never ends the worker
            raise _Failure("python", f"{type(exc).__name__}: {exc}", exc) from exc


class _HeldTurn:
    """Stands for a turn the caller has already entered: ``dispatch`` enters nothing."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


_HELD: Any = _HeldTurn()


def _value_reply(request_id: int, codec: Codec, value: Any) -> pb.Reply:
    try:
        data = codec.encode_pieces(value)
    except Exception as exc:  # CodecError, or what a result's own methods raised
        raise _Failure("encode", f"the result cannot cross the bridge: {exc}") from None
    return pb.Reply(request_id, data)


def _error_reply(request_id: int, failure: _Failure) -> pb.Reply:
    return pb.Reply(
        id=request_id,
        error=pb.Error(
            category=failure.category,
            message=str(failure),
            python_type=failure.python_type,
            traceback=failure.tb,
        ),
    )


def protocol_error(request_id: int, message: str) -> pb.Reply:
    """The reply to bytes that are not a valid Request."""
    return pb.Reply(id=request_id, error=pb.Error(category="protocol", message=message))
