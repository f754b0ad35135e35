"""Waits end within their timeout, with our errors and nothing from torch on stderr, when the
store's host is gone: rank 0 (which serves the TCPStore) killed while rank 1 waits, and a
store that nobody serves at all (issue 19). So do the store requests outside the waits:
``expire_data``'s deletes, a broadcast that overflows the boards into the store, and
``create``'s join.

Rank 0 is a real process started here (``doomed``) that SIGKILLs itself once rank 1 says
(a store key) that it is about to wait; rank 1 runs under ``run_ranks`` with its stderr (the
file descriptor, which torch's C++ logger writes to) sent to a file that the test reads.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.errors import (
    BarrierFailure,
    DistributedError,
    GroupTimeout,
    PeerGoneError,
    StoreError,
)
from bridge_py.distributed.spg.board import BROADCAST_RING
from bridge_py.distributed.store.quiet import QUIET, enabled
from tests.distributed.harness import TRANSPORTS, free_port, run_ranks, use_transport
from tests.distributed.test_dist_peer_death import doomed

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 5.0
SLACK = 2.0  # the error must come within the timeout and this much more
ROOT = Path(__file__).resolve().parents[2]
# What torch's C++ logger writes: "[W1123 19:04:24.110 TCPStore.cpp:138] [c10d] ..." and
# the stack trace of the exception it logs.
CPP_LOG = ("[c10d]", "Exception raised from", "frame #")

OPS = ("broadcast_obj", "recv_obj", "all_gather_obj", "barrier")


READY = "test/ready"


def _store_host(rank: int, port: int, transport: str, delay: float) -> None:
    use_transport(transport)
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=60)
    group.store.wait([READY])
    time.sleep(delay)  # rank 1 is waiting by now
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_until_refused(port: int, limit: float = 20.0) -> None:
    """Return once nothing listens on ``port`` (rank 0 is dead)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            try:
                sock.connect(("127.0.0.1", port))
            except ConnectionRefusedError:
                return
        time.sleep(0.05)
    raise AssertionError(f"rank 0 still serves {port}")


def _call(group: StatelessProcessGroup, op: str) -> None:
    if op == "broadcast_obj":
        group.broadcast_obj(None, src=0, timeout=TIMEOUT)
    elif op == "recv_obj":
        group.recv_obj(0, timeout=TIMEOUT)
    elif op == "all_gather_obj":
        group.all_gather_obj(group.rank)  # bounded by the store's timeout (TIMEOUT here)
    else:
        group.barrier(timeout=TIMEOUT)


def _outcome(fn: Any) -> dict:
    start = time.monotonic()
    try:
        fn()
    except BaseException as exc:
        return {
            "elapsed": time.monotonic() - start,
            "type": f"{type(exc).__module__}.{type(exc).__name__}",
            "ours": isinstance(exc, (GroupTimeout, PeerGoneError, StoreError, BarrierFailure)),
            "message": str(exc),
        }
    return {"elapsed": time.monotonic() - start, "type": None}


def _stderr_to(path: str) -> None:
    """Send this process's stderr (the descriptor torch's C++ logger writes to) to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.close(fd)


def _waiter(rank: int, port: int, transport: str, op: str, stderr_path: str, again: bool) -> dict:
    _stderr_to(stderr_path)
    use_transport(transport)
    store_timeout = TIMEOUT if op == "all_gather_obj" else 300
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=store_timeout)
    first = None
    if again:
        # A wait that runs out while rank 0 is alive drops the waiting connection: the next
        # wait, after rank 0 died, has to open a new one (torch's client would retry for
        # its whole timeout and more).
        first = _outcome(lambda: group.broadcast_obj(None, src=0, timeout=0.3))
    group.store.set(READY, "1")
    if again:
        _wait_until_refused(port)
    return {"first": first, "result": _outcome(lambda: _call(group, op))}


def _check(result: dict, op: str, key: str, stderr: str) -> None:
    assert result["type"] is not None, f"{op} did not fail"
    message = result["message"]
    assert result["ours"], f"{result['type']}: {message}"
    assert result["type"].startswith("bridge_py.distributed.errors."), result["type"]
    assert result["elapsed"] < TIMEOUT + SLACK, (result["elapsed"], message)
    assert "rank 1" in message and key in message, message
    if enabled():
        assert not any(part in stderr for part in CPP_LOG), stderr


def _key(op: str, transport: str) -> str:
    if op == "recv_obj":
        return "'p2p/0/1/0'"
    if op == "barrier":  # the boards' barrier has no key: it names the barrier
        return "'barrier/0/arrivals'" if transport == "store" else "barrier 0"
    return "'bcast/0/0'"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_rank_0_killed_while_rank_1_waits(op: str, transport: str, tmp_path: Path) -> None:
    port = free_port()
    stderr_path = tmp_path / "stderr"
    with doomed(_store_host, 0, port, transport, 0.5) as proc:
        (out,) = run_ranks(
            _waiter, 2, port, transport, op, str(stderr_path), False, ranks=[1], timeout=60
        )
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
    _check(out["result"], op, _key(op, transport), stderr_path.read_text())


def test_a_wait_that_must_reconnect_after_rank_0_died(tmp_path: Path) -> None:
    # Over the store only (the boards' waits need no connection).
    port = free_port()
    stderr_path = tmp_path / "stderr"
    with doomed(_store_host, 0, port, "store", 0.0):
        (out,) = run_ranks(
            _waiter, 2, port, "store", "broadcast_obj", str(stderr_path), True, ranks=[1]
        )
    first = out["first"]
    assert first["type"] == "bridge_py.distributed.errors.GroupTimeout", first
    result = out["result"]
    _check(result, "broadcast_obj", "'bcast/0/0'", stderr_path.read_text())
    assert result["type"].endswith("StoreError") and result["elapsed"] < 1.0, result


# A store request that is not a wait, made once rank 0 is gone: (transport, the key named).
REQUESTS = {
    # Deletes the message to rank 0 that was never received.
    "expire_data": ("store", "'p2p/1/0/0'"),
    # Rank 0 reads no broadcast: once the broadcast ring is full, values go in the store
    # (a set has no reply: the broken connection is seen by the next one).
    "broadcast_overflow": ("shm", "'bcast/1/"),
}


def _requester(rank: int, port: int, request: str, stderr_path: str) -> dict:
    _stderr_to(stderr_path)
    use_transport(REQUESTS[request][0])
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=300)
    if request == "expire_data":
        group.send_obj("never received", dst=0)
        group.data_expiration_seconds = 0
        action = group.expire_data
    else:
        for i in range(BROADCAST_RING):
            group.broadcast_obj(i, src=1)

        def action() -> None:
            for _ in range(50):
                group.broadcast_obj("overflow", src=1)
                time.sleep(0.02)

    group.store.set(READY, "1")
    _wait_until_refused(port)
    return _outcome(action)


@pytest.mark.parametrize("request_", REQUESTS)
def test_a_store_request_after_rank_0_died(request_: str, tmp_path: Path) -> None:
    port = free_port()
    stderr_path = tmp_path / "stderr"
    with doomed(_store_host, 0, port, REQUESTS[request_][0], 0.0):
        (out,) = run_ranks(_requester, 2, port, request_, str(stderr_path), ranks=[1], timeout=60)
    _check(out, request_, REQUESTS[request_][1], stderr_path.read_text())
    assert out["type"].endswith("StoreError"), out


def _dies_while_joining(rank: int, port: int) -> None:
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
    StatelessProcessGroup.create("127.0.0.1", port, rank, 3, store_timeout=60)


def _joiner(rank: int, port: int, stderr_path: str) -> dict:
    _stderr_to(stderr_path)
    return _outcome(lambda: StatelessProcessGroup.create("127.0.0.1", port, rank, 3, 3600, 60))


def test_rank_0_killed_while_rank_1_joins(tmp_path: Path) -> None:
    port = free_port()
    stderr_path = tmp_path / "stderr"
    with doomed(_dies_while_joining, 0, port):
        (out,) = run_ranks(_joiner, 3, port, str(stderr_path), ranks=[1], timeout=60)
    _check(out, "create", "'join/done'", stderr_path.read_text())
    assert out["type"].endswith("StoreError") and f"127.0.0.1:{port}" in out["message"], out


_UNREACHABLE = """
import sys, time
from bridge_py.distributed import StatelessProcessGroup
start = time.monotonic()
try:
    StatelessProcessGroup.create("127.0.0.1", int(sys.argv[1]), 1, 2, store_timeout=5)
except BaseException as exc:
    print(f"{time.monotonic() - start:.3f}", type(exc).__module__, type(exc).__name__)
    print(exc)
"""


def test_create_against_an_unreachable_store_is_bounded_and_quiet() -> None:
    port = free_port()  # nobody listens there
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-c", _UNREACHABLE, str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    head, _, message = stdout.partition("\n")
    elapsed, module, name = head.split()
    assert (module, name) == ("bridge_py.distributed.errors", "StoreError"), stdout
    assert float(elapsed) < 7.0, stdout
    assert "rank 1" in message and f"127.0.0.1:{port}" in message, message
    assert not any(part in stderr for part in CPP_LOG), stderr


def test_quiet_restores_the_level() -> None:
    if not enabled():
        pytest.skip("no c10 log-level flag here, or TORCH_CPP_LOG_LEVEL is set")
    flag = QUIET._flag
    assert flag is not None
    before = flag.value
    with QUIET:
        with QUIET:
            assert flag.value == 3
        assert flag.value == 3
    assert flag.value == before < 3
    with pytest.raises(ValueError), QUIET:
        raise ValueError
    assert flag.value == before
    assert issubclass(StoreError, DistributedError)
