"""The gRPC transport: ``BridgeService`` from proto/bridge.proto, over grpcio.

The same dispatcher, registry and export table as the port transport serve every
call; this module only maps RPCs to requests, after three checks of its own:

* **credential**: on TCP every call must carry ``authorization: Bearer <token>``
  (compared in constant time); a call without it is refused from its metadata
  alone, before its body is read. On a Unix socket (``unix:PATH``, created 0600)
  the socket is the credential (``grpc_credentials.py``);
* **session**: a request must name a session this server issued to that credential
  (``OpenSession``, ``grpc_sessions.py``), so no client reaches another's handles;
* **limits**: message sizes both ways, concurrent RPCs, metadata size.

Generic method handlers with the envelope codec as (de)serializer mean no
generated stubs are needed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN
from bridge_py.worker.dispatcher import Dispatcher
from bridge_py.worker.transports.grpc_credentials import (
    TOKEN_ENV,
    CredentialError,
    check_private_socket,
    clear_socket_path,
    private_umask,
    unix_path,
)
from bridge_py.worker.transports.grpc_sessions import SessionTable, TooManySessions

__all__ = [
    "DEFAULT_MAX_CONCURRENT_RPCS",
    "DEFAULT_MAX_MESSAGE",
    "METHODS",
    "OPEN_SESSION",
    "SERVICE",
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
OPEN_SESSION = "OpenSession"

# RPC name -> the operation its Request must carry.
METHODS: dict[str, type] = {
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


def _decode(data: bytes) -> pb.Request:
    try:
        return pb.decode_request(data)
    except pb.EnvelopeError as exc:
        # Raised inside grpc's deserializer: the client sees INTERNAL with this text.
        raise ValueError(f"malformed request: {exc}") from None


def _shown(session: str) -> str:
    """A client-chosen session string, cut short for an error message."""
    return repr(session if len(session) <= 80 else session[:77] + "...")


def _refuse_session(context: grpc.ServicerContext, session: str) -> None:
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


def _wrong_op(context: grpc.ServicerContext, name: str, op_type: type, op: Any) -> None:
    context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{SERVICE}/{name} needs a Request with op {pb.op_name(op_type())}, got {pb.op_name(op)}",
    )


def _handler(
    dispatcher: Dispatcher, sessions: SessionTable, credential: str, name: str, op_type: type
) -> Callable[[pb.Request, grpc.ServicerContext], pb.Reply]:
    """The behaviour of one RPC: check the op and the session, then dispatch."""
    releases_session = op_type is pb.ReleaseSession

    def handle(request: pb.Request, context: grpc.ServicerContext) -> pb.Reply:
        if not isinstance(request.op, op_type):
            _wrong_op(context, name, op_type, request.op)
        if not sessions.allows(request.session, credential):
            _refuse_session(context, request.session)
        reply = dispatcher.dispatch(request)
        if releases_session:
            # Over gRPC releasing a session ends it: its id is no longer accepted.
            sessions.close(request.session, credential)
        return reply

    return handle


def _open_session_handler(
    sessions: SessionTable, credential: str
) -> Callable[[pb.Request, grpc.ServicerContext], pb.Reply]:
    """``OpenSession``: issue a session to the caller's credential; the value is its id."""

    def handle(request: pb.Request, context: grpc.ServicerContext) -> pb.Reply:
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
        return pb.Reply(id=request.id, value=PLAIN.encode(session))

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
    max_sessions: int | None = None,
) -> Serving:
    """Start serving ``dispatcher`` on ``address`` (``HOST:PORT`` or ``unix:PATH``).

    A TCP address needs ``token`` (raises :class:`CredentialError` without one);
    with a token every call must carry it. A Unix socket is created 0600 and needs
    no token (one given is required too). Raises :class:`OSError` when the address
    cannot be bound.
    """
    socket_path = unix_path(address)
    if socket_path is None and not token:
        raise CredentialError(
            f"refusing to serve gRPC on {address} without a token: set ${TOKEN_ENV}, "
            f"give --token-file, or serve on unix:PATH"
        )
    sessions = SessionTable() if max_sessions is None else SessionTable(max_sessions)
    credential = _credential_of(token, socket_path)
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _handler(dispatcher, sessions, credential, name, op_type),
            request_deserializer=_decode,
            response_serializer=pb.encode_reply,
        )
        for name, op_type in METHODS.items()
    }
    handlers[OPEN_SESSION] = grpc.unary_unary_rpc_method_handler(
        _open_session_handler(sessions, credential),
        request_deserializer=_decode,
        response_serializer=pb.encode_reply,
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
            # A second server on a busy port fails instead of sharing it.
            ("grpc.so_reuseport", 0),
        ],
    )
    if socket_path is not None:
        serving = _bind_socket(server, socket_path)
    else:
        serving = _bind_tcp(server, address)
    server.start()
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
