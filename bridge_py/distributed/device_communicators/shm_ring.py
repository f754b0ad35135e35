"""ShmRingBuffer: one writer, n readers, ``max_chunks`` chunks in one shared-memory segment.

Segment layout (all integers little-endian, regions aligned to 64 bytes)::

    +--------+------------------------+------------------------------+----------------------+
    | header | reader slots           | chunk flags                  | chunks               |
    | 64 B   | n_reader x 16 B        | max_chunks x (1 + n_reader)  | max_chunks x         |
    |        |                        |                              |   max_chunk_bytes    |
    +--------+------------------------+------------------------------+----------------------+

* header: the shared-memory header (``shm.header``: magic ``VBMQ``, layout version) with
  n_reader, max_chunks, max_chunk_bytes, a 16-byte random token (its start is also in the
  segment's name, so a reader knows it opened this queue's segment), the writer's PID and
  PID namespace; then a *ready* byte (all readers joined) and a *closed* byte (the writer
  closed the queue).
* reader slot: state (0 not attached, 1 attached, 2 detached), PID and PID namespace of the
  reader, so that a writer waiting on a reader can tell that it died.
* chunk flags: byte 0 is *written*, byte ``1 + i`` is *read by reader i*. A chunk is free
  when it is not written or every reader has read it; readable by reader i when written and
  not yet read by i. The writer clears *written* before filling a chunk and clears the read
  flags before setting *written* again, so readers never see a half-written chunk as ready;
  readers only ever set their own flag. Memory fences order these writes on any CPU.
* chunk: a 16-byte header (:data:`CHUNK`: total message length, part index, bytes in this
  part) and the part's bytes, so a message larger than a chunk spans consecutive chunks.
  Remote readers get the same chunks over TCP (``shm_remote``).

The writer takes the memory of the header, the reader slots and the flags when it creates
the segment, and that of each chunk before a message first needs it (:meth:`reserve`), so
that a full ``/dev/shm`` is an error and not a SIGBUS. It alone unlinks the segment: on
:meth:`ShmRingBuffer.close`, when garbage-collected, or at interpreter exit. Its name
follows ``shm.segments``' (``vbspg_<pid namespace>_<writer pid>_<token>_mq``), so a killed
writer's segment is removed by ``segments.remove_orphans`` (and by multiprocessing's resource
tracker). Readers attach through ``shm.posix.attach`` (checked, and never the tracker's)
and never unlink it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import struct
import weakref
from collections.abc import Iterator
from typing import Any

from bridge_py.distributed.errors import (
    DistributedError,
    PeerGoneError,
    SharedMemoryError,
    StateError,
)
from bridge_py.distributed.shm import posix
from bridge_py.distributed.shm.header import Header
from bridge_py.distributed.shm.segments import NAME_PREFIX
from bridge_py.distributed.shm.wait import Cancel, fence, pid_namespace, process_alive, wait_until

__all__ = ["CHUNK", "CHUNK_HEADER_BYTES", "NAME_SUFFIX", "RAW_PART", "ShmRingBuffer"]

NAME_SUFFIX = "_mq"
# n_reader, max_chunks, max_chunk_bytes, token, writer pid, writer pid namespace
_HEADER = Header(b"VBMQ", 2, "2xIIQ16sI4xQ")
_READY_AT = _HEADER.size
_CLOSED_AT = _HEADER.size + 1
_SLOTS_AT = 64
_SLOT = struct.Struct("<B3xIQ")  # state, pid, pid namespace
CHUNK = struct.Struct("<QII")  # total message length, part index, bytes in this part
CHUNK_HEADER_BYTES = CHUNK.size
# The part index of a raw slot (MessageQueue.acquire_write), which is part of no message.
RAW_PART = 0xFFFFFFFF

SLOT_EMPTY, SLOT_ATTACHED, SLOT_DETACHED = 0, 1, 2


def _align(offset: int) -> int:
    return (offset + 63) // 64 * 64


def _release(shm: posix.SharedMemory, creator: bool, slot: list[int], pid: int) -> None:
    """Mark the writer closed (or this reader detached), unlink if creator, unmap.

    In a process forked from the owner (``pid``) only the mapping is released: the queue
    still belongs to the process that created or attached it.
    """
    owner = os.getpid() == pid
    if owner:
        with contextlib.suppress(Exception):  # closed already, or unmapped: nothing to mark
            buf = posix.view(shm)
            if creator:
                buf[_CLOSED_AT] = 1
            elif slot:
                buf[slot[0]] = SLOT_DETACHED
            fence()
    if creator and owner:
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()
    # A view still referenced elsewhere (a traceback) keeps the mapping until it goes.
    with contextlib.suppress(BufferError):
        shm.close()


class ShmRingBuffer:
    """A shared memory ring buffer for broadcast: one writer, ``n_reader`` readers.

    Created by the writer (``name`` None) or attached by a reader (``name`` from
    :meth:`handle`, on the same host). Pickling it transfers the handle; unpickling attaches.
    """

    def __init__(
        self,
        n_reader: int,
        max_chunk_bytes: int,
        max_chunks: int,
        name: str | None = None,
        *,
        ranks: list[int] | None = None,
    ) -> None:
        """``ranks``: the readers' ranks, named in the writer's errors (default: their
        indices)."""
        if n_reader < 1:
            raise ValueError(f"a ring buffer needs at least one reader, got n_reader={n_reader}")
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be at least 1, got {max_chunks}")
        self.n_reader = n_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.metadata_size = 1 + n_reader
        self.metadata_offset = _align(_SLOTS_AT + _SLOT.size * n_reader)
        self.data_offset = _align(self.metadata_offset + self.metadata_size * max_chunks)
        self.total_bytes_of_buffer = self.data_offset + max_chunk_bytes * max_chunks
        self._namespace = pid_namespace()
        self.is_creator = name is None
        self.shared_memory: posix.SharedMemory
        if name is not None:
            # A reader checks the file against the handle's layout before it sizes anything
            # by the handle's numbers: a file that passes holds that many readers and chunks.
            self.shared_memory = posix.attach(name)
            try:
                self.token = self._validate(name)
            except BaseException:
                self.shared_memory.close()
                raise
        self._all_read = b"\x01" * n_reader
        self._no_reads = bytes(n_reader)
        self._slot: list[int] = []  # [offset of this reader's slot] once attached
        self.ranks = list(range(n_reader)) if ranks is None else ranks
        self.reader = -1  # this process's reader index, once attached
        self.current_idx = 0
        self._reserved = [0] * max_chunks  # writer: the bytes of each chunk with memory taken
        if name is None:
            self.token = secrets.token_bytes(16)
            name = f"{NAME_PREFIX}{self._namespace}_{os.getpid()}_{self.token[:6].hex()}"
            # The memory of the header, the reader slots and the flags is taken now; that of
            # the chunks as messages need it (reserve): a ring is mostly never written.
            self.shared_memory = posix.create(
                name + NAME_SUFFIX, self.total_bytes_of_buffer, reserve=self.data_offset
            )
            # A new segment is zero-filled: no chunk written, no reader attached, not ready.
            _HEADER.pack_into(
                posix.view(self.shared_memory), n_reader, max_chunks, max_chunk_bytes,
                self.token, os.getpid(), self._namespace,
            )  # fmt: skip
        self.name = self.shared_memory.name
        self._buf: memoryview = posix.view(self.shared_memory)
        self._finalizer = weakref.finalize(
            self, _release, self.shared_memory, self.is_creator, self._slot, os.getpid()
        )

    def _validate(self, name: str) -> bytes:
        buf = posix.view(self.shared_memory)
        n_reader, chunks, chunk_bytes, token, *_ = _HEADER.unpack_from(buf, name)
        if not name.endswith(token[:6].hex() + NAME_SUFFIX):
            raise SharedMemoryError(f"shared-memory segment {name!r} is not this queue's")
        if (n_reader, chunks, chunk_bytes) != (
            self.n_reader,
            self.max_chunks,
            self.max_chunk_bytes,
        ):
            raise SharedMemoryError(f"shared-memory segment {name!r} has not the handle's layout")
        if len(buf) < self.total_bytes_of_buffer:
            raise SharedMemoryError(f"shared-memory segment {name!r} is smaller than its layout")
        return bytes(token)

    def handle(self) -> tuple[int, int, int, str]:
        """``(n_reader, max_chunk_bytes, max_chunks, name)``: what a reader needs to attach."""
        return (self.n_reader, self.max_chunk_bytes, self.max_chunks, self.name)

    def __reduce__(self) -> tuple[Any, tuple[int, int, int, str]]:
        return (self.__class__, self.handle())

    # --- views, as vLLM's (for callers that use the raw chunks) ---

    @contextlib.contextmanager
    def get_data(self, current_idx: int) -> Iterator[memoryview]:
        """A view of chunk ``current_idx`` (its 16-byte part header included); the writer's
        has its memory taken first (SharedMemoryError when ``/dev/shm`` has no room)."""
        if self.is_creator:
            self._take_memory(current_idx, self.max_chunk_bytes, "a whole chunk")
        start = self.data_offset + current_idx * self.max_chunk_bytes
        with self._buf[start : start + self.max_chunk_bytes] as view:
            yield view

    @contextlib.contextmanager
    def get_metadata(self, current_idx: int) -> Iterator[memoryview]:
        """A view of chunk ``current_idx``'s flags: written, then one read flag per reader."""
        start = self.metadata_offset + current_idx * self.metadata_size
        with self._buf[start : start + self.metadata_size] as view:
            yield view

    # --- the flag protocol ---

    def _flags(self, idx: int) -> int:
        return self.metadata_offset + idx * self.metadata_size

    def chunk_writable(self, idx: int) -> bool:
        """Whether chunk ``idx`` is free: never written, or read by every reader."""
        at = self._flags(idx)
        fence()
        buf = self._buf
        return buf[at] == 0 or bytes(buf[at + 1 : at + 1 + self.n_reader]) == self._all_read

    def unread_by(self, idx: int) -> list[int]:
        """The readers that have not yet read chunk ``idx`` (empty when it is not written)."""
        at = self._flags(idx)
        fence()
        if self._buf[at] == 0:
            return []
        return [i for i in range(self.n_reader) if self._buf[at + 1 + i] == 0]

    def reserve(self, total: int) -> None:
        """Writer: take the memory of the chunks that a message of ``total`` bytes fills,
        from the next chunk on (memory taken once stays), before any of it is written.

        A store through the mapping into memory that /dev/shm cannot give kills the process
        (SIGBUS). Raises SharedMemoryError naming the segment when /dev/shm has no room:
        nothing of the message has been written then, and the ring is as it was.
        """
        part_bytes = self.max_chunk_bytes - CHUNK_HEADER_BYTES
        reserved = self._reserved
        for j in range(min(-(-total // part_bytes) or 1, self.max_chunks)):
            idx = (self.current_idx + j) % self.max_chunks
            need = CHUNK_HEADER_BYTES + min(part_bytes, total - j * part_bytes)
            if need > reserved[idx]:
                self._take_memory(idx, need, f"part {j} ({need} bytes) of a {total}-byte message")

    def _take_memory(self, idx: int, need: int, what: str) -> None:
        """Take the memory of the first ``need`` bytes of chunk ``idx`` (``what`` they are
        for, in the error), unless taken already."""
        if need > self._reserved[idx]:
            start = self.data_offset + idx * self.max_chunk_bytes
            posix.reserve_memory(self.shared_memory, start, need, what)
            self._reserved[idx] = need

    def write_chunk(self, idx: int, total: int, part: int, payload: memoryview) -> None:
        """Fill free chunk ``idx`` with one part of a message and publish it to the readers
        (its memory taken first, if :meth:`reserve` has not: SharedMemoryError when
        ``/dev/shm`` has no room, and the chunk is left as it was)."""
        if CHUNK_HEADER_BYTES + len(payload) > self._reserved[idx]:
            self._take_memory(idx, CHUNK_HEADER_BYTES + len(payload), f"a {len(payload)}-byte part")
        at = self._flags(idx)
        buf = self._buf
        buf[at] = 0  # not written while we fill it
        fence()
        start = self.data_offset + idx * self.max_chunk_bytes
        CHUNK.pack_into(buf, start, total, part, len(payload))
        buf[start + CHUNK_HEADER_BYTES : start + CHUNK_HEADER_BYTES + len(payload)] = payload
        buf[at + 1 : at + 1 + self.n_reader] = self._no_reads
        fence()  # read flags cleared before the chunk is marked written
        buf[at] = 1
        fence()

    @contextlib.contextmanager
    def raw_slot(self, idx: int) -> Iterator[memoryview]:
        """Writer: free chunk ``idx`` as a raw slot: hidden from the readers, then a view of
        its payload (the chunk less its part header) for the caller to fill; published to
        every reader, marked :data:`RAW_PART`, when the block ends without an exception,
        left unwritten (never seen) when it raises. SharedMemoryError first when
        ``/dev/shm`` has no room for the chunk."""
        self._take_memory(idx, self.max_chunk_bytes, "a raw slot")
        at, buf = self._flags(idx), self._buf
        buf[at] = 0  # not written while the caller fills it
        fence()
        start = self.data_offset + idx * self.max_chunk_bytes
        size = self.max_chunk_bytes - CHUNK_HEADER_BYTES
        with buf[start + CHUNK_HEADER_BYTES : start + self.max_chunk_bytes] as view:
            yield view
        CHUNK.pack_into(buf, start, size, RAW_PART, size)
        buf[at + 1 : at + 1 + self.n_reader] = self._no_reads
        fence()  # read flags cleared before the chunk is marked written
        buf[at] = 1
        fence()
        self.current_idx = (idx + 1) % self.max_chunks

    def chunk_readable(self, idx: int, reader: int) -> bool:
        """Whether chunk ``idx`` holds a part that ``reader`` has not read yet."""
        at = self._flags(idx)
        buf = self._buf
        ready = buf[at] == 1 and buf[at + 1 + reader] == 0
        fence()
        return ready

    # --- who is there ---

    def _slot_at(self, reader: int) -> int:
        return _SLOTS_AT + reader * _SLOT.size

    def attach_reader(self, reader: int) -> None:
        """Record this process as ``reader`` (for the writer's liveness checks)."""
        if not 0 <= reader < self.n_reader:
            raise ValueError(f"reader index must be in [0, {self.n_reader}), got {reader}")
        at = self._slot_at(reader)
        state, pid, _ = _SLOT.unpack_from(self._buf, at)
        if state == SLOT_ATTACHED and pid != os.getpid() and process_alive(pid):
            raise StateError(f"reader {reader} of {self.name!r} is already held by pid {pid}")
        _SLOT.pack_into(self._buf, at, SLOT_ATTACHED, os.getpid(), self._namespace)
        fence()
        self._slot[:] = [at]
        self.reader = reader

    def reader_state(self, reader: int) -> tuple[int, int, int]:
        """``(state, pid, pid namespace)`` of ``reader``'s slot."""
        fence()
        return _SLOT.unpack_from(self._buf, self._slot_at(reader))

    def set_ready(self) -> None:
        """Writer: every reader has joined."""
        self._buf[_READY_AT] = 1
        fence()

    def is_ready(self) -> bool:
        """Whether the writer has seen every reader join."""
        fence()
        return self._buf[_READY_AT] == 1

    def _exited(self, pid: int, namespace: int) -> bool:
        """Whether process ``pid`` of PID namespace ``namespace`` has exited (as far as this
        process can tell: a PID of another namespace is never judged)."""
        return namespace != 0 and namespace == self._namespace and not process_alive(pid)

    # --- a MessageQueue's end of the ring: its writer's, or one reader's ---
    # The same calls as the TCP ends of shm_remote (join, put, flush, take, release, broken),
    # so that the queue drives either alike; current_idx is the chunk this end uses next.

    def join(self, deadline: float | None, cancel: Cancel) -> None:
        """Writer: wait until every reader has attached (the queue then calls
        :meth:`set_ready`). Reader: wait until the writer has called it."""
        if not self.is_creator:
            wait_until(
                self.is_ready,
                "the writer to see every reader join (wait_until_ready)",
                deadline,
                check=lambda: self._check_writer(None),
                cancel=cancel,
            )
            return

        def missing() -> list[int]:
            return [r for i, r in enumerate(self.ranks) if self.reader_state(i)[0] == SLOT_EMPTY]

        wait_until(
            lambda: not missing(),
            lambda: f"local readers to attach: local reader ranks {missing()} did not",
            deadline,
            cancel=cancel,
        )

    def put(
        self, total: int, part: int, payload: memoryview, deadline: float | None, cancel: Cancel
    ) -> None:
        """Writer: wait for the next chunk to be free, then fill it with one part."""
        idx = self.wait_free(deadline, cancel)
        self.write_chunk(idx, total, part, payload)
        self.current_idx = (idx + 1) % self.max_chunks

    def wait_free(self, deadline: float | None, cancel: Cancel) -> int:
        """Writer: wait for the next chunk to be free (every local reader has read it);
        returns its index."""
        idx = self.current_idx
        wait_until(
            lambda: self.chunk_writable(idx),
            lambda: (
                f"local readers to free chunk {idx}: local reader ranks "
                f"{[self.ranks[i] for i in self.unread_by(idx)]} have not read it"
            ),
            deadline,
            check=self._check_readers,
            cancel=cancel,
        )
        return idx

    def flush(self, deadline: float | None, cancel: Cancel) -> None:
        """Writer: nothing to do, a chunk is visible once :meth:`put` returns."""

    def take(
        self,
        deadline: float | None,
        cancel: Cancel,
        log: bool,
        what: str = "a message from the writer",
    ) -> tuple[int, int, memoryview]:
        """Reader: ``(total message length, part index, a view of the part)`` of the next
        chunk, once written; the view must be released before :meth:`release`.
        SharedMemoryError when its header claims more than a chunk holds."""
        idx = self.current_idx
        wait_until(
            lambda: self.chunk_readable(idx, self.reader),
            what,
            deadline,
            check=lambda: self._check_writer(idx),
            cancel=cancel,
            log=log,
        )
        start = self.data_offset + idx * self.max_chunk_bytes + CHUNK_HEADER_BYTES
        total, part, size = CHUNK.unpack_from(self._buf, start - CHUNK_HEADER_BYTES)
        if size > self.max_chunk_bytes - CHUNK_HEADER_BYTES:
            raise self.broken(
                f"is corrupt: it holds {size} bytes (at most "
                f"{self.max_chunk_bytes - CHUNK_HEADER_BYTES} fit in a chunk)"
            )
        return total, part, self._buf[start : start + size]

    def release(self) -> None:
        """Reader: record that this reader is done with the chunk :meth:`take` returned, so
        the writer may reuse it, and go on to the next."""
        fence()  # our reads of the chunk complete before the writer may overwrite it
        self._buf[self._flags(self.current_idx) + 1 + self.reader] = 1
        fence()
        self.current_idx = (self.current_idx + 1) % self.max_chunks

    def broken(self, what: str) -> DistributedError:
        """The error for the chunk :meth:`take` returned, that ``what`` (it is corrupt)."""
        where = f"local reader {self.reader}: chunk {self.current_idx} of segment {self.name!r}"
        return SharedMemoryError(f"{where} {what}")

    def _check_readers(self) -> None:
        """Raise PeerGoneError if a reader that has not read the next chunk is gone."""
        for reader in self.unread_by(self.current_idx):
            state, pid, namespace = self.reader_state(reader)
            rank = self.ranks[reader]
            if state == SLOT_DETACHED:
                raise PeerGoneError(f"local reader rank {rank} closed its end of the queue")
            if state != SLOT_EMPTY and self._exited(pid, namespace):
                raise PeerGoneError(f"local reader rank {rank} (pid {pid}) has exited")

    def _check_writer(self, idx: int | None) -> None:
        """Raise PeerGoneError if the writer is gone and chunk ``idx`` holds nothing to read."""
        fence()
        *_, pid, namespace = _HEADER.unpack_from(self._buf, self.name)
        closed = self._buf[_CLOSED_AT] == 1
        if not closed and not self._exited(pid, namespace):
            return
        if idx is not None and self.chunk_readable(idx, self.reader):
            return  # written before the writer left: read it first
        raise PeerGoneError(
            "the writer closed the queue" if closed else f"the writer (pid {pid}) has exited"
        )

    def close(self) -> None:
        """Writer: mark closed and unlink the segment. Reader: mark detached. Both: unmap.

        Idempotent; also run when the object is garbage-collected or the interpreter exits.
        """
        # Dropped so that the mapping can go; any later use fails at once (a TypeError).
        self._buf = None  # type: ignore[assignment]  # a closed ring has no memory
        self._finalizer()
