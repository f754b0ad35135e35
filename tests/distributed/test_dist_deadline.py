"""A caller's deadline (``bridge_py.deadline``) clamps the group's waits.

A worker runs each request under its caller's deadline; a wait of StatelessProcessGroup
that would outlast it gives up at it, as at its own timeout: a receive that gives up
takes nothing, so the next receive gets the next message. Without a deadline nothing
changes (the store's timeout, or the call's own).
"""

from __future__ import annotations

import datetime
import time

import pytest
from torch.distributed import TCPStore

from bridge_py import deadline
from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue
from bridge_py.distributed.errors import BarrierTimeout, GroupTimeout

pytestmark = pytest.mark.timeout(60)


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
