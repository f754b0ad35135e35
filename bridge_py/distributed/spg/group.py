"""StatelessProcessGroup: vLLM's metadata group over a TCPStore, with the same names and fields.

Compatible with ``vllm.distributed.utils.StatelessProcessGroup`` (fields, their order,
counters, method signatures, pickled objects between ranks), and better in these ways:

* point-to-point objects travel on a store queue per (sender, receiver) pair, so two ranks
  sending to one rank never collide, and receiving removes them (``spg_p2p``);
* values are deleted from the store once every receiver has read them (broadcast,
  all_gather, barrier), so the store stays small however many operations run;
* on one node, large values travel through shared-memory segments (``spg_shm``,
  ``spg_segments``), and without an auth key all_gather_obj, point-to-point objects,
  broadcast_obj and barrier skip the store altogether: shared-memory boards and FIFO
  doorbells (``spg_board``, ``spg_board_paths``);
* ``barrier(timeout)`` fails within ``timeout`` with a message naming the rank, the phase and
  how many ranks arrived, whatever the store's timeout is (see ``barrier.py``);
* ``recv_obj`` and ``broadcast_obj`` take a keyword-only ``timeout`` (default: the store's
  timeout, as in vLLM) and fail with a message naming this rank, the sender, the key and the
  time waited when the sender never writes (it died, or took another path); the wait runs
  on a separate connection (``waiting.py``), so the group's own stays usable;
* ``create`` binds only the given interface (IPv4 or IPv6), accepts a pre-bound socket,
  returns only when all ranks have joined, and says why when it cannot;
* with a shared key (``create(..., auth_key=...)``, ``group.auth_key = ...`` or the
  environment variable ``VLLM_BRIDGE_AUTH_KEY``) every value carries an HMAC-SHA256 tag
  bound to its store key, checked before unpickling (``auth.py``): whoever can reach the
  store but lacks the key cannot make a rank unpickle anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import pickle
import socket
import sys
import time
import traceback
import weakref
from collections import deque
from typing import Any

from torch.distributed import Store

from bridge_py.distributed.auth import AuthKey, open_payload, resolve_key, seal_payload
from bridge_py.distributed.shm import segments as spg_segments
from bridge_py.distributed.spg import board as spg_board
from bridge_py.distributed.spg import keys
from bridge_py.distributed.spg import p2p as spg_p2p
from bridge_py.distributed.spg import values as spg_shm
from bridge_py.distributed.spg.barrier import BarrierHooks, Mailbox, run_barrier, run_board_barrier
from bridge_py.distributed.spg.board_paths import BoardPaths
from bridge_py.distributed.store import format_address, join_group, open_store, require_queues
from bridge_py.distributed.store import reaper as spg_reaper
from bridge_py.distributed.store.fetching import FetchingWaiter

__all__ = ["StatelessProcessGroup", "validate_rank"]

Socket = socket.socket

# compare_set's expected value for "read without waiting": no stored value is ever this (no
# pickle, tag or descriptor starts with "\x00a"), so the value is returned unchanged.
_ABSENT = b"\x00absent"
# After a value was not there yet, wait this many times before asking without waiting again.
_EAGER_BACKOFF = 4


def validate_rank(rank: int, world_size: int, name: str = "rank") -> None:
    """Raise TypeError/ValueError unless ``world_size >= 1`` and ``0 <= rank < world_size``."""
    for label, value in (("world_size", world_size), (name, rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be an int, got {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{name} must be in [0, {world_size}), got {rank}")


@dataclasses.dataclass
class StatelessProcessGroup(BoardPaths):
    """A dataclass to hold a metadata store, and the rank, world_size of the
    group. Only use it to communicate metadata between processes.
    For data-plane communication, create NCCL-related objects.

    Objects are pickled between ranks: only form groups with processes you trust, or give
    every rank the same ``auth_key`` (see :attr:`auth_key`), so that values written by anyone
    without the key are refused before they are unpickled.
    """

    rank: int
    world_size: int
    store: Store
    # Rank 0's listening socket (None elsewhere), kept so that it lives as long as the group.
    socket: Socket | None
    data_expiration_seconds: int = 3600
    # dst rank -> number of objects sent to it
    send_dst_counter: dict[int, int] = dataclasses.field(default_factory=dict)
    # src rank -> number of objects received from it
    recv_src_counter: dict[int, int] = dataclasses.field(default_factory=dict)
    broadcast_send_counter: int = 0
    # src rank -> number of broadcasts received from it
    broadcast_recv_src_counter: dict[int, int] = dataclasses.field(default_factory=dict)
    # Keys this rank wrote, with the time written, oldest first (see expire_data).
    entries: deque[tuple[str, float]] = dataclasses.field(default_factory=deque)

    def __post_init__(self) -> None:
        validate_rank(self.rank, self.world_size)
        if self.world_size > 1:
            require_queues(self.store)
        self.send_dst_counter = {i: 0 for i in range(self.world_size)}
        self.recv_src_counter = {i: 0 for i in range(self.world_size)}
        self.broadcast_recv_src_counter = {i: 0 for i in range(self.world_size)}
        # Not dataclass fields: the documented field list stays vLLM's.
        self._barrier_count = 0
        self._waiter = FetchingWaiter(self.store)
        self._inbox = spg_p2p.Inbox(self.store, self.rank, self.world_size)
        self._mailbox = Mailbox(self.store, self.rank)
        # Two ranks gather through a queue each way: its inbox, values sent and received.
        self._gather_inbox = spg_p2p.Inbox(
            self.store, self.rank, self.world_size, keys.gather_queue
        )
        self._exchanged = [0, 0]
        self._outbox = [keys.p2p_queue(self.rank, dst) for dst in range(self.world_size)]
        self._others = [r for r in range(self.world_size) if r != self.rank]
        # create() sets the key it resolved before constructing (so that with the operator's
        # VLLM_BRIDGE_REQUIRE_AUTH_KEY an explicit key is not asked for again here).
        preset = self.__dict__.get("_auth_key")
        self._auth_key: bytes | None = preset if preset is not None else resolve_key(None)
        # Keys this rank has read and may delete, handed at its next store operation (after
        # a write, or before a wait) to the reaper, which deletes them on its own thread.
        self._trash: list[str] = []
        self._reaper = spg_reaper.KeyReaper(self.store)
        # This rank's values (and segments) of its last all_gather, until all ranks read them.
        self._own_gather: list[tuple[str, str | None]] = []
        # Fetches left before trying to read a value without waiting first (per kind, src).
        self._eager_skips: dict[tuple[str, int], int] = {}
        # Node identities of all ranks (None: not probed yet; probed at the first all_gather
        # or barrier), and whether each rank can take this rank's segments.
        self._nodes: list[bytes] | None = None
        self._probed = self.world_size == 1
        self._local = [False] * self.world_size
        self._all_local = False
        self._segments = spg_segments.SegmentOwner(self.world_size)
        # Whether the last value for shared memory was large: pickle the next into a segment.
        self._spilled = False
        self._shm_threshold = spg_shm.threshold()  # read once: the environment lookup costs
        weakref.finalize(self, self._segments.release)
        # This rank's board for the operations of ranks on one node (see spg_board): made
        # when this rank tells the others its node, used once every rank has one there.
        self._board: spg_board.Board | None = None
        self._board_names: list[str] | None = None
        # This rank's broadcast ring slot -> the segment of the value in it (see spg_board).
        self._broadcast_segments: dict[int, str] = {}
        # Point to point over the boards: per peer, messages that went through the store
        # queue (sent to it, received from it), and those received before their turn.
        self._queue_sent = [0] * self.world_size
        self._queue_taken = [0] * self.world_size
        self._board_early: dict[int, dict[int, bytes | memoryview]] = {}

    @property
    def auth_key(self) -> bytes | None:
        """The shared key that authenticates values (None: plain pickles, as in vLLM).

        Not a dataclass field, so the documented fields stay vLLM's. It starts as
        ``$VLLM_BRIDGE_AUTH_KEY`` (None when unset or empty); ``create(..., auth_key=...)``
        sets it, and so can assigning bytes or a str (UTF-8) before the first operation.
        Assigning None goes back to the environment variable. All ranks need the same key.
        The operator's environment wins (``auth.resolve_key``): with ``$VLLM_BRIDGE_AUTH_KEY``
        set, another key raises AuthenticationError, and with
        ``$VLLM_BRIDGE_REQUIRE_AUTH_KEY=1`` so does going without one (also when the group is
        constructed directly).
        """
        return self._auth_key

    @auth_key.setter
    def auth_key(self, key: AuthKey | None) -> None:
        self._auth_key = resolve_key(key)

    # --- values -------------------------------------------------------------------------

    def _dumps(
        self,
        key: str,
        obj: Any,
        local: bool = False,
        readers: list[int] | None = None,
        pickled: bytes | None = None,
    ) -> tuple[bytes, str | None]:
        """The store value for ``obj`` under ``key`` (tagged when there is an auth key).

        ``local``: every receiver (``readers``, default all other ranks) shares this node, so
        a large pickle goes to a shared-memory segment and the value names it (see
        ``spg_shm``); returns the segment's name too. ``pickled``: ``obj``'s plain pickle,
        when the caller has made it already (it is not made twice).
        """
        limit = self._shm_threshold
        keyed = self._auth_key is not None
        readers = self._others if readers is None else readers
        if pickled is None and local and (self._spilled or sys.getsizeof(obj) > limit):
            # Looks large (or the last value was): pickle straight into a segment.
            payload = spg_shm.dump(obj, self._segments, keyed, readers)
        else:
            # Pickling into a spill file costs several times a plain pickle, so small objects
            # (most) are pickled plainly, and copied to a segment only if that was wrong.
            if pickled is None:
                pickled = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            payload = pickled
            if not local or len(payload) <= limit:
                return seal_payload(self._auth_key, _context(key), payload), None
            payload = spg_shm.dump_pickled(payload, self._segments, keyed, readers)
        segment = spg_shm.segment_name(payload)
        self._spilled = segment is not None
        return seal_payload(self._auth_key, _context(key), payload), segment

    def _plain_value(self, key: str, obj: Any) -> tuple[bytes, str | None]:
        """``_dumps`` for the paths without an auth key, with less work around it: a plain
        pickle, or (all ranks on one node, a large value) a segment's descriptor; and the
        segment's name."""
        if self._all_local and (self._spilled or sys.getsizeof(obj) > self._shm_threshold):
            return self._dumps(key, obj, True)
        value = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if self._all_local and len(value) > self._shm_threshold:
            return self._dumps(key, obj, True, pickled=value)
        return value, None

    def _open(self, key: str, data: bytes | memoryview, src: int, label: str = "key") -> Any:
        """The checked payload of ``data`` (``key``, from ``src``): bytes, or an open segment.

        ``label`` says what ``key`` names in error messages (a store key, or a message).
        """
        what = f"the value of {label} {key!r} from rank {src} (received by rank {self.rank})"
        payload = open_payload(self._auth_key, _context(key), data, what)
        if spg_shm.is_descriptor(payload):
            return spg_shm.open_descriptor(payload, self._auth_key is not None, what, self.rank)
        return payload

    @staticmethod
    def _load(payload: Any) -> Any:
        if isinstance(payload, spg_shm.SharedValue):
            return payload.load()
        return pickle.loads(payload)

    def _loads(
        self, key: str, data: bytes | memoryview, src: int, last: bool = True, label: str = "key"
    ) -> Any:
        """The object in ``data``, read from ``key`` written by ``src``; checked, then unpickled.

        ``last``: this rank is the value's last reader (a one-shot segment is unlinked once
        open; see ``spg_shm``).
        Without an auth key, a plain pickle (protocol 2 or later: it starts with the PROTO
        opcode, which neither a tag nor a descriptor does) is unpickled at once.
        """
        if self._auth_key is None and data and data[0] == 0x80:
            return pickle.loads(data)
        payload = self._open(key, data, src, label)
        if last and isinstance(payload, spg_shm.SharedValue):
            payload.retire()
        return self._load(payload)

    # --- store traffic ------------------------------------------------------------------

    def _default_timeout(self) -> float:
        timeout = getattr(self.store, "timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout.total_seconds()
        return 300.0

    def _limit(self, timeout: float | None) -> float:
        limit = self._default_timeout() if timeout is None else timeout
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return limit

    def _flush(self) -> None:
        """Delete the keys waiting in the trash (read values nobody needs any more), on the
        reaper's thread: nothing waits for them (see ``spg_reaper``)."""
        self._reaper.delete(self._trash)
        self._trash.clear()

    def _flush_now(self) -> None:
        """Delete the trash and wait until every key handed to the reaper is gone (bounded
        by the store's timeout): for a barrier, after which the store holds no read value."""
        self._flush()
        self._reaper.drain(self._default_timeout())

    def _peek(self, key: str) -> bytes | None:
        """The value of ``key`` if it exists, in one round trip (``get`` takes two)."""
        value = self.store.compare_set(key, _ABSENT, _ABSENT)
        return None if value == _ABSENT else value

    def _await(self, key: str, src: int, op: str, timeout: float | None) -> bytes:
        """The value of ``key`` (written by ``src``), waiting at most ``timeout`` seconds.

        When the last few values of this kind from ``src`` were already there when asked for,
        first ask without waiting (one round trip). Otherwise the wait runs on the bounded
        waiter's own connection; only then is the value read on the main connection, which
        therefore never holds a wait that might be abandoned.
        """
        limit = self._limit(timeout)
        slot = (op, src)
        skips = self._eager_skips.get(slot, 0)
        if skips == 0:
            value = self._peek(key)
            if value is not None:
                return value
            self._eager_skips[slot] = _EAGER_BACKOFF
        else:
            self._eager_skips[slot] = skips - 1
        self._flush()
        start = time.monotonic()
        deadline = start + limit
        while True:
            try:
                arrived = self._waiter.wait([key], max(deadline - time.monotonic(), 0.001))
            except RuntimeError as exc:
                raise RuntimeError(
                    f"{op} on rank {self.rank} lost the store after "
                    f"{time.monotonic() - start:.1f} s while waiting for key {key!r} from rank "
                    f"{src} (did rank 0, which serves the store, exit?): {exc}"
                ) from exc
            if not arrived:
                raise RuntimeError(
                    f"{op} on rank {self.rank} timed out after {time.monotonic() - start:.1f} s "
                    f"(timeout {limit:g} s) waiting for key {key!r} from rank {src}: rank {src} "
                    "did not send it (did it exit, or call something else?)"
                )
            value = self._peek(key)
            if value is not None:
                return value
            # Woken without the key: the server also wakes the waiters of a key when another
            # rank asks for it with compare_set (our read without waiting). Wait again.

    def _lost(self, op: str, key: str, src: int, start: float, exc: Exception) -> RuntimeError:
        return RuntimeError(
            f"{op} on rank {self.rank} lost the store after {time.monotonic() - start:.1f} s "
            f"while waiting for {key!r} from rank {src} (did rank 0, which serves the "
            f"store, exit?): {exc}"
        )

    def _peer(self, peer: int, name: str) -> int:
        validate_rank(peer, self.world_size, name)
        return peer

    def _write(self, key: str, value: bytes) -> None:
        self.store.set(key, value)
        self.entries.append((key, time.time()))

    # --- point to point -----------------------------------------------------------------

    def send_obj(self, obj: Any, dst: int) -> None:
        """Send an object to a destination rank.

        The object is pickled and pushed, numbered per pair, onto the store queue from this
        rank to ``dst`` (``spg_p2p``), without waiting for a reply; ``dst`` removes it by
        receiving it. On one node (once known, see ``spg_shm``) a large pickle travels
        through shared memory (a segment this rank reuses once ``dst`` has read it). When
        every rank is on one node and there is no auth key, the message goes instead into a
        slot of this rank's shared-memory board and ``dst``'s doorbell is rung
        (``spg_board``); one whose slot ``dst`` has not read yet, or too large for a slot,
        still takes the store queue. Sending never waits for the receiver.
        """
        if type(dst) is not int or not 0 <= dst < self.world_size:
            validate_rank(dst, self.world_size, "dst")
        entries = self.entries
        now = time.time()
        self._expire_if_due(now)
        seq = self.send_dst_counter[dst]
        name = f"p2p/{self.rank}/{dst}/{seq}"  # keys.p2p_value, spelled out on this hot path
        if self._on_boards():
            self._send_board(obj, dst, seq, name, now)
            return
        if self._auth_key is None and not self._local[dst]:
            value = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            value = self._dumps(name, obj, self._local[dst] and dst != self.rank, [dst])[0]
        self.store.queue_push(self._outbox[dst], spg_p2p.frame(seq, value))
        entries.append((name, now))
        self.send_dst_counter[dst] = seq + 1
        if self._trash:
            self._flush()

    def _expire_if_due(self, now: float) -> None:
        """``expire_data``, when this rank's oldest entry is due or it has segments out."""
        entries = self.entries
        if (entries and now - entries[0][1] > self.data_expiration_seconds) or self._segments:
            self.expire_data()

    def expire_data(self) -> None:
        """Expire data that is older than data_expiration_seconds seconds.

        Deletes the keys this rank wrote more than ``data_expiration_seconds`` ago (whether or
        not they were received), and removes from their queues the objects it sent that long
        ago that are still unreceived, so that values nobody reads do not stay in the store,
        and unlinks the shared-memory segments it created that long ago.
        """
        now = time.time()
        entries = self.entries
        while entries:
            key, written = entries[0]
            if now - written <= self.data_expiration_seconds:
                break
            if key.startswith("p2p/"):
                src, dst, seq = (int(part) for part in key.split("/")[1:])
                queue = keys.p2p_queue(src, dst)
                # Over the boards, only some messages took the queue: look at its head.
                sent = seq + 1 if self._board_names is not None else self.send_dst_counter[dst]
                spg_p2p.drop(self.store, queue, seq, sent)
            elif key.startswith("gx/"):
                src, dst, seq = (int(part) for part in key.split("/")[1:])
                spg_p2p.drop(self.store, keys.gather_queue(src, dst), seq, self._exchanged[0])
            else:
                self.store.delete_key(key)
            entries.popleft()
        self._segments.expire(self.data_expiration_seconds)

    def recv_obj(self, src: int, *, timeout: float | None = None) -> Any:
        """Receive an object from a source rank.

        Blocks until ``src`` has sent its next object, then returns it; receiving removes it
        from the store (it is popped from the queue ``src`` pushed it on). Waits at most
        ``timeout`` seconds (None: the store's timeout), then raises RuntimeError naming this
        rank, ``src``, the object (``p2p/<src>/<dst>/<number>``) and the time waited; the
        object is then still expected, so a later call may receive it. With an auth key, a
        value that fails its check raises AuthenticationError (a RuntimeError) naming the
        object and ``src``, and is dropped without being unpickled. Over the shared-memory
        boards (every rank on one node, no auth key; see ``send_obj``) the wait sleeps on this
        rank's doorbell, and a ``src`` that exits is reported within a second.
        """
        if type(src) is not int or not 0 <= src < self.world_size:
            validate_rank(src, self.world_size, "src")
        seq = self.recv_src_counter[src]
        if timeout is not None:
            self._limit(timeout)  # checked before anything else
        if self._trash:
            self._flush()
        if self._on_boards() and self._board.is_open(src):
            data = self._recv_board(src, seq, timeout)
            self.recv_src_counter[src] = seq + 1
            if data[:1] == b"\x80":
                return pickle.loads(data)
            return self._loads(keys.p2p_value(src, self.rank, seq), data, src, label="message")
        start = time.monotonic()
        try:
            data = self._inbox.receive(src, seq, timeout)
        except RuntimeError as exc:
            name = keys.p2p_value(src, self.rank, seq)
            raise self._lost("recv_obj", name, src, start, exc) from exc
        if data is None:
            raise RuntimeError(
                f"recv_obj on rank {self.rank} timed out after {time.monotonic() - start:.1f} s "
                f"(timeout {self._limit(timeout):g} s) waiting for "
                f"{keys.p2p_value(src, self.rank, seq)!r} from rank {src}: rank {src} "
                "did not send it (did it exit, or call something else?)"
            )
        self.recv_src_counter[src] = seq + 1
        if self._auth_key is None and data and data[0] == 0x80:  # a plain pickle (see _loads)
            return pickle.loads(data)
        return self._loads(keys.p2p_value(src, self.rank, seq), data, src, label="message")

    # --- collectives --------------------------------------------------------------------

    def broadcast_obj(self, obj: Any | None, src: int, *, timeout: float | None = None) -> Any:
        """Broadcast an object from a source rank to all other ranks.

        Returns ``obj`` on ``src`` and the received object on the other ranks. Unlike vLLM's,
        which does not clean up after all ranks have received the object, the last receiver
        deletes it from the store (at its next store operation), so it can be used any number
        of times. Receivers wait at most ``timeout`` seconds (None: the store's timeout) and
        raise as ``recv_obj`` does. On one node (once known, see ``spg_shm``) a large pickle
        travels through shared memory (a segment ``src`` reuses once every receiver has read
        it). When every rank is on one node and there is no auth key, the value goes into a
        slot of ``src``'s shared-memory board instead of the store, and the receivers'
        doorbells are rung (``spg_board``); one whose slot some rank has not read yet, or too
        large for a slot, still takes the store. ``src`` never waits for the receivers.
        """
        self._peer(src, "src")
        boards = self._on_boards()
        if self.rank == src:
            self.expire_data()
            if self.world_size > 1:
                seq = self.broadcast_send_counter
                key = keys.broadcast_value(src, seq)
                value, segment = self._dumps(key, obj, self._all_local)
                if not (boards and self._broadcast_on_board(seq, value, segment)):
                    self._write(key, value)
                    # The ack counter is the receivers' key (unused with a single receiver),
                    # but if they never all read the value it is this rank's expire_data
                    # that must remove it.
                    self.entries.append((keys.broadcast_acks(src, seq), time.time()))
                    self._flush()
                if boards:
                    self._board.broadcast_sent(seq)
            self.broadcast_send_counter += 1
            return obj
        seq = self.broadcast_recv_src_counter[src]
        if boards and self._board.is_open(src):
            return self._broadcast_from_board(src, seq, timeout)
        return self._broadcast_from_store(src, seq, timeout)

    def _broadcast_from_store(self, src: int, seq: int, timeout: float | None) -> Any:
        """A receiver's side of broadcast ``seq`` of ``src`` through the store."""
        key = keys.broadcast_value(src, seq)
        data = self._await(key, src, "broadcast_obj", timeout)
        self.broadcast_recv_src_counter[src] += 1
        if self.world_size == 2:  # the only receiver is the last
            self._trash.append(key)
            return self._loads(key, data, src)
        acks = keys.broadcast_acks(src, seq)
        payload = None
        try:
            payload = self._open(key, data, src)  # a segment is open before acknowledging
        finally:
            last = self.store.add(acks, 1) >= self.world_size - 1
            if last:
                self._trash += (key, acks)
                if isinstance(payload, spg_shm.SharedValue):
                    payload.retire()
        return self._load(payload)

    def all_gather_obj(self, obj: Any) -> list[Any]:
        """All gather an object from all ranks.

        Returns the objects of all ranks in rank order. Each rank writes its object once, then
        reads all the others' in one request (``multi_get``, which waits for all of them), so
        an all_gather costs every rank the same few round trips whatever the world size. The
        counters advance as for vLLM's (one broadcast from every rank). A rank deletes its
        value once it knows every rank has read it (when its next all_gather completes, or at
        the next barrier). Two ranks without an auth key instead push their objects to each
        other on store queues, which receiving empties. Ranks that all run on one node,
        without an auth key, use no store at all once they know it (after the first
        all_gather or barrier): each posts its object on its shared-memory board and rings
        the others' doorbells (``spg_board``). Waits at most the store's timeout, then raises
        RuntimeError naming the ranks whose values are missing (or, over the boards, that
        exited).
        """
        if self.world_size == 1:
            self.broadcast_send_counter += 1
            return [obj]
        if self._probed and self._auth_key is None:
            if self._board_names is not None:
                return self._all_gather_board(obj)
            if self.world_size == 2:
                return self._exchange(obj)
            return self._all_gather_plain(obj)
        self.expire_data()
        rank = self.rank
        probing = not self._probed
        self._probed = True
        key = keys.broadcast_value(rank, self.broadcast_send_counter)
        value, segment = self._dumps(key, obj, self._all_local)
        names, values = [key], [value]
        card = b""
        if probing:
            names.append(keys.gather_node(rank, self.broadcast_send_counter))
            card = self._node_card()
            values.append(self._seal_card(names[-1], card))
        if probing:
            self.store.multi_set(names, values)
        else:
            self.store.set(key, value)
        now = time.time()
        self.entries.extend((name, now) for name in names)
        self.broadcast_send_counter += 1
        if self._trash:
            self._flush()
        others = self._others
        counters = self.broadcast_recv_src_counter
        wanted = [keys.broadcast_value(src, counters[src]) for src in others]
        if probing:
            wanted += [
                keys.gather_node(src, self.broadcast_recv_src_counter[src]) for src in others
            ]
        got = self._gather(wanted, others)
        for src in others:
            self.broadcast_recv_src_counter[src] += 1
        # Every rank has written this gather's value, so it has read this rank's earlier ones.
        self._release_own_gather()
        self._own_gather = [(key, segment)] + [(name, None) for name in names[1:]]
        if probing:
            cards = zip(others, wanted[len(others) :], got[len(others) :], strict=True)
            nodes = {src: self._open_card(name, data, src) for src, name, data in cards}
            nodes[rank] = card
            self._learn_nodes([nodes[r] for r in range(self.world_size)])
        result: list[Any] = []
        for src in range(self.world_size):
            if src == rank:
                result.append(obj)
            else:
                index = src if src < rank else src - 1
                result.append(self._loads(wanted[index], got[index], src, last=False))
        return result

    def _all_gather_plain(self, obj: Any) -> list[Any]:
        """``all_gather_obj`` without an auth key: the same steps, with less work around them.

        Costs every rank a ``set`` (no reply), the ``delete_key`` of its previous value and
        one ``multi_get`` on the main connection (a wait for all values, bounded by the store's
        timeout, then one read); with more ranks than cores the Python work around these
        requests counts as much as they do, hence this path.
        """
        entries = self.entries
        now = time.time()
        self._expire_if_due(now)
        rank = self.rank
        seq = self.broadcast_send_counter
        key = f"bcast/{rank}/{seq}"  # keys.broadcast_value, spelled out on this hot path
        value, segment = self._plain_value(key, obj)
        store = self.store
        store.set(key, value)
        entries.append((key, now))
        self.broadcast_send_counter = seq + 1
        if self._trash:
            self._flush()
        others = self._others
        counters = self.broadcast_recv_src_counter
        wanted = [f"bcast/{src}/{counters[src]}" for src in others]
        start = time.monotonic()
        try:
            got = store.multi_get(wanted)
        except RuntimeError as exc:
            if "timeout" not in str(exc).lower():
                raise self._gather_lost(others, start, exc) from exc
            raise self._gather_late(wanted, others, start, self._default_timeout()) from None
        if not all(got):  # woken early (see _gather): fetch what is missing
            got = self._gather(wanted, others)
        for src in others:
            counters[src] += 1
        # Every rank has written this gather's value, so it has read this rank's earlier ones.
        if self._own_gather:
            self._release_own_gather()
        self._own_gather = [(key, segment)]
        result = [
            pickle.loads(value) if value[:1] == b"\x80" else self._loads(name, value, src, False)
            for name, value, src in zip(wanted, got, others, strict=True)
        ]
        result.insert(rank, obj)
        return result

    def _exchange(self, obj: Any) -> list[Any]:
        """``all_gather_obj`` of two ranks without an auth key: one queue each way.

        Each rank pushes its value onto the queue to the other (no reply to wait for) and
        pops the other's (a wait, then the pop): nothing is left to delete afterwards, which
        saves the ``delete_key`` of the general path. Waits at most the store's timeout.
        """
        entries = self.entries
        now = time.time()
        self._expire_if_due(now)
        rank = self.rank
        peer = 1 - rank
        sent, received = self._exchanged
        name = f"gx/{rank}/{peer}/{sent}"
        value, segment = self._plain_value(name, obj)
        self.store.queue_push(keys.gather_queue(rank, peer), spg_p2p.frame(sent, value))
        entries.append((name, now))
        self._exchanged[0] = sent + 1
        self.broadcast_send_counter += 1
        if self._trash:
            self._flush()
        start = time.monotonic()
        try:
            data = self._gather_inbox.receive(peer, received, None)
        except RuntimeError as exc:
            raise self._gather_lost([peer], start, exc) from exc
        if data is None:
            raise RuntimeError(
                f"all_gather_obj on rank {rank} timed out after "
                f"{time.monotonic() - start:.1f} s (timeout {self._default_timeout():g} s) "
                f"waiting for the values of ranks [{peer}] ('gx/{peer}/{rank}/{received}'): "
                "they did not call all_gather_obj (did they exit, or call something else?)"
            )
        self._exchanged[1] = received + 1
        self.broadcast_recv_src_counter[peer] += 1
        # The other rank has sent this gather's value, so it has read this rank's earlier one.
        if self._own_gather:
            self._release_own_gather()
        self._own_gather = [("", segment)] if segment is not None else []
        if data and data[0] == 0x80:
            got = pickle.loads(data)
        else:
            got = self._loads(f"gx/{peer}/{rank}/{received}", data, peer, False)
        return [obj, got] if rank == 0 else [got, obj]

    def _gather(self, wanted: list[str], others: list[int]) -> list[bytes]:
        """The values of ``wanted`` (the first ``len(others)`` are the others' values)."""
        limit = self._default_timeout()
        start = time.monotonic()
        deadline = start + limit
        got: list[bytes] = [b""] * len(wanted)
        missing = list(range(len(wanted)))
        # The first fetch asks for the whole limit (the same each time, so the waiting
        # connection keeps its bound); a fetch again after a spurious wake-up, what is left.
        left = limit
        while missing:
            try:
                fetched = self._waiter.multi_get([wanted[i] for i in missing], left)
            except RuntimeError as exc:
                raise self._gather_lost(others, start, exc) from exc
            if fetched is None:
                raise self._gather_late(wanted, others, start, limit)
            for i, value in zip(missing, fetched, strict=True):
                got[i] = value
            # No value is empty: an empty one is a key that was not there, read after a
            # spurious wake-up (see _await). Fetch those again.
            missing = [i for i in missing if not got[i]]
            left = max(deadline - time.monotonic(), 0.001)
        return got

    def _gather_lost(self, others: list[int], start: float, exc: Exception) -> RuntimeError:
        return RuntimeError(
            f"all_gather_obj on rank {self.rank} lost the store after "
            f"{time.monotonic() - start:.1f} s while waiting for the values of ranks "
            f"{others} (did rank 0, which serves the store, exit?): {exc}"
        )

    def _gather_late(
        self, wanted: list[str], others: list[int], start: float, limit: float
    ) -> RuntimeError:
        """The error for a gather that timed out, naming the ranks whose values are missing."""
        late = [src for src, key in zip(others, wanted, strict=False) if not self._has(key)]
        return RuntimeError(
            f"all_gather_obj on rank {self.rank} timed out after "
            f"{time.monotonic() - start:.1f} s (timeout {limit:g} s) waiting for the "
            f"values of ranks {late} (keys {[wanted[others.index(r)] for r in late]}): "
            "they did not call all_gather_obj (did they exit, or call something else?)"
        )

    def _has(self, key: str) -> bool:
        with contextlib.suppress(RuntimeError):
            return self._peek(key) is not None
        return False

    def _release_own_gather(self) -> None:
        """Every rank has read this rank's last all_gather value: drop it (and its segment)."""
        for name, segment in self._own_gather:
            if name:  # not a value that went through a queue
                self._trash.append(name)
            if segment is not None:
                self._segments.discard(segment)
        self._own_gather = []

    def _learn_nodes(self, cards: list[bytes]) -> None:
        """Record the node identities of all ranks (from their ``_node_card``): who can take
        this rank's segments, and whether all_gather goes over boards."""
        nodes = [card.split(b"\n", 1)[0] for card in cards]
        self._nodes = nodes
        mine = nodes[self.rank]
        self._local = [mine != spg_shm.NOT_LOCAL and node == mine for node in nodes]
        self._all_local = self.world_size > 1 and all(self._local)
        boards = [card.split(b"\n", 1)[1].decode() for card in cards if b"\n" in card]
        if self._all_local and len(boards) == self.world_size:
            self._start_boards(boards)
        elif self._board is not None:
            self._board.close()  # some rank has none, or is elsewhere: the store it is
            self._board = None
        if any(self._local[r] for r in range(self.world_size) if r != self.rank):
            spg_segments.remove_orphans()

    def _seal_card(self, key: str, card: bytes) -> bytes:
        """This rank's node card as stored under ``key``: sealed like a value (with a key).

        A card decides whether ranks pass each other segments and meet on boards: with a
        key, one forged by whoever can write the store must not be believed.
        """
        return seal_payload(self._auth_key, _context(key), card)

    def _open_card(self, key: str, data: bytes, src: int) -> bytes:
        """Rank ``src``'s node card read from ``key``; AuthenticationError if forged (with a
        key), naming the key and the rank."""
        what = f"the node card {key!r} of rank {src} (read by rank {self.rank})"
        return bytes(open_payload(self._auth_key, _context(key), data, what))

    def _barrier_hooks(self, barrier_id: int) -> BarrierHooks:
        """Deferred deletes while waiting, own values once all arrived, the node probe."""

        def all_arrived() -> None:
            self._release_own_gather()
            self._flush_now()

        if self._probed:
            # No hook once all arrived when there is nothing to do then: the barrier is
            # shorter (see barrier.py, phase 2).
            busy = self._own_gather or self._trash or self._reaper.pending
            hook = all_arrived if busy else None
            return BarrierHooks(while_waiting=self._flush, all_arrived=hook)
        self._probed = True
        node_keys = [keys.barrier_node(barrier_id, r) for r in range(self.world_size)]
        identity = self._node_card()

        def probe() -> None:
            all_arrived()
            # Every rank wrote its identity before arriving: none is waited for (a rank that
            # did not, killed while arriving, makes this group use the store only).
            others = [key for r, key in enumerate(node_keys) if r != self.rank]
            if self.store.check(others):
                got = iter(self.store.multi_get(others))
                self._learn_nodes(
                    [
                        identity if r == self.rank else self._open_card(node_keys[r], next(got), r)
                        for r in range(self.world_size)
                    ]
                )

        sealed = self._seal_card(node_keys[self.rank], identity)
        return BarrierHooks(
            before_arrival=lambda: self.store.set(node_keys[self.rank], sealed),
            while_waiting=self._flush,
            all_arrived=probe,
            delete_when_all_departed=node_keys,
        )

    def barrier(self, timeout: float = 30.0) -> None:
        """A robust barrier to synchronize all ranks.

        Uses a multi-phase approach to ensure all processes reach the barrier
        before proceeding:

        1. Each process signals it has reached the barrier

        2. Each process signals that it has confirmed the arrival of all other
           ranks.

        3. Rank 0 waits for all other ranks to signal their departure to ensure
           that all ranks have departed the barrier first.

        Every rank must call barrier in the same order (barriers are numbered, not named).
        Each phase waits at most ``timeout`` seconds, whatever the store's own timeout is;
        if any rank gives up, every rank of that barrier fails, so the next barrier starts
        cleanly. The barrier's keys are deleted once all ranks have left. Ranks that all
        run on one node (known after the first all_gather or barrier) meet on their
        shared-memory boards instead of the store, and a rank that exits fails the barrier
        within a second.

        Args:
            timeout: Maximum time in seconds to wait for each phase (in seconds)

        Raises:
            RuntimeError: If coordination fails or times out, naming the rank, the phase and
                how many of world_size ranks arrived.
        """
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        barrier_id = self._barrier_count
        self._barrier_count += 1
        board = self._board
        if self._board_names is not None and board is not None:
            if not board.connected:
                self._connect_all(f"barrier {barrier_id} failed on rank {self.rank}")
            run_board_barrier(
                board,
                self.rank,
                self.world_size,
                barrier_id,
                timeout,
                self._barrier_hooks(barrier_id),
            )
            return
        run_barrier(
            self.store,
            self._mailbox,
            self.rank,
            self.world_size,
            barrier_id,
            timeout,
            self._barrier_hooks(barrier_id),
        )

    @staticmethod
    def create(
        host: str,
        port: int,
        rank: int,
        world_size: int,
        data_expiration_seconds: int = 3600,
        store_timeout: int = 300,
        *,
        listen_socket: Socket | None = None,
        auth_key: AuthKey | None = None,
    ) -> StatelessProcessGroup:
        """A replacement for `torch.distributed.init_process_group` that does not
        pollute the global state.

        If we have process A and process B called `torch.distributed.init_process_group`
        to form a group, and then we want to form another group with process A, B, C,
        D, it is not possible in PyTorch, because process A and process B have already
        formed a group, and process C and process D cannot join that group. This
        function is a workaround for this issue.

        `torch.distributed.init_process_group` is a global call, while this function
        is a stateless call. It will return a `StatelessProcessGroup` object that can be
        used for exchanging metadata. With this function, process A and process B
        can call `StatelessProcessGroup.create` to form a group, and then process A, B,
        C, and D can call `StatelessProcessGroup.create` to form another group.

        Rank 0 serves the store on ``host:port`` only (IPv4 or IPv6), or on
        ``listen_socket``, a socket it has already bound (port 0 avoids port races).
        Every rank returns once all ``world_size`` ranks have joined, or raises
        ``StoreError`` (a RuntimeError) within ``store_timeout`` seconds saying how many
        ranks joined, that the port is in use, or which address could not be reached.

        ``auth_key`` (bytes, or a str taken as UTF-8; None: ``$VLLM_BRIDGE_AUTH_KEY``, if
        set) authenticates every value the group stores: all ranks must give the same key.
        When the environment sets ``$VLLM_BRIDGE_AUTH_KEY`` (the operator's key), an
        ``auth_key`` that differs from it raises AuthenticationError (a RuntimeError) before
        anything is served or joined; so does creating a group without any key when
        ``$VLLM_BRIDGE_REQUIRE_AUTH_KEY=1``.
        """
        validate_rank(rank, world_size)
        key = resolve_key(auth_key)  # a bad key fails before anything is served
        deadline = time.monotonic() + store_timeout
        store, sock = open_store(host, port, rank, store_timeout, listen_socket=listen_socket)
        owned = listen_socket is None
        address = format_address(host, sock.getsockname()[1] if sock is not None else port)
        try:
            join_group(store, rank, world_size, address, store_timeout, deadline)
        except BaseException as exc:
            # Release the store (rank 0: stop serving) before the error travels up: frames
            # kept alive by the traceback would otherwise keep the server running.
            del store
            traceback.clear_frames(exc.__traceback__)
            if owned and sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
            raise
        # The key resolved above goes in before __post_init__, which then keeps it.
        group = StatelessProcessGroup.__new__(StatelessProcessGroup)
        group._auth_key = key
        group.__init__(  # type: ignore[misc]
            rank=rank,
            world_size=world_size,
            store=store,
            socket=sock,
            data_expiration_seconds=data_expiration_seconds,
        )
        return group


def _context(key: str) -> str:
    """What a value's tag is bound to: its store key, which names sender, receiver and number."""
    return f"spg/{key}"
