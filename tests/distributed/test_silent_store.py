"""Waits that end on time when the store's host goes silent: it accepts connections (or
holds them) but never answers. Whatever torch's store client does underneath (its
handshake, the cancel of a wait that gave up), our calls end at their timeout plus the
watchdog's grace, with our errors (``store.watchdog``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.errors import DistributedError, StoreError
from bridge_py.distributed.store.watchdog import GRACE
from tests.distributed.harness import free_port, run_ranks

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
BOUND = GRACE + 2.0  # what a wait may take past its timeout here (a loaded machine)


def test_create_ends_when_the_store_accepts_and_never_answers() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(StoreError) as failed:
            StatelessProcessGroup.create("127.0.0.1", port, 1, 2, store_timeout=3)
        took = time.monotonic() - start
    assert took < 3 + BOUND, took
    assert f"127.0.0.1:{port}" in str(failed.value)


def _wire(op: str) -> str:
    return "vllm" if op.endswith("(vllm wire)") else "bridge"


def _serve(port: int, ready: str, op: str) -> None:
    """Rank 0 of a group on the store path, as between machines; then idle (to be frozen)."""
    os.environ["VLLM_BRIDGE_SPG_SHM"] = "0"
    group = StatelessProcessGroup.create("127.0.0.1", port, 0, 2, 1, 5, wire=_wire(op))
    group.barrier(timeout=30)
    Path(ready).touch()
    time.sleep(120)


def _until_stopped(pid: int) -> None:
    """Wait until the kernel says every thread of ``pid`` is stopped (state T): SIGSTOP lands
    asynchronously, and a request made before it does is answered (on a loaded machine,
    expire_data's delete once was, and returned)."""
    for _ in range(1000):
        states = [
            (task / "stat").read_text().rpartition(")")[2].split()[0]
            for task in Path(f"/proc/{pid}/task").iterdir()
        ]
        if set(states) == {"T"}:  # every thread (the store's server runs in its own)
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within 10 s of SIGSTOP")


def _wait_on_frozen_host(rank: int, port: int, ready: str, host: int, op: str) -> list[Any]:
    os.environ["VLLM_BRIDGE_SPG_SHM"] = "0"
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, 1, 5, wire=_wire(op))
    group.barrier(timeout=30)
    if op.startswith("expire_data"):
        group.send_obj("unread", 0)  # an entry to expire (data_expiration_seconds=1)
        time.sleep(1.2)
    while not Path(ready).exists():
        time.sleep(0.01)
    os.kill(host, signal.SIGSTOP)  # the store's host freezes
    _until_stopped(host)
    start = time.monotonic()
    try:
        if op == "recv_obj":
            group.recv_obj(0, timeout=3)
        elif op == "barrier":
            group.barrier(timeout=3)
        else:  # a request with no timeout of its own: the store's (5 s) bounds it
            group.expire_data()
    except DistributedError as exc:
        return [f"{type(exc).__name__}: {exc}", time.monotonic() - start]
    raise AssertionError(f"{op} returned while rank 0 was frozen")


@pytest.mark.parametrize("op", ["recv_obj", "barrier", "expire_data", "expire_data (vllm wire)"])
def test_a_wait_ends_on_time_when_the_store_host_freezes(tmp_path: Path, op: str) -> None:
    ready, port = str(tmp_path / "ready"), free_port()
    script = (
        f"from tests.distributed.test_silent_store import _serve; _serve({port}, {ready!r}, {op!r})"
    )
    host = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        args = (port, ready, host.pid, op)
        error, took = run_ranks(_wait_on_frozen_host, 2, *args, timeout=60, ranks=[1])[0]
    finally:
        host.kill()
        host.wait(10)
    assert took < (5 if op.startswith("expire") else 3) + BOUND, (took, error)
    assert "rank 1" in error and "it stopped answering" in error, error


def _slow_new_client_beside_a_group(rank: int, port: int) -> str:
    from bridge_py.distributed.store.watchdog import watched

    os.environ["VLLM_BRIDGE_SPG_SHM"] = "0"
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=30)
    group.barrier(timeout=30)
    if rank == 1:  # a new client's handshake that runs past its deadline (a lossy link)
        watched(("127.0.0.1", port), time.monotonic()).__enter__()
        time.sleep(GRACE + 1)  # the watchdog has acted on it
    group.barrier(timeout=30)
    return "passed"


def test_a_new_clients_overrun_leaves_the_groups_connections_alone() -> None:
    """The watchdog shuts only what a late new client opened: a group's connections in
    the same process go on (once, all of them were shut, and the group failed with
    'it stopped answering' though the store answered)."""
    assert run_ranks(_slow_new_client_beside_a_group, 2, free_port(), timeout=60) == [
        "passed",
        "passed",
    ]
