"""A StatelessProcessGroup's operations over shared-memory boards, when all ranks share a node.

Each rank writes on its own board (``board.Board``: a small file under ``/dev/shm`` that
every rank maps) and rings the FIFO doorbells of the ranks asleep waiting for it; a rank
that waits sleeps on its own doorbell, and checks every second that the ranks it waits for
still run, so a rank that exits is reported at once instead of at the timeout. No store
request is made while things fit, and what does not goes through the store (``overflow``,
the group's store transport):

* ``send``/``recv``: message ``n`` to ``dst`` goes into slot ``n % RING`` of the sender's
  ring for ``dst``; a message whose slot ``dst`` has not read yet, or too large for a slot,
  goes on the pair's store queue instead (``spills`` on the board say how many did), and the
  receiver takes messages from both in number order. Sending never waits for the receiver;
* ``broadcast`` and ``all_gather`` (a broadcast from every rank, numbered as vLLM numbers
  them): into the source's broadcast ring, else under the value's store key. The source
  deletes what it put in the store (and its segments) once every rank's receipt on its
  board has passed it, or at the next barrier;
* ``barrier``: the three phases of the store barrier, on the boards (:meth:`barrier`).

Values are packed as on the store (``values.Values``: large ones in segments, sealed with
the group's key), so a board carries only what the store would.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.distributed import Store

from bridge_py import deadline
from bridge_py.distributed.errors import (
    BarrierFailure,
    BarrierTimeout,
    GroupTimeout,
    PeerGoneError,
)
from bridge_py.distributed.shm.segments import maker_exited
from bridge_py.distributed.shm.wait import DOORBELL, wait_until
from bridge_py.distributed.spg import keys, p2p
from bridge_py.distributed.spg.board import (
    FAILED,
    PASSED,
    Board,
    BoardError,
)
from bridge_py.distributed.spg.common import (
    BarrierHooks,
    arrival_timeout,
    exited,
    lost,
    timed_out,
)
from bridge_py.distributed.spg.store_transport import StoreTransport
from bridge_py.distributed.store.quiet import QUIET
from bridge_py.distributed.store.requests import StoreRequest

__all__ = ["ShmTransport", "queue_flusher"]

# How long one pop of a pair's store queue waits before looking at the ring again.
_QUEUE_POLL = 0.05


class _Exited(Exception):
    """A barrier's liveness check found ranks that exited before arriving (its verdict)."""


class ShmTransport:
    """One rank's side of a group's board traffic (see the module docstring).

    ``board`` is this rank's, connected to every rank's that still exists (``names``);
    ``overflow`` the group's store transport, which carries what the boards cannot.
    """

    def __init__(self, board: Board, names: list[str], overflow: StoreTransport) -> None:
        self.board = board
        self.names = names
        self.overflow = overflow
        self.values = overflow.values
        self.rank = overflow.rank
        self.world_size = overflow.world_size
        self._others = [r for r in range(self.world_size) if r != self.rank]
        # Per peer: messages that went through the store queue to it.
        self._queue_sent = [0] * self.world_size
        # (number, store key or "", segment or None) of this rank's broadcasts that left
        # something to remove once every rank has read them, oldest first.
        self._sent: deque[tuple[int, str, str | None]] = deque()

    # --- waiting --------------------------------------------------------------------------

    def _wait(
        self,
        op: str,
        what: str | Callable[[], str],
        srcs: list[int],
        timeout: float | None,
        ready: Callable[[int], bool | None],
        many: bool = False,
    ) -> None:
        """Sleep on the doorbell until ``ready(src)`` is true for every one of ``srcs``.

        ``ready`` returning None means "not yet, look again without sleeping" (a message is
        on its way through the store). GroupTimeout after ``timeout`` seconds (None: the
        store's timeout; either clamped to the running call's deadline), PeerGoneError
        once a rank waited for has exited, naming ``op``, this rank, the rank(s) and
        ``what`` (``many``: the values of a collective).
        """
        board, rank = self.board, self.rank
        waiting = srcs

        def look() -> bool | None:
            nonlocal waiting
            still, soon = [], False
            for src in waiting:
                done = ready(src)
                if not done:
                    still.append(src)
                    soon = soon or done is None
            waiting = still
            return None if soon else not still

        if look():
            return
        start = time.monotonic()
        limit = deadline.clamp(self.overflow.limit(timeout))

        def awaited() -> str:
            return what if isinstance(what, str) else what()

        def liveness() -> None:
            gone = board.gone(waiting)
            if gone:
                raise exited(op, rank, awaited(), gone if many else gone[0], start)

        try:
            wait_until(
                look,
                awaited,
                start + limit,
                check=liveness,
                sleep=lambda seconds: board.wait(seconds, waiting[0]),
                pace=DOORBELL,
            )
        except GroupTimeout:
            late = waiting if many else waiting[0]
            raise timed_out(op, rank, awaited(), late, start, limit) from None
        finally:
            board.awake()

    def _unopened(
        self,
        src: int,
        op: str,
        what: str,
        timeout: float | None,
        receive: Callable[[float | None], Callable[[], Any]],
    ) -> Callable[[], Any]:
        """``receive(timeout)`` through the store, for ``src`` whose board this rank never
        opened: ``src`` had closed its group, or exited, when this rank joined. What a rank
        sends is in the store before its process ends (its group's close flushes its rings
        there), so when ``src`` has exited the store gets a short look, and a PeerGoneError
        naming ``what`` if nothing is there."""
        if not maker_exited(self.names[src]):
            return receive(timeout)
        start = time.monotonic()
        look = DOORBELL.check_every if timeout is None else min(timeout, DOORBELL.check_every)
        try:
            return receive(look)
        except TimeoutError:
            raise exited(op, self.rank, what, src, start) from None

    # --- point to point -------------------------------------------------------------------

    def send(self, dst: int, seq: int, obj: Any) -> None:
        """Message ``seq`` to ``dst``: into its ring slot, else onto their store queue."""
        name = keys.p2p_value(self.rank, dst, seq)
        value = self.values.pack(name, obj, [dst] if dst != self.rank else None)[0]
        if not self.board.send(dst, seq, value):
            self.overflow.push(dst, seq, value, name)
            self._queue_sent[dst] += 1
            self.board.spilled(dst, self._queue_sent[dst])
        self.overflow.flush()

    def recv(
        self, src: int, seq: int, timeout: float | None, like: Tensor | None = None
    ) -> Callable[[], Any]:
        """Receive message ``seq`` from ``src``, from its ring slot or the store queue it
        took; returns what loads it (see ``StoreTransport.recv``)."""
        if not self.board.is_open(src):  # src had closed its group when this rank joined
            name = repr(keys.p2p_value(src, self.rank, seq))
            receive = lambda limit: self.overflow.recv(src, seq, limit, like)  # noqa: E731
            return self._unopened(src, "recv_obj", name, timeout, receive)
        self.overflow.flush()
        board, inbox = self.board, self.overflow.inbox
        name = keys.p2p_value(src, self.rank, seq)
        found: list[bytes | memoryview] = []

        def ready(_src: int) -> bool | None:
            data: bytes | memoryview | None = inbox.take(src, seq)
            if data is None:
                data = board.take(src, seq)
            if data is None and board.spills(src) > inbox.popped[src]:
                # A message waits in the store queue (or is on its way there: the push has
                # no reply). Pop with a short wait, then look at the ring again.
                try:
                    with QUIET:
                        data = inbox.receive(src, seq, _QUEUE_POLL)
                except RuntimeError as exc:
                    raise lost("recv_obj", self.rank, repr(name), src, start, exc) from exc
                if data is None:
                    return None
            if data is not None:
                found.append(data)
            return data is not None

        start = time.monotonic()
        if not ready(src):
            self._wait("recv_obj", repr(name), [src], timeout, ready)
        board.received(src, seq + 1)  # a copy was taken: the slot is free
        message = found[0]
        return lambda: self.values.unpack(name, message, src, label="message", like=like)

    # --- broadcast and all_gather ---------------------------------------------------------

    def _publish(self, seq: int, obj: Any, op: str) -> None:
        """Broadcast ``seq`` of this rank (for ``op``): into its ring slot, else under its
        store key."""
        key = keys.broadcast_value(self.rank, seq)
        value, segment = self.values.pack(key, obj, self._others)
        if self._sent:
            self._release(False)
        stored = not self.board.broadcast(seq, value)
        if stored:  # a slot some rank has not read yet, too large, no room on /dev/shm
            self.overflow.put(op, key, value)
            self.overflow.entries.append((key, time.time()))
        if stored or segment is not None:
            self._sent.append((seq, key if stored else "", segment))
        self.board.broadcast_sent(seq)
        self.overflow.flush()

    def _release(self, everything: bool) -> None:
        """Remove the store keys and segments of this rank's broadcasts that every rank has
        read (``everything``: all of them, which every rank has read by now)."""
        sent = self._sent
        if not sent or not (everything or self.board.connected):
            return
        read = (1 << 64) if everything else self.board.broadcasts_read()
        while sent and sent[0][0] < read:
            _seq, key, segment = sent.popleft()
            if key:
                self.overflow.discard([key])
            if segment is not None:
                self.values.segments.discard(segment)

    def _fetch(self, src: int, seq: int, op: str, timeout: float | None) -> bytes:
        """``src``'s broadcast ``seq``, from its ring slot or from the store (waiting at most
        ``timeout`` seconds for both, None: the store's timeout)."""
        board = self.board
        key = keys.broadcast_value(src, seq)
        found: list[bytes] = []

        def ready(src: int) -> bool:
            data = board.poll_broadcast(src, seq)
            if data is None:
                return False
            found.append(data)  # b"": in the store
            return True

        start = time.monotonic()
        self._wait(op, f"key {key!r}", [src], timeout, ready)
        if found[0]:
            return found[0]
        spent = time.monotonic() - start  # (the key is there by now: what is left will do)
        return self.overflow.await_key(
            key, src, op, max(self.overflow.limit(timeout) - spent, 0.001)
        )

    def broadcast_send(self, seq: int, obj: Any) -> None:
        """This rank's broadcast ``seq``: into its ring slot, else the store."""
        self._publish(seq, obj, "broadcast_obj")

    def broadcast_recv(
        self, src: int, seq: int, timeout: float | None, like: Tensor | None = None
    ) -> Callable[[], Any]:
        """A receiver's side of broadcast ``seq`` of ``src``, from its ring slot or the
        store; returns what loads it (see ``StoreTransport.recv``)."""
        board = self.board
        key = keys.broadcast_value(src, seq)
        if not board.is_open(src):
            receive = lambda limit: self.overflow.broadcast_recv(src, seq, limit, like)  # noqa: E731
            return self._unopened(src, "broadcast_obj", f"key {key!r}", timeout, receive)
        try:
            data = self._fetch(src, seq, "broadcast_obj", timeout)
        except BaseException:
            board.broadcast_received(src, seq)
            raise

        def load() -> Any:
            try:
                return self.values.unpack(key, data, src, last=False, like=like)
            finally:
                board.broadcast_received(src, seq)  # after loading: the slot may be reused

        return load

    def all_gather(
        self, seq: int, seqs: list[int], obj: Any, like: Tensor | None = None
    ) -> list[Any]:
        """Every rank's object: this rank's broadcast ``seq``, and rank ``r``'s broadcast
        ``seqs[r]``, all waited for at once (``like``: see ``StoreTransport.all_gather``)."""
        board = self.board
        if not board.connected:
            self._connect_all(f"all_gather_obj on rank {self.rank}")
        self._publish(seq, obj, "all_gather_obj")
        others, poll = self._others, board.poll_broadcast
        got: list[Any] = [obj] * self.world_size  # this rank's, then the others' as they come

        def ready(src: int) -> bool:
            data = poll(src, seqs[src])
            if data is None:
                return False
            got[src] = data  # b"": in the store
            return True

        def what() -> str:
            return f"keys {[keys.broadcast_value(src, seqs[src]) for src in others]}"

        self._wait("all_gather_obj", what, others, None, ready, many=True)
        board.unname()  # every rank has opened this rank's board by now: the names can go
        unpack = self.values.unpack
        try:
            for src in others:
                key = keys.broadcast_value(src, seqs[src])
                data = got[src]
                if not data:  # in the store
                    limit = deadline.clamp(self.overflow.default_timeout())
                    data = self.overflow.await_key(key, src, "all_gather_obj", limit)
                got[src] = unpack(key, data, src, last=False, like=like)
        finally:
            board.broadcasts_received(seqs)  # after loading: the slots may be reused
        return got

    # --- barrier --------------------------------------------------------------------------

    def barrier(self, barrier_id: int, timeout: float) -> None:
        """Barrier ``barrier_id`` over the boards: the three phases of the store barrier
        (``StoreTransport.barrier``), with no store request.

        1. each rank marks itself arrived on its board and rings the doorbells of the ranks
           asleep waiting for it, then sleeps on its own until every rank has arrived.
           Whether the barrier passed is *settled* once, under a lock on rank 0's board: by
           the first rank to see everyone arrived (passed; the others find it settled and
           take no lock) or to give up at ``timeout`` (failed, with its verdict, which rings
           every rank asleep), and every rank follows what was settled, so all ranks pass or
           all fail. A rank whose process exits makes it fail at once;
        2. every rank runs the ``all_arrived`` hook, marks itself departed and rings rank 0
           (if it sleeps waiting for this rank);
        3. rank 0 waits (at most ``timeout``) until every rank has departed, so that it does
           not leave, and perhaps shut the store down, while another rank still uses it.
        """
        board, rank, world_size = self.board, self.rank, self.world_size
        if not board.connected:
            self._connect_all(f"barrier {barrier_id} failed on rank {rank}")
        hooks = self.overflow.hooks((lambda: self._release(True)) if self._sent else None)
        start = time.monotonic()
        until = deadline.clamp_until(start + timeout)
        board.arrive(barrier_id)
        try:
            outcome, verdict, failure = self._arrivals(barrier_id, timeout, start, until, hooks)
        finally:
            board.awake()
        if outcome != PASSED:
            raise failure(f"barrier {barrier_id} failed on rank {rank}: {verdict}")
        if hooks.all_arrived is not None:
            hooks.all_arrived()
        board.depart(barrier_id)
        board.unname()  # every rank has opened this rank's board by now
        if rank != 0:
            return
        missing: list[int] = []

        def departed() -> bool:
            nonlocal missing
            missing = board.not_departed(barrier_id)
            return not missing

        until = deadline.clamp_until(time.monotonic() + timeout)
        try:
            wait_until(
                departed,
                "every rank to depart",
                until,
                sleep=lambda seconds: board.wait(seconds, missing[0]),
                pace=DOORBELL,
            )
        except GroupTimeout:
            raise BarrierTimeout(
                f"barrier {barrier_id} failed on rank 0: timed out after {timeout:g} s "
                f"in phase 3 (departure): {world_size - len(missing)} of {world_size} "
                "ranks departed"
            ) from None
        finally:
            board.awake()

    def _arrivals(
        self, barrier_id: int, timeout: float, start: float, until: float, hooks: BarrierHooks
    ) -> tuple[int, str, type[BarrierFailure]]:
        """Phase 1 of :meth:`barrier` once this rank has arrived: wait until every rank has
        arrived or the barrier is settled; return the outcome, its verdict and what this
        rank raises if it failed. Sleeps until the first rank still missing arrives (or a
        rank settles a failure, which rings every rank asleep)."""
        board, rank, world_size = self.board, self.rank, self.world_size
        missing: list[int] = []
        waited = False

        def settled() -> bool | None:
            nonlocal missing, waited
            missing = board.not_arrived(barrier_id)
            if not missing or board.decision(barrier_id) == FAILED:
                return True
            if not waited and hooks.while_waiting is not None:
                waited = True
                hooks.while_waiting()
                return None  # it took a while: look again before sleeping
            return False

        def liveness() -> None:
            gone = board.gone(missing)
            if gone:
                raise _Exited(f"ranks {gone} exited before arriving (seen by rank {rank})")

        try:
            wait_until(
                settled,
                "every rank to arrive",
                until,
                check=liveness,
                sleep=lambda seconds: board.wait(seconds, missing[0]),
                pace=DOORBELL,
            )
        except GroupTimeout:
            verdict = arrival_timeout(rank, timeout, world_size - len(missing), world_size, missing)
            outcome, settled_verdict = board.decide(barrier_id, FAILED, verdict)
            # A timeout only where this rank's own settled it: when another rank's
            # verdict came first, this rank fails with it, as over the store.
            failure = BarrierTimeout if settled_verdict == verdict else BarrierFailure
            return outcome, settled_verdict, failure
        except _Exited as exc:
            return (*board.decide(barrier_id, FAILED, str(exc)), BarrierFailure)
        if not missing:
            return (*board.decide(barrier_id, PASSED), BarrierFailure)
        return (*board.decide(barrier_id, FAILED), BarrierFailure)  # reads the verdict

    def _connect_all(self, what: str) -> None:
        """Open every rank's board (for a collective); PeerGoneError starting with ``what``
        when some rank's is gone (it exited, or closed its group)."""
        try:
            gone = self.board.connect(self.names, missing_ok=True)
        except BoardError as exc:
            raise BoardError(f"{what}: {exc}") from exc
        if gone:
            raise PeerGoneError(
                f"{what}: ranks {gone} exited or closed the group (their boards are gone)"
            )

    # --- expiry ---------------------------------------------------------------------------

    def expire(self, max_age: float, sent: list[int]) -> None:
        """Expire what went through the store (only some messages took the queues)."""
        self.overflow.expire(max_age, None)


def queue_flusher(store: Store, rank: int) -> Any:
    """What a closing board gives its unreceived messages to: the pairs' store queues (a
    receiver that has not opened the board finds them there)."""

    def flush(dst: int, number: int, value: bytes) -> None:
        name = keys.p2p_value(rank, dst, number)
        with StoreRequest("closing the group", rank, name):
            store.queue_push(keys.p2p_queue(rank, dst), p2p.frame(number, value))

    return flush
