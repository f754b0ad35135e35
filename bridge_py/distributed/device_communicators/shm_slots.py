"""MessageQueue's raw ring slots and single-reader queues (vLLM 0.34), beside its data path.

A mixin of ``shm_broadcast.MessageQueue``:

* :meth:`~QueueSlots.acquire_write` / :meth:`~QueueSlots.acquire_read` hand the caller one
  chunk of the shared-memory ring as a raw buffer, as vLLM's (which ``enqueue``/``dequeue``
  are built on there). The caller frames its own bytes: the writer's view is the chunk's
  payload (``max_chunk_bytes`` less the ring's 16-byte part header), the readers see those
  bytes, the whole view whatever was written. Only local readers take part (vLLM's too:
  remote readers never see a raw slot). A raw slot is no message: ``dequeue`` refuses one
  and ``acquire_read`` refuses a chunk of a message (StateError, the chunk left unread), so
  mixing the two cannot tear the stream.
* :meth:`~QueueSlots.create_from_process_group_single_reader`: one queue per rank of a
  group, all read by one rank (GroupCoordinator's ``create_single_reader_mq_broadcasters``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

from bridge_py.deadline import clamp_until
from bridge_py.distributed.auth import AuthKey, open_object, resolve_key, seal_object
from bridge_py.distributed.device_communicators.shm_remote import address_toward_group
from bridge_py.distributed.device_communicators.shm_ring import RAW_PART, ShmRingBuffer
from bridge_py.distributed.errors import StateError
from bridge_py.distributed.groups.node import same_node_as
from bridge_py.distributed.groups.objects import object_group
from bridge_py.distributed.shm.wait import deadline_after

__all__ = ["QueueSlots"]

_Queue = TypeVar("_Queue", bound="QueueSlots")


class QueueSlots:
    """acquire_write, acquire_read and create_from_process_group_single_reader of a
    MessageQueue (the state they use is the queue's)."""

    buffer: ShmRingBuffer | None
    _source: Any
    _is_writer: bool
    _closed: bool
    _lock: threading.Lock
    _shutdown: threading.Event
    _incoming: Any
    _slot_open: bool

    def _flush(self, deadline: float | None) -> None: ...  # the queue's

    def _enter_slot(self, op: str) -> None:
        """Under the lock: refuse a closed end, or a second slot while one is open."""
        if self._closed:
            raise StateError("this end of the message queue is closed")
        if self._slot_open:
            raise StateError(f"{op}: a slot of this end is open (leave its with-block first)")

    @contextlib.contextmanager
    def acquire_write(self, timeout: float | None = None) -> Iterator[memoryview]:
        """Context manager: the next chunk of the ring, for the writer to fill itself.

        Waits (at most ``timeout`` seconds) until every local reader has read the chunk,
        then yields a writable memoryview of its payload (``max_chunk_bytes - 16`` bytes,
        holding what was there before: the caller writes what it needs, and frames it).
        When the block ends, the chunk is published to the local readers
        (:meth:`acquire_read`); when it raises, nothing is published and the next write
        takes the same chunk. The view is valid inside the block only. A message an
        earlier ``enqueue`` left half written (a timeout) is finished first.

        Raises:
            StateError: not the writer's end, a queue without local readers (no ring), a
                closed end, or a slot of this end already open.
            GroupTimeout: a TimeoutError, after ``timeout`` seconds.
            PeerGoneError: a local reader it waits for has exited or closed its end.
            WaitCancelled: :meth:`shutdown` was called while it waited.
            SharedMemoryError: ``/dev/shm`` has no room for the chunk.
        """
        ring = self.buffer
        if not self._is_writer or ring is None:
            why = "not the writer's end" if not self._is_writer else "no local readers (no ring)"
            raise StateError(f"acquire_write needs the writer of a shared-memory ring: {why}")
        deadline = clamp_until(deadline_after(timeout))  # the caller's, if sooner
        with self._lock:
            self._enter_slot("acquire_write")
            self._flush(deadline)
            idx = ring.wait_free(deadline, self._shutdown)
            self._slot_open = True
        try:
            with ring.raw_slot(idx) as view:
                yield view
        finally:
            self._slot_open = False

    @contextlib.contextmanager
    def acquire_read(
        self, timeout: float | None = None, indefinite: bool = False
    ) -> Iterator[memoryview]:
        """Context manager: the next chunk of the ring, written by :meth:`acquire_write`.

        Waits (at most ``timeout`` seconds; ``indefinite`` only silences the periodic
        "still waiting" log, as in vLLM) until the writer has published the chunk, then
        yields a read-only memoryview of the payload the writer filled. When the block
        ends, even by an exception, the chunk counts as read by this reader (the writer
        may reuse it once every reader has read it). The view is valid inside the block
        only: copy out what is to be kept.

        Raises:
            StateError: not a local reader's end, a closed end, a slot already open, a
                message partly read, or a chunk that holds part of a message written by
                ``enqueue`` (read it with ``dequeue``; it is left unread).
            GroupTimeout: a TimeoutError, after ``timeout`` seconds.
            PeerGoneError: the writer has closed the queue or exited, and nothing is left.
            WaitCancelled: :meth:`shutdown` was called while it waited.
        """
        ring = self._source
        if not isinstance(ring, ShmRingBuffer):
            raise StateError("acquire_read needs a local reader's end (one on the ring)")
        deadline = clamp_until(deadline_after(timeout))
        with self._lock:
            self._enter_slot("acquire_read")
            if self._incoming is not None:
                raise StateError("acquire_read: a message is partly read; finish it with dequeue")
            _, part, view = ring.take(deadline, self._shutdown, not indefinite)
            if part != RAW_PART:
                view.release()
                raise StateError(
                    "acquire_read: the next chunk holds part of a message written by "
                    "enqueue; read it with dequeue"
                )
            self._slot_open = True
        try:
            with view, view.toreadonly() as readonly:
                yield readonly
        finally:
            ring.release()
            self._slot_open = False

    @classmethod
    def create_from_process_group_single_reader(
        cls: type[_Queue],
        pg: Any,
        max_chunk_bytes: int,
        max_chunks: int,
        reader_rank: int = 0,
        blocking: bool = False,
        *,
        auth_key: AuthKey | None = None,
    ) -> tuple[_Queue, list[Any]]:
        """Creates a MessageQueue for a process group with a single reader.

        A collective over ``pg`` (a torch ProcessGroup with a CPU backend, a
        StatelessProcessGroup, or anything with a ``cpu_group``): every rank, the reader
        included, becomes the writer of a queue of its own (chunks of ``max_chunk_bytes``,
        ``max_chunks`` of them) with one reader, ``reader_rank``: through shared memory
        when on its node, else over TCP. ``reader_rank`` is a global rank, as in vLLM,
        for a group known to torch.distributed; for a stateless group, the rank in it.

        Returns ``(queue, handles)``: ``handles`` lists every rank's handle, in group rank
        order, on the reader, and is empty elsewhere; the reader opens each with
        ``MessageQueue.create_from_handle(handle, 0)``. With ``blocking`` the other ranks
        wait until the reader has opened their queue; the reader cannot wait on its own
        queue before opening it, so it returns at once and calls ``wait_until_ready``
        on its queue after opening the handles (vLLM's would wait forever there).
        ``auth_key`` (None: ``$VLLM_BRIDGE_AUTH_KEY``) authenticates the handles and
        every message; all ranks must give the same key.

        Raises:
            ValueError: ``reader_rank`` is not a rank of ``pg``.
            TypeError: ``pg`` is none of the groups above, or ``reader_rank`` not an int.
        """
        key = resolve_key(auth_key)
        group = object_group(pg, key, purpose="single-reader queues")
        reader = _group_rank(getattr(pg, "cpu_group", pg), reader_rank, group.world_size)
        rank = group.rank
        local = same_node_as(group, reader)[rank]
        connect_ip = None
        if not local and not os.environ.get("VLLM_HOST_IP"):
            connect_ip = address_toward_group(pg)
        queue = cls(  # type: ignore[call-arg]  # MessageQueue's constructor
            n_reader=1,
            n_local_reader=1 if local else 0,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            connect_ip=connect_ip,
            auth_key=key,
        )
        context = f"mq/single-reader/{reader}"
        handle = queue.export_handle()  # type: ignore[attr-defined]
        sealed = group.all_gather_obj(seal_object(key, f"{context}/{rank}", handle))
        if rank != reader:
            if blocking:
                queue.wait_until_ready()  # type: ignore[attr-defined]
            return queue, []
        what = "the queue handle of rank {}"
        handles = [
            open_object(key, f"{context}/{r}", data, what.format(r))
            for r, data in enumerate(sealed)
        ]
        return queue, handles


def _group_rank(pg: Any, reader_rank: int, world_size: int) -> int:
    """``reader_rank`` as a rank of ``pg``: from a global rank where torch.distributed
    knows ``pg``, as it is for a stateless group."""
    if isinstance(reader_rank, bool) or not isinstance(reader_rank, int):
        raise TypeError(f"reader_rank must be an int, got {type(reader_rank).__name__}")
    if isinstance(pg, ProcessGroup) and dist.is_initialized():
        try:
            ranks = dist.get_process_group_ranks(pg)
        except (ValueError, RuntimeError):  # a group torch.distributed does not know
            ranks = None
        if ranks is not None:
            if reader_rank not in ranks:
                raise ValueError(f"reader_rank {reader_rank} is not a global rank of pg {ranks}")
            return ranks.index(reader_rank)
    if not 0 <= reader_rank < world_size:
        raise ValueError(f"reader_rank must be in [0, {world_size}), got {reader_rank}")
    return reader_rank
