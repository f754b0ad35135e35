"""How a StatelessProcessGroup uses the shared-memory boards of ``spg_board``.

When every rank of a group runs on one node (learnt with the node identities, at the first
all_gather or barrier) and there is no auth key, ``all_gather_obj``, ``send_obj``/``recv_obj``
and ``barrier`` go over boards and doorbells instead of the store. This mixin holds those
paths: making this rank's board when it tells the others its node (``_node_card``), opening
the others' (``_start_boards``), and each operation's board path. It works on the group's
own fields and helpers (the store, the counters, ``_dumps``/``_loads``, the trash), which
``StatelessProcessGroup`` defines; the choice of path stays in the group's public methods.
"""

from __future__ import annotations

import pickle
import time
import weakref
from typing import Any

from torch.distributed import Store

from bridge_py.distributed.spg import board as spg_board
from bridge_py.distributed.spg import keys
from bridge_py.distributed.spg import p2p as spg_p2p
from bridge_py.distributed.spg import values as spg_shm
from bridge_py.distributed.store.waiting import pop_before

__all__ = ["BoardPaths"]


class BoardPaths:
    """The board paths of :class:`~bridge_py.distributed.StatelessProcessGroup` (a mixin).

    Everything it uses (``rank``, ``store``, the counters, ``_board``, ``_board_names``, the
    store-lane counters of messages) is set in ``StatelessProcessGroup.__post_init__``; no
    annotation here, so that the group's documented fields stay its own.
    """

    def _on_boards(self) -> bool:
        """Whether this group's operations go over the boards now: every rank on one node
        (the boards are open) and no auth key (values on the boards carry no tag)."""
        return self._board_names is not None and self._auth_key is None

    def _send_board(self, obj: Any, dst: int, seq: int, name: str, now: float) -> None:
        """``send_obj`` on one node without an auth key: into ``dst``'s ring slot on this
        rank's board (see ``spg_board``), or, if that slot is still unread or the value too
        large for it, onto the pair's store queue as on the other path."""
        board = self._board
        assert board is not None
        if dst == self.rank:
            value = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            value = self._dumps(name, obj, True, [dst])[0]
        if not board.send(dst, seq, value):
            self.store.queue_push(self._outbox[dst], spg_p2p.frame(seq, value))
            self.entries.append((name, now))
            self._queue_sent[dst] += 1
            board.spilled(dst, self._queue_sent[dst])
        self.send_dst_counter[dst] = seq + 1
        if self._trash:
            self._flush()

    def _recv_board(self, src: int, seq: int, timeout: float | None) -> bytes | memoryview:
        """``recv_obj`` on one node without an auth key: message ``seq`` from ``src``'s ring
        slot, or from the pair's store queue when ``src`` sent it there; raises RuntimeError
        when ``src`` exits or ``timeout`` (None: the store's) passes first."""
        board = self._board
        assert board is not None
        data = board.take(src, seq)
        if data is None:
            data = self._await_message(board, src, seq, timeout)
        board.received(src, seq + 1)
        return data

    def _await_message(
        self, board: spg_board.Board, src: int, seq: int, timeout: float | None
    ) -> bytes | memoryview:
        name = keys.p2p_value(src, self.rank, seq)
        clock = _PeerWait(board, self.rank, src, "recv_obj", repr(name), self._limit(timeout))
        early = self._board_early.setdefault(src, {})
        queue = keys.p2p_queue(src, self.rank)
        while True:
            data = early.pop(seq, None)
            if data is None:
                data = board.take(src, seq)
            if data is not None:
                return data
            queued = board.spills(src) > self._queue_taken[src]
            if queued:
                # A message waits in the store queue (or is still on its way there: the push
                # has no reply). Pop it with a short wait, then look at the ring again: the
                # sender may have expired it (see expire_data).
                try:
                    limit = min(clock.deadline, time.monotonic() + 0.05)
                    item = pop_before(self.store, queue, limit)
                except RuntimeError as exc:
                    raise self._lost("recv_obj", name, src, clock.start, exc) from exc
                if item is not None:
                    self._queue_taken[src] += 1
                    got, value = spg_p2p.unframe(item)
                    if got == seq:
                        return value
                    if got > seq:
                        early[got] = value
                    continue
            pause = clock.check()
            if not queued:
                board.wait(pause)

    def _all_gather_board(self, obj: Any) -> list[Any]:
        """``all_gather_obj`` of ranks on one node without an auth key: over the boards.

        Each rank posts its value on its board and rings the others' doorbells, then reads
        theirs, sleeping on its own doorbell until all are there (see ``spg_board``): no
        store request at all. A large value goes to a segment as on the other paths (its
        descriptor goes on the board); one too large for the board otherwise, to the store.
        Waits at most the store's timeout, and reports a rank that exited when it does.
        """
        board = self._board
        assert board is not None and self._board_names is not None
        now = time.time()
        self._expire_if_due(now)
        rank = self.rank
        if not board.connected:
            self._connect_all(f"all_gather_obj on rank {rank}")
        seq = board.seq + 1
        value, segment = self._plain_value(f"board/{rank}/{seq}", obj)
        written = ""
        if len(value) <= spg_board.CAPACITY:
            try:
                board.post(value)
            except spg_board.BoardFull:
                written = spg_board.overflow_key(rank, seq)
        else:
            written = spg_board.overflow_key(rank, seq)
        if written:  # too large for the board, or no room on /dev/shm: the store takes it
            self.store.set(written, value)
            board.post(b"", in_store=True)
        self.broadcast_send_counter += 1
        if self._trash:
            self._flush()
        others = self._others
        start = time.monotonic()
        limit = self._default_timeout()
        got, missing = spg_board.wait_for_values(board, seq, others, limit)
        if missing:
            raise self._board_failure(seq, missing, start, limit)
        counters = self.broadcast_recv_src_counter
        for src in others:
            counters[src] += 1
        if seq == 1:
            board.unname()  # every rank has opened this rank's board: the names can go
        # Every rank has posted this gather's value, so it has read this rank's earlier one.
        if self._own_gather:
            self._release_own_gather()
        self._own_gather = [(written, segment)] if written or segment is not None else []
        result = []
        for src, data in zip(others, got, strict=True):
            if not data:  # too large for the board: in the store
                data = self.store.get(spg_board.overflow_key(src, seq))
            result.append(self._loads(f"board/{src}/{seq}", data, src, False))
        result.insert(rank, obj)
        return result

    def _broadcast_on_board(self, seq: int, value: bytes, segment: str | None) -> bool:
        """Put this rank's broadcast ``seq`` in its ring slot; False if it must take the store
        (a slot some rank has not read yet, a value too large, no room on /dev/shm)."""
        board = self._board
        assert board is not None
        if not board.broadcast(seq, value):
            return False
        # The slot's last value has been read by every rank: its segment can go.
        slot = seq % spg_board.BROADCAST_RING
        old = self._broadcast_segments.pop(slot, None)
        if old is not None:
            self._segments.discard(old)
        if segment is not None:
            self._broadcast_segments[slot] = segment
        return True

    def _broadcast_from_board(self, src: int, seq: int, timeout: float | None) -> Any:
        """A receiver's side of broadcast ``seq`` of ``src`` when the boards are in use: from
        the ring slot, or through the store when ``src`` sent it there."""
        board = self._board
        assert board is not None
        key = keys.broadcast_value(src, seq)
        data = board.take_broadcast(src, seq)
        if data is None:
            data = self._await_broadcast(board, src, seq, key, timeout)
        try:
            if data is None:  # src put it in the store
                return self._broadcast_from_store(src, seq, timeout)
            self.broadcast_recv_src_counter[src] += 1
            return self._loads(key, data, src, last=False)
        finally:
            board.broadcast_received(src, seq)  # after loading: the slot may be reused now

    def _await_broadcast(
        self, board: spg_board.Board, src: int, seq: int, key: str, timeout: float | None
    ) -> bytes | None:
        """Sleep on the doorbell until ``src``'s broadcast ``seq`` is in its ring slot (its
        bytes) or ``src`` says it went out another way (None)."""
        what = f"key {key!r}"
        clock = _PeerWait(board, self.rank, src, "broadcast_obj", what, self._limit(timeout))
        while True:
            sent = board.broadcasts_sent(src)
            data = board.take_broadcast(src, seq)
            if data is not None:
                return data
            if sent > seq:
                return None
            board.wait(clock.check())

    def _connect_all(self, what: str) -> None:
        """Open every rank's board (for a collective); RuntimeError starting with ``what``
        when some rank's is gone (it exited, or closed its group)."""
        assert self._board is not None and self._board_names is not None
        try:
            gone = self._board.connect(self._board_names, missing_ok=True)
        except spg_board.BoardError as exc:
            raise RuntimeError(f"{what}: {exc}") from exc
        if gone:
            raise RuntimeError(
                f"{what}: ranks {gone} exited or closed the group (their boards are gone)"
            )

    def _board_failure(
        self, seq: int, missing: list[int], start: float, limit: float
    ) -> RuntimeError:
        """The error of a board gather that some ranks did not join: exited, or late."""
        waited = time.monotonic() - start
        if waited < limit:
            return RuntimeError(
                f"all_gather_obj on rank {self.rank}: ranks {missing} exited after "
                f"{waited:.1f} s without posting their values (board gather {seq})"
            )
        return RuntimeError(
            f"all_gather_obj on rank {self.rank} timed out after {waited:.1f} s (timeout "
            f"{limit:g} s) waiting for the values of ranks {missing} (board gather {seq}): "
            "they did not call all_gather_obj (did they exit, or call something else?)"
        )

    def _node_card(self) -> bytes:
        """What this rank tells the others of its node: its identity (``spg_shm``) and, if
        it could make one, the name of its board (``spg_board``), after a newline."""
        identity = spg_shm.node_identity()
        if identity == spg_shm.NOT_LOCAL or self.world_size == 1:
            return identity
        if self._board is None:
            try:
                self._board = spg_board.Board(self.rank, self.world_size)
            except OSError:
                return identity  # no board: all_gather keeps to the store
            # Messages still unreceived in its rings go to the store queues when the group
            # closes: a receiver that has not opened the board finds them there.
            weakref.finalize(self, self._board.close, _queue_flusher(self.store, self._outbox))
        return identity + b"\n" + self._board.name.encode()

    def _start_boards(self, names: list[str]) -> None:
        """Open every rank's board; from now on gathers and messages go over them.

        Every message sent so far went through the store: each receiver is told so (the
        spill counts), and takes those still unreceived from the queues first.
        """
        board = self._board
        assert board is not None
        try:
            # A rank may have closed its group already (sent what it had to, and left): its
            # messages are in the store queues, received from there as before.
            board.connect(names, missing_ok=True)
        except spg_board.BoardError as exc:
            raise spg_board.BoardError(
                f"rank {self.rank} could not join the boards: {exc}"
            ) from exc
        for src in range(self.world_size):
            if not board.is_open(src):
                continue
            early = self._inbox.take_early(src)
            self._board_early[src] = early
            self._queue_taken[src] = self.recv_src_counter[src] + len(early)
        for dst in range(self.world_size):
            self._queue_sent[dst] = self.send_dst_counter[dst]
            board.spilled(dst, self._queue_sent[dst])
        self._board_names = names


class _PeerWait:
    """The clock of one wait for rank ``src`` over the boards: the deadline, and when next
    to check that ``src`` still runs (every ``spg_board.LIVENESS_PERIOD`` seconds)."""

    def __init__(
        self, board: spg_board.Board, rank: int, src: int, op: str, what: str, limit: float
    ) -> None:
        self.board, self.rank, self.src, self.op, self.what = board, rank, src, op, what
        self.limit = limit
        self.start = time.monotonic()
        self.deadline = self.start + limit
        self._check_at = self.start + spg_board.LIVENESS_PERIOD

    def check(self) -> float:
        """Seconds to sleep at most before looking again; RuntimeError naming this rank,
        ``src`` and what was waited for once the time is up or ``src`` has exited."""
        now = time.monotonic()
        if now >= self.deadline:
            raise RuntimeError(
                f"{self.op} on rank {self.rank} timed out after {now - self.start:.1f} s "
                f"(timeout {self.limit:g} s) waiting for {self.what} from rank {self.src}: "
                f"rank {self.src} did not send it (did it exit, or call something else?)"
            )
        if now >= self._check_at:
            self._check_at = now + spg_board.LIVENESS_PERIOD
            if self.board.gone([self.src]):
                raise RuntimeError(
                    f"{self.op} on rank {self.rank}: rank {self.src} exited after "
                    f"{now - self.start:.1f} s without sending {self.what}"
                )
        return min(self.deadline, self._check_at) - now


def _queue_flusher(store: Store, outbox: list[str]) -> Any:
    """What a closing board gives its unreceived messages to: the pairs' store queues."""

    def flush(dst: int, number: int, value: bytes) -> None:
        store.queue_push(outbox[dst], spg_p2p.frame(number, value))

    return flush
