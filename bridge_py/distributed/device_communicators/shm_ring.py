"""ShmRingBuffer: one writer, n readers, ``max_chunks`` chunks in one shared-memory segment.

Segment layout (all integers little-endian, regions aligned to 64 bytes)::

    +--------+------------------------+------------------------------+----------------------+
    | header | reader slots           | chunk flags                  | chunks               |
    | 64 B   | n_reader x 16 B        | max_chunks x (1 + n_reader)  | max_chunks x         |
    |        |                        |                              |   max_chunk_bytes    |
    +--------+------------------------+------------------------------+----------------------+

* header: magic ``VBMQ``, layout version, n_reader, max_chunks, max_chunk_bytes, a 16-byte
  random token (its start is also in the segment's name, so a reader knows it opened this
  queue's segment), the writer's PID and PID namespace, a *ready* byte (all readers joined)
  and a *closed* byte (the writer closed the queue).
* reader slot: state (0 not attached, 1 attached, 2 detached), PID and PID namespace of the
  reader, so that a writer waiting on a reader can tell that it died.
* chunk flags: byte 0 is *written*, byte ``1 + i`` is *read by reader i*. A chunk is free
  when it is not written or every reader has read it; readable by reader i when written and
  not yet read by i. The writer clears *written* before filling a chunk and clears the read
  flags before setting *written* again, so readers never see a half-written chunk as ready;
  readers only ever set their own flag. Memory fences order these writes on any CPU.
* chunk: a 16-byte header (total message length, part index, bytes in this part) and the
  part's bytes, so a message larger than a chunk spans consecutive chunks.

The writer creates the segment (its name is ``vbmq_`` and 12 random hex digits) and alone
unlinks it: on :meth:`ShmRingBuffer.close`, when garbage-collected, or at interpreter exit;
a killed writer's segment is removed by multiprocessing's resource tracker. Readers attach
through ``shm.posix.attach`` (checked, and never the tracker's) and never unlink it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import struct
import weakref
from collections.abc import Iterator
from multiprocessing import shared_memory
from typing import Any

from bridge_py.distributed.errors import SharedMemoryError
from bridge_py.distributed.shm import posix
from bridge_py.distributed.shm.wait import (
    fence,
    pid_namespace,
    process_alive,
)

__all__ = [
    "CHUNK_HEADER_BYTES",
    "NAME_PREFIX",
    "ShmRingBuffer",
    "orphaned_segments",
]

NAME_PREFIX = "vbmq_"
_MAGIC = b"VBMQ"
_VERSION = 1
_HEADER = struct.Struct("<4sHHIIQ16sIIQ")  # magic ver pad n_reader chunks chunk_bytes token pid
_READY_AT = 56
_CLOSED_AT = 57
_HEADER_BYTES = 64
_SLOT = struct.Struct("<B3xIQ")  # state, pid, pid namespace
_CHUNK = struct.Struct("<QII")  # total message length, part index, bytes in this part
CHUNK_HEADER_BYTES = _CHUNK.size

SLOT_EMPTY, SLOT_ATTACHED, SLOT_DETACHED = 0, 1, 2


def _align(offset: int) -> int:
    return (offset + 63) // 64 * 64


def orphaned_segments(directory: str = "/dev/shm") -> list[str]:
    """Names of queue segments whose writer process has exited (of this PID namespace).

    Only a killed writer leaves one behind (until its resource tracker exits); unlink them
    with ``SharedMemory(name).unlink()``. Empty where ``directory`` does not exist.
    """
    try:
        names = [name for name in os.listdir(directory) if name.startswith(NAME_PREFIX)]
    except FileNotFoundError:
        return []
    orphans = []
    for name in sorted(names):
        try:
            with open(os.path.join(directory, name), "rb") as segment:
                header = segment.read(_HEADER.size)
            magic, *_, pid, _, namespace = _HEADER.unpack(header)
        except (OSError, struct.error):
            continue  # gone meanwhile, or not ours
        if magic == _MAGIC and namespace == pid_namespace() and not process_alive(pid):
            orphans.append(name)
    return orphans


def _release(shm: posix.Segment, creator: bool, slot: list[int], pid: int) -> None:
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
        self, n_reader: int, max_chunk_bytes: int, max_chunks: int, name: str | None = None
    ) -> None:
        if n_reader < 1:
            raise ValueError(f"a ring buffer needs at least one reader, got n_reader={n_reader}")
        if not CHUNK_HEADER_BYTES < max_chunk_bytes < 2**32:
            raise ValueError(
                f"max_chunk_bytes must be in ({CHUNK_HEADER_BYTES}, 2**32), got {max_chunk_bytes}"
            )
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be at least 1, got {max_chunks}")
        self.n_reader = n_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.metadata_size = 1 + n_reader
        self._slots_offset = _HEADER_BYTES
        self.metadata_offset = _align(_HEADER_BYTES + _SLOT.size * n_reader)
        self.data_offset = _align(self.metadata_offset + self.metadata_size * max_chunks)
        self.total_bytes_of_buffer = self.data_offset + max_chunk_bytes * max_chunks
        self._all_read = b"\x01" * n_reader
        self._no_reads = bytes(n_reader)
        self._slot: list[int] = []  # [offset of this reader's slot] once attached
        self.is_creator = name is None
        self.shared_memory: posix.Segment
        if name is None:
            self.shared_memory, token = self._create()
        else:
            self.shared_memory = posix.attach(name)
            token = self._validate(name)
        self.token = token
        self.name = self.shared_memory.name
        self._buf: memoryview = posix.view(self.shared_memory)
        self._finalizer = weakref.finalize(
            self, _release, self.shared_memory, self.is_creator, self._slot, os.getpid()
        )

    def _create(self) -> tuple[shared_memory.SharedMemory, bytes]:
        while True:
            token = secrets.token_bytes(16)
            try:
                shm = posix.create(NAME_PREFIX + token[:6].hex(), self.total_bytes_of_buffer)
                break
            except FileExistsError:  # pragma: no cover - 48 random bits collided
                continue
        # A new segment is zero-filled: no chunk written, no reader attached, not ready.
        _HEADER.pack_into(
            posix.view(shm), 0, _MAGIC, _VERSION, 0, self.n_reader, self.max_chunks,
            self.max_chunk_bytes, token, os.getpid(), 0, pid_namespace(),
        )  # fmt: skip
        return shm, token

    def _validate(self, name: str) -> bytes:
        shm = self.shared_memory
        try:
            if shm.size < self.total_bytes_of_buffer:
                raise ValueError(f"shared memory segment {name!r} is smaller than the handle says")
            magic, version, _, n_reader, chunks, chunk_bytes, token, *_ = _HEADER.unpack_from(
                posix.view(shm), 0
            )
            if magic != _MAGIC or not name.endswith(token[:6].hex()):
                raise ValueError(f"shared memory segment {name!r} is not a MessageQueue's")
            if version != _VERSION:
                raise ValueError(f"segment {name!r} has layout {version}, expected {_VERSION}")
            if (n_reader, chunks, chunk_bytes) != (
                self.n_reader,
                self.max_chunks,
                self.max_chunk_bytes,
            ):
                raise ValueError(f"segment {name!r} does not have the handle's layout")
        except BaseException:
            shm.close()
            raise
        return token

    def handle(self) -> tuple[int, int, int, str]:
        """``(n_reader, max_chunk_bytes, max_chunks, name)``: what a reader needs to attach."""
        return (self.n_reader, self.max_chunk_bytes, self.max_chunks, self.name)

    def __reduce__(self) -> tuple[Any, tuple[int, int, int, str]]:
        return (self.__class__, self.handle())

    # --- views, as vLLM's (for callers that use the raw chunks) ---

    @contextlib.contextmanager
    def get_data(self, current_idx: int) -> Iterator[memoryview]:
        """A view of chunk ``current_idx`` (its 16-byte part header included)."""
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

    def write_chunk(self, idx: int, total: int, part: int, payload: memoryview) -> None:
        """Fill free chunk ``idx`` with one part of a message and publish it to the readers."""
        at = self._flags(idx)
        buf = self._buf
        buf[at] = 0  # not written while we fill it
        fence()
        start = self.data_offset + idx * self.max_chunk_bytes
        _CHUNK.pack_into(buf, start, total, part, len(payload))
        buf[start + CHUNK_HEADER_BYTES : start + CHUNK_HEADER_BYTES + len(payload)] = payload
        buf[at + 1 : at + 1 + self.n_reader] = self._no_reads
        fence()  # read flags cleared before the chunk is marked written
        buf[at] = 1
        fence()

    def chunk_readable(self, idx: int, reader: int) -> bool:
        """Whether chunk ``idx`` holds a part that ``reader`` has not read yet."""
        at = self._flags(idx)
        buf = self._buf
        ready = buf[at] == 1 and buf[at + 1 + reader] == 0
        fence()
        return ready

    def chunk_header(self, idx: int) -> tuple[int, int, int]:
        """``(total message length, part index, bytes in this part)`` of readable chunk ``idx``."""
        total, part, size = _CHUNK.unpack_from(
            self._buf, self.data_offset + idx * self.max_chunk_bytes
        )
        if size > self.max_chunk_bytes - CHUNK_HEADER_BYTES or size > total:
            raise SharedMemoryError(
                f"chunk {idx} of segment {self.name!r} is corrupt: it holds {size} bytes "
                f"of a {total}-byte message (at most {self.max_chunk_bytes - CHUNK_HEADER_BYTES} "
                "fit in a chunk)"
            )
        return total, part, size

    def read_chunk(self, idx: int) -> bytes:
        """A copy of the part in readable chunk ``idx``."""
        _, _, size = self.chunk_header(idx)
        begin = self.data_offset + idx * self.max_chunk_bytes + CHUNK_HEADER_BYTES
        return bytes(self._buf[begin : begin + size])

    def read_chunk_into(self, idx: int, into: bytearray, offset: int) -> int:
        """Copy the part in readable chunk ``idx`` to ``into[offset:]``; its size."""
        _, _, size = self.chunk_header(idx)
        if offset + size > len(into):
            raise SharedMemoryError(
                f"chunk {idx} of segment {self.name!r} overflows its message: {size} more "
                f"bytes after {offset} of {len(into)}"
            )
        begin = self.data_offset + idx * self.max_chunk_bytes + CHUNK_HEADER_BYTES
        into[offset : offset + size] = self._buf[begin : begin + size]
        return size

    def mark_read(self, idx: int, reader: int) -> None:
        """Record that ``reader`` is done with chunk ``idx``, so the writer may reuse it."""
        fence()  # our reads of the chunk complete before the writer may overwrite it
        self._buf[self._flags(idx) + 1 + reader] = 1
        fence()

    # --- who is there ---

    def _slot_at(self, reader: int) -> int:
        return self._slots_offset + reader * _SLOT.size

    def attach_reader(self, reader: int) -> None:
        """Record this process as ``reader`` (for the writer's liveness checks)."""
        if not 0 <= reader < self.n_reader:
            raise ValueError(f"reader index must be in [0, {self.n_reader}), got {reader}")
        at = self._slot_at(reader)
        state, pid, _ = _SLOT.unpack_from(self._buf, at)
        if state == SLOT_ATTACHED and pid != os.getpid() and process_alive(pid):
            raise RuntimeError(f"reader {reader} of {self.name!r} is already held by pid {pid}")
        _SLOT.pack_into(self._buf, at, SLOT_ATTACHED, os.getpid(), pid_namespace())
        fence()
        self._slot[:] = [at]

    def reader_state(self, reader: int) -> tuple[int, int, int]:
        """``(state, pid, pid namespace)`` of ``reader``'s slot."""
        fence()
        return _SLOT.unpack_from(self._buf, self._slot_at(reader))

    def writer_state(self) -> tuple[bool, int, int]:
        """``(closed, pid, pid namespace)`` of the writer."""
        fence()
        closed = self._buf[_CLOSED_AT] == 1
        *_, pid, _, namespace = _HEADER.unpack_from(self._buf, 0)
        return closed, pid, namespace

    def set_ready(self) -> None:
        """Writer: every reader has joined."""
        self._buf[_READY_AT] = 1
        fence()

    def is_ready(self) -> bool:
        """Whether the writer has seen every reader join."""
        fence()
        return self._buf[_READY_AT] == 1

    def close(self) -> None:
        """Writer: mark closed and unlink the segment. Reader: mark detached. Both: unmap.

        Idempotent; also run when the object is garbage-collected or the interpreter exits.
        """
        # Dropped so that the mapping can go; any later use fails at once (a TypeError).
        self._buf = None  # type: ignore[assignment]  # a closed ring has no memory
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return not self._finalizer.alive
