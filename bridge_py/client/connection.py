"""A gRPC connection to one worker: handle-based operations, as the port offers them."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import grpc

from bridge_py.client.proxy import RemoteObject
from bridge_py.distributed import errors
from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import Codec, RefValue
from bridge_py.worker.transports.grpc import OPEN_SESSION, SERVICE, SESSION_IDLE_KEY, TOKEN_ENV
from bridge_py.worker.transports.grpc_credentials import read_token_file

_RPC = {
    pb.CreateInstance: "Create",
    pb.CallMethod: "Call",
    pb.CallFunction: "CallFunction",
    pb.GetAttribute: "GetAttribute",
    pb.ReleaseHandles: "Release",
    pb.ReleaseSession: "ReleaseSession",
    pb.Describe: "Describe",
    pb.Ping: "Ping",
}


class BridgeError(RuntimeError):
    """A failed call: the worker's error reply, or a gRPC status, as data.

    ``category`` is one of docs/protocol.md's categories, or ``"transport"`` for gRPC
    failures (then ``code`` is the grpc.StatusCode).
    """

    def __init__(
        self,
        category: str,
        message: str,
        python_type: str = "",
        traceback: str = "",
        code: grpc.StatusCode | None = None,
    ) -> None:
        super().__init__(f"[{category}] {message}")
        self.category = category
        self.message = message
        self.python_type = python_type
        self.traceback = traceback
        self.code = code


# The classes a worker's error reply may name that a caller catches by class: the package's
# hierarchy and Python's argument errors (docs/guide-python.md, "Errors").
_CATCHABLE: dict[str, type[BaseException]] = {
    **{name: getattr(errors, name) for name in errors.__all__ if name[0].isupper()},
    "ValueError": ValueError,
    "TypeError": TypeError,
}
_remote_classes: dict[str, type[BridgeError]] = {}


def remote_error(
    category: str, message: str, python_type: str = "", traceback: str = ""
) -> BridgeError:
    """The BridgeError for a worker's error reply; where ``python_type`` is one of the
    classes code catches (``GroupTimeout``, ``BarrierFailure``, ``ValueError`` ...), one
    that is also an instance of that class, so that ``except GroupTimeout`` works the same
    on a remote worker as in this process."""
    base = _CATCHABLE.get(python_type)
    if base is None:
        return BridgeError(category, message, python_type, traceback)
    cls = _remote_classes.get(python_type)
    if cls is None:
        doc = f"A remote {python_type}: a BridgeError and a {base.__name__}."
        cls = type(python_type, (BridgeError, base), {"__doc__": doc, "__str__": _str})
        _remote_classes[python_type] = cls
    return cls(category, message, python_type, traceback)


def _str(self: BridgeError) -> str:
    return f"[{self.category}] {self.message}"


class _ProxyCodec:
    """The codec's ref hooks on the client side: refs <-> proxies of this client."""

    def __init__(self, client: Client) -> None:
        self._client = weakref.ref(client)

    def resolve(self, ref: RefValue) -> Any:
        client = self._client()
        if client is None:
            raise BridgeError("transport", "the client is closed")
        return client._proxy(ref.handle, ref.class_name)

    def register(self, obj: Any) -> tuple[int, str]:
        if isinstance(obj, RemoteObject):
            return obj._handle, obj._class_name
        raise TypeError(f"a {type(obj).__name__} cannot be sent to a remote worker")


class Client:
    """One channel to one worker, in one session (handles are the session's).

    The session is issued by the worker (``OpenSession``) when the client is made,
    bound to the client's credential, and released whole when it closes (or, never
    closed, when it is collected or its program exits; a killed client's session
    expires after the worker's idle time, :attr:`idle`, for which a live client pings
    while it sends nothing else). To share
    it, pass ``client.session`` as ``session=`` to another client with the same
    credential (the same token, or the same socket): that client checks it with a
    ping, uses it without opening one, and on close releases only the handles of its
    own proxies.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        session: str | None = None,
        timeout: float | None = 300.0,
        max_message_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        if session is not None and not session:
            raise ValueError(
                "session= must be an id the worker issued (another client's .session), "
                "not empty: the default session is not served over gRPC"
            )
        self.target = target
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        self._stubs = {
            name: self._channel.unary_unary(
                f"/{SERVICE}/{name}",
                request_serializer=pb.encode_request,
                response_deserializer=pb.decode_reply,
            )
            for name in (*_RPC.values(), OPEN_SESSION)
        }
        self._ids = itertools.count(1)
        self._codec = Codec(_ProxyCodec(self))
        self._proxies: weakref.WeakValueDictionary[int, RemoteObject] = (
            weakref.WeakValueDictionary()
        )
        self._lock = threading.Lock()
        self._members: dict[str, tuple[set[str], set[str]]] | None = None
        self._closed = False
        # A session of our own is released whole on close; a given one may be shared.
        self._own_session = session is None
        self.session = ""
        # Seconds without a request after which the worker lets the session expire (0:
        # never), as the worker says; the client pings before, while it is idle.
        self.idle = 0.0
        self._last = time.monotonic()  # when the last request was sent
        try:
            if session is None:
                self.session = self._open_session()
            else:
                self.session = session
                request = pb.Request(next(self._ids), session, pb.Ping())
                self._learn_idle(self._send(_RPC[pb.Ping], request, with_trailers=True)[1])
        except BaseException:
            self._closed = True
            self._channel.close()
            raise
        self._stop = threading.Event()
        if self.idle:
            threading.Thread(
                target=_keep_alive,
                args=(weakref.ref(self), self._stop, self.idle / 3),
                name="bridge-client-keepalive",
                daemon=True,
            ).start()
        # A client that is collected, or still open when the interpreter exits, was
        # never closed: its session is released then (a session of its own), and its
        # channel closed, rather than held in the worker until the worker ends.
        self._abandoned = weakref.finalize(
            self,
            _release_abandoned,
            self._channel,
            self._stubs[_RPC[pb.ReleaseSession]] if self._own_session else None,
            self._metadata,
            self.session,
            self._stop,
        )

    # -- plumbing -------------------------------------------------------------------

    def _open_session(self) -> str:
        """Ask the worker for a session of our own (its id is random, 256 bits), and learn
        when it expires unused (:attr:`idle`)."""
        request = pb.Request(id=next(self._ids), op=pb.Ping())
        session, trailers = self._send(OPEN_SESSION, request, with_trailers=True)
        if not isinstance(session, str) or not session:
            raise BridgeError("protocol", f"{OPEN_SESSION} answered {session!r}, not a session")
        self._learn_idle(trailers)
        return session

    def _learn_idle(self, trailers: Any) -> None:
        """Take :attr:`idle` from the trailing metadata of OpenSession or Ping (a worker
        that does not say lets sessions live until released)."""
        for key, value in trailers:
            if key == SESSION_IDLE_KEY:
                with contextlib.suppress(ValueError):
                    self.idle = max(float(value), 0.0)

    def _request(self, op: pb.Operation, timeout: float | None = None) -> Any:
        if self._closed:
            raise BridgeError("transport", "the client is closed")
        wait = timeout if timeout is not None else self.timeout
        # The worker learns how long we wait, so a call we gave up on is not run late,
        # and its blocking waits give up with us (docs/protocol.md, deadline_ms).
        deadline_ms = math.ceil(wait * 1000) if wait is not None else 0
        request = pb.Request(next(self._ids), self.session, op, deadline_ms)
        return self._send(_RPC[type(op)], request, wait)

    def _send(
        self,
        rpc: str,
        request: pb.Request,
        timeout: float | None = None,
        *,
        with_trailers: bool = False,
    ) -> Any:
        """The value of ``request``'s reply (and, ``with_trailers``, the RPC's trailing
        metadata beside it), or BridgeError."""
        self._last = time.monotonic()
        stub = self._stubs[rpc]
        wait = timeout if timeout is not None else self.timeout
        try:
            if not with_trailers:
                return self._value(stub(request, timeout=wait, metadata=self._metadata))
            reply, call = stub.with_call(request, timeout=wait, metadata=self._metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            raise BridgeError("transport", f"{code.name}: {exc.details()}", code=code) from None
        return self._value(reply), call.trailing_metadata() or ()

    def _value(self, reply: pb.Reply) -> Any:
        if reply.error is not None:
            e = reply.error
            raise remote_error(e.category, e.message, e.python_type, e.traceback)
        value = reply.value
        if isinstance(value, list):  # only replies built in this process are in pieces
            value = b"".join(value)
        return self._codec.decode(value) if value else None

    def _encode(self, values: Any) -> bytes:
        return self._codec.encode(values) if values else b""

    def _proxy(self, handle: int, class_name: str = "") -> RemoteObject:
        """The proxy of ``handle``, holding one more of the worker's hand-outs of it."""
        with self._lock:
            proxy = self._proxies.get(handle)
            if proxy is None:
                proxy = RemoteObject(self, handle, class_name)
                self._proxies[handle] = proxy
            else:
                proxy._holds[0] += 1
            return proxy

    def _take_holds(self, proxies: Any) -> list[int]:
        """The handles of ``proxies``, each as many times as it is held, which this
        client no longer holds (a proxy released twice gives nothing the second time)."""
        with self._lock:
            handles = [p._handle for p in proxies for _ in range(p._holds[0])]
            for proxy in proxies:
                proxy._holds[0] = 0
        return handles

    def _members_of(self, class_name: str) -> tuple[set[str], set[str]]:
        """(methods, attributes) of an exported class, from the worker's describe."""
        if self._members is None:
            table = self.describe()
            self._members = {
                name: (set(entry["methods"]), set(entry["attributes"]))
                for name, entry in table["classes"].items()
            }
        return self._members.get(class_name, (set(), set()))

    # -- operations -----------------------------------------------------------------

    def attach(self, handle: int, class_name: str = "") -> RemoteObject:
        """A proxy for a handle this client's session already holds (made by another
        client of the session, over either transport). The proxy then owns it: it is
        released with the proxy or when this client closes."""
        return self._proxy(handle, class_name)

    def create(self, class_name: str, *args: Any, **kwargs: Any) -> Any:
        """Construct an exported class in the worker; returns a proxy."""
        op = pb.CreateInstance(class_name, self._encode(list(args)), self._encode(kwargs))
        return self._request(op)

    def call_function(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call an exported function or static method (``"Class.method"``)."""
        return self._request(pb.CallFunction(name, self._encode(list(args)), self._encode(kwargs)))

    def call_method(self, obj: RemoteObject, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call an exported method of a remote object (proxies do this for you)."""
        op = pb.CallMethod(obj._handle, method, self._encode(list(args)), self._encode(kwargs))
        return self._request(op)

    def get_attr(self, obj: RemoteObject, name: str) -> Any:
        """Read an exported attribute of a remote object."""
        return self._request(pb.GetAttribute(obj._handle, name))

    def release(self, *objs: RemoteObject) -> int:
        """Release remote objects now; returns how many objects the worker freed (an
        object that another proxy or client still holds is not freed)."""
        handles = self._take_holds(objs)
        return self._request(pb.ReleaseHandles(handles)) if handles else 0

    def describe(self) -> dict[str, Any]:
        """The worker's export table."""
        return self._request(pb.Describe())

    def ping(self, value: Any = None, timeout: float | None = None) -> Any:
        """Round-trip ``value`` through the worker (a health check)."""
        return self._request(pb.Ping(self._codec.encode(value)), timeout)

    def _release_handle(self, handle: int, holds: list[int]) -> None:
        """Best effort, for proxies being collected: never raises."""
        if self._closed or holds[0] <= 0:
            return
        with contextlib.suppress(Exception):
            self._request(pb.ReleaseHandles([handle] * holds[0]), timeout=5.0)

    def close(self) -> None:
        """Release this client's handles and close the channel.

        With a session of its own (the default) the whole session is released; with a
        given ``session=`` only the handles of this client's live proxies are, since
        others may share that session.
        """
        if self._closed:
            return
        self._abandoned.detach()
        self._stop.set()
        try:
            if self._own_session:
                self._request(pb.ReleaseSession(), timeout=5.0)
            else:
                handles = self._take_holds(list(self._proxies.values()))
                if handles:
                    self._request(pb.ReleaseHandles(handles), timeout=5.0)
        except BridgeError:
            pass
        finally:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _keep_alive(client_ref: weakref.ref[Client], stop: threading.Event, period: float) -> None:
    """Ping the worker every ``period`` seconds in which the client sent nothing, so that
    an idle client's session does not expire; until ``stop``, or the client is gone."""
    while not stop.wait(period):
        client = client_ref()
        if client is None:
            return
        if time.monotonic() - client._last >= period:
            with contextlib.suppress(BridgeError):
                client.ping()
        del client


def _release_abandoned(
    channel: grpc.Channel,
    release: Any,
    metadata: tuple[tuple[str, str], ...],
    session: str,
    stop: threading.Event,
) -> None:
    """What closing a client that was never closed can still do: release its own session
    (``release`` is the ReleaseSession stub, None for a given session), best effort and
    briefly, then close the channel. Holds no reference to the client."""
    stop.set()
    if release is not None:
        with contextlib.suppress(Exception):
            release(pb.Request(0, session, pb.ReleaseSession()), timeout=2.0, metadata=metadata)
    channel.close()


def connect(
    target: str, token: str | None = None, *, token_file: str | Path | None = None, **options: Any
) -> Client:
    """A client for the worker at ``target`` (``"host:port"`` or ``"unix:PATH"``).

    The token is ``token``, else the contents of ``token_file`` (e.g. the file a
    worker wrote a generated token to; it must be readable by its owner only), else
    ``$VLLM_BRIDGE_TOKEN``; a worker on a Unix socket needs none. Options:
    ``session`` (default: a new one issued by the worker; pass another client's
    ``.session`` to share it), ``timeout`` (seconds per call, default 300; sent with
    each request as its deadline, so the worker does not run a call after its caller
    gave up, and blocking waits inside it give up too), ``max_message_bytes``.
    """
    if token is None and token_file is not None:
        token = read_token_file(Path(token_file))
    return Client(target, token=token or os.environ.get(TOKEN_ENV), **options)


__all__ = ["BridgeError", "Client", "connect"]
