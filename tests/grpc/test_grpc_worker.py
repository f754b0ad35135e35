"""The worker over gRPC: the same operations, errors and sessions as over the port."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from bridge_py.client import BridgeError, RemoteObject, connect
from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN, Atom, RefValue
from tests.grpc.conftest import ROOT, SAMPLE, GrpcWorker
from tests.worker.port_client import PortClient, WorkerError

pytestmark = pytest.mark.timeout(120)


def test_ping_describe_and_values(grpc_worker: GrpcWorker) -> None:
    with grpc_worker.connect() as client:
        value = {"a": [1, 2.5, (Atom("ok"), None)], "t": torch.arange(4.0)}
        back = client.ping(value)
        assert back["a"] == value["a"] and torch.equal(back["t"], value["t"])
        assert "Counter" in client.describe()["classes"]


def test_proxies_call_methods_and_read_attributes(grpc_worker: GrpcWorker) -> None:
    with grpc_worker.connect() as client:
        counter = client.create("Counter", 10, step=5)
        assert isinstance(counter, RemoteObject)
        assert counter.incr() == 15
        assert counter.incr(by=2) == 17
        assert counter.value == 17 and counter.step == 5
        with pytest.raises(AttributeError):
            counter.secret  # noqa: B018
        with pytest.raises(BridgeError) as info:
            counter.fail("boom")
        assert info.value.category == "python" and info.value.python_type == "ValueError"
        assert "in fail" in info.value.traceback
        # A proxy passed as an argument is the live object in the worker.
        assert client.call_function("open_gate", counter) is None
        assert counter.wait_gate(1.0) is True


def _port_error(port: PortClient, op: pb.Operation) -> tuple[str, str]:
    with pytest.raises(WorkerError) as info:
        port.request(op)
    return info.value.error.category, info.value.error.message


def _grpc_error(client, call) -> tuple[str, str]:
    with pytest.raises(BridgeError) as info:
        call(client)
    return info.value.category, info.value.message


def test_unexported_names_are_refused_exactly_as_over_the_port(grpc_worker: GrpcWorker) -> None:
    port = PortClient(exports=SAMPLE)
    try:
        with grpc_worker.connect() as client:
            cases = [
                (pb.CreateInstance("os.system"), lambda c: c.create("os.system")),
                (
                    pb.CallFunction("builtins.eval", PLAIN.encode(["1"])),
                    lambda c: c.call_function("builtins.eval", "1"),
                ),
                (pb.CallFunction("__import__"), lambda c: c.call_function("__import__")),
                (
                    pb.CallFunction("Counter.__init__"),
                    lambda c: c.call_function("Counter.__init__"),
                ),
            ]
            for op, call in cases:
                assert _grpc_error(client, call) == _port_error(port, op)
            # Methods and attributes of a live object: dunders and unlisted names.
            ref = port.create("Counter")
            g_ref = client.create("Counter")
            for name in ["secret", "__class__", "__reduce__"]:
                over_port = _port_error(port, pb.CallMethod(ref.handle, name))
                over_grpc = _grpc_error(client, lambda c, n=name: c.call_method(g_ref, n))
                assert over_grpc == over_port
                assert over_grpc[0] == "not_exported"
            over_port = _port_error(port, pb.GetAttribute(ref.handle, "__dict__"))
            assert _grpc_error(client, lambda c: c.get_attr(g_ref, "__dict__")) == over_port
    finally:
        port.close()


def test_handles_are_released_when_proxies_are_collected(grpc_worker: GrpcWorker) -> None:
    with grpc_worker.connect() as client:
        counter = client.create("Counter")
        handle = counter._handle
        del counter
        gc.collect()
        # The handle is gone: releasing it again frees nothing.
        assert client._request(pb.ReleaseHandles([handle])) == 0


def test_a_proxy_gives_back_every_hold_of_its_handle(grpc_worker: GrpcWorker) -> None:
    # The worker counts each hand-out of a handle: a proxy returned by two calls holds
    # two, and gives both back when released or collected (not one, which would keep
    # the object alive until the session ends).
    with grpc_worker.connect() as client:
        counter = client.create("Counter")
        assert client.ping(counter) is counter
        assert client.release(counter) == 1
        assert client.release(counter) == 0  # released already: nothing more
        other = client.create("Counter")
        assert client.ping(other) is other
        handle = other._handle
        del other
        gc.collect()
        assert client._request(pb.ReleaseHandles([handle])) == 0  # both holds are gone


def test_close_releases_and_ends_the_session(grpc_worker: GrpcWorker) -> None:
    client = grpc_worker.connect()
    client.create("Counter")
    session = client.session
    client.close()
    # The session is gone with its handles: its id is no longer accepted (a client given
    # it learns so as it is made).
    with pytest.raises(BridgeError) as info:
        grpc_worker.connect(session=session)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "was not opened on this server" in info.value.message


def test_a_wrong_method_for_the_op_is_invalid_argument(grpc_worker: GrpcWorker) -> None:
    channel = grpc.insecure_channel(grpc_worker.target)
    stub = channel.unary_unary(
        "/bridge.BridgeService/Call",
        request_serializer=pb.encode_request,
        response_deserializer=pb.decode_reply,
    )
    with pytest.raises(grpc.RpcError) as info:
        stub(
            pb.Request(id=1, op=pb.Ping()),
            timeout=10,
            metadata=(("authorization", f"Bearer {grpc_worker.token}"),),
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()


_KILLED_CLIENT = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from bridge_py.client import connect
client = connect(sys.argv[1])
print("calling", flush=True)
client.call_function("sleep", 30.0)
"""


def test_a_client_killed_mid_call_leaves_the_worker_serving(grpc_worker: GrpcWorker) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CLIENT, grpc_worker.target],
        stdout=subprocess.PIPE,
        env={**os.environ, "VLLM_BRIDGE_TOKEN": grpc_worker.token or ""},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"calling\n"
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stdout:
            proc.stdout.close()
    with grpc_worker.connect() as client:
        assert client.ping("alive", timeout=10) == "alive"
        assert client.create("Counter").incr() == 1


def test_the_token_from_the_environment_is_required_and_checked(
    grpc_worker: GrpcWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_BRIDGE_TOKEN", raising=False)
    for token, why in [(None, "no bridge token"), ("wrong", "wrong bridge token")]:
        with pytest.raises(BridgeError) as info:
            connect(grpc_worker.target, token=token)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert why in info.value.message
    with grpc_worker.connect() as client:
        assert client.ping(1) == 1


def test_messages_over_the_limit_get_a_clear_error() -> None:
    worker = GrpcWorker("--max-message-bytes", "100000")
    try:
        with worker.connect() as client:
            with pytest.raises(BridgeError) as info:
                client.ping(b"x" * 200_000, timeout=10)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "100000" in info.value.message or "larger than" in info.value.message
            assert client.ping(b"x" * 1000) == b"x" * 1000
    finally:
        worker.stop()


def test_both_transports_share_handles_within_a_session() -> None:
    worker = GrpcWorker("--stdio")
    port = PortClient(proc=worker.proc)
    try:
        with worker.connect() as client:
            # The BEAM (trusted) may name the session the worker issued to the client.
            shared = client.session
            ref = port.create("Counter", 5, session=shared)
            counter = client.attach(ref.handle, "Counter")
            assert counter.incr() == 6
            assert port.call(ref, "incr", session=shared) == 7
            made_over_grpc = client.create("Counter", 100)
            as_ref = RefValue(made_over_grpc._handle, "Counter")
            assert port.call(as_ref, "incr", session=shared) == 101
            with worker.connect() as other:
                with pytest.raises(BridgeError) as info:
                    other.attach(ref.handle).incr()
                assert info.value.category == "not_found"
        # Closing released what that client held, over both transports.
        with pytest.raises(WorkerError) as gone:
            port.call(ref, "incr", session=shared)
        assert gone.value.error.category == "not_found"
    finally:
        worker.stop()
