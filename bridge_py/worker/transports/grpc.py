"""The gRPC transport: ``BridgeService`` from proto/bridge.proto, over grpcio.

The same dispatcher, registry and export table as the port transport serve every
call, the same way: each RPC hands the request's bytes as they came to
``Dispatcher.admit`` and answers what ``Dispatcher.run`` returns, so calls get the
same call plans and the same order on one object as over the port. This module only
maps RPCs to requests, with three checks of its own:

* **credential**: on TCP every call must carry ``authorization: Bearer <token>``
  (compared in constant time); a call without it is refused from its metadata
  alone, before its body is read. On a Unix socket (``unix:PATH``, created 0600)
  the socket is the credential (``grpc_credentials.py``);
* **session and op**: a request must carry the op of its RPC and name a session this
  server issued to that credential (``OpenSession``, ``grpc_sessions.py``), so no
  client reaches another's handles. This is the gate the handler gives ``admit``: it
  sees what the dispatcher made of the bytes, before the call takes any turn. Sessions
  idle too long expire, and a thread of the server releases them;
* **limits**: message sizes both ways, concurrent RPCs, metadata size.

Generic method handlers that take and return bytes mean no generated stubs are needed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN
from bridge_py.worker.dispatcher import Dispatcher, protocol_error
from bridge_py.worker.transports.grpc_credentials import (
    TOKEN_ENV,
    CredentialError,
    check_private_socket,
    clear_socket_path,
    private_umask,
    unix_path,
)
from bridge_py.worker.transports.grpc_sessions import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_IDLE,
    SessionTable,
    TooManySessions,
)

__all__ = [
    "DEFAULT_MAX_CONCURRENT_RPCS",
    "DEFAULT_MAX_MESSAGE",
    "METHODS",
    "OPEN_SESSION",
    "SERVICE",
    "SESSION_IDLE_KEY",
    "TOKEN_ENV",
    "Serving",
    "serve_grpc",
    "split_address",
]

SERVICE = "bridge.BridgeService"
DEFAULT_MAX_MESSAGE = 256 * 1024 * 1024
# Every RPC in progress holds one thread (a barrier holds it while it waits); beyond
# this many, new calls get RESOURCE_EXHAUSTED at once instead of queueing.
DEFAULT_MAX_CONCURRENT_RPCS = 256
MAX_METADATA_BYTES = 16 * 1024
HANDSHAKE_TIMEOUT_MS = 5_000
"""How long a connection may take to start speaking HTTP/2 before the server closes it:
connections that never speak (22,000 of them once took every file descriptor of a worker,
and its own clients then got DEADLINE_EXCEEDED) go after this instead of 120 s."""
OPEN_SESSION = "OpenSession"
# Trailing metadata of OpenSession's and Ping's answers: seconds without a request after
# which the session expires ("0": never), so that a client can ping before.
SESSION_IDLE_KEY = "bridge-session-idle-s"

# RPC name -> the operation its Request must carry.
METHODS: dict[str, type[pb.Operation]] = {
    "Create": pb.CreateInstance,
    "Call": pb.CallMethod,
    "CallFunction": pb.CallFunction,
    "GetAttribute": pb.GetAttribute,
    "Release": pb.ReleaseHandles,
    "ReleaseSession": pb.ReleaseSession,
    "Describe": pb.Describe,
    "Ping": pb.Ping,
}


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT or unix:PATH, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _shown(session: str) -> str:
    """A client-chosen session string, cut short for an error message."""
    return repr(session if len(session) <= 80 else session[:77] + "...")


def _refuse_session(context: grpc.ServicerContext, session: str) -> NoReturn:
    if not session:
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"a Request over gRPC must name a session opened with {SERVICE}/{OPEN_SESSION}: "
            f"the empty (default) session is not served over gRPC",
        )
    context.abort(
        grpc.StatusCode.PERMISSION_DENIED,
        f"session {_shown(session)} was not opened on this server with this credential "
        f"(or was released): open one with {SERVICE}/{OPEN_SESSION}",
    )


def _wrong_op(
    context: grpc.ServicerContext,
    name: str,
    op_type: type[pb.Operation],
    got: pb.Operation | type[pb.Operation] | None,
) -> NoReturn:
    context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{SERVICE}/{name} needs a Request with op {pb.op_name(op_type)}, got {pb.op_name(got)}",
    )


def _handler(
    dispatcher: Dispatcher,
    sessions: SessionTable,
    credential: str,
    name: str,
    op_type: type[pb.Operation],
) -> Callable[[bytes, grpc.ServicerContext], bytes]:
    """The behaviour of one RPC: admit the request's bytes, with the op and the session
    checked before it is admitted, run it, answer its reply's bytes.

    Over gRPC releasing a session ends it: its id is no longer accepted from the moment
    the release is admitted, and every request of it that was admitted before (the
    release itself too: it may fail, its deadline passed) releases the session again as
    it ends, so that nothing stays held (see ``grpc_sessions``)."""
    releases_session = op_type is pb.ReleaseSession
    # A ping says when its session expires unused, as OpenSession does (for a client
    # given a session to share, and for clients that check).
    idle = _idle_metadata(sessions) if op_type is pb.Ping else None

    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        entered: list[str] = []  # the session of a request the gate counted in
        if idle is not None:
            context.set_trailing_metadata(idle)

        def check(op: type[pb.Operation] | None, session: str) -> None:
            if op is not op_type:
                _wrong_op(context, name, op_type, op)
            if not sessions.enter(session, credential):
                _refuse_session(context, session)
            entered.append(session)
            if releases_session:
                sessions.close(session, credential)

        # Bytes that are not a Request pass no gate: they are answered as over the port,
        # with a protocol error reply.
        try:
            reply = dispatcher.run(dispatcher.admit(request, check))
        finally:
            if entered and sessions.leave(entered[0]):
                _release(dispatcher, entered[0])
        return b"".join(reply)

    return handle


def _idle_metadata(sessions: SessionTable) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that tells a client when its session expires unused."""
    return ((SESSION_IDLE_KEY, f"{sessions.idle:g}"),)


def _release(dispatcher: Dispatcher, session: str) -> None:
    """Release every handle of ``session``."""
    dispatcher.dispatch(pb.Request(0, session, pb.ReleaseSession()))


def _release_expired(server: grpc.Server, dispatcher: Dispatcher, sessions: SessionTable) -> None:
    """Until ``server`` stops, release every quarter of the idle time the sessions that
    have expired (see ``grpc_sessions``): a worker that gets no more requests frees a
    killed client's objects too. (``wait_for_termination`` is true when it timed out.)"""
    while server.wait_for_termination(sessions.idle / 4):
        for session in sessions.expired():
            _release(dispatcher, session)


def _open_session_handler(
    sessions: SessionTable, credential: str
) -> Callable[[bytes, grpc.ServicerContext], bytes]:
    """``OpenSession``: issue a session to the caller's credential; the value is its id,
    and the trailing metadata says when it expires unused (``SESSION_IDLE_KEY``). Nothing
    is dispatched: the request is only decoded, to check it."""
    idle = _idle_metadata(sessions)

    def handle(data: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            request = pb.decode_request(data)
        except pb.EnvelopeError as exc:
            message = f"malformed request: {exc}"
            return pb.encode_reply(protocol_error(pb.peek_request_id(data), message))
        if not isinstance(request.op, pb.Ping):
            _wrong_op(context, OPEN_SESSION, pb.Ping, request.op)
        if request.session:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{SERVICE}/{OPEN_SESSION} issues a new session: leave Request.session empty "
                f"(got {_shown(request.session)})",
            )
        try:
            session = sessions.open(credential)
        except TooManySessions as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        context.set_trailing_metadata(idle)
        return pb.encode_reply(pb.Reply(id=request.id, value=PLAIN.encode(session)))

    return handle


class _TokenCheck(grpc.ServerInterceptor):
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <token>``.

    grpc runs interceptors on the call's metadata, before any of its body is read.
    The refusal is a *stream*-request handler that never asks for the body: a
    unary handler would first receive the whole message (up to the size limit),
    so unauthenticated callers could make the server buffer hundreds of MiB each.
    """

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def refuser(details: str) -> grpc.RpcMethodHandler:
            def refuse(_requests: Any, context: grpc.ServicerContext) -> None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

            return grpc.stream_unary_rpc_method_handler(refuse)

        self._missing = refuser(
            "no bridge token: send metadata 'authorization: Bearer <token>' on every call"
        )
        self._wrong = refuser("wrong bridge token (metadata 'authorization: Bearer <token>')")

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(given, self._expected):
                    return continuation(handler_call_details)
                return self._wrong
        return self._missing


@dataclass(slots=True)
class Serving:
    """A started gRPC server: what clients connect to, and how to clean up after it.

    ``target`` is what ``grpc.insecure_channel`` (and ``bridge_py.client.connect``)
    take: ``"HOST:PORT"`` or ``"unix:PATH"``; ``port`` is 0 on a Unix socket.
    """

    server: grpc.Server
    target: str
    port: int
    socket_path: Path | None = None
    _socket_id: tuple[int, int] | None = None

    def remove_socket(self) -> None:
        """Unlink the Unix socket, if it is still ours (for exit, when no stop runs)."""
        if self.socket_path is None or self._socket_id is None:
            return
        with contextlib.suppress(OSError):
            info = os.lstat(self.socket_path)
            if (info.st_dev, info.st_ino) == self._socket_id:
                self.socket_path.unlink()


def _credential_of(token: str | None, socket_path: Path | None) -> str:
    """What sessions are bound to: the token (as a digest, not kept in clear) or the socket."""
    if token:
        return "token:" + hashlib.sha256(token.encode()).hexdigest()
    return f"unix:{socket_path}"


def serve_grpc(
    dispatcher: Dispatcher,
    address: str,
    *,
    token: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE,
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
    session_idle: float = DEFAULT_SESSION_IDLE,
) -> Serving:
    """Start serving ``dispatcher`` on ``address`` (``HOST:PORT`` or ``unix:PATH``).

    A TCP address needs ``token`` (raises :class:`CredentialError` without one);
    with a token every call must carry it. A Unix socket is created 0600 and needs
    no token (one given is required too). A session with no request for
    ``session_idle`` seconds expires (0: never). Raises :class:`OSError` when the
    address cannot be bound, ValueError for a negative ``session_idle``.
    """
    socket_path = unix_path(address)
    if socket_path is None and not token:
        raise CredentialError(
            f"refusing to serve gRPC on {address} without a token: set ${TOKEN_ENV}, "
            f"give --token-file, or serve on unix:PATH"
        )
    sessions = SessionTable(max_sessions, session_idle)
    credential = _credential_of(token, socket_path)
    # No (de)serializers: the handlers take the request's bytes as they came and return
    # the reply's bytes.
    handlers: dict[str, grpc.RpcMethodHandler] = {
        name: grpc.unary_unary_rpc_method_handler(
            _handler(dispatcher, sessions, credential, name, op_type)
        )
        for name, op_type in METHODS.items()
    }
    handlers[OPEN_SESSION] = grpc.unary_unary_rpc_method_handler(
        _open_session_handler(sessions, credential)
    )
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_concurrent_rpcs, thread_name_prefix="bridge-grpc"),
        handlers=[grpc.method_handlers_generic_handler(SERVICE, handlers)],
        interceptors=[_TokenCheck(token)] if token else None,
        maximum_concurrent_rpcs=max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_concurrent_streams", max_concurrent_rpcs),
            ("grpc.max_metadata_size", MAX_METADATA_BYTES),
            ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
            # A second server on a busy port fails instead of sharing it.
            ("grpc.so_reuseport", 0),
            # Fixed flow-control windows: with bandwidth-delay probing each connection's
            # window grows while a flood of refused bodies is sent, and the server holds
            # what the window let in (up to 160 MiB measured). Loopback throughput of a
            # 64 MiB echo is the same without it.
            ("grpc.http2.bdp_probe", 0),
        ],
    )
    if socket_path is not None:
        serving = _bind_socket(server, socket_path)
    else:
        serving = _bind_tcp(server, address)
    server.start()
    if session_idle:
        threading.Thread(
            target=_release_expired,
            args=(server, dispatcher, sessions),
            name="bridge-grpc-sessions",
            daemon=True,
        ).start()
    return serving


def _bind_tcp(server: grpc.Server, address: str) -> Serving:
    host, port = split_address(address)
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(bind)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address} (in use, or not an address of this host)")
    shown = f"[{host}]" if ":" in host else host
    return Serving(server, f"{shown}:{bound}", bound)


def _bind_socket(server: grpc.Server, path: Path) -> Serving:
    """Bind ``path`` 0600 from the start: under a private umask, then checked."""
    clear_socket_path(path)
    with private_umask():
        try:
            bound = server.add_insecure_port(f"unix:{path}")
        except RuntimeError:
            bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on unix:{path} (is its directory there and writable?)")
    try:
        check_private_socket(path)
    except (CredentialError, OSError):
        server.stop(None)
        raise
    info = os.lstat(path)
    return Serving(server, f"unix:{path}", 0, path, (info.st_dev, info.st_ino))
