"""A StatelessProcessGroup's operations over shared-memory boards, when all ranks share a node.

Each rank posts on its own board (``board.Board``: a small file under ``/dev/shm`` that
every rank maps) and rings the others' FIFO doorbells; a rank that waits sleeps on its own
doorbell, and checks every second that the ranks it waits for still run, so a rank that
exits is reported at once instead of at the timeout. No store request is made while things
fit:

* ``send``/``recv``: message ``n`` to ``dst`` goes into slot ``n % RING`` of the sender's
  ring for ``dst``; a message whose slot ``dst`` has not read yet, or too large for a slot,
  goes on the pair's store queue instead (``spills`` on the board say how many did), and the
  receiver takes messages from both in number order. Sending never waits for the receiver;
* ``broadcast``: into the source's broadcast ring, or the store when its slot is busy;
* ``all_gather``: each rank posts its value in its board's gather slot (two slots used in
  turn), or the store when it does not fit;
* ``barrier``: the three phases of ``barrier.run_board_barrier``, on the boards.

Values are packed as on the store (``values.Values``: large ones in segments, sealed with
the group's key), so a board carries only what the store would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch.distributed import Store

from bridge_py.distributed.errors import GroupTimeout, PeerGoneError
from bridge_py.distributed.spg import keys, p2p
from bridge_py.distributed.spg.barrier import run_board_barrier
from bridge_py.distributed.spg.board import (
    BROADCAST_RING,
    CAPACITY,
    LIVENESS_PERIOD,
    Board,
    BoardError,
    BoardFull,
    overflow_key,
    wait_for_values,
)
from bridge_py.distributed.spg.store_transport import StoreTransport
from bridge_py.distributed.store.torch_api import set_bytes
from bridge_py.distributed.store.waiting import pop_before

__all__ = ["ShmTransport", "queue_flusher"]


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
        # Per peer: messages that went through the store queue (sent to it, taken from it),
        # and those taken from the queue before their turn.
        self._queue_sent = [0] * self.world_size
        self._queue_taken = [0] * self.world_size
        self._early: dict[int, dict[int, bytes | memoryview]] = {}
        # This rank's broadcast ring slot -> the segment of the value in it.
        self._broadcast_segments: dict[int, str] = {}

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

    def recv(self, src: int, seq: int, timeout: float | None) -> Callable[[], Any]:
        """Receive message ``seq`` from ``src``, from its ring slot or the store queue it
        took; returns what loads it (see ``StoreTransport.recv``)."""
        if not self.board.is_open(src):  # src had closed its group when this rank joined
            return self.overflow.recv(src, seq, timeout)
        self.overflow.flush()
        data: bytes | memoryview | None = self.board.take(src, seq)
        if data is None:
            data = self._await_message(src, seq, timeout)
        message = data
        self.board.received(src, seq + 1)  # a copy was taken: the slot is free
        name = keys.p2p_value(src, self.rank, seq)
        return lambda: self.values.unpack(name, message, src, label="message")

    def _await_message(self, src: int, seq: int, timeout: float | None) -> bytes | memoryview:
        board, store = self.board, self.overflow.store
        name = keys.p2p_value(src, self.rank, seq)
        clock = _PeerWait(
            board, self.rank, src, "recv_obj", repr(name), self.overflow.limit(timeout)
        )
        early = self._early.setdefault(src, {})
        queue = keys.p2p_queue(src, self.rank)
        while True:
            data = early.pop(seq, None)
            if data is None:
                data = board.take(src, seq)
            if data is not None:
                return data
            queued = board.spills(src) > self._queue_taken[src]
            if queued:
                # A message waits in the store queue (or is on its way there: the push has
                # no reply). Pop it with a short wait, then look at the ring again: the
                # sender may have expired it (see expire_data).
                try:
                    item = pop_before(store, queue, min(clock.deadline, time.monotonic() + 0.05))
                except RuntimeError as exc:
                    raise self.overflow.lost("recv_obj", repr(name), src, clock.start, exc) from exc
                if item is not None:
                    self._queue_taken[src] += 1
                    got, value = p2p.unframe(item)
                    if got == seq:
                        return value
                    if got > seq:
                        early[got] = value
                    continue
            pause = clock.check()
            if not queued:
                board.wait(pause)

    # --- broadcast ------------------------------------------------------------------------

    def broadcast_send(self, seq: int, obj: Any) -> None:
        """This rank's broadcast ``seq``: into its ring slot, else the store."""
        key = keys.broadcast_value(self.rank, seq)
        value, segment = self.values.pack(key, obj, self._others)
        if self.board.broadcast(seq, value):
            # The slot's last value has been read by every rank: its segment can go.
            slot = seq % BROADCAST_RING
            old = self._broadcast_segments.pop(slot, None)
            if old is not None:
                self.values.segments.discard(old)
            if segment is not None:
                self._broadcast_segments[slot] = segment
        else:  # a slot some rank has not read yet, a value too large, no room on /dev/shm
            self.overflow.set_broadcast(seq, value)
        self.board.broadcast_sent(seq)

    def broadcast_recv(self, src: int, seq: int, timeout: float | None) -> Callable[[], Any]:
        """A receiver's side of broadcast ``seq`` of ``src``, from its ring slot or the
        store; returns what loads it (see ``StoreTransport.recv``)."""
        board = self.board
        if not board.is_open(src):
            return self.overflow.broadcast_recv(src, seq, timeout)
        key = keys.broadcast_value(src, seq)
        try:
            data = board.take_broadcast(src, seq)
            if data is None:
                data = self._await_broadcast(src, seq, key, timeout)
            stored = self.overflow.broadcast_recv(src, seq, timeout) if data is None else None
        except BaseException:
            board.broadcast_received(src, seq)
            raise

        def load() -> Any:
            try:
                if stored is not None:  # src put it in the store
                    return stored()
                assert data is not None
                return self.values.unpack(key, data, src, last=False)
            finally:
                board.broadcast_received(src, seq)  # after loading: the slot may be reused

        return load

    def _await_broadcast(self, src: int, seq: int, key: str, timeout: float | None) -> bytes | None:
        """Sleep on the doorbell until ``src``'s broadcast ``seq`` is in its ring slot (its
        bytes) or ``src`` says it went out another way (None)."""
        board = self.board
        clock = _PeerWait(
            board, self.rank, src, "broadcast_obj", f"key {key!r}", self.overflow.limit(timeout)
        )
        while True:
            sent = board.broadcasts_sent(src)
            data = board.take_broadcast(src, seq)
            if data is not None:
                return data
            if sent > seq:
                return None
            board.wait(clock.check())

    # --- all_gather -----------------------------------------------------------------------

    def all_gather(self, seq: int, seqs: list[int], obj: Any) -> list[Any]:
        """Every rank's object, posted on the boards (``seq``/``seqs``: the store's
        numbering, unused here: the boards number their gathers themselves)."""
        board, store = self.board, self.overflow.store
        rank = self.rank
        if not board.connected:
            self._connect_all(f"all_gather_obj on rank {rank}")
        number = board.seq + 1
        value, segment = self.values.pack(f"board/{rank}/{number}", obj, self._others)
        written = ""
        if len(value) <= CAPACITY:
            try:
                board.post(value)
            except BoardFull:
                written = overflow_key(rank, number)
        else:
            written = overflow_key(rank, number)
        if written:  # too large for the board, or no room on /dev/shm: the store takes it
            set_bytes(store, written, value)
            board.post(b"", in_store=True)
        self.overflow.flush()
        start = time.monotonic()
        limit = self.overflow.default_timeout()
        got, missing = wait_for_values(board, number, self._others, limit)
        if missing:
            raise self._gather_failure(number, missing, start, limit)
        board.unname()  # every rank has opened this rank's board by now: the names can go
        # Every rank has posted this gather's value, so it has read this rank's earlier one.
        self.overflow.keep_own_gather(written, segment)
        result = []
        for src, data in zip(self._others, got, strict=True):
            if not data:  # too large for the board: in the store
                data = store.get(overflow_key(src, number))
            result.append(self.values.unpack(f"board/{src}/{number}", data, src, last=False))
        result.insert(rank, obj)
        return result

    def _gather_failure(
        self, number: int, missing: list[int], start: float, limit: float
    ) -> RuntimeError:
        """The error of a board gather that some ranks did not join: exited, or late."""
        waited = time.monotonic() - start
        if waited < limit:
            return PeerGoneError(
                f"all_gather_obj on rank {self.rank}: ranks {missing} exited after "
                f"{waited:.1f} s without posting their values (board gather {number})"
            )
        return GroupTimeout(
            f"all_gather_obj on rank {self.rank} timed out after {waited:.1f} s (timeout "
            f"{limit:g} s) waiting for the values of ranks {missing} (board gather {number}): "
            "they did not call all_gather_obj (did they exit, or call something else?)"
        )

    # --- barrier --------------------------------------------------------------------------

    def barrier(self, barrier_id: int, timeout: float) -> None:
        """Barrier ``barrier_id`` on the boards (``barrier.run_board_barrier``)."""
        if not self.board.connected:
            self._connect_all(f"barrier {barrier_id} failed on rank {self.rank}")
        run_board_barrier(
            self.board,
            self.rank,
            self.world_size,
            barrier_id,
            timeout,
            self.overflow.hooks(),
        )
        self.board.unname()  # every rank has opened this rank's board by now

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

    # --- expiry and closing ---------------------------------------------------------------

    def expire(self, max_age: float, sent: list[int]) -> None:
        """Expire what went through the store (only some messages took the queues)."""
        self.overflow.expire(max_age, None)


class _PeerWait:
    """The clock of one wait for rank ``src`` over the boards: the deadline, and when next
    to check that ``src`` still runs (every ``board.LIVENESS_PERIOD`` seconds)."""

    def __init__(self, board: Board, rank: int, src: int, op: str, what: str, limit: float) -> None:
        self.board, self.rank, self.src, self.op, self.what = board, rank, src, op, what
        self.limit = limit
        self.start = time.monotonic()
        self.deadline = self.start + limit
        self._check_at = self.start + LIVENESS_PERIOD

    def check(self) -> float:
        """Seconds to sleep at most before looking again; GroupTimeout naming this rank,
        ``src`` and what was waited for once the time is up, PeerGoneError once ``src`` has
        exited."""
        now = time.monotonic()
        if now >= self.deadline:
            raise GroupTimeout(
                f"{self.op} on rank {self.rank} timed out after {now - self.start:.1f} s "
                f"(timeout {self.limit:g} s) waiting for {self.what} from rank {self.src}: "
                f"rank {self.src} did not send it (did it exit, or call something else?)"
            )
        if now >= self._check_at:
            self._check_at = now + LIVENESS_PERIOD
            if self.board.gone([self.src]):
                raise PeerGoneError(
                    f"{self.op} on rank {self.rank}: rank {self.src} exited after "
                    f"{now - self.start:.1f} s without sending {self.what}"
                )
        return min(self.deadline, self._check_at) - now


def queue_flusher(store: Store, rank: int) -> Any:
    """What a closing board gives its unreceived messages to: the pairs' store queues (a
    receiver that has not opened the board finds them there)."""

    def flush(dst: int, number: int, value: bytes) -> None:
        store.queue_push(keys.p2p_queue(rank, dst), p2p.frame(number, value))

    return flush
