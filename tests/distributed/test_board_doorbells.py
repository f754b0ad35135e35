"""When a board rings a doorbell: only for a rank asleep waiting for the writer (or anyone).

Boards of a group made in this one process, connected to each other; what a doorbell got is
read straight off its FIFO (a byte per ring).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bridge_py.distributed.spg import board as spg_board

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def boards() -> Iterator[list[spg_board.Board]]:
    """Connected boards of ranks 0, 1 and 2 of a 3-rank group, made in this process."""
    group = [spg_board.Board(rank, 3) for rank in range(3)]
    names = [b.name for b in group]
    try:
        for board in group:
            board.connect(names)
        yield group
    finally:
        for board in group:
            board.close()


def _sleep(board: spg_board.Board, src: int = -1) -> None:
    """Bring ``board`` to where its wait for ``src`` would sleep: its asleep word says whom it
    waits for (the first sleep of a wait says so and returns at once)."""
    board.wait(5.0, src)
    assert board._armed


def _rings(board: spg_board.Board) -> int:
    """How many times ``board``'s doorbell was rung since last asked (empties it)."""
    try:
        return len(os.read(board._own_bell, 4096))
    except BlockingIOError:
        return 0


def test_a_rank_that_does_not_sleep_is_not_rung(boards: list[spg_board.Board]) -> None:
    rank0, rank1, _rank2 = boards  # none has slept (a wait's spin does not; test_shm_wait)
    assert rank0.send(1, 0, b"x")
    rank0.broadcast_sent(0)  # ranks 1 and 2 do not wait: nothing rung
    rank1.arrive(0)
    rank1.depart(0)
    assert [_rings(b) for b in boards] == [0, 0, 0]


def test_a_sleeping_rank_is_rung_only_by_the_rank_it_waits_for(
    boards: list[spg_board.Board],
) -> None:
    rank0, rank1, rank2 = boards
    _sleep(rank2, src=1)  # says whom it waits for, and returns at once (it looks again)
    assert rank0.send(2, 0, b"from 0")
    rank0.broadcast_sent(0)
    assert _rings(rank2) == 0  # waiting for rank 1: news from rank 0 does not wake it
    assert rank1.send(2, 0, b"from 1")
    assert _rings(rank2) == 1
    rank1.arrive(0)  # ring_all: rank 2 waits for rank 1, rank 0 does not sleep
    assert [_rings(b) for b in boards] == [0, 0, 1]
    rank2.awake()
    assert rank1.send(2, 1, b"again")
    assert _rings(rank2) == 0  # its wait is over


def test_a_rank_waiting_for_anyone_is_rung_by_all(boards: list[spg_board.Board]) -> None:
    rank0, rank1, rank2 = boards
    _sleep(rank1)
    rank0.broadcast_sent(0)
    rank2.depart(0)  # rings rank 0 only: rank 1 is not rung by it
    assert [_rings(b) for b in boards] == [0, 1, 0]
    assert rank2.send(1, 0, b"x")
    assert _rings(rank1) == 1


def test_a_failed_barrier_wakes_every_sleeper_a_passed_one_none(
    boards: list[spg_board.Board],
) -> None:
    rank0, rank1, rank2 = boards
    _sleep(rank0, src=2)
    _sleep(rank1, src=2)
    assert rank1.decide(0, spg_board.PASSED) == (spg_board.PASSED, "")
    assert [_rings(b) for b in boards] == [0, 0, 0]
    assert rank2.decide(0, spg_board.FAILED, "late") == (spg_board.PASSED, "")  # settled once
    outcome = rank1.decide(1, spg_board.FAILED, "rank 2 is late")
    assert outcome == (spg_board.FAILED, "rank 2 is late")
    assert [_rings(b) for b in boards] == [1, 0, 0]  # rank 1 itself was the one to decide
    assert rank2.decide(1, spg_board.PASSED) == outcome  # read without the lock
