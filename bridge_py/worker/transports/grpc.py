"""The gRPC transport: ``BridgeService`` from proto/bridge.proto, over grpcio.

The same dispatcher, registry and export table as the port transport serve every
call; this module only maps RPCs to requests. Generic method handlers with the
envelope codec as (de)serializer mean no generated stubs are needed.

Safe by default: it listens on loopback unless told otherwise, and a shared token
is required whenever it listens on any other address. Message sizes are limited
explicitly on both directions.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from bridge_py.worker import envelope as pb
from bridge_py.worker.dispatcher import Dispatcher

SERVICE = "bridge.BridgeService"
DEFAULT_MAX_MESSAGE = 256 * 1024 * 1024
TOKEN_ENV = "VLLM_BRIDGE_TOKEN"

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


class InsecureBinding(ValueError):
    """A non-loopback address without a token."""


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _decode(data: bytes) -> pb.Request:
    try:
        return pb.decode_request(data)
    except pb.EnvelopeError as exc:
        # Raised inside grpc's deserializer: the client sees INTERNAL with this text.
        raise ValueError(f"malformed request: {exc}") from None


def _handler(dispatcher: Dispatcher, name: str, op_type: type) -> Callable[..., pb.Reply]:
    def handle(request: pb.Request, context: grpc.ServicerContext) -> pb.Reply:
        if not isinstance(request.op, op_type):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{SERVICE}/{name} needs a Request with op {pb.op_name(op_type())}, "
                f"got {pb.op_name(request.op)}",
            )
        return dispatcher.dispatch(request)

    return handle


class _TokenCheck(grpc.ServerInterceptor):
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(_request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bridge token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and hmac.compare_digest(value.encode(), self._expected):
                return continuation(handler_call_details)
        return self._deny


def serve_grpc(
    dispatcher: Dispatcher,
    address: str = "127.0.0.1:0",
    *,
    token: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE,
    max_threads: int = 256,
) -> tuple[grpc.Server, int]:
    """Start serving ``dispatcher`` on ``address``; return the server and its port.

    A token is required unless ``address`` is a loopback address; with a token every
    call must carry it. Blocking calls (a barrier) each hold one of ``max_threads``.
    """
    host, port = split_address(address)
    if not token and not is_loopback(host):
        raise InsecureBinding(
            f"refusing to serve gRPC on {address} without a token: pass --token or set "
            f"{TOKEN_ENV} (only loopback addresses may go without one)"
        )
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _handler(dispatcher, name, op_type),
            request_deserializer=_decode,
            response_serializer=pb.encode_reply,
        )
        for name, op_type in METHODS.items()
    }
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="bridge-grpc"),
        handlers=[grpc.method_handlers_generic_handler(SERVICE, handlers)],
        interceptors=[_TokenCheck(token)] if token else None,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(bind)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address} (in use, or not an address of this host)")
    server.start()
    return server, bound
