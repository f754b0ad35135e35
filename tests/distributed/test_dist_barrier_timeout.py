"""barrier(timeout) fails fast and clearly when a rank is missing; the group then refuses
every later operation at once instead of failing each after its timeout."""

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
    # gave up on; then every rank refuses the next barrier at once.
    late = results[2]
    assert "failed on rank 2" in late["error"]
    assert "timed out after 1 s in phase 1 (arrival): 2 of 3 ranks arrived" in late["error"]
    assert late["elapsed"] < 0.5
    for rank, result in enumerate(results):
        assert result["next_s"] < 0.5, result
        assert result["next"].startswith(f"StateError: barrier on rank {rank} "), result
        assert "refused: barrier 0 failed on it (Barrier" in result["next"], result


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


def _skipped_barrier(rank: int, port: int, transport: str) -> list[tuple[str, float]]:
    use_transport(transport)
    group = StatelessProcessGroup.create("127.0.0.1", port, rank, 2, store_timeout=300)
    outcomes = []
    calls = [lambda: group.barrier(timeout=TIMEOUT)] if rank == 0 else []  # rank 1 skips it
    if rank == 1:
        time.sleep(TIMEOUT + 1.0)  # the driver's next call comes after rank 0 gave up
    # Then a driver retries in lockstep, as after any failure: barrier, barrier, gather.
    calls += [lambda: group.barrier(timeout=10), lambda: group.barrier(timeout=10)]
    calls.append(lambda: group.all_gather_obj(rank))
    for call in calls:
        start = time.monotonic()
        try:
            call()
            outcomes.append(("passed", time.monotonic() - start))
        except RuntimeError as exc:
            outcomes.append((f"{type(exc).__name__}: {exc}", time.monotonic() - start))
    if rank == 0:
        time.sleep(TIMEOUT + 3)  # it serves the store: stay until rank 1 is done
    return outcomes


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_after_a_skipped_barrier_every_call_fails_at_once(transport: str) -> None:
    """The ranks are a barrier apart: instead of every later barrier failing after its
    full timeout, the group is unusable on both, and says why at once."""
    first, skipper = run_ranks(_skipped_barrier, 2, free_port(), transport, timeout=60)
    message, elapsed = first[0]
    assert message.startswith("BarrierTimeout: barrier 0 failed on rank 0"), message
    assert elapsed < TIMEOUT + 1.0
    # Rank 1's first barrier is barrier 0, which failed: it learns that at once.
    message, elapsed = skipper[0]
    assert "Barrier" in message and "barrier 0 failed on rank 1: rank 0 timed out" in message
    assert elapsed < 0.5, message
    for rank, outcomes, ops in (
        (0, first[1:], ["barrier", "barrier", "all_gather_obj"]),
        (1, skipper[1:], ["barrier", "all_gather_obj"]),
    ):
        assert len(outcomes) == len(ops)
        for (message, elapsed), op in zip(outcomes, ops, strict=True):
            assert elapsed < 0.5, message
            assert message.startswith(f"StateError: {op} on rank {rank} "), message
            assert "refused: barrier 0 failed on it" in message, message
