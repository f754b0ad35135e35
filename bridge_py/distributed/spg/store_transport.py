"""A StatelessProcessGroup's operations through its TCPStore: one path per operation.

The transport of ranks on several nodes (and of a group made from a store it was given); the
shared-memory transport also sends through it what does not fit its boards. Keys and queues
are named in ``keys``:

* ``send``/``recv``: the object goes on the store queue of its (sender, receiver) pair
  (``p2p``), numbered per pair; receiving pops it, so nothing is left to delete;
* ``broadcast``: the source sets ``bcast/<src>/<n>``; each receiver reads it and, with more
  than one receiver, counts itself in ``.../acks``; the last one deletes both;
* ``all_gather``: each rank sets its value, then reads every other rank's in one request
  (``multi_get``, which waits for all of them); a rank deletes its value once every rank
  has read it (when its next all_gather completes, or at the next barrier);
* ``barrier``: three phases over a counter and the ranks' barrier queues (:meth:`barrier`).

Reads of values that are no longer needed are deleted by the reaper, on its own thread
(``store.reaper``), so that no operation waits for them. Waits are bounded by the call's
timeout, or the store's, and fail with GroupTimeout naming this rank, the peer and the key;
a store that goes away is a StoreError naming them too (``common``), whatever request found
it gone. Store requests run ``with QUIET`` (``store.quiet``), those that are not waits
``with StoreRequest`` (``store.requests``, which also makes their failure a StoreError):
torch logs nothing of the failures that these errors report.
"""

from __future__ import annotations

import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.distributed import Store

from bridge_py import deadline
from bridge_py.distributed.auth import AuthenticationError
from bridge_py.distributed.errors import (
    BarrierFailure,
    BarrierStoreError,
    BarrierTimeout,
    GroupTimeout,
    is_store_timeout,
)
from bridge_py.distributed.spg import keys, p2p
from bridge_py.distributed.spg.common import (
    BarrierHooks,
    arrival_timeout,
    lost,
    store_seconds,
    timed_out,
    wait_limit,
)
from bridge_py.distributed.spg.values import SharedValue, Values
from bridge_py.distributed.store.quiet import QUIET
from bridge_py.distributed.store.reaper import KeyReaper
from bridge_py.distributed.store.requests import StoreRequest, check_value
from bridge_py.distributed.store.torch_api import compare_set_bytes, set_bytes
from bridge_py.distributed.store.waiting import BoundedWaiter, pop_before
from bridge_py.distributed.store.watchdog import watched, why_lost

__all__ = ["POISON", "Mailbox", "StoreTransport"]

# compare_set's expected value for "read without waiting": no stored value is ever this (no
# pickle, tag or descriptor starts with "\x00a"), so the value is returned unchanged.
_ABSENT = b"\x00absent"
# After a value was not there yet, wait this many times before asking without waiting again.
_EAGER_BACKOFF = 4


class StoreTransport:
    """One rank's side of a group's store traffic (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        values: Values,
        entries: deque[tuple[str, float]],
        local: list[bool] | None = None,
    ) -> None:
        """``entries`` is the group's record of the keys it wrote (vLLM's field), appended
        to here; ``local`` says which ranks share this node (their large values then go
        through shared memory; None: none does)."""
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.values = values
        self.entries = entries
        self.locate(local if local is not None else [False] * world_size)
        self._others = [r for r in range(world_size) if r != rank]
        # What this rank adds to a barrier's ``arrivals``, and its value once all arrived:
        # a bit per rank where they fit below POISON (a timeout can then say who is
        # missing), else a count.
        self._named = named = world_size <= _NAMED_ARRIVALS
        self._arrive_by = 1 << rank if named else 1
        self._all_in = (1 << world_size) - 1 if named else world_size
        self._outbox = [keys.p2p_queue(rank, dst) for dst in range(world_size)]
        self.inbox = p2p.Inbox(store, rank, world_size)
        self._mailbox = Mailbox(store, rank)
        self._waiter = BoundedWaiter(store)
        # Keys this rank has read and may delete, handed at its next store operation (after
        # a write, or before a wait) to the reaper, which deletes them on its own thread.
        self._trash: list[str] = []
        self._reaper = KeyReaper(store)
        # This rank's values (and segments) of its last all_gather, until all ranks read them.
        self._own_gather: list[tuple[str, str | None]] = []
        # Fetches left before trying to read a value without waiting first (per kind, src).
        self._eager_skips: dict[tuple[str, int], int] = {}

    def locate(self, local: list[bool]) -> None:
        """Which ranks share this node: their large values go through shared memory."""
        self.local = local
        self._all_local = self.world_size > 1 and all(local)

    # --- timeouts -----------------------------------------------------------------------

    def default_timeout(self) -> float:
        """The store's timeout, in seconds (300 when it has none)."""
        return store_seconds(self.store)

    def limit(self, timeout: float | None) -> float:
        """``timeout`` (None: the store's), checked to be a positive number of seconds."""
        return wait_limit(self.store, timeout)

    # --- deferred deletes -----------------------------------------------------------------

    def discard(self, names: list[str]) -> None:
        """Delete ``names`` at this rank's next store operation (by the reaper)."""
        self._trash += names

    def flush(self) -> None:
        """Hand the keys in the trash to the reaper (nothing waits for them)."""
        if self._trash:
            self._reaper.delete(self._trash)
            self._trash.clear()

    def flush_now(self) -> None:
        """Delete the trash and wait until every key handed to the reaper is gone."""
        self.flush()
        self._reaper.drain(self.default_timeout())

    def release_own_gather(self) -> None:
        """Every rank has read this rank's last all_gather value: drop it (and its segment)."""
        for name, segment in self._own_gather:
            if name:
                self._trash.append(name)
            if segment is not None:
                self.values.segments.discard(segment)
        self._own_gather = []

    def keep_own_gather(self, name: str, segment: str | None) -> None:
        """This rank's value of the all_gather just completed: released at the next one."""
        self.release_own_gather()  # every rank has read the one before
        if name or segment is not None:
            self._own_gather = [(name, segment)]

    # --- point to point -------------------------------------------------------------------

    def send(self, dst: int, seq: int, obj: Any) -> None:
        """Push object ``seq`` for ``dst`` on their queue (no reply is awaited)."""
        name = keys.p2p_value(self.rank, dst, seq)
        local = self.local[dst] and dst != self.rank
        self.push(dst, seq, self.values.pack(name, obj, [dst] if local else None)[0], name)

    def push(self, dst: int, seq: int, value: bytes, name: str) -> None:
        """Push the packed message ``seq`` (named ``name``) on the queue to ``dst``
        (ValueError, nothing sent, when it is longer than the store takes)."""
        item = p2p.frame(seq, value)
        check_value("send_obj", self.rank, name, len(item))
        with StoreRequest("send_obj", self.rank, name, store=self.store):
            self.store.queue_push(self._outbox[dst], item)
        self.entries.append((name, time.time()))
        self.flush()

    def recv(
        self, src: int, seq: int, timeout: float | None, like: Tensor | None = None
    ) -> Callable[[], Any]:
        """Receive object ``seq`` from ``src``, waiting at most ``timeout`` (None: the
        store's); returns what loads it (once received, it is consumed whether or not it
        loads). ``like``: a tensor like it is expected (``Values.unpack``)."""
        data = self.pop(src, seq, timeout)
        name = keys.p2p_value(src, self.rank, seq)
        return lambda: self.values.unpack(name, data, src, label="message", like=like)

    def pop(self, src: int, seq: int, timeout: float | None) -> memoryview:
        """The packed message ``seq`` from ``src``, popped from its queue."""
        self.flush()
        start = time.monotonic()
        name = keys.p2p_value(src, self.rank, seq)
        try:
            with QUIET:
                data = self.inbox.receive(src, seq, timeout)
        except RuntimeError as exc:
            raise lost("recv_obj", self.rank, repr(name), src, start, exc) from exc
        if data is None:
            raise timed_out("recv_obj", self.rank, repr(name), src, start, self.limit(timeout))
        return data

    # --- broadcast ------------------------------------------------------------------------

    def broadcast_send(self, seq: int, obj: Any) -> None:
        """This rank's broadcast ``seq``: set under ``bcast/<rank>/<seq>``."""
        key = keys.broadcast_value(self.rank, seq)
        value = self.values.pack(key, obj, self._others if self._all_local else None)[0]
        self.put("broadcast_obj", key, value)
        now = time.time()
        # The ack counter is the receivers' key, but if they never all read the value it is
        # this rank's expire_data that must remove it.
        self.entries.extend(((key, now), (keys.broadcast_acks(self.rank, seq), now)))
        self.flush()

    def put(self, op: str, key: str, value: bytes) -> None:
        """Set ``key`` to ``value`` for ``op`` (a StoreError if the store is lost; ValueError,
        nothing sent, when ``value`` is longer than the store takes)."""
        check_value(op, self.rank, key, len(value))
        with StoreRequest(op, self.rank, key, store=self.store):
            set_bytes(self.store, key, value)

    def broadcast_recv(
        self, src: int, seq: int, timeout: float | None, like: Tensor | None = None
    ) -> Callable[[], Any]:
        """A receiver's side of broadcast ``seq`` of ``src``: waits for it, then returns
        what loads it (see :meth:`recv`)."""
        key = keys.broadcast_value(src, seq)
        data = self.await_key(key, src, "broadcast_obj", timeout)
        if self.world_size == 2:  # the only receiver is the last
            self._trash.append(key)
            return lambda: self.values.unpack(key, data, src, like=like)
        acks = keys.broadcast_acks(src, seq)

        def load() -> Any:
            payload = None
            try:
                payload = self.values.open(key, data, src)  # a segment is open before the ack
            finally:
                with StoreRequest(
                    "broadcast_obj", self.rank, acks, "counting in", store=self.store
                ):
                    count = self.store.add(acks, 1)
                if count >= self.world_size - 1:
                    self._trash += (key, acks)
                    if isinstance(payload, SharedValue):
                        payload.retire()
            return self.values.load(payload, like, self.values.describe(key, src))

        return load

    def _peek(self, key: str) -> bytes | None:
        """The value of ``key`` if it exists, in one round trip (``get`` takes two)."""
        value = compare_set_bytes(self.store, key, _ABSENT, _ABSENT)
        return None if value == _ABSENT else value

    def await_key(self, key: str, src: int, op: str, timeout: float | None) -> bytes:
        """The value of ``key`` (written by ``src``), waiting at most ``timeout`` seconds.

        When the last few values of this kind from ``src`` were already there when asked
        for, ask without waiting first (one round trip). Otherwise the wait runs on the
        waiter's own connection; only then is the value read on the main connection, which
        therefore never holds a wait that might be abandoned.
        """
        limit = self.limit(timeout)
        start = time.monotonic()
        try:
            with QUIET:
                return self._await(key, src, op, limit, start)
        except RuntimeError as exc:
            if isinstance(exc, GroupTimeout):
                raise
            raise lost(op, self.rank, f"key {key!r}", src, start, exc) from exc

    def _await(self, key: str, src: int, op: str, limit: float, start: float) -> bytes:
        slot = (op, src)
        skips = self._eager_skips.get(slot, 0)
        if skips == 0:
            value = self._peek(key)
            if value is not None:
                return value
            self._eager_skips[slot] = _EAGER_BACKOFF
        else:
            self._eager_skips[slot] = skips - 1
        self.flush()
        deadline = start + limit
        woken = 0
        while True:
            if not self._waiter.wait([key], max(deadline - time.monotonic(), 0.001)):
                raise timed_out(op, self.rank, f"key {key!r}", src, start, limit)
            value = self._peek(key)
            if value is not None:
                return value
            # Woken without the key: the server also wakes the waiters of a key when another
            # rank asks for it with compare_set (our read without waiting). Wait again, until
            # the deadline: a key that holds what _peek reads as absent (no rank writes that;
            # anyone who reaches the store can) ends every wait at once.
            if time.monotonic() >= deadline:
                raise timed_out(op, self.rank, f"key {key!r}", src, start, limit)
            _pause(woken)
            woken += 1

    # --- all_gather -----------------------------------------------------------------------

    def all_gather(
        self, seq: int, seqs: list[int], obj: Any, like: Tensor | None = None
    ) -> list[Any]:
        """Every rank's object: this rank's as ``bcast/<rank>/<seq>``, rank ``r``'s read
        from ``bcast/<r>/<seqs[r]>`` (``like``: tensors like it are expected)."""
        key = keys.broadcast_value(self.rank, seq)
        value, segment = self.values.pack(key, obj, self._others if self._all_local else None)
        self.put("all_gather_obj", key, value)
        self.entries.append((key, time.time()))
        self.flush()
        wanted = [keys.broadcast_value(src, seqs[src]) for src in self._others]
        got = self.gather(wanted, self._others, "all_gather_obj")
        # Every rank has written this gather's value, so it has read this rank's earlier one.
        self.keep_own_gather(key, segment)
        result = [
            self.values.unpack(name, data, src, last=False, like=like)
            for name, data, src in zip(wanted, got, self._others, strict=True)
        ]
        result.insert(self.rank, obj)
        return result

    def gather(self, wanted: list[str], others: list[int], op: str) -> list[bytes]:
        """The values of ``wanted`` (the values of ``others``, in order), once all exist;
        GroupTimeout naming the ranks that did not write theirs within the store's timeout."""
        with QUIET:
            return self._gather(wanted, others, op)

    def _gather(self, wanted: list[str], others: list[int], op: str) -> list[bytes]:
        limit = deadline.clamp(self.default_timeout())
        start = time.monotonic()
        if deadline.current():
            # The main connection waits for the store's timeout: wait on the waiter's.
            got: list[bytes] = [b""] * len(wanted)
        else:
            try:
                got = self.store.multi_get(wanted)
            except RuntimeError as exc:
                if not is_store_timeout(exc):
                    raise lost(op, self.rank, f"keys {wanted}", -1, start, exc) from exc
                raise self._gather_late(wanted, others, start, limit, op) from None
        if all(got):
            return list(got)
        # Woken early (see _await), or under a deadline: fetch what is missing on the
        # waiter's connection.
        missing = [i for i, value in enumerate(got) if not value]
        until = start + limit
        woken = 0
        while True:
            left = max(until - time.monotonic(), 0.001)
            try:
                fetched = self._waiter.multi_get([wanted[i] for i in missing], left)
            except RuntimeError as exc:
                raise lost(op, self.rank, f"keys {wanted}", -1, start, exc) from exc
            if fetched is None:
                raise self._gather_late(wanted, others, start, limit, op)
            still: list[int] = []
            for i, value in zip(missing, fetched, strict=True):
                # An empty answer is a key not there yet (woken, see _await), or one that
                # holds nothing, which no rank writes: that is then its value, refused when
                # it is unpacked.
                present = value or self._peek(wanted[i])
                if present is None:
                    still.append(i)
                else:
                    got[i] = present
            missing = still
            if not missing:
                return list(got)
            if time.monotonic() >= until:  # (keys holding what _peek reads as absent)
                raise self._gather_late(wanted, others, start, limit, op)
            _pause(woken)
            woken += 1

    def _gather_late(
        self, wanted: list[str], others: list[int], start: float, limit: float, op: str
    ) -> GroupTimeout:
        late = [src for src, key in zip(others, wanted, strict=False) if not self._has(key)]
        what = f"keys {[wanted[others.index(r)] for r in late]}"
        return timed_out(op, self.rank, what, late, start, limit)

    def _has(self, key: str) -> bool:
        try:
            return self._peek(key) is not None
        except RuntimeError:
            return False

    # --- barrier --------------------------------------------------------------------------

    def hooks(self, also: Callable[[], None] | None = None) -> BarrierHooks:
        """Deferred deletes while waiting; once all arrived, every read value can go (with
        ``also``, the calling transport's own)."""
        # No hook once all arrived when there is nothing to do then: the barrier is shorter
        # (see barrier, phase 2).
        if not (also or self._own_gather or self._trash or self._reaper.pending):
            return BarrierHooks(self.flush)

        def all_arrived() -> None:
            if also is not None:
                also()
            self.release_own_gather()
            self.flush_now()

        return BarrierHooks(self.flush, all_arrived)

    def barrier(self, barrier_id: int, timeout: float) -> None:
        """Barrier ``barrier_id`` over the store, in three phases; BarrierTimeout when a rank
        does not arrive or leave in time, BarrierFailure when another rank gave up or the
        store failed.

        Barrier ``n`` (all ranks count their barriers, and call them in the same order) uses
        one key, the counter ``arrivals`` (:func:`keys.barrier_arrivals`), and the ranks'
        barrier queues (:class:`Mailbox`) for messages tagged with ``n``:

        1. arrive: each rank ``add``s its bit, ``1 << rank``, to ``arrivals`` (1 in
           groups of more than 32 ranks). The rank that completes it knows that all ranks
           arrived and tells every other rank so (``queue_push``: no reply to wait for);
           the others pop their queue, waiting at most ``timeout`` seconds. A rank that
           times out adds :data:`POISON` to ``arrivals`` and pushes its verdict ("rank r
           timed out ... k of N ranks arrived, ranks [..] did not") to every other rank:
           a rank that arrives later sees the poison in its own ``add`` and fails with that
           verdict, so all ranks pass or all fail. (A rank whose poison finds that all
           ranks had arrived, the last one just in time, passes.)
        2. depart: every rank other than 0, once it knows that all arrived (and has run the
           ``all_arrived`` hook), pushes "left" to rank 0 and returns (without such a hook,
           the last arrival's message to rank 0 says both).
        3. rank 0, which serves the store, pops its queue until every other rank has left
           (again at most ``timeout`` seconds), so it cannot leave, and perhaps shut the
           store down, while another rank is still inside; then it deletes ``arrivals``.

        On two ranks that is, on the slowest rank, an ``add``, a pop and a ``delete_key``.
        A store request that fails (rank 0, which serves the store, exited) is a
        BarrierStoreError (a BarrierFailure and a StoreError) naming the phase and the keys.
        """
        with QUIET:
            self._barrier(barrier_id, timeout)

    def _barrier(self, barrier_id: int, timeout: float) -> None:
        rank, world_size, mailbox = self.rank, self.world_size, self._mailbox
        arrivals = keys.barrier_arrivals(barrier_id)
        hooks = self.hooks()
        left = 0  # ranks known to have left (rank 0 may hear of some while it waits in phase 1)

        def failure(phase: str, exc: Exception) -> BarrierFailure:
            return BarrierStoreError(
                f"barrier {barrier_id} failed on rank {rank} in phase {phase}: store error "
                f"on {arrivals!r} or the barrier queues {why_lost(exc)}"
            )

        # Phase 1: arrive, and learn (with every other rank) whether all arrived in time.
        # Every request is watched (its waits by pop_before): a store that stops answering
        # (its host frozen, the network cut) fails it GRACE seconds after the barrier's
        # timeout, whatever torch's client does.
        try:
            with self._watched(timeout):
                arrived = self.store.add(arrivals, self._arrive_by)
            # With nothing to do once all arrived, the last to arrive also leaves at once.
            merged = hooks.all_arrived is None
            if arrived == self._all_in:  # the last to arrive, none gave up before
                with self._watched(timeout):
                    for dst in self._others:
                        last = _ARRIVED_AND_LEFT if dst == 0 and merged else _ALL_ARRIVED
                        mailbox.send(dst, barrier_id, last)
            elif arrived > self._all_in:  # a rank gave up before this one arrived
                raise BarrierFailure(self._verdict_of_others(barrier_id, timeout))
            else:
                self.flush()  # while the others come
                left = self._wait_for_all(barrier_id, timeout)
            if hooks.all_arrived is not None:
                hooks.all_arrived()
        except (BarrierFailure, AuthenticationError):
            raise
        except RuntimeError as exc:
            raise failure("1 (arrival)", exc) from exc

        # Phase 2: depart (the last to arrive may have said so to rank 0 already).
        if rank != 0:
            if arrived != self._all_in or not merged:
                try:
                    with self._watched(timeout):
                        mailbox.send(0, barrier_id, _LEFT)
                except RuntimeError as exc:
                    raise failure("2 (confirm)", exc) from exc
            return

        # Phase 3: rank 0 leaves last.
        gone = 1 + left
        try:
            until = deadline.clamp_until(time.monotonic() + timeout)
            while gone < world_size:
                message = mailbox.receive(barrier_id, until)
                if message is None:
                    break
                if message[0] in (_LEFT, _ARRIVED_AND_LEFT):
                    gone += 1
            if gone == world_size:
                with self._watched(timeout):
                    self.store.delete_key(arrivals)
        except RuntimeError as exc:
            raise failure("3 (departure)", exc) from exc
        if gone < world_size:
            raise BarrierTimeout(
                f"barrier {barrier_id} failed on rank 0: timed out after {timeout:g} s in "
                f"phase 3 (departure): {gone} of {world_size} ranks departed"
            )

    def _watched(self, timeout: float) -> watched:
        """A watch on requests that should be answered within ``timeout`` seconds."""
        return watched(self.store, time.monotonic() + timeout)

    def _wait_for_all(self, barrier_id: int, timeout: float) -> int:
        """Phase 1 for a rank that is not the last to arrive: return once all have, or raise.

        Returns how many ranks this rank heard leave meanwhile (only rank 0 hears of that).
        """
        rank, world_size = self.rank, self.world_size
        until = deadline.clamp_until(time.monotonic() + timeout)
        left = 0
        while (message := self._mailbox.receive(barrier_id, until)) is not None:
            kind, _sender, text = message
            if kind == _FAILED:
                raise BarrierFailure(f"barrier {barrier_id} failed on rank {rank}: {_text(text)}")
            if kind in (_LEFT, _ARRIVED_AND_LEFT):
                left += 1
            if kind in (_ALL_ARRIVED, _ARRIVED_AND_LEFT):
                return left
        # Timed out: give up, unless the last rank arrived just now.
        with self._watched(timeout):
            seen = self.store.add(keys.barrier_arrivals(barrier_id), POISON)
        came = seen % POISON
        if seen // POISON == 1 and came >= self._all_in:
            return left  # all had arrived: passed (the message saying so is dropped later)
        if seen // POISON > 1:  # another rank gave up first: its verdict is everyone's
            raise BarrierFailure(self._verdict_of_others(barrier_id, timeout))
        if not self._named:  # a count
            verdict = arrival_timeout(rank, timeout, came, world_size, None)
        else:
            missing = [r for r in range(world_size) if not came >> r & 1]
            verdict = arrival_timeout(rank, timeout, world_size - len(missing), world_size, missing)
        with self._watched(timeout):
            for dst in self._others:
                self._mailbox.send(dst, barrier_id, _FAILED, verdict.encode())
        raise BarrierTimeout(f"barrier {barrier_id} failed on rank {rank}: {verdict}")

    def _verdict_of_others(self, barrier_id: int, timeout: float) -> str:
        """The message for a rank that finds the barrier already failed: the first verdict."""
        until = deadline.clamp_until(time.monotonic() + timeout)
        verdict = "another rank gave up before all ranks arrived"
        while (message := self._mailbox.receive(barrier_id, until)) is not None:
            if message[0] == _FAILED:
                verdict = _text(message[2])
                break
        return f"barrier {barrier_id} failed on rank {self.rank}: {verdict}"

    # --- expiry ---------------------------------------------------------------------------

    def expire(self, max_age: float, sent: list[int] | None) -> None:
        """Delete the keys this rank wrote more than ``max_age`` seconds ago (a message
        still unreceived is removed from its queue). ``sent``: how many messages went to
        each rank, when all of them went through the queues (None: only some did)."""
        now = time.time()
        entries = self.entries
        while entries:
            key, written = entries[0]
            if now - written <= max_age:
                break
            with StoreRequest("expire_data", self.rank, key, "deleting", store=self.store):
                if key.startswith("p2p/"):
                    src, dst, seq = (int(part) for part in key.split("/")[1:])
                    count = seq + 1 if sent is None else sent[dst]
                    p2p.drop(self.store, keys.p2p_queue(src, dst), seq, count)
                else:
                    self.store.delete_key(key)
            entries.popleft()


# Added to a barrier's ``arrivals`` by a rank that gave up: far above any world size.
POISON = 1 << 32
# Up to this world size, each rank adds its own bit to ``arrivals`` (below POISON).
_NAMED_ARRIVALS = 32
# A barrier message: barrier number, kind, sender; then the verdict's text for _FAILED.
_ITEM = struct.Struct(">QBI")
_ALL_ARRIVED, _LEFT, _ARRIVED_AND_LEFT, _FAILED = 1, 2, 3, 4
# Messages of later barriers a rank keeps, and the bytes of a verdict it keeps or shows: a
# rank sends each other rank a few per barrier; more is someone else pushing onto the queue.
_MAX_LATER = 1024
_MAX_VERDICT = 2000


class Mailbox:
    """One rank's barrier queue: messages to it, popped in barrier order, with a deadline.

    Messages of an earlier barrier (left over when it failed) are dropped; those of a later
    one (a rank that gave up on the next barrier while rank 0 still waits in this one) are
    kept until then.
    """

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
        """``(kind, sender, text)`` of the next message of ``barrier_id``; None at ``deadline``
        (a ``time.monotonic()`` value). Store failures propagate."""
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
            if bid > barrier_id and len(self._later) < _MAX_LATER:
                self._later.append((bid, kind, sender, item[_ITEM.size :][:_MAX_VERDICT]))
        return None


def _pause(woken: int) -> None:
    """Before waiting again after the ``woken``-th wake (from 0) that brought nothing: none
    the first time (a rank's read without waiting wakes a wait once), then 0.2 ms doubling
    to 10 ms: a wait that every attempt ends at once must not take a CPU until its
    deadline."""
    if woken:
        time.sleep(min(0.0001 * 2**woken, 0.01))


def _text(verdict: bytes) -> str:
    """A verdict from another rank's barrier message, for an error: anyone who reaches the
    store can write one, so bytes that are not UTF-8 are shown escaped, and at most
    _MAX_VERDICT bytes of it."""
    return verdict[:_MAX_VERDICT].decode(errors="backslashreplace")
