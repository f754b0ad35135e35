"""Waits end within their timeout when a rank dies, and the survivors keep working.

A doomed rank is a real process started here (not by ``run_ranks``, which fails when one of
its ranks dies): it joins the group, then exits with ``os._exit`` or SIGKILLs itself at a
chosen point. The survivors run under ``run_ranks`` with a large ``store_timeout`` (300 s)
and must get a clear RuntimeError within their own, much smaller, timeout: over the store,
a GroupTimeout at that timeout; on one machine (shared memory), a PeerGoneError as soon as
the rank is seen gone, within about a second.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.spg import keys
from tests.distributed.harness import TRANSPORTS, free_port, run_ranks, use_transport

pytestmark = pytest.mark.timeout(90)

TIMEOUT = 3.0
BOUND = 5.0  # the error must come well before the 300 s store timeout


@contextmanager
def doomed(target: Callable[..., None], *args: Any) -> Iterator[multiprocessing.Process]:
    """Run ``target(*args)`` in a process of its own; it is killed if still alive at the end."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch.distributed", "bridge_py.distributed"])  # as harness
    else:
        ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    try:
        yield proc
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def _join_then_die(rank: int, world_size: int, port: int, how: str, transport: str) -> None:
    use_transport(transport)
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, store_timeout=60)
    if how == "arrive_then_kill":  # dies inside barrier 0, having arrived first in phase 1
        group.store.add(keys.barrier_arrivals(0), 1 << rank)  # its bit
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "kill_later":  # rank 0 serves the store: let the others start waiting first
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def _timed(fn: Callable[[], Any]) -> tuple[str, float]:
    start = time.monotonic()
    try:
        fn()
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("expected a RuntimeError")


def _survivor_of_silent_sender(rank: int, port: int, transport: str) -> dict:
    use_transport(transport)
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 3, store_timeout=300)
    result: dict = {}
    if rank == 1:
        result["recv"] = _timed(lambda: group.recv_obj(2, timeout=TIMEOUT))
    else:
        result["bcast"] = _timed(lambda: group.broadcast_obj(None, src=2, timeout=TIMEOUT))
    # The main connection is unharmed: operations between the survivors still work.
    if rank == 0:
        group.send_obj("still here", dst=1)
        group.broadcast_obj({"x": 1}, src=0)
        result["after"] = group.recv_obj(1, timeout=10)
    else:
        result["after"] = group.recv_obj(0, timeout=10)
        result["bcast_after"] = group.broadcast_obj(None, src=0, timeout=10)
        group.send_obj("back", dst=0)
    return result


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_waits_for_a_dead_sender_end_within_their_timeout(transport: str) -> None:
    port = free_port()
    with doomed(_join_then_die, 2, 3, port, "exit", transport):
        results = run_ranks(
            _survivor_of_silent_sender, 3, port, transport, ranks=[0, 1], timeout=60
        )
    # Over the store the wait runs out; on one machine the dead rank is seen gone at once.
    gone = "timed out" if transport == "store" else "rank 2 exited"
    message, elapsed = results[1]["recv"]
    assert elapsed < BOUND, message
    for part in ("recv_obj on rank 1", gone, "'p2p/2/1/0'"):
        assert part in message
    if transport == "store":
        assert "from rank 2" in message and "timeout 3 s" in message
    message, elapsed = results[0]["bcast"]
    assert elapsed < BOUND, message
    for part in ("broadcast_obj on rank 0", "'bcast/2/0'", gone):
        assert part in message
    assert results[0]["after"] == "back"
    assert results[1]["after"] == "still here"
    assert results[1]["bcast_after"] == {"x": 1}


def _survivor_default_timeout(rank: int, port: int, transport: str) -> dict:
    # No timeout argument: the store's timeout bounds the wait, as in vLLM.
    use_transport(transport)
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=3)
    return {"recv": _timed(lambda: group.recv_obj(1))}


def test_default_timeout_is_the_stores() -> None:
    # Over the store, where a dead rank shows only as silence (on one machine it is seen gone).
    port = free_port()
    with doomed(_join_then_die, 1, 2, port, "exit", "store"):
        (result,) = run_ranks(_survivor_default_timeout, 2, port, "store", ranks=[0], timeout=60)
    message, elapsed = result["recv"]
    assert 2.5 < elapsed < BOUND, message
    assert "timeout 3 s" in message and "'p2p/1/0/0'" in message


def _survivor_of_barrier_death(rank: int, port: int, transport: str) -> dict:
    use_transport(transport)
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 3, store_timeout=300)
    result: dict = {}
    # Rank 2 arrived at barrier 0 and was killed: everyone arrived, so rank 1 passes, but
    # rank 0, which leaves last, waits for a departure that never comes.
    time.sleep(1.0)  # rank 2 arrives first (its arrival is all it does before dying)
    start = time.monotonic()
    try:
        group.barrier(timeout=TIMEOUT)
        result["first"] = ("passed", time.monotonic() - start)
    except RuntimeError as exc:
        result["first"] = (str(exc), time.monotonic() - start)
    # The group is unusable on the rank whose barrier failed: rank 0 refuses the next
    # barrier at once; rank 1, whose barrier passed, waits for it and fails in phase 1.
    result["second"] = _timed(lambda: group.barrier(timeout=TIMEOUT))
    # Now both refuse everything at once, naming the barrier that failed there.
    result["after"] = _timed(lambda: group.send_obj("ok", dst=1 - rank))
    if rank == 0:
        time.sleep(TIMEOUT + 1)  # rank 0 serves the store: stay until rank 1 is done
    return result


def test_a_rank_killed_inside_a_barrier() -> None:
    # The store's barrier (test_dist_board has the boards'): rank 2 adds its arrival itself.
    port = free_port()
    with doomed(_join_then_die, 2, 3, port, "arrive_then_kill", "store") as proc:
        results = run_ranks(_survivor_of_barrier_death, 3, port, "store", ranks=[0, 1], timeout=60)
        assert proc.exitcode == -signal.SIGKILL
    message, elapsed = results[0]["first"]
    assert elapsed < BOUND, message
    assert "failed on rank 0" in message and "phase 3 (departure): 2 of 3 ranks departed" in message
    assert results[1]["first"][0] == "passed"
    message, elapsed = results[0]["second"]
    assert elapsed < 0.5, message
    assert "barrier on rank 0 of a StatelessProcessGroup of 3 refused" in message, message
    assert "barrier 0 failed on it (BarrierTimeout: barrier 0 failed on rank 0" in message
    assert "create it again on every rank" in message
    message, elapsed = results[1]["second"]
    assert elapsed < BOUND, message
    assert "barrier 1 failed on rank 1" in message and "phase 1 (arrival)" in message, message
    assert "1 of 3 ranks arrived" in message, message
    for rank, failed in ((0, "barrier 0"), (1, "barrier 1")):
        message, elapsed = results[rank]["after"]
        assert elapsed < 0.5, message
        assert f"send_obj on rank {rank} of a StatelessProcessGroup of 3 refused" in message
        assert f"{failed} failed on it" in message, message


def _survivor_of_store_owner(rank: int, port: int, transport: str) -> tuple[str, float]:
    use_transport(transport)
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 3, store_timeout=300)
    return _timed(lambda: group.recv_obj(0, timeout=TIMEOUT))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_store_owner_killed_while_others_wait(transport: str) -> None:
    port = free_port()
    with doomed(_join_then_die, 0, 3, port, "kill_later", transport):
        results = run_ranks(_survivor_of_store_owner, 3, port, transport, ranks=[1, 2], timeout=60)
    for rank, (message, elapsed) in zip((1, 2), results, strict=True):
        assert elapsed < BOUND, message
        assert f"recv_obj on rank {rank}" in message
        assert f"'p2p/0/{rank}/0'" in message and "rank 0" in message
