"""gRPC through the dispatcher's ``admit`` and ``run``, as the port: the same call plans,
the same order on one object, its checks made before a call takes any turn, and bytes
that are not a Request answered as the port answers them.

A real server on a real port, in this process (so that the test can count what the
dispatcher decodes), and real clients.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from bridge_py.client import BridgeError, Client, connect
from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN
from bridge_py.worker.dispatcher import Dispatcher
from bridge_py.worker.transports.grpc import SERVICE, Serving, serve_grpc
from tests.grpc.conftest import GrpcWorker
from tests.worker.sample_exports import table

pytestmark = pytest.mark.timeout(120)
TOKEN = "dispatch-test"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture
def serving() -> Iterator[tuple[Serving, Dispatcher]]:
    dispatcher = Dispatcher(table())
    serving = serve_grpc(dispatcher, "127.0.0.1:0", token=TOKEN)
    yield serving, dispatcher
    serving.server.stop(None)
    # The thread that expires its sessions ends with the server.
    sweepers = [t for t in threading.enumerate() if t.name == "bridge-grpc-sessions"]
    for thread in sweepers:
        thread.join(10)
    assert not any(t.is_alive() for t in sweepers)


@pytest.fixture
def client(serving: tuple[Serving, Dispatcher]) -> Iterator[Client]:
    with connect(serving[0].target, token=TOKEN, timeout=20) as client:
        yield client


def _raw(target: str, rpc: str) -> tuple[grpc.Channel, grpc.UnaryUnaryMultiCallable]:
    channel = grpc.insecure_channel(target)
    return channel, channel.unary_unary(f"/{SERVICE}/{rpc}")


def test_a_repeated_call_is_decoded_once(
    serving: tuple[Serving, Dispatcher], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = client.create("Counter")
    assert counter.value == 0  # the client learns the class's members (a Describe) here
    decoded: list[int] = []
    decode = pb.decode_request

    def counting(frame: bytes) -> pb.Request:
        decoded.append(1)
        return decode(frame)

    monkeypatch.setattr(pb, "decode_request", counting)
    assert [counter.incr() for _ in range(30)] == list(range(1, 31))
    assert len(decoded) == 1  # the first: every later one ran from its plan
    assert len(serving[1].plans) == 3  # the constructor's (Counter), the getter's (value), incr's


def test_calls_on_one_object_run_in_the_order_they_were_admitted(client: Client) -> None:
    counter = client.create("Counter")
    results: dict[str, object] = {}
    blocked = threading.Thread(target=lambda: results.update(gate=counter.wait_gate(20.0)))
    blocked.start()
    time.sleep(0.5)  # wait_gate holds the object's turn
    after = threading.Thread(target=lambda: results.update(incr=counter.incr()))
    after.start()
    time.sleep(0.5)
    assert results == {}  # incr waits behind it
    assert counter.value == 0  # an attribute read takes no turn
    client.call_function("open_gate", counter)
    blocked.join(10)
    after.join(10)
    assert results == {"gate": True, "incr": 1}


def test_a_refused_request_takes_no_turn(
    serving: tuple[Serving, Dispatcher], client: Client
) -> None:
    # A method call sent to the wrong RPC, and one naming a session that was never
    # issued: both refused before they were admitted, so the object's calls go on.
    counter = client.create("Counter")
    counter.incr()
    counter.incr()  # planned from now on
    channel, ping = _raw(serving[0].target, "Ping")
    _, call = _raw(serving[0].target, "Call")
    try:
        for args in (b"", PLAIN.encode([5])):  # from its plan, and decoded
            for rpc, session, code in [
                (ping, client.session, grpc.StatusCode.INVALID_ARGUMENT),
                (call, "grpc-" + "0" * 64, grpc.StatusCode.PERMISSION_DENIED),
            ]:
                request = pb.Request(7, session, pb.CallMethod(counter._handle, "incr", args))
                with pytest.raises(grpc.RpcError) as info:
                    rpc(pb.encode_request(request), timeout=10, metadata=AUTH)
                assert info.value.code() == code
        # Nothing was run, and no turn was left taken (the call would wait for it).
        assert counter.incr() == 3
    finally:
        channel.close()


@pytest.mark.parametrize("rpc", ["Call", "Ping", "OpenSession"])
def test_bytes_that_are_not_a_request_get_a_protocol_error_reply(
    serving: tuple[Serving, Dispatcher], rpc: str
) -> None:
    channel, stub = _raw(serving[0].target, rpc)
    try:
        reply = pb.decode_reply(stub(b"\x08\x2a\x5a\x09\x08", timeout=10, metadata=AUTH))
        assert reply.id == 42
        assert reply.error is not None and reply.error.category == "protocol"
        assert reply.error.message.startswith("malformed request: "), reply.error.message
        # Still serving, with a session of its own.
        with connect(serving[0].target, token=TOKEN) as client:
            assert client.ping("up") == "up"
    finally:
        channel.close()


def test_a_session_released_over_grpc_is_closed(serving: tuple[Serving, Dispatcher]) -> None:
    # The session the gate let in is the one closed (an encoded request, as it came).
    with connect(serving[0].target, token=TOKEN) as client:
        counter = client.create("Counter")  # held: a collected proxy releases its handle
        channel, release = _raw(serving[0].target, "ReleaseSession")
        try:
            request = pb.encode_request(pb.Request(3, client.session, pb.ReleaseSession()))
            reply = pb.decode_reply(release(request, timeout=10, metadata=AUTH))
            assert (reply.id, PLAIN.decode(reply.value)) == (3, 1)
            with pytest.raises(grpc.RpcError) as info:
                release(request, timeout=10, metadata=AUTH)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        finally:
            channel.close()
        del counter


def test_a_call_the_client_gave_up_on_is_not_run_later() -> None:
    # The client sends its timeout as the request's deadline: a call queued behind a
    # blocking one on the same object, whose caller stopped waiting, is not run when its
    # turn comes (without the deadline it would increment the counter 2 s later).
    worker = GrpcWorker()
    try:
        with worker.connect(timeout=0.5) as client:
            counter = client.create("Counter")
            with pytest.raises(BridgeError) as blocked:
                counter.wait_gate(2.0)  # runs on for 2 s in the worker, holding the turn
            assert blocked.value.category == "transport"
            with pytest.raises(BridgeError) as late:
                counter.incr()
            assert late.value.category == "transport"  # DEADLINE_EXCEEDED, client side
            time.sleep(2.5)
            assert counter.value == 0
            assert counter.incr() == 1
    finally:
        worker.stop()
