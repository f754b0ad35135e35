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

DEFAULT_SESSION = "default"

# Operations that never block and are cheap: a transport may run them inline.
INLINE_OPS = (pb.Ping, pb.Describe, pb.ReleaseHandles, pb.ReleaseSession, pb.GetAttribute)


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

    def dispatch(self, req: pb.Request) -> pb.Reply:
        """Run one request; always returns a Reply (errors included)."""
        session = req.session or DEFAULT_SESSION
        codec = Codec(SessionResolver(self.registry, session, self.exports.class_name))
        try:
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
        if isinstance(op, pb.CallMethod):
            obj = self._get(op.handle, session)
            method = self._lookup(lambda: self.exports.method(obj, op.method))
            name = f"{self.exports.class_name(type(obj))}.{op.method}"
            args, kwargs = self._arguments(codec, op.args, op.kwargs)
            lock = self._lookup(lambda: self.registry.call_lock(op.handle, session))
            with lock:
                return self._call(method, name, args, kwargs)
        if isinstance(op, pb.CreateInstance):
            cls = self._lookup(lambda: self.exports.constructor(op.class_name))
            args, kwargs = self._arguments(codec, op.args, op.kwargs)
            obj = self._call(cls, op.class_name, args, kwargs)
            class_name = self.exports.class_name(type(obj))
            return RefValue(self.registry.register(obj, session, class_name), class_name)
        if isinstance(op, pb.CallFunction):
            fn = self._lookup(lambda: self.exports.function(op.function))
            args, kwargs = self._arguments(codec, op.args, op.kwargs)
            return self._call(fn, op.function, args, kwargs)
        if isinstance(op, pb.GetAttribute):
            obj = self._get(op.handle, session)
            return self._lookup(lambda: self.exports.attribute(obj, op.name))
        if isinstance(op, pb.ReleaseHandles):
            return self.registry.release(list(op.handles), session)
        if isinstance(op, pb.ReleaseSession):
            return self.registry.release_session(session)
        if isinstance(op, pb.Describe):
            return self.exports.describe()
        if isinstance(op, pb.Ping):
            if not op.payload:
                return None
            return self._decode(codec, op.payload, "ping payload")
        raise _Failure("protocol", "request has no operation")

    def _get(self, handle: int, session: str) -> Any:
        return self._lookup(lambda: self.registry.get(handle, session))

    @staticmethod
    def _lookup(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except HandleNotFound as exc:
            raise _Failure("not_found", str(exc)) from None
        except NotExported as exc:
            raise _Failure("not_exported", str(exc)) from None

    def _arguments(
        self, codec: Codec, args: bytes, kwargs: bytes
    ) -> tuple[list[Any], dict[str, Any]]:
        pos = self._decode(codec, args, "args") if args else []
        kw = self._decode(codec, kwargs, "kwargs") if kwargs else {}
        if not isinstance(pos, list):
            raise _Failure("bad_args", f"args must be a msgpack array, got {type(pos).__name__}")
        if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw):
            raise _Failure("bad_args", "kwargs must be a msgpack map with string keys")
        return pos, {str(k): v for k, v in kw.items()}

    def _decode(self, codec: Codec, data: bytes, what: str) -> Any:
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
