"""Point-to-point messages of a StatelessProcessGroup: one store queue per (src, dst) pair.

``send_obj`` pushes onto the queue ``p2p/<src>/<dst>`` (``queue_push``: the client does not
wait for a reply) and ``recv_obj`` pops from it (``queue_pop``: the pop removes the message,
so no ``delete_key`` follows). A leg costs the sender nothing to wait for and the receiver one
round trip when the message is already there, two (a wait, then the pop) when it is not,
against a ``set``, a ``get`` (two) and a ``delete_key`` with one key per message.

Each item is ``u64be(seq) || value``: ``seq`` is the message's number on its pair and the value
is sealed (``auth.seal_payload``) for its name ``p2p/<src>/<dst>/<seq>`` (:func:`keys.p2p_value`),
so with an auth key a message moved to another position or pair fails its check.

Between ranks of one node without an auth key, messages go through the shared-memory boards of
``board`` instead, and take these queues only when a ring slot is busy or too small.

Messages are received in order. An item numbered below the expected one is stale (its sender
expired it while it was being popped, see :func:`drop`) and is skipped; one above it is
kept aside until its turn. Queues are not keys: they do not show in ``num_keys``/``list_keys``
and an empty one is just a name in the server.
"""

from __future__ import annotations

import struct
import time

from torch.distributed import QueueEmptyError, Store

from bridge_py.distributed.errors import is_store_timeout
from bridge_py.distributed.spg import keys
from bridge_py.distributed.store.torch_api import timeout_of
from bridge_py.distributed.store.waiting import pop_before
from bridge_py.distributed.store.watchdog import watched

__all__ = ["HEADER", "Inbox", "drop", "frame", "unframe"]

HEADER = struct.Struct(">Q")
# After a message was not there yet, pop with a wait 1, 2, 4, ... (at most this many) times
# before trying without again: a failed try costs a round trip and an exception, and a rank
# that always waits for its peer (request and reply) would pay it often.
_MAX_BACKOFF = 64
# Messages popped before their turn that a rank keeps per sender, and their bytes. A
# sender's messages come in order but for one that expire_data put back (see drop), so a
# few is what happens; more is someone else pushing onto the queue (anyone who reaches
# the store can), and what does not fit is dropped: its turn then times out, if it was real.
_MAX_EARLY = 64
_MAX_EARLY_BYTES = 64 << 20


def frame(seq: int, value: bytes) -> bytes:
    """The queue item for message ``seq`` holding ``value`` (already sealed)."""
    return HEADER.pack(seq) + value


def unframe(item: bytes) -> tuple[int, memoryview]:
    """``(seq, value)`` of a queue item, the value not copied (a short item: never due)."""
    if len(item) < HEADER.size:
        return (1 << 64) - 1, memoryview(item)
    return HEADER.unpack_from(item)[0], memoryview(item)[HEADER.size :]


class Inbox:
    """The receiving side of one rank: pops its pairs' queues in order, with a deadline."""

    def __init__(self, store: Store, rank: int, world_size: int) -> None:
        self._store = store
        # src -> {seq: value} of messages popped before their turn.
        self._early: dict[int, dict[int, memoryview]] = {}
        # src -> [pops with a wait left before trying one without, the next such count].
        self._skips: dict[int, list[int]] = {}
        self._queues = [keys.p2p_queue(src, rank) for src in range(world_size)]
        # Per src: items popped from its queue so far (due, early or stale).
        self.popped = [0] * world_size

    def take(self, src: int, seq: int) -> memoryview | None:
        """Message ``seq`` from ``src`` if it was popped before its turn (no store request)."""
        early = self._early.get(src)
        return early.pop(seq, None) if early else None

    def receive(self, src: int, seq: int, limit: float | None) -> memoryview | None:
        """The value of message ``seq`` from ``src``, or None after ``limit`` seconds.

        ``limit`` None: the store's timeout. When the last few messages from ``src`` were
        already there when asked for, first pop without waiting (one round trip); otherwise
        pop with the store's wait, bounded by ``limit`` (a TCPStore client that gives up a
        wait cancels it with the server, so the connection stays usable). Store failures (the
        server is gone) propagate; a store that stops answering fails them GRACE seconds
        after ``limit`` (``store.watchdog``).
        """
        value = self.take(src, seq)
        if value is not None:
            return value
        bound = timeout_of(self._store).total_seconds() if limit is None else limit
        with watched(self._store, time.monotonic() + bound):
            return self._pop(src, seq, limit)

    def _pop(self, src: int, seq: int, limit: float | None) -> memoryview | None:
        queue = self._queues[src]
        store = self._store
        skips = self._skips.get(src)
        if skips is None:
            skips = self._skips[src] = [0, 1]
        if skips[0] == 0:
            try:
                item = store.queue_pop(queue, False)
            except QueueEmptyError:
                skips[0] = skips[1]
                skips[1] = min(2 * skips[1], _MAX_BACKOFF)
            else:
                skips[1] = 1
                value = self._sort(src, seq, item)
                if value is not None:
                    return value
        else:
            skips[0] -= 1
        if limit is None:
            # The default limit is the store's own timeout: the first pop waits with it as it
            # is (which spares setting it); a pop again needs what is left.
            start = time.monotonic()
            try:
                value = self._sort(src, seq, store.queue_pop(queue))
            except QueueEmptyError:
                pass  # woken, but the sender expired the message first
            except RuntimeError as exc:
                if is_store_timeout(exc):
                    return None
                raise
            if value is not None:
                return value
            limit = timeout_of(store).total_seconds() - (time.monotonic() - start)
        deadline = time.monotonic() + limit
        while (popped := pop_before(store, queue, deadline)) is not None:
            value = self._sort(src, seq, popped)
            if value is not None:
                return value
        return None

    def _sort(self, src: int, seq: int, item: bytes) -> memoryview | None:
        """The value of a popped item if it is message ``seq``; else None, and the message is
        kept until its turn (or forgotten, if its turn has passed)."""
        self.popped[src] += 1
        got, value = unframe(item)
        if got == seq:
            return value
        if got > seq:
            early = self._early.setdefault(src, {})
            held = sum(len(kept) for kept in early.values())
            if len(early) < _MAX_EARLY and held + len(value) <= _MAX_EARLY_BYTES:
                early[got] = value
        return None


def drop(store: Store, queue: str, seq: int, sent: int) -> None:
    """Remove message ``seq`` (of ``sent`` so far) from ``queue`` if it is still there.

    For ``expire_data``: messages are expired oldest first, so an unreceived ``seq`` is at the
    front of the queue, and a later message there means ``seq`` was received: that message
    and those behind it (at most the ``sent - seq - 1`` sent after ``seq``) are popped and
    pushed back in order, so the receiver still finds them in turn (one it pops meanwhile is
    set aside until its turn). Only pops and pushes: torch's ``queue_len`` holds the GIL while
    it waits for the server, so on a silent store it would stop the watchdog that ends this
    request (``store.watchdog``) along with every other thread.
    """
    try:
        item = store.queue_pop(queue, False)
    except QueueEmptyError:
        return
    if unframe(item)[0] <= seq:
        return  # unreceived: dropped
    later = [item]
    while len(later) < sent - seq - 1:
        try:
            later.append(store.queue_pop(queue, False))
        except QueueEmptyError:
            break
    for item in later:
        store.queue_push(queue, item)
