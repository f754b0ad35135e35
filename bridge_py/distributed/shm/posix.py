"""POSIX shared-memory segments under ``/dev/shm``: made, opened and removed in one place.

Every mapped segment the package makes or opens (the MessageQueue's ring, the CPU
all-reduce, the same-node probe; large values go through ``shm.segments``) is a
:class:`SharedMemory` from these functions: a file under ``/dev/shm``, mapped, with the names of
``multiprocessing``'s ``SharedMemory`` (``name``, ``size``, ``buf``, ``close``,
``unlink``). It is not ``multiprocessing.shared_memory.SharedMemory``, because that
class has a trap: it registers a segment with the process's *resource tracker*, which
unlinks it when the process exits, and before Python 3.13 it does so for a segment the
process only *opened* too (python/cpython#82300), so a reader that exits would remove the
writer's segment from under everyone else.

* :func:`create` makes a new segment (``0o600``, never over an existing name) and takes
  its memory (all of it, or what ``reserve`` says; :func:`reserve_memory` takes more
  later): a store through a mapping into memory a full /dev/shm cannot give is a SIGBUS
  that kills the process, while taking it first fails as a SharedMemoryError.
  ``tracked=True`` registers it with the tracker, so that a creator killed before it
  removes its segment still leaves nothing behind (for segments only their creator
  removes); ``tracked=False`` is for segments another process removes.
* :func:`attach` opens another process's segment, never telling the tracker, and checks it
  before anything is read from it (``files.open_peer_file``: not a link, this user's
  regular file, writable by this user only).
* :meth:`SharedMemory.unlink` (or :func:`unlink`) removes a segment's name (the memory goes
  with its last mapping), and takes it off the tracker's list if it was on it.
"""

from __future__ import annotations

import errno
import mmap
import os
from multiprocessing import resource_tracker

from bridge_py.distributed.errors import SharedMemoryError
from bridge_py.distributed.shm.files import SHM_DIR, UntrustedFileError, open_peer_file

__all__ = [
    "SharedMemory",
    "attach",
    "create",
    "fileno",
    "no_room",
    "reserve_memory",
    "unlink",
    "view",
]


class SharedMemory:
    """A segment open and mapped: ``name``, ``size``, ``buf`` (None once closed)."""

    def __init__(self, name: str, fd: int, *, tracked: bool = False) -> None:
        self.name = name.lstrip("/")
        self._fd = fd
        self._tracked = tracked
        try:
            self.size = os.fstat(fd).st_size
            if not self.size:  # (mmap refuses it with a bare ValueError)
                raise SharedMemoryError(f"shared-memory segment {self.name!r} is empty")
            self._mmap = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            raise
        self.buf: memoryview | None = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap and close (BufferError while a view of ``buf`` is still held)."""
        if self._fd < 0 or self.buf is None:
            return
        self.buf.release()
        self.buf = None
        self._mmap.close()
        os.close(self._fd)
        self._fd = -1

    def unlink(self) -> None:
        """Remove the segment's name (FileNotFoundError if it is gone already)."""
        os.unlink(f"{SHM_DIR}/{self.name}")
        if self._tracked:
            self._tracked = False
            resource_tracker.unregister(f"/{self.name}", "shared_memory")

    def fileno(self) -> int:
        """The open file descriptor of the segment."""
        return self._fd


def create(
    name: str, size: int, *, tracked: bool = True, reserve: int | None = None
) -> SharedMemory:
    """A new segment ``name`` of ``size`` bytes (FileExistsError if the name is taken),
    with the memory of its first ``reserve`` bytes (None: all of it) taken now.

    A store through the mapping into memory /dev/shm cannot give kills the process
    (SIGBUS), so whatever is written that way must be taken first (:func:`reserve_memory`).
    Raises SharedMemoryError naming the segment when /dev/shm has no room for it.
    """
    path = f"{SHM_DIR}/{name}"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        segment = SharedMemory(name, fd)  # (which closes fd if it fails)
        try:
            reserve_memory(segment, 0, size if reserve is None else reserve)
        except BaseException:
            segment.close()
            raise
    except BaseException:
        os.unlink(path)
        raise
    if tracked:
        resource_tracker.register(f"/{name}", "shared_memory")
        segment._tracked = True
    return segment


def attach(name: str) -> SharedMemory:
    """Open the existing segment ``name`` that another process made, never telling the
    resource tracker; UntrustedFileError (a PermissionError) naming the file when it is not
    this user's own regular file, or others may write it, or it is a link, or ``name``
    is not that of a file directly in /dev/shm (a name from a peer may say ``../``)."""
    name = name.lstrip("/")
    path = f"{SHM_DIR}/{name}"
    if "/" in name or name in ("", ".", ".."):
        raise UntrustedFileError(path, "it is not a file directly in /dev/shm")
    return SharedMemory(name, open_peer_file(path, os.O_RDWR))  # checked


def reserve_memory(segment: SharedMemory, offset: int, length: int, what: str = "") -> None:
    """Take the memory of ``length`` bytes of ``segment`` from ``offset`` on, so that stores
    through the mapping there cannot fail (memory taken once stays until the segment goes).

    Raises SharedMemoryError naming the segment and ``what`` did not fit (default: the
    bytes) when /dev/shm has no room (ENOSPC: it is full, or smaller than it must be);
    any other OSError as it is.
    """
    if length <= 0:
        return
    try:
        os.posix_fallocate(segment.fileno(), offset, length)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        what = f"no room on {SHM_DIR} for {what or f'{length} bytes'}"
        raise no_room(segment.name, what, exc) from None


def no_room(name: str, what: str, exc: OSError) -> SharedMemoryError:
    """The error of segment ``name`` for which ``/dev/shm`` had no room: ``what`` failed
    (and ``exc``, the system's error, says how), with what the user can do about it."""
    return SharedMemoryError(
        f"shared-memory segment {name!r}: {what} ({exc.strerror}); give {SHM_DIR} more "
        "space (docker run --shm-size) or use smaller buffers"
    )


def fileno(segment: SharedMemory) -> int:
    """The file descriptor of a segment from :func:`create` or :func:`attach`."""
    return segment.fileno()


def unlink(segment: SharedMemory, *, tracked: bool = True) -> None:
    """Remove ``segment``'s name; FileNotFoundError if it is gone already.

    ``tracked`` is kept for callers written for SharedMemory: a segment knows whether the
    tracker has it.
    """
    segment.unlink()


def view(segment: SharedMemory) -> memoryview:
    """The memory of ``segment``; SharedMemoryError naming it once it has been closed."""
    buf = segment.buf
    if buf is None:
        raise SharedMemoryError(f"shared-memory segment {segment.name!r} is closed")
    return buf
