"""The three-phase store barrier of StatelessProcessGroup, bounded by its own timeout.

Barrier ``n`` (every rank counts its barriers, and all ranks call them in the same order) uses
one key, the counter ``arrivals`` (:func:`keys.barrier_arrivals`), and the ranks' barrier
queues (:func:`keys.barrier_queue`, one per rank) for messages tagged with ``n``:

1. arrive: each rank ``add``s 1 to ``arrivals``. The rank that brings it to ``world_size``
   knows that all ranks arrived and tells every other rank so (``queue_push``: no reply to
   wait for); the others pop their queue, waiting at most ``timeout`` seconds. A rank that
   times out adds :data:`POISON` to ``arrivals`` and pushes its verdict ("rank r timed out
   ... k of N ranks arrived") to every other rank: a rank that arrives later sees the poison
   in its own ``add`` and fails with that verdict, so all ranks pass or all fail. (A rank
   whose poison finds that all ranks had arrived, the last one just in time, passes.)
2. depart: every rank other than 0, once it knows that all arrived (and has run the
   ``all_arrived`` hook), pushes "left" to rank 0 and returns (without such a hook, the last
   arrival's message to rank 0 says both).
3. rank 0, which serves the store, pops its queue until every other rank has left (again at
   most ``timeout`` seconds), so it cannot leave, and perhaps shut the store down, while
   another rank is still inside; then it deletes ``arrivals``.

On two ranks that is, on the slowest rank, an ``add``, a pop (a wait, then the pop) and a
``delete_key``; the pops remove the messages, so only ``arrivals`` is left to delete.
Messages of an earlier barrier (left over when it failed) are dropped; those of a later one
(a rank that gave up on the next barrier while rank 0 still waits in this one) are kept.

Ranks that all run on one node (once they know it) take the same three phases over their
shared-memory boards instead, with no store request (:func:`run_board_barrier`).

A group can hook its own work into a barrier (:class:`BarrierHooks`): something to do before
arriving, while waiting for the others (deferred deletes, off the critical path), once all
ranks have arrived (every rank has finished everything it did before the barrier, so values
they read can go) and keys for rank 0 to delete with ``arrivals``.
"""

from __future__ import annotations

import dataclasses
import struct
import time
from collections.abc import Callable, Sequence

from torch.distributed import Store

from bridge_py.distributed.errors import (
    AuthenticationError,
    BarrierFailure,
    BarrierTimeout,
)
from bridge_py.distributed.spg import keys
from bridge_py.distributed.spg.board import FAILED, LIVENESS_PERIOD, PASSED, Board, BoardError
from bridge_py.distributed.store.waiting import pop_before

__all__ = [
    "POISON",
    "BarrierFailure",
    "BarrierHooks",
    "BarrierTimeout",
    "Mailbox",
    "run_barrier",
    "run_board_barrier",
]

# Added to ``arrivals`` by a rank that gave up: far above any world size.
POISON = 1 << 32
# A message: barrier number, kind, sender; then the verdict's text for _FAILED.
_ITEM = struct.Struct(">QBI")
_ALL_ARRIVED, _LEFT, _ARRIVED_AND_LEFT, _FAILED = 1, 2, 3, 4


def _store_failure(barrier_id: int, rank: int, phase: str, exc: Exception) -> BarrierFailure:
    return BarrierFailure(
        f"barrier {barrier_id} failed on rank {rank} in phase {phase}: store error: {exc}"
    )


@dataclasses.dataclass(frozen=True)
class BarrierHooks:
    """Optional work of the calling group at fixed points of one barrier."""

    # Before this rank arrives (phase 1).
    before_arrival: Callable[[], None] | None = None
    # After arriving, when other ranks are still to come (the rank would only wait).
    while_waiting: Callable[[], None] | None = None
    # Once all ranks have arrived (and before this rank departs in phase 2).
    all_arrived: Callable[[], None] | None = None
    # Keys rank 0 deletes with ``arrivals`` once all ranks have left.
    delete_when_all_departed: Sequence[str] = ()


_NO_HOOKS = BarrierHooks()


class Mailbox:
    """One rank's barrier queue: messages to it, popped in barrier order, with a deadline."""

    def __init__(self, store: Store, rank: int) -> None:
        self._store = store
        self._rank = rank
        self._queue = keys.barrier_queue(rank)
        # (barrier, kind, sender, text) of messages for later barriers, popped early.
        self._later: list[tuple[int, int, int, bytes]] = []

    def send(self, dst: int, barrier_id: int, kind: int, text: bytes = b"") -> None:
        """Push a message of barrier ``barrier_id`` to rank ``dst`` (no reply awaited)."""
        item = _ITEM.pack(barrier_id, kind, self._rank) + text
        self._store.queue_push(keys.barrier_queue(dst), item)

    def receive(self, barrier_id: int, deadline: float) -> tuple[int, int, bytes] | None:
        """``(kind, sender, text)`` of the next message of ``barrier_id``; None at ``deadline``.

        ``deadline`` is a ``time.monotonic()`` value. Each pop's wait is bounded by what is
        left (a TCPStore client that gives up a wait cancels it, so the connection stays in
        step). Store failures propagate.
        """
        for index, (bid, kind, sender, text) in enumerate(self._later):
            if bid == barrier_id:
                del self._later[index]
                return kind, sender, text
        while (item := pop_before(self._store, self._queue, deadline)) is not None:
            if len(item) < _ITEM.size:
                continue  # not a barrier message
            bid, kind, sender = _ITEM.unpack_from(item)
            if bid == barrier_id:
                return kind, sender, item[_ITEM.size :]
            if bid > barrier_id:
                self._later.append((bid, kind, sender, item[_ITEM.size :]))
        return None


def run_barrier(
    store: Store,
    mailbox: Mailbox,
    rank: int,
    world_size: int,
    barrier_id: int,
    timeout: float,
    hooks: BarrierHooks | None = None,
) -> None:
    """Run barrier ``barrier_id`` for ``rank``; BarrierTimeout when a rank does not arrive or
    leave in time, BarrierFailure when another rank gave up or the store failed."""
    arrivals = keys.barrier_arrivals(barrier_id)
    hooks = _NO_HOOKS if hooks is None else hooks
    left = 0  # ranks known to have left (rank 0 may hear of some while it waits in phase 1)

    # Phase 1: arrive, and learn (with every other rank) whether all ranks arrived in time.
    try:
        if hooks.before_arrival is not None:
            hooks.before_arrival()
        arrived = store.add(arrivals, 1)
        # With nothing to do once all arrived, the last to arrive also leaves at once.
        merged = hooks.all_arrived is None
        if arrived == world_size:  # the last to arrive, none gave up before
            for dst in range(world_size):
                if dst != rank:
                    kind = _ARRIVED_AND_LEFT if dst == 0 and merged else _ALL_ARRIVED
                    mailbox.send(dst, barrier_id, kind)
        elif arrived > world_size:  # a rank gave up before this one arrived
            raise BarrierFailure(_verdict_of_others(mailbox, barrier_id, rank, timeout))
        else:
            if hooks.while_waiting is not None:
                hooks.while_waiting()
            left = _wait_for_all(store, mailbox, rank, world_size, barrier_id, timeout)
        if hooks.all_arrived is not None:
            hooks.all_arrived()
    except (BarrierFailure, AuthenticationError, BoardError):
        raise  # a forged node card or a refused board (read by a hook): not a store failure
    except RuntimeError as exc:
        raise _store_failure(barrier_id, rank, "1 (arrival)", exc) from exc

    # Phase 2: depart (the last to arrive may have said so to rank 0 already).
    if rank != 0:
        if arrived != world_size or not merged:
            try:
                mailbox.send(0, barrier_id, _LEFT)
            except RuntimeError as exc:
                raise _store_failure(barrier_id, rank, "2 (confirm)", exc) from exc
        return

    # Phase 3: rank 0 leaves last.
    gone = 1 + left
    try:
        deadline = time.monotonic() + timeout
        while gone < world_size:
            message = mailbox.receive(barrier_id, deadline)
            if message is None:
                break
            if message[0] in (_LEFT, _ARRIVED_AND_LEFT):
                gone += 1
        if gone == world_size:
            store.delete_key(arrivals)
            for key in hooks.delete_when_all_departed:
                store.delete_key(key)
    except RuntimeError as exc:
        raise _store_failure(barrier_id, rank, "3 (departure)", exc) from exc
    if gone < world_size:
        raise BarrierTimeout(
            f"barrier {barrier_id} failed on rank 0: timed out after {timeout:g} s in "
            f"phase 3 (departure): {gone} of {world_size} ranks departed"
        )


def _wait_for_all(
    store: Store, mailbox: Mailbox, rank: int, world_size: int, barrier_id: int, timeout: float
) -> int:
    """Phase 1 for a rank that is not the last to arrive: return once all have, or raise.

    Returns how many ranks this rank heard leave meanwhile (only rank 0 hears of that).
    """
    deadline = time.monotonic() + timeout
    left = 0
    while True:
        message = mailbox.receive(barrier_id, deadline)
        if message is None:
            break
        kind, _sender, text = message
        if kind == _FAILED:
            raise BarrierFailure(f"barrier {barrier_id} failed on rank {rank}: {text.decode()}")
        if kind in (_LEFT, _ARRIVED_AND_LEFT):
            left += 1
        if kind in (_ALL_ARRIVED, _ARRIVED_AND_LEFT):
            return left
    # Timed out: give up, unless the last rank arrived just now.
    seen = store.add(keys.barrier_arrivals(barrier_id), POISON)
    count = seen % POISON
    if seen // POISON == 1 and count >= world_size:
        return left  # all had arrived: passed (the message saying so is dropped later)
    if seen // POISON > 1:  # another rank gave up first: its verdict is everyone's
        raise BarrierFailure(_verdict_of_others(mailbox, barrier_id, rank, timeout))
    verdict = (
        f"rank {rank} timed out after {timeout:g} s in phase 1 (arrival): "
        f"{count} of {world_size} ranks arrived"
    )
    for dst in range(world_size):
        if dst != rank:
            mailbox.send(dst, barrier_id, _FAILED, verdict.encode())
    raise BarrierTimeout(f"barrier {barrier_id} failed on rank {rank}: {verdict}")


def _verdict_of_others(mailbox: Mailbox, barrier_id: int, rank: int, timeout: float) -> str:
    """The message for a rank that finds the barrier already failed: the first verdict."""
    deadline = time.monotonic() + timeout
    while True:
        message = mailbox.receive(barrier_id, deadline)
        if message is None:
            return (
                f"barrier {barrier_id} failed on rank {rank}: another rank gave up before "
                "all ranks arrived"
            )
        kind, _sender, text = message
        if kind == _FAILED:
            return f"barrier {barrier_id} failed on rank {rank}: {text.decode()}"


def run_board_barrier(
    board: Board,
    rank: int,
    world_size: int,
    barrier_id: int,
    timeout: float,
    hooks: BarrierHooks | None = None,
) -> None:
    """Barrier ``barrier_id`` over shared-memory boards (ranks of one node, see ``spg_board``).

    The same three phases as :func:`run_barrier`, with no store request:

    1. each rank marks itself arrived on its board and rings every doorbell, then sleeps on its
       own until every rank has arrived. Whether the barrier passed is *settled* once, under a
       lock on rank 0's board: by the first rank to see everyone arrived (passed) or to give
       up at ``timeout`` (failed, with its verdict), and every rank follows what was settled,
       so all ranks pass or all fail. A rank whose process exits makes it fail at once;
    2. every rank runs the ``all_arrived`` hook, marks itself departed and rings rank 0;
    3. rank 0 waits (at most ``timeout``) until every rank has departed, so that it does not
       leave, and perhaps shut the store down, while another rank still uses it in its hook.
    """
    hooks = _NO_HOOKS if hooks is None else hooks
    if hooks.before_arrival is not None:
        hooks.before_arrival()
    start = time.monotonic()
    deadline = start + timeout
    check_at = start + LIVENESS_PERIOD
    board.arrive(barrier_id)
    waited = False
    failure: type[BarrierFailure] = BarrierFailure  # what this rank raises if it fails
    while True:
        missing = board.not_arrived(barrier_id)
        if not missing:
            outcome, verdict = board.decide(barrier_id, PASSED)
            break
        if board.decision(barrier_id) == FAILED:
            outcome, verdict = board.decide(barrier_id, FAILED)  # reads the verdict
            break
        if not waited and hooks.while_waiting is not None:
            waited = True
            hooks.while_waiting()
            continue
        now = time.monotonic()
        if now >= deadline:
            verdict = (
                f"rank {rank} timed out after {timeout:g} s in phase 1 (arrival): "
                f"{world_size - len(missing)} of {world_size} ranks arrived"
            )
            outcome, verdict = board.decide(barrier_id, FAILED, verdict)
            failure = BarrierTimeout
            break
        if now >= check_at:
            check_at = now + LIVENESS_PERIOD
            gone = board.gone(missing)
            if gone:
                verdict = f"ranks {gone} exited before arriving (seen by rank {rank})"
                outcome, verdict = board.decide(barrier_id, FAILED, verdict)
                break
        board.wait(min(deadline, check_at) - now)
    if outcome != PASSED:
        raise failure(f"barrier {barrier_id} failed on rank {rank}: {verdict}")
    if hooks.all_arrived is not None:
        hooks.all_arrived()
    board.depart(barrier_id)
    if rank != 0:
        return
    deadline = time.monotonic() + timeout
    while missing := board.not_departed(barrier_id):
        now = time.monotonic()
        if now >= deadline:
            raise BarrierTimeout(
                f"barrier {barrier_id} failed on rank 0: timed out after {timeout:g} s in "
                f"phase 3 (departure): {world_size - len(missing)} of {world_size} ranks "
                "departed"
            )
        board.wait(deadline - now)
