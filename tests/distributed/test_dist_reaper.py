"""The key reaper deletes read keys on its own thread and connection, and drains on demand."""

from __future__ import annotations

import datetime
import gc
import threading
import time

import pytest
from torch.distributed import HashStore, TCPStore

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.store.reaper import KeyReaper
from tests.distributed.harness import free_port, run_ranks

pytestmark = pytest.mark.timeout(60)


def _store() -> TCPStore:
    return TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )


def _reapers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "spg-key-reaper"]


def test_keys_are_deleted_off_the_callers_thread_and_drain_waits_for_them() -> None:
    store = _store()
    names = [f"v/{i}" for i in range(200)]
    store.multi_set(names, [b"x"] * len(names))
    before = len(_reapers())
    reaper = KeyReaper(store)
    reaper.delete(names)
    assert len(_reapers()) == before + 1  # a thread of its own
    assert reaper.drain(20)
    assert reaper.pending == 0
    assert store.num_keys() == 0
    # The thread ends with the reaper (after what it was given).
    reaper.delete(["not/there"])
    del reaper
    gc.collect()
    deadline = time.monotonic() + 10
    while len(_reapers()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_reapers()) == before


def test_a_store_that_is_gone_does_not_hold_up_drain() -> None:
    store = _store()
    client = TCPStore("127.0.0.1", store.port, None, False, timeout=datetime.timedelta(seconds=5))
    reaper = KeyReaper(client, connect_timeout=0.5)
    del store  # the server goes away
    gc.collect()
    start = time.monotonic()
    reaper.delete(["a", "b"])
    assert reaper.drain(30)  # the deletes fail and are dropped, not tried one by one
    assert time.monotonic() - start < 20


def test_other_stores_delete_on_the_callers_thread() -> None:
    store = HashStore()
    store.set("k", b"v")
    reaper = KeyReaper(store)
    reaper.delete(["k"])
    assert store.num_keys() == 0 and reaper.pending == 0


def _broadcasts_then_barrier(rank: int, port: int) -> dict:
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 3, store_timeout=30)
    got = [group.broadcast_obj(i if rank == 0 else None, src=0) for i in range(30)]
    got += [group.all_gather_obj(rank)[2] for _ in range(30)]
    group.barrier(timeout=10)
    # rank 0 serves the store and leaves the barrier last: it alone looks
    listed = group.store.list_keys() if rank == 0 else []
    group.barrier(timeout=10)
    return {"got": got, "left": sorted(k for k in listed if not k.startswith("barrier/"))}


def test_a_group_leaves_no_read_value_behind_a_barrier() -> None:
    results = run_ranks(_broadcasts_then_barrier, 3, free_port(), timeout=60)
    for result in results:
        assert result["got"] == list(range(30)) + [2] * 30
    assert results[0]["left"] == ["join/count", "join/done"]


_EXITING = """
import logging, os, signal, subprocess, sys, time, datetime
from torch.distributed import TCPStore
from bridge_py.distributed.store.reaper import KeyReaper
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(message)s")
server = subprocess.Popen([sys.executable, "-c",
    "import time, datetime; from torch.distributed import TCPStore; "
    "s = TCPStore('127.0.0.1', {port}, None, True, timeout=datetime.timedelta(seconds=60), "
    "wait_for_workers=False); print('up', flush=True); time.sleep(120)"],
    stdout=subprocess.PIPE, text=True)
assert server.stdout.readline().strip() == "up"
client = TCPStore("127.0.0.1", {port}, None, False, timeout=datetime.timedelta(seconds=30))
os.kill(server.pid, signal.SIGSTOP)  # the store's host freezes
import atexit
atexit.register(server.kill)  # (registered first: runs after the reaper's join)
reaper = KeyReaper(client, connect_timeout=1.0)
reaper.delete(["k"])  # its thread connects to a store that never answers
time.sleep(0.2)
print("exiting", flush=True)
"""


def test_at_exit_a_reaper_thread_in_torch_is_joined_not_left_running() -> None:
    """A daemon thread still inside torch's client when Python finalizes can abort the
    process (std::terminate) when its call returns; at exit the reaper's threads are
    stopped and joined instead, within their connect timeout and the watchdog's grace."""
    import subprocess
    import sys

    script = _EXITING.replace("{port}", str(free_port()))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # the thread's connect ended (the watchdog shut it) and it said so before the exit
    assert "could not delete 'k'" in done.stderr, done.stderr[-2000:]
