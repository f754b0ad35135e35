"""Shared-memory segments of large values (a StatelessProcessGroup rank's, a gather's).

A *segment* is a file under ``/dev/shm`` that carries one large value to the ranks of the same
node (``spg.values`` pickles values into them and reads them back; ModelOpt's gathers carry
their configs and tensors in one-shot segments of the same format, see :func:`write_once`
and :func:`read_once`). Writing a value into a fresh file costs far more than the copy
itself: every page is allocated and zeroed by the kernel on first touch (bench/README.md).
So a rank keeps a few segments and writes its next value over one whose readers are all
done.

Every segment starts with the shared-memory header (``shm.header``), then the marks the
readers report to::

    offset 0   b"VBSG", u16 layout version
    offset 8   u64 generation       (which value the segment holds now; 0: a one-shot segment)
    offset 16  u32 slots            (the group's world size; 0: no reader marks)
    offset 24  u64 size             (the bytes of the value it holds now)
    offset 32  slots x u64 marks    (mark r: the last generation rank r finished reading)
    data_offset(slots)              the value (from the next page boundary on)

All integers are little-endian. When a value is written, the marks of the ranks that will not
read it are set to its generation; each reader sets its own mark after loading, and the
segment is free again once every mark equals the generation (one ``pread`` tells). The owner
writes over a segment only then, so a reader never sees its value change; it checks the
generation again after reading, and a changed one (someone else wrote ``/dev/shm``) is an error.

A rank pools at most :data:`POOL_SIZE` segments of at most :data:`POOL_MAX_BYTES` each. A
value that finds no free one when the pool is full, or that is larger, goes into a *one-shot*
segment (generation 0) which, as before pooling, its last reader unlinks. Segments nobody
reads (a receiver died) are unlinked after ``data_expiration_seconds`` (:meth:`expire`), free
ones after as long unused, and all of them when the group is released, garbage-collected or
the interpreter exits. Segments of a creator that was killed are unlinked by any rank of the
same PID namespace (:func:`remove_orphans`), which leaves alone names it should not or cannot
remove (another user's, a directory, a link) rather than fail the group that looked.

Segments are named ``vbspg_<pid namespace>_<creator pid>_<token>_<n>`` and readable and
writable by their user only (the ranks of one group run as one user). A one-shot segment of
:func:`write_once` has the name its caller gives (one its reader can work out), no reader
marks, and is unlinked by its reader once open (``take``), even when it turns out
unreadable; a reader checks every segment it opens (:func:`open_value`, ``shm.files``)
before anything is read from it.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bridge_py.distributed.errors import SharedMemoryError
from bridge_py.distributed.shm import posix
from bridge_py.distributed.shm.files import SHM_DIR, UntrustedFileError, open_peer_file
from bridge_py.distributed.shm.header import Header
from bridge_py.distributed.shm.wait import pid_namespace, process_alive

__all__ = [
    "NAME_PATTERN",
    "NAME_PREFIX",
    "POOL_MAX_BYTES",
    "POOL_SIZE",
    "SHM_DIR",
    "Segment",
    "SegmentOwner",
    "create",
    "data_offset",
    "maker_exited",
    "mark_offset",
    "open_value",
    "read_generation",
    "read_once",
    "remove_orphans",
    "unlink",
    "write_at",
    "write_mark",
    "write_once",
]

NAME_PREFIX = "vbspg_"
NAME_PATTERN = re.compile(r"vbspg_[0-9]+_[0-9]+_[0-9a-f]+_[0-9]+\Z")
POOL_SIZE = 4
POOL_MAX_BYTES = 32 << 20
_HEADER = Header(b"VBSG", 2, "2xQI4xQ")  # generation, slots, size
_GENERATION_AT = 8
_MARK = struct.Struct("<Q")
_MARKS_AT = 32
_PAGE = 4096
_CHUNK = 1 << 20


def data_offset(slots: int) -> int:
    """Where the value starts in a segment with ``slots`` reader marks: on a page boundary
    (copying into tmpfs at an unaligned offset is slow)."""
    return (_MARKS_AT + _MARK.size * slots + _PAGE - 1) // _PAGE * _PAGE


def mark_offset(rank: int) -> int:
    """Where rank ``rank``'s reader mark is."""
    return _MARKS_AT + _MARK.size * rank


def open_value(
    name: str,
    generation: int,
    rank: int,
    size: int | None = None,
    whose: str = "",
    take: bool = False,
) -> tuple[int, int, int]:
    """``(fd, offset, size)``: segment ``name`` open, and where its value is, which must be
    ``generation`` for reader ``rank``, of ``size`` bytes (None: what the header says).
    ``take``: unlink the name once it is open, before anything is read (its one reader).

    Raises SharedMemoryError naming the segment (and ``whose`` it is, as " of rank 1") when
    it cannot be opened (gone: its writer exited, or could not write it), is not a file of
    this user's that only it may write (``shm.files``: refused before anything is read, and
    never unlinked), its header is not a segment's (too short, another magic or layout
    version) or says it holds another value, or the file is shorter than the value.
    """
    label = f"shared-memory segment {name!r}{whose}"
    try:
        fd = open_peer_file(os.path.join(SHM_DIR, name), os.O_RDWR)
    except FileNotFoundError:
        raise SharedMemoryError(
            f"{label} is missing: its writer exited, or could not write it (is /dev/shm full?)"
        ) from None
    except UntrustedFileError as exc:
        raise SharedMemoryError(f"{label} is refused: {exc.strerror}") from None
    except OSError as exc:
        raise SharedMemoryError(f"{label} cannot be opened ({exc.strerror})") from exc
    try:
        if take:
            unlink(name)
        held, slots, held_size = _HEADER.read(fd, name)
        if held != generation or (generation and rank >= slots) or size not in (None, held_size):
            raise SharedMemoryError(
                f"{label} does not hold that value (generation {held} of {slots} readers, "
                f"{held_size} bytes; expected generation {generation} for rank {rank}, "
                f"{size} bytes)"
            )
        offset = data_offset(slots)
        if (length := os.fstat(fd).st_size) < offset + held_size:
            raise SharedMemoryError(
                f"{label} is truncated: {length} bytes, its header needs {offset + held_size}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, offset, held_size


def read_generation(fd: int) -> int:
    """The generation the segment open as ``fd`` holds now (-1 if unreadable)."""
    raw = os.pread(fd, _MARK.size, _GENERATION_AT)
    return _MARK.unpack(raw)[0] if len(raw) == _MARK.size else -1


def write_mark(fd: int, rank: int, generation: int) -> None:
    """Tell the owner that ``rank`` has finished reading ``generation``."""
    os.pwrite(fd, _MARK.pack(generation), mark_offset(rank))


def unlink(name: str) -> None:
    """Remove segment ``name`` if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


def create(name: str, *, pooled: bool = False) -> Segment:
    """A new, empty segment ``name`` of this user's alone (FileExistsError if the name is
    taken: nothing is ever written over another file)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return Segment(name, os.open(os.path.join(SHM_DIR, name), flags, 0o600), pooled)


def write_at(fd: int, view: memoryview, at: int) -> int:
    """Write all of ``view`` at offset ``at`` of ``fd``; returns the offset after it."""
    while view:
        written = os.pwrite(fd, view[:_CHUNK] if len(view) > _CHUNK else view, at)
        view = view[written:]
        at += written
    return at


def _header(generation: int, slots: int, size: int, marks: Sequence[int] = ()) -> bytes:
    """The header of a segment holding ``generation`` (``size`` bytes), then the ``marks``."""
    head = bytearray(_MARKS_AT)
    _HEADER.pack_into(head, generation, slots, size)
    return bytes(head) + struct.pack(f"<{len(marks)}Q", *marks)


@dataclass(slots=True, eq=False)
class Segment:
    """One segment of this rank: its name, an open descriptor, and where it is in its life.

    ``generation`` is the value it holds (0 before the first and for a one-shot segment),
    ``size`` the bytes of the file (a reused segment never shrinks), ``since`` when it was
    last written or freed (for expiry), ``pooled`` whether it is reused once free.
    """

    name: str
    fd: int
    pooled: bool
    generation: int = 0
    size: int = 0
    since: float = 0.0

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


class SegmentOwner:
    """The segments one group's rank created: the pool, and removal on expiry and release.

    A writer :meth:`take`\\ s a segment, writes its value from :attr:`offset` on, and
    :meth:`publish`\\ es it with the ranks that will read it (which returns the generation
    for the descriptor); if writing fails it :meth:`drop`\\ s it instead.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.offset = data_offset(slots)
        self._token = secrets.token_hex(4)
        self._count = 0  # segments created (the next one's number)
        self._generation = 0
        self._pid = os.getpid()
        self._free: list[Segment] = []  # pooled, every reader done; the most recent last
        self._busy: deque[Segment] = deque()  # pooled, being read; oldest first
        self._one_shot: deque[tuple[str, float]] = deque()  # unlinked by their last reader
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        """Whether segments are out being read (:meth:`expire` may have work)."""
        return bool(self._busy or self._one_shot)

    def take(self) -> Segment:
        """A segment to write a value into: a free pooled one, else a new one.

        A new segment is pooled while the pool has room, else one-shot.
        """
        with self._lock:
            self._collect()
            if self._free:
                return self._free.pop()
            pooled = len(self._busy) < POOL_SIZE
            self._count += 1
            name = f"{NAME_PREFIX}{pid_namespace()}_{os.getpid()}_{self._token}_{self._count}"
        segment = create(name, pooled=pooled)
        if not pooled:
            with self._lock:
                self._one_shot.append((name, time.time()))
        return segment

    def publish(self, segment: Segment, size: int, readers: list[int]) -> int:
        """``segment`` now holds a value of ``size`` bytes for ``readers``: its generation.

        Writes the header; returns 0 for a one-shot segment (a pooled one that has grown past
        :data:`POOL_MAX_BYTES` becomes one), which this owner no longer holds open.
        """
        end = self.offset + size
        segment.size = max(segment.size, end)
        if segment.pooled and segment.size > POOL_MAX_BYTES:
            segment.pooled = False
            with self._lock:
                self._one_shot.append((segment.name, time.time()))
        if not segment.pooled:
            os.pwrite(segment.fd, _header(0, self.slots, size), 0)
            segment.close()
            return 0
        with self._lock:
            self._generation += 1
            generation = self._generation
        marks = [0 if rank in readers else generation for rank in range(self.slots)]
        os.pwrite(segment.fd, _header(generation, self.slots, size, marks), 0)
        segment.generation = generation
        segment.since = time.time()
        with self._lock:
            self._busy.append(segment)
        return generation

    def drop(self, segment: Segment) -> None:
        """Forget ``segment`` and unlink it (writing it failed)."""
        segment.close()
        unlink(segment.name)
        with self._lock:
            self._one_shot = deque(entry for entry in self._one_shot if entry[0] != segment.name)

    def discard(self, name: str) -> None:
        """Every reader is done with segment ``name``: unlink it if it is a one-shot segment.

        A pooled segment is left alone: its readers' marks free it (and by now it may hold
        a newer value).
        """
        with self._lock:
            if any(segment.name == name for segment in (*self._busy, *self._free)):
                return
        unlink(name)

    def _collect(self) -> None:
        """Move the busy segments every reader is done with to the free list (lock held)."""
        if not self._busy:
            return
        done = [segment for segment in self._busy if self._read_by_all(segment)]
        for segment in done:
            self._busy.remove(segment)
            self._free_up(segment)

    def _read_by_all(self, segment: Segment) -> bool:
        try:
            raw = os.pread(segment.fd, _MARK.size * self.slots, _MARKS_AT)
        except OSError:
            return False
        generation = segment.generation
        return all(mark == generation for (mark,) in _MARK.iter_unpack(raw))

    def _free_up(self, segment: Segment) -> None:
        segment.since = time.time()
        self._free.append(segment)

    def expire(self, max_age: float) -> None:
        """Unlink segments written more than ``max_age`` seconds ago that are still being read
        (or never will be), and free ones unused as long."""
        now = time.time()
        with self._lock:
            while self._one_shot and now - self._one_shot[0][1] > max_age:
                unlink(self._one_shot.popleft()[0])
            self._collect()
            while self._busy and now - self._busy[0].since > max_age:
                self._gone(self._busy.popleft())
            while self._free and now - self._free[0].since > max_age:
                self._gone(self._free.pop(0))

    @staticmethod
    def _gone(segment: Segment) -> None:
        segment.close()
        unlink(segment.name)

    def release(self) -> None:
        """Unlink every segment this owner created, then the orphans of dead creators."""
        if os.getpid() != self._pid:
            return  # a forked child: the segments still belong to the parent
        with self._lock:
            while self._one_shot:
                unlink(self._one_shot.popleft()[0])
            for segment in (*self._busy, *self._free):
                self._gone(segment)
            self._busy.clear()
            self._free.clear()
        remove_orphans()


def write_once(name: str, parts: Sequence[Any]) -> None:
    """Create the one-shot segment ``name`` holding the bytes of ``parts`` (bytes-like
    objects) one after the other, for one reader that knows the name (:func:`read_once`).

    Closed on return: it lives on under its name until its reader (or :func:`remove`)
    unlinks it. FileExistsError if the name is taken; on any other failure it is unlinked,
    and a failure to write it (ENOSPC: ``/dev/shm`` has no room) is a SharedMemoryError
    naming the segment and the size.
    """
    segment = create(name)
    try:
        start = at = data_offset(0)
        for part in parts:
            at = write_at(segment.fd, memoryview(part).cast("B"), at)
        os.pwrite(segment.fd, _header(0, 0, at - start), 0)  # last: a reader sees it whole
    except OSError as exc:
        unlink(name)
        if exc.errno != errno.ENOSPC:
            raise
        size = sum(memoryview(part).nbytes for part in parts)
        raise posix.no_room(name, f"cannot write {size} bytes on {SHM_DIR}", exc) from exc
    except BaseException:
        unlink(name)
        raise
    finally:
        segment.close()


@contextlib.contextmanager
def read_once(name: str, whose: str = "") -> Iterator[memoryview]:
    """The value in the one-shot segment ``name`` (from :func:`write_once`), unlinked as soon
    as it is open: a read-only view, valid inside the ``with`` only (copy what you keep).

    Raises SharedMemoryError naming the segment (and ``whose`` it is, as " of rank 1") when
    it is missing, not a file of this user's that only it may write (refused unread, and
    left where it is), or not a one-shot segment holding a whole value.
    """
    fd, offset, size = open_value(name, 0, 0, None, whose, take=True)
    try:
        mapped = mmap.mmap(fd, offset + size, access=mmap.ACCESS_READ)
        try:
            with memoryview(mapped) as whole, whole[offset:] as view:
                yield view
        finally:
            # A view of it may live on in the traceback of a failed read: the mapping then
            # goes with the traceback.
            with contextlib.suppress(BufferError):
                mapped.close()
    finally:
        os.close(fd)


def maker_exited(name: str) -> bool:
    """Whether the process that made the shared-memory file ``name`` (a group's name,
    ``vbspg_<pid namespace>_<pid>_...``: a segment, a board, a doorbell, a gather's
    segment) is another one of this PID namespace, and has exited. False for a name that
    does not say, or a process of another namespace."""
    try:
        namespace, pid = name.removeprefix(NAME_PREFIX).split("_", 2)[:2]
        made_by, namespace_id = int(pid), int(namespace)
    except ValueError:
        return False
    if namespace_id != pid_namespace() or made_by == os.getpid():
        return False
    return not process_alive(made_by)


def remove_orphans() -> list[str]:
    """Unlink segments whose creator (in this PID namespace) has exited; return their names.

    Only what a group of this user left behind is removed: a regular file (a segment, a
    board) or a FIFO (a doorbell), owned by this effective user, not a symbolic link. Any
    other name that merely looks like one (a directory, another user's file, a link) is
    skipped, and so is one that cannot be removed (EPERM, EACCES, EISDIR, ...): this runs
    inside the operations of every same-node group on the host, which must not fail
    because of a stray name under ``/dev/shm``. Never raises.
    """
    prefix = f"{NAME_PREFIX}{pid_namespace()}_"
    try:
        names = [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]
    except OSError:
        return []
    removed = []
    uid = os.geteuid()
    for name in names:
        try:
            if not maker_exited(name):
                continue
            path = os.path.join(SHM_DIR, name)
            info = os.lstat(path)
            if info.st_uid != uid or not (
                stat.S_ISREG(info.st_mode) or stat.S_ISFIFO(info.st_mode)
            ):
                continue  # not ours, or not something a group makes: leave it alone
            os.unlink(path)
        except (OSError, ValueError, OverflowError):
            continue  # gone already, not a pid, or not ours to remove
        removed.append(name)
    return removed
