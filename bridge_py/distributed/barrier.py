"""The three-phase store barrier of StatelessProcessGroup, bounded by its own timeout.

Barrier ``n`` (every rank counts its barriers, and all ranks call them in the same order)
uses four keys, all deleted once every rank has left:

1. arrive: each rank ``add``s 1 to ``arrivals``. The rank that brings it to ``world_size``
   writes ``ok`` to ``outcome``; the others wait for ``outcome`` with ``store.wait`` (no
   polling), on a separate connection and for at most ``timeout`` seconds. A rank that times
   out writes its verdict ("rank r timed out ... k of N ranks arrived") to ``outcome``
   instead. ``outcome`` is written with ``compare_set`` so the first writer wins: every rank,
   even one that arrives after the timeout, reads the same outcome, and all pass or all fail.
2. confirm: each rank, having seen ``ok``, ``add``s 1 to ``departures``; the last one deletes
   ``arrivals`` and ``outcome`` (nobody reads them any more) and sets ``all_departed``.
   Ranks other than 0 return here.
3. rank 0, which serves the store, waits (again at most ``timeout``) for ``all_departed``,
   so it cannot leave, and perhaps shut the store down, while another rank is still inside;
   then it deletes ``departures`` and ``all_departed``.

A group can hook its own work into a barrier (:class:`BarrierHooks`): something to do before
arriving, while waiting for the others (deferred deletes, off the critical path), once all
ranks have arrived (every rank has finished everything it did before the barrier, so values
they read can go) and keys for the last rank to leave to delete with ``arrivals``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from torch.distributed import Store

from bridge_py.distributed import keys
from bridge_py.distributed.waiting import BoundedWaiter

__all__ = ["BarrierHooks", "run_barrier"]

_OK = b"ok"
_ABSENT = b"\x00absent"


def _store_failure(barrier_id: int, rank: int, phase: str, exc: Exception) -> RuntimeError:
    return RuntimeError(
        f"barrier {barrier_id} failed on rank {rank} in phase {phase}: store error: {exc}"
    )


@dataclasses.dataclass(frozen=True)
class BarrierHooks:
    """Optional work of the calling group at fixed points of one barrier."""

    # Before this rank arrives (phase 1).
    before_arrival: Callable[[], None] | None = None
    # After arriving, when other ranks are still to come (the rank would only wait).
    while_waiting: Callable[[], None] | None = None
    # Once all ranks have arrived (and before this rank confirms it in phase 2).
    all_arrived: Callable[[], None] | None = None
    # Keys the last rank to leave deletes, with ``arrivals`` and ``outcome``.
    delete_when_all_departed: Sequence[str] = ()


_NO_HOOKS = BarrierHooks()


def run_barrier(
    store: Store,
    waiter: BoundedWaiter,
    rank: int,
    world_size: int,
    barrier_id: int,
    timeout: float,
    hooks: BarrierHooks | None = None,
) -> None:
    """Run barrier ``barrier_id`` for ``rank``; raise RuntimeError on timeout or store failure."""
    arrivals = keys.barrier_arrivals(barrier_id)
    outcome_key = keys.barrier_outcome(barrier_id)
    departures = keys.barrier_departures(barrier_id)
    all_departed = keys.barrier_all_departed(barrier_id)
    hooks = _NO_HOOKS if hooks is None else hooks

    # Phase 1: arrive, and learn (with every other rank) whether all ranks arrived in time.
    try:
        if hooks.before_arrival is not None:
            hooks.before_arrival()
        arrived = store.add(arrivals, 1)
        if arrived >= world_size:
            outcome = store.compare_set(outcome_key, "", _OK)
        else:
            if hooks.while_waiting is not None:
                hooks.while_waiting()
            if waiter.wait([outcome_key], timeout):
                # One round trip (``get`` is two: a wait, then the read): the key exists, so
                # compare_set with an impossible expected value returns it unchanged.
                outcome = store.compare_set(outcome_key, _ABSENT, _ABSENT)
            else:
                seen = store.add(arrivals, 0)
                verdict = (
                    f"rank {rank} timed out after {timeout:g} s in phase 1 (arrival): "
                    f"{seen} of {world_size} ranks arrived"
                )
                outcome = store.compare_set(outcome_key, "", verdict.encode())
        if outcome == _OK and hooks.all_arrived is not None:
            hooks.all_arrived()
    except RuntimeError as exc:
        raise _store_failure(barrier_id, rank, "1 (arrival)", exc) from exc
    if outcome != _OK:
        raise RuntimeError(f"barrier {barrier_id} failed on rank {rank}: {outcome.decode()}")

    # Phase 2: confirm the arrival of all ranks by departing.
    try:
        departed = store.add(departures, 1)
        if departed == world_size:
            store.delete_key(arrivals)
            store.delete_key(outcome_key)
            for key in hooks.delete_when_all_departed:
                store.delete_key(key)
            if rank == 0:
                store.delete_key(departures)
                return
            store.set(all_departed, _OK)
    except RuntimeError as exc:
        raise _store_failure(barrier_id, rank, "2 (confirm)", exc) from exc
    if rank != 0:
        return

    # Phase 3: rank 0 leaves last.
    try:
        everyone_left = waiter.wait([all_departed], timeout)
        if everyone_left:
            store.delete_key(departures)
            store.delete_key(all_departed)
        else:
            gone = store.add(departures, 0)
    except RuntimeError as exc:
        raise _store_failure(barrier_id, rank, "3 (departure)", exc) from exc
    if not everyone_left:
        raise RuntimeError(
            f"barrier {barrier_id} failed on rank 0: timed out after {timeout:g} s in "
            f"phase 3 (departure): {gone} of {world_size} ranks departed"
        )
