"""The dispatcher: one Request in, one Reply out, whatever the transport.

Both transports (the stdin/stdout port and gRPC) hand decoded requests here, so
there is one code path for resolving handles, checking the export table, checking
arguments, running the call and encoding the result. Every failure becomes an
``Error`` reply with a category (docs/protocol.md); none stops the worker.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from bridge_py.worker import envelope as pb
from bridge_py.worker.arguments import BadArguments, prepare_call
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


class Dispatcher:
    """Runs requests against an export table and a handle registry."""

    def __init__(self, exports: ExportTable, registry: HandleRegistry | None = None) -> None:
        self.exports = exports
        self.registry = registry if registry is not None else HandleRegistry()
        # One codec per session (it holds no per-call state): built once, not per call.
        self._codecs: dict[str, Codec] = {}

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
        if not isinstance(op, pb.CallMethod):
            return None
        try:
            return self.registry.turn(op.handle, req.session or DEFAULT_SESSION)
        except HandleNotFound:
            return None  # dispatch reports it

    def dispatch(self, req: pb.Request, turn: Turn | None = None) -> pb.Reply:
        """Run one request; always returns a Reply (errors included)."""
        if turn is None:
            turn = self.reserve(req)
        session = req.session or DEFAULT_SESSION
        codec = self._codec(session)
        try:
            if turn is not None:
                with turn:
                    value = self._run(req.op, session, codec)
            else:
                value = self._run(req.op, session, codec)
            try:
                data = codec.encode(value)
            except CodecError as exc:
                raise _Failure("encode", f"the result cannot cross the bridge: {exc}") from None
            return pb.Reply(id=req.id, value=data)
        except _Failure as failure:
            return pb.Reply(
                id=req.id,
                error=pb.Error(
                    category=failure.category,
                    message=str(failure),
                    python_type=failure.python_type,
                    traceback=failure.tb,
                ),
            )

    # -- operations -----------------------------------------------------------------

    def _run(self, op: pb.Operation | None, session: str, codec: Codec) -> Any:
        try:
            return self._operation(op, session, codec)
        except HandleNotFound as exc:
            raise _Failure("not_found", str(exc)) from None
        except NotExported as exc:
            raise _Failure("not_exported", str(exc)) from None

    def _operation(self, op: pb.Operation | None, session: str, codec: Codec) -> Any:
        exports = self.exports
        if isinstance(op, pb.CallMethod):
            obj = self.registry.get(op.handle, session)
            method = exports.method(obj, op.method)
            args, kwargs = self._arguments(codec, op.args, op.kwargs)
            return self._call(method, f"{exports.class_name(type(obj))}.{op.method}", args, kwargs)
        if isinstance(op, pb.CreateInstance):
            cls = exports.constructor(op.class_name)
            args, kwargs = self._arguments(codec, op.args, op.kwargs)
            obj = self._call(cls, op.class_name, args, kwargs)
            class_name = exports.class_name(type(obj))
            return RefValue(self.registry.register(obj, session, class_name), class_name)
        if isinstance(op, pb.CallFunction):
            fn = exports.function(op.function)
            args, kwargs = self._arguments(codec, op.args, op.kwargs)
            return self._call(fn, op.function, args, kwargs)
        if isinstance(op, pb.GetAttribute):
            return exports.attribute(self.registry.get(op.handle, session), op.name)
        if isinstance(op, pb.ReleaseHandles):
            return self.registry.release(list(op.handles), session)
        if isinstance(op, pb.ReleaseSession):
            self._codecs.pop(session, None)
            return self.registry.release_session(session)
        if isinstance(op, pb.Describe):
            return exports.describe()
        if isinstance(op, pb.Ping):
            if not op.payload:
                return None
            return self._decode(codec, op.payload, "ping payload")
        raise _Failure("protocol", "request has no operation")

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

    @staticmethod
    def _call(fn: Callable[..., Any], name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        try:
            args, kwargs = prepare_call(fn, name, args, kwargs)
        except BadArguments as exc:
            raise _Failure("bad_args", str(exc)) from None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise _Failure("python", f"{type(exc).__name__}: {exc}", exc) from exc


def protocol_error(request_id: int, message: str) -> pb.Reply:
    """The reply to bytes that are not a valid Request."""
    return pb.Reply(id=request_id, error=pb.Error(category="protocol", message=message))
