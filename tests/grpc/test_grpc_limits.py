"""Limits that hold before a caller is known: unauthenticated bodies are never buffered,
and concurrent calls are bounded."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from bridge_py.client import connect
from bridge_py.worker import envelope as pb
from bridge_py.worker.dispatcher import Dispatcher
from bridge_py.worker.transports.grpc import serve_grpc
from tests.grpc.conftest import ROOT, GrpcWorker
from tests.worker.sample_exports import table

pytestmark = pytest.mark.timeout(240)

# A process of unauthenticated callers: THREADS at once, ROUNDS each, BODY MiB per call,
# half without a token and half with a wrong one. Prints the status codes it got.
_FLOOD = """
import collections, json, sys, threading
import grpc
target, threads, rounds, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
body = b"x" * (mib << 20)
codes = collections.Counter()
lock = threading.Lock()
def flood(i):
    options = [("grpc.max_send_message_length", 1 << 30)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = channel.unary_unary("/bridge.BridgeService/Call")
        metadata = (("authorization", "Bearer wrong"),) if i % 2 else ()
        for _ in range(rounds):
            try:
                stub(body, timeout=60, metadata=metadata)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            with lock:
                codes[code] += 1
workers = [threading.Thread(target=flood, args=(i,)) for i in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
print(json.dumps(codes))
"""


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_an_unauthenticated_flood_is_refused_unread_while_a_client_works() -> None:
    threads, rounds, mib = 16, 4, 32  # 2 GiB sent in all, 512 MiB in flight at once
    worker = GrpcWorker()
    try:
        with worker.connect() as client:
            counter = client.create("Counter")
            counter.incr()
            baseline = _rss_kib(worker.proc.pid)
            peak = [baseline]
            stop = threading.Event()

            def watch() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], _rss_kib(worker.proc.pid))
                    time.sleep(0.01)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            flood = subprocess.Popen(
                [sys.executable, "-c", _FLOOD, worker.target, *map(str, (threads, rounds, mib))],
                stdout=subprocess.PIPE,
                cwd=ROOT,
            )
            try:
                served = 0
                while flood.poll() is None:
                    assert counter.incr() == served + 2  # every call answered, none refused
                    served += 1
                out, _ = flood.communicate(timeout=120)
            finally:
                if flood.poll() is None:
                    flood.kill()
                    flood.wait()
                stop.set()
                watcher.join()
            codes = json.loads(out)
            assert codes == {"UNAUTHENTICATED": threads * rounds}
            assert served > 0
            grown_mib = (peak[0] - baseline) / 1024
            # Buffering each refused body would take hundreds of MiB. With fixed HTTP/2
            # flow-control windows (no BDP probing) what arrives unread is a few 64 KiB
            # windows per connection: about 1 MiB here. With probing the windows grew with
            # the flood, to 34-162 MiB in different runs.
            assert grown_mib < 48, f"the worker grew by {grown_mib:.0f} MiB during the flood"
            assert client.ping("after", timeout=10) == "after"
    finally:
        worker.stop()


def test_calls_over_the_concurrency_limit_are_refused_at_once() -> None:
    serving = serve_grpc(
        Dispatcher(table()), "127.0.0.1:0", token="limit-test", max_concurrent_rpcs=2
    )
    # Its own connection: on the client's, the third call would wait for a free stream
    # (max_concurrent_streams), not reach the server.
    other = grpc.insecure_channel(serving.target, options=[("grpc.use_local_subchannel_pool", 1)])
    open_session = other.unary_unary(
        "/bridge.BridgeService/OpenSession",
        request_serializer=pb.encode_request,
        response_deserializer=pb.decode_reply,
    )
    auth = (("authorization", "Bearer limit-test"),)
    try:
        with connect(serving.target, token="limit-test") as client, ThreadPoolExecutor(2) as pool:
            slow = [pool.submit(client.call_function, "sleep", 2.0) for _ in range(2)]
            time.sleep(0.5)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                open_session(pb.Request(id=1, op=pb.Ping()), timeout=10, metadata=auth)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - started < 1.0
            assert [f.result(timeout=10) for f in slow] == [2.0, 2.0]
            assert open_session(pb.Request(id=2, op=pb.Ping()), timeout=10, metadata=auth).value
            assert client.ping(2) == 2
    finally:
        other.close()
        serving.server.stop(None)


def test_connections_that_never_speak_are_closed_and_take_no_fds_for_long() -> None:
    """Idle TCP connections (no HTTP/2, no token) go after the handshake timeout, so that
    a crowd of them cannot hold the worker's file descriptors (22,000 once did, and its
    own client then got DEADLINE_EXCEEDED)."""
    import socket

    from bridge_py.worker.transports.grpc import HANDSHAKE_TIMEOUT_MS

    worker = GrpcWorker()
    try:
        idle = [socket.create_connection(("127.0.0.1", worker.port)) for _ in range(200)]
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_MS / 1000 + 10
        for sock in idle:  # each is closed by the server (its settings, a GOAWAY, then EOF)
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            while sock.recv(1 << 16):
                pass
            sock.close()
        assert len(list(Path(f"/proc/{worker.proc.pid}/fd").iterdir())) < 100  # not 200 more
        with worker.connect() as client:
            assert client.ping("after") == "after"
    finally:
        worker.stop()
