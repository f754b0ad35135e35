"""barrier(timeout) fails fast and clearly when a rank is missing, and the group stays usable."""

from __future__ import annotations

import time

import pytest

from bridge_py.distributed import StatelessProcessGroup
from tests.distributed.harness import TRANSPORTS, free_port, late_barrier, run_ranks, use_transport

TIMEOUT = 1.0


def _absent_rank(rank: int, port: int, transport: str) -> dict:
    use_transport(transport)
    # store_timeout is large: the barrier must be bounded by its own timeout, not by this.
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 3, store_timeout=300)
    # Rank 2 misses barrier 0, then arrives late; every rank is present for the next one.
    return late_barrier(group, rank == 2, TIMEOUT + 1.0, TIMEOUT)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_barrier_times_out_naming_rank_phase_and_the_missing_rank(transport: str) -> None:
    results = run_ranks(_absent_rank, 3, free_port(), transport)
    for rank in (0, 1):
        error = results[rank]["error"]
        assert results[rank]["elapsed"] < TIMEOUT + 1.0, results[rank]
        assert f"failed on rank {rank}" in error
        assert "phase 1 (arrival)" in error
        assert "2 of 3 ranks arrived, rank 2 did not" in error
    # The late rank learns the same outcome at once instead of passing a barrier the others
    # gave up on, so all ranks agree and number their next barrier alike.
    late = results[2]
    assert "failed on rank 2" in late["error"]
    assert "timed out after 1 s in phase 1 (arrival): 2 of 3 ranks arrived" in late["error"]
    assert late["elapsed"] < 0.5
    for result in results:
        assert result["gathered"] == [0, 1, 2]


def _rank_0_gives_up_first(rank: int, port: int) -> str:
    use_transport("store")
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 3, store_timeout=60)
    if rank == 2:  # absent from the barrier
        time.sleep(4)
        return ""
    try:
        group.barrier(timeout=1.0 if rank == 0 else 3.0)
    except RuntimeError as exc:
        if rank == 0:  # it serves the store: keep it up until rank 1 has read the verdict
            time.sleep(4)  # (once it failed at 3 s at the latest)
        return str(exc)
    return "passed"


def test_the_rank_serving_the_store_names_the_missing_rank_too() -> None:
    """Rank 0 gives up first, so its verdict is everyone's (its own bit is 1 << 0)."""
    errors = run_ranks(_rank_0_gives_up_first, 3, free_port(), timeout=60)
    for error in errors[:2]:
        assert "rank 0 timed out after 1 s in phase 1 (arrival)" in error, error
        assert "2 of 3 ranks arrived, rank 2 did not" in error, error
