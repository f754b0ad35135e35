"""The eight operations of a Request, run against an export table and a handle registry.

This is what a request *does*, once it is decoded and its turn has come: resolve the
handle (``registry``), check the export table (``exports``) and the arguments
(``arguments``), run the call, encode the result (``codec``). Every failure becomes an
``Error`` reply with a category (docs/protocol.md); none stops the worker. When and in
which order requests get here, and which of them skip decoding, is the dispatcher's
business (``dispatcher.py``).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

from bridge_py import deadline
from bridge_py.worker import envelope as pb
from bridge_py.worker.arguments import BadArguments, accepts_no_arguments, checker
from bridge_py.worker.call_plans import Run
from bridge_py.worker.codec import Codec, CodecError, RefValue
from bridge_py.worker.exports import ExportTable, NotExported
from bridge_py.worker.registry import HandleNotFound, HandleRegistry, SessionResolver
from bridge_py.worker.schema import Category

DEFAULT_SESSION = "default"
_MAX_CACHED_CODECS = 1024


class Failure(Exception):
    """Carries an error reply's category (one of proto/error_categories.txt's, checked by
    the type) and message up from wherever it was detected."""

    def __init__(self, category: Category, message: str, exc: BaseException | None = None) -> None:
        super().__init__(message)
        self.category = category
        self.python_type = type(exc).__name__ if exc is not None else ""
        self.tb = (
            "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            if exc is not None and category in ("python", "timeout")
            else ""
        )


class Operations:
    """Runs decoded requests; one codec per session and the wire name of each exported
    method, worked out once. ``on_release`` is called after every release, with the
    handles released (None for a whole session) and the session, so that whatever holds
    objects on the side (call plans) lets them go."""

    def __init__(
        self,
        exports: ExportTable,
        registry: HandleRegistry,
        on_release: Callable[[list[int] | None, str], None] = lambda handles, session: None,
    ) -> None:
        self.exports = exports
        self.registry = registry
        self._on_release = on_release
        # One codec per session (it holds no per-call state): built once, not per call.
        self._codecs: dict[str, Codec] = {}
        # (class, method name) -> "Class.method", for exported methods met so far.
        self._methods: dict[tuple[type, str], str] = {}
        # The operations with plans: what makes the call (see ``plan``) ...
        self._calls: dict[type, Callable[[Any, str, Codec], Run]] = {
            pb.CreateInstance: self._construction,
            pb.CallMethod: self._method_call,
            pb.CallFunction: self._function_call,
            pb.GetAttribute: self._attribute_read,
            pb.Ping: self._ping,
        }
        self.planned = frozenset(self._calls)
        """The operations that get plans (see :meth:`plan`)."""
        # ... and every operation, run: those with plans make their call and make it.
        self._ops: dict[type, Callable[[Any, str, Codec], Any]] = {
            **{kind: _made_and_run(make) for kind, make in self._calls.items()},
            pb.ReleaseHandles: self._release,
            pb.ReleaseSession: self._release_session,
            pb.Describe: self._describe,
        }

    def codec(self, session: str) -> Codec:
        """The value codec of ``session`` (refs resolve to, and register under, it)."""
        codec = self._codecs.get(session)
        if codec is None:
            if len(self._codecs) >= _MAX_CACHED_CODECS:
                self._codecs.clear()  # sessions come and go: keep the cache bounded
            codec = Codec(SessionResolver(self.registry, session, self.exports.class_name))
            self._codecs[session] = codec
        return codec

    def reply(self, req: pb.Request) -> pb.Reply:
        """Run ``req`` now (its turn, if it takes one, is the caller's to hold); failures
        are error replies. Raises only on a bug of ours."""
        op = req.op
        session = req.session or DEFAULT_SESSION
        try:
            run = self._ops.get(type(op))
            if run is None:
                raise Failure("protocol", "request has no operation")
            codec = self.codec(session)
            value = run(op, session, codec)
            at = deadline.current()
            if at and (late := time.monotonic() - at) > 0:
                raise late_failure(late)
            return _value_reply(req.id, codec, value)
        except EXPECTED as exc:
            return error_reply(req.id, as_failure(exc))

    def plan(self, req: pb.Request) -> Run | None:
        """How to run requests that name what ``req`` names (``call_plans``): the very
        call :meth:`reply` makes of ``req``, a function of the argument bytes (args and
        kwargs; a ping's payload). None for the operations that get no plan. ``req`` has
        just succeeded; raises what resolving it raises should that no longer hold."""
        make = self._calls.get(type(req.op))
        if make is None:
            return None
        session = req.session or DEFAULT_SESSION
        return make(req.op, session, self.codec(session))

    # -- the calls of the operations with plans: all that does not depend on the
    # -- argument bytes worked out (the object, the callee, its check, the names) ---

    def _construction(self, op: pb.CreateInstance, session: str, codec: Codec) -> Run:
        construct = _caller(self.exports.constructor(op.class_name), op.class_name, codec)
        class_name, register = self.exports.class_name, self.registry.register

        def run(args: bytes, kwargs: bytes) -> RefValue:
            obj = construct(args, kwargs)
            name = class_name(type(obj))
            return RefValue(register(obj, session, name), name)

        return run

    def _method_call(self, op: pb.CallMethod, session: str, codec: Codec) -> Run:
        obj = self.registry.get(op.handle, session)
        name = self._methods.get((type(obj), op.method)) or self._method(obj, op.method)
        return _caller(getattr(obj, op.method), name, codec)

    def _method(self, obj: Any, name: str) -> str:
        """Look up an exported method (raises NotExported); its name in errors
        ("Class.method"), remembered for the class."""
        self.exports.method(obj, name)
        full = f"{self.exports.class_name(type(obj))}.{name}"
        self._methods[(type(obj), name)] = full
        return full

    def _function_call(self, op: pb.CallFunction, session: str, codec: Codec) -> Run:
        return _caller(self.exports.function(op.function), op.function, codec)

    def _attribute_read(self, op: pb.GetAttribute, session: str, codec: Codec) -> Run:
        obj = self.registry.get(op.handle, session)
        name = op.name
        self.exports.check_attribute(obj, name)  # (the table does not change once built)
        return lambda _args, _kwargs: getattr(obj, name)

    def _ping(self, op: pb.Ping, session: str, codec: Codec) -> Run:
        decode = codec.decode
        return lambda payload, _: _decode(decode, payload, "ping payload") if payload else None

    # -- the other operations ---------------------------------------------------------

    def _release(self, op: pb.ReleaseHandles, session: str, codec: Codec) -> int:
        handles = list(op.handles)
        freed = self.registry.release(handles, session)
        self._on_release(handles, session)
        return freed

    def _release_session(self, op: pb.ReleaseSession, session: str, codec: Codec) -> int:
        self._codecs.pop(session, None)
        freed = self.registry.release_session(session)
        self._on_release(None, session)
        return freed

    def _describe(self, op: pb.Describe, session: str, codec: Codec) -> dict[str, Any]:
        return self.exports.describe()


EXPECTED = (Failure, HandleNotFound, NotExported)
"""What an operation raises when it fails in a way its caller is told about."""


def _made_and_run(make: Callable[[Any, str, Codec], Run]) -> Callable[[Any, str, Codec], Any]:
    """The full way of an operation with a plan: make its call (``make``) and make it with
    the operation's own argument bytes, as a plan is run with the request's."""

    def run(op: Any, session: str, codec: Codec) -> Any:
        if type(op) is pb.Ping:
            return make(op, session, codec)(op.payload, b"")
        return make(op, session, codec)(getattr(op, "args", b""), getattr(op, "kwargs", b""))

    return run


def as_failure(exc: Failure | HandleNotFound | NotExported) -> Failure:
    """The failure an exception of :data:`EXPECTED` answers."""
    if isinstance(exc, HandleNotFound):
        return Failure("not_found", str(exc))
    if isinstance(exc, NotExported):
        return Failure("not_exported", str(exc))
    return exc


def _caller(fn: Callable[..., Any], name: str, codec: Codec) -> Run:
    """The call of ``fn`` (``name`` in errors) with arguments decoded by ``codec``: decode
    them, check them against ``fn``'s signature (``arguments.checker``), call. A call
    without argument bytes to a function that takes none is just the call."""
    check = checker(fn, name)
    decode = codec.decode
    bare = accepts_no_arguments(fn)

    def call(args: bytes, kwargs: bytes) -> Any:
        if args or kwargs or not bare:
            what = "args"
            try:
                pos = decode(args) if args else []
                what = "kwargs"
                kw = decode(kwargs) if kwargs else {}
            except Exception as exc:
                raise _decode_failure(exc, what) from None
            if type(pos) is not list:
                raise Failure("bad_args", f"args must be a msgpack array, got {type(pos).__name__}")
            if type(kw) is not dict:  # its keys are checked by ``check``
                raise Failure("bad_args", "kwargs must be a msgpack map with string keys")
            try:
                pos, kw = check(pos, kw)
            except BadArguments as exc:
                raise Failure("bad_args", str(exc)) from None
            try:
                return fn(*pos, **kw)
            except BaseException as exc:  # SystemExit too: a call never ends the worker
                raise python_failure(exc) from exc
        try:
            return fn()
        except BaseException as exc:  # SystemExit too: a call never ends the worker
            raise python_failure(exc) from exc

    return call


def _decode(decode: Callable[[bytes], Any], data: bytes, what: str) -> Any:
    """``decode(data)``, its failures as ``Failure``s (``what`` names the data)."""
    try:
        return decode(data)
    except Exception as exc:
        raise _decode_failure(exc, what) from None


def _decode_failure(exc: Exception, what: str) -> Failure:
    """What decoding ``what`` (``"args"``...) that raised ``exc`` answers."""
    if isinstance(exc, HandleNotFound):
        return Failure("not_found", str(exc))
    if isinstance(exc, CodecError):
        return Failure("bad_args", f"cannot decode {what}: {exc}")
    # The codec turns every error into CodecError: a bug.
    return Failure("bad_args", f"cannot decode {what}: {type(exc).__name__}: {exc}")


def _value_reply(request_id: int, codec: Codec, value: Any) -> pb.Reply:
    try:
        data = codec.encode_pieces(value)
    except Exception as exc:  # CodecError, or what a result's own methods raised
        raise encode_failure(exc) from None
    return pb.Reply(request_id, data)


def python_failure(exc: BaseException) -> Failure:
    """What an exported call that raised ``exc`` answers: a ``python`` error; or, for a
    TimeoutError raised once the call's deadline has passed (a wait that gave up at the
    deadline, see :mod:`bridge_py.deadline`), a ``timeout`` error."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, TimeoutError):
        left = deadline.remaining()
        if left is not None and left <= 0:
            return Failure("timeout", f"{message} (at the caller's deadline)", exc)
    return Failure("python", message, exc)


def expired_failure(late: float) -> Failure:
    """What a request answers when its deadline had passed before its turn came: a
    ``timeout`` error (the call was not run)."""
    return Failure(
        "timeout",
        f"not run: the caller's deadline had passed {late * 1000:.0f} ms before its turn came",
    )


def late_failure(late: float) -> Failure:
    """What a call answers that returned after its deadline: a ``timeout`` error, and its
    result dropped, not encoded: the caller has stopped waiting, and an object in it
    would be held by a handle nobody has (the gRPC transport drops such results too)."""
    return Failure(
        "timeout",
        f"the call returned {late * 1000:.0f} ms after the caller's deadline; its result "
        "was dropped",
    )


def encode_failure(exc: BaseException) -> Failure:
    """What a result that cannot be encoded answers: an ``encode`` error."""
    return Failure("encode", f"the result cannot cross the bridge: {exc}")


def internal_failure(exc: BaseException) -> Failure:
    """What a bug of ours answers (a ``python`` error naming it), so the caller still hears."""
    return Failure("python", f"internal error: {type(exc).__name__}: {exc}", exc)


def error_reply(request_id: int, failure: Failure) -> pb.Reply:
    """The error reply for ``failure``."""
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
