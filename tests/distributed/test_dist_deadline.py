"""A caller's deadline (``bridge_py.deadline``) clamps the group's waits.

A worker runs each request under its caller's deadline; a wait of StatelessProcessGroup
that would outlast it gives up at it, as at its own timeout: a receive that gives up
takes nothing, so the next receive gets the next message. Without a deadline nothing
changes (the store's timeout, or the call's own). A GroupCoordinator's collective gives
up at it too (CollectiveTimeout), over gloo or shared memory, instead of blocking until
the group's timeout, and the group refuses its later collectives.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore

from bridge_py import deadline
from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue
from bridge_py.distributed.errors import BarrierTimeout, GroupTimeout, StoreError
from bridge_py.distributed.store.watchdog import GRACE
from tests.distributed.harness import free_port, run_ranks

pytestmark = pytest.mark.timeout(90)


def _pair() -> tuple[StatelessProcessGroup, StatelessProcessGroup]:
    store = TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )
    return tuple(  # type: ignore[return-value]
        StatelessProcessGroup(rank=r, world_size=2, store=store, socket=None) for r in (0, 1)
    )


def _gives_up_in_time(call, seconds: float = 0.3, error: type = GroupTimeout) -> None:
    start = time.monotonic()
    with deadline.until(start + seconds), pytest.raises(error):
        call()
    took = time.monotonic() - start
    assert seconds - 0.05 < took < seconds + 2.0, took  # not the store's 30 s


def test_a_receive_without_a_timeout_gives_up_at_the_deadline_and_takes_nothing() -> None:
    rank0, rank1 = _pair()
    _gives_up_in_time(lambda: rank0.recv_obj(1))
    _gives_up_in_time(lambda: rank0.recv_obj(1, timeout=20.0))
    rank1.send_obj("first", dst=0)
    rank1.send_obj("second", dst=0)
    assert rank0.recv_obj(1, timeout=5) == "first"  # not lost to the calls that gave up
    with deadline.until(time.monotonic() + 5):
        assert rank0.recv_obj(1) == "second"  # a deadline far enough changes nothing


def test_broadcast_and_all_gather_give_up_at_the_deadline() -> None:
    rank0, rank1 = _pair()
    _gives_up_in_time(lambda: rank1.broadcast_obj(None, src=0))
    rank0.broadcast_obj("b", src=0)
    assert rank1.broadcast_obj(None, src=0, timeout=5) == "b"
    _gives_up_in_time(lambda: rank0.all_gather_obj(0))


def test_a_barrier_gives_up_at_the_deadline() -> None:
    rank0, _rank1 = _pair()
    _gives_up_in_time(lambda: rank0.barrier(timeout=20.0), error=BarrierTimeout)


def test_a_shorter_own_timeout_still_wins() -> None:
    rank0, _rank1 = _pair()
    start = time.monotonic()
    with deadline.until(start + 10), pytest.raises(GroupTimeout):
        rank0.recv_obj(1, timeout=0.2)
    assert time.monotonic() - start < 2


def test_message_queue_waits_give_up_at_the_deadline() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        _gives_up_in_time(reader.dequeue, error=TimeoutError)  # nothing written yet
        writer.enqueue("a")
        writer.enqueue("b")  # the ring is full: the next enqueue waits for the reader
        _gives_up_in_time(lambda: writer.enqueue("c"), error=TimeoutError)
        assert reader.dequeue(timeout=5) == "a"
        assert reader.dequeue(timeout=5) == "b"
    finally:
        reader.close()
        writer.close()


def test_wait_until_ready_gives_up_at_the_deadline() -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    try:  # its one local reader never attaches
        _gives_up_in_time(lambda: writer.wait_until_ready(timeout=20.0))
    finally:
        writer.close()


# -- a GroupCoordinator collective, through a worker request with a deadline ----------------

# How long the rank that never joins stays (alive: a rank that exits is reported at once).
_ABSENT_FOR = 25.0


def _tp_group_of_two(rank: int, port: int, shm: bool, done: str) -> object:
    """The TP group of two ranks (shared memory on or off) on rank 0; rank 1 joins, then
    stays without calling anything until rank 0 is done, and gets None."""
    from bridge_py.distributed import (
        get_tp_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

    os.environ["VLLM_BRIDGE_CPU_SHM"] = "1" if shm else "0"
    init_distributed_environment(
        world_size=2,
        rank=rank,
        local_rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
        timeout=datetime.timedelta(seconds=60),
    )
    initialize_model_parallel(tensor_model_parallel_size=2)
    if rank == 1:
        until = time.monotonic() + _ABSENT_FOR
        while not Path(done).exists() and time.monotonic() < until:
            time.sleep(0.05)
        return None
    return get_tp_group()


def _all_reduce_alone(rank: int, port: int, shm: bool, done: str) -> dict:
    """Rank 0 calls the TP group's all_reduce in a worker request with a 1 s deadline; rank 1
    never calls it, and stays until rank 0 is done."""
    import torch

    from bridge_py.worker import envelope as pb
    from bridge_py.worker.codec import PLAIN
    from bridge_py.worker.dispatcher import Dispatcher
    from bridge_py.worker.export_table import default_exports

    if _tp_group_of_two(rank, port, shm, done) is None:
        return {}
    d = Dispatcher(default_exports())
    tp = d.dispatch(pb.Request(1, "", pb.CallFunction("get_tp_group")))
    call = pb.CallMethod(PLAIN.decode(tp.value).handle, "all_reduce", PLAIN.encode([torch.ones(4)]))
    start = time.monotonic()
    reply = d.dispatch(pb.Request(2, "", call, 1000))
    took = time.monotonic() - start
    # The same call again: refused at once, since rank 1 would still run the abandoned one
    # (without the refusal: a second wait of its deadline, or a result mixed with it).
    start = time.monotonic()
    again = d.dispatch(pb.Request(3, "", call, 1000))
    took_again = time.monotonic() - start
    Path(done).touch()
    error, refused = reply.error, again.error
    assert error is not None and refused is not None, (reply, again)
    return {
        "took": took,
        "category": error.category,
        "type": error.python_type,
        "message": error.message,
        "again": (refused.category, refused.python_type, refused.message),
        "took_again": took_again,
    }


@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
def test_a_collective_whose_peer_never_joins_gives_up_at_the_deadline(
    shm: bool, tmp_path: Path
) -> None:
    got = run_ranks(
        _all_reduce_alone, 2, free_port(), shm, str(tmp_path / "done"), timeout=_ABSENT_FOR + 30
    )[0]
    # Not the group's 60 s, nor the moment rank 1 leaves.
    assert 0.9 < got["took"] < 4.0, got
    assert got["category"] == "timeout" and got["type"] == "CollectiveTimeout", got
    message = got["message"]
    assert "all_reduce" in message and "rank 0" in message and "'tp" in message, message
    assert "unusable" in message, message
    # Then the group refuses its next collective at once, saying why.
    category, kind, refusal = got["again"]
    assert category == "python" and kind in ("StateError", "DistributedError"), got
    assert "unusable" in refusal and "all_reduce" in refusal, refusal
    assert got["took_again"] < 0.9, got  # not a second wait of its 1 s deadline


def _abandon_then(rank: int, port: int, shm: bool, first: str, done: str) -> dict:
    """Rank 0 runs ``first`` (an object receive or an all_reduce) on the TP group under a 1 s
    deadline, which rank 1 never joins, then the other one: what the second one does."""
    import torch

    tp: Any = _tp_group_of_two(rank, port, shm, done)
    if tp is None:
        return {}
    calls = {
        "recv_object": lambda: tp.recv_object(1),
        "all_reduce": lambda: tp.all_reduce(torch.ones(4)),
    }
    second = next(name for name in calls if name != first)
    got: dict = {}
    for name in (first, second):
        start = time.monotonic()
        try:
            with deadline.until(start + 1.0):
                calls[name]()
        except Exception as exc:
            got[name] = (type(exc).__name__, str(exc), time.monotonic() - start)
    Path(done).touch()
    return got


@pytest.mark.parametrize("first", ["recv_object", "all_reduce"])
@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
def test_an_abandoned_operation_makes_every_later_one_on_the_group_refused(
    shm: bool, first: str, tmp_path: Path
) -> None:
    """Objects and collectives of one GroupCoordinator share its CPU group: whichever of them
    timed out, the other is refused at once instead of waiting again (or pairing with what
    the other rank still runs)."""
    got = run_ranks(
        _abandon_then, 2, free_port(), shm, first, str(tmp_path / "done"), timeout=_ABSENT_FOR + 30
    )[0]
    kind, message, took = got[first]
    assert kind == "CollectiveTimeout" and "unusable" in message, got
    assert 0.9 < took < 4.0, got
    second = next(name for name in got if name != first)
    kind, message, took = got[second]
    assert kind == "StateError", got
    named = second.removesuffix("_object")  # the channel's words: "recv of an object"
    assert "refused" in message and "unusable" in message and named in message, got
    assert took < 0.9, got  # not a second wait of its 1 s deadline


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("wire", ["bridge", "vllm"])
def test_create_alone_gives_up_at_the_deadline_and_leaves_nothing_listening(
    rank: int, wire: str
) -> None:
    """A rank whose peers never come: its create ends at the caller's deadline (2 s), not
    at ``store_timeout`` (60 s), says how far the join got, and serves nothing after."""
    port = free_port()
    start = time.monotonic()
    with pytest.raises(StoreError) as failed, deadline.until(start + 2):
        StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=60, wire=wire)
    took = time.monotonic() - start
    assert 1.9 < took < 2 + GRACE, took
    message = str(failed.value)
    assert f"127.0.0.1:{port}" in message and "within 2 s" in message, message
    if rank == 0:
        assert "1 of 2 ranks joined" in message, message
    with socket.socket() as probe:  # nothing listens there any more
        assert probe.connect_ex(("127.0.0.1", port)) != 0
