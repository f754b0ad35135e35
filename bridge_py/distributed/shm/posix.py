"""POSIX shared-memory segments under ``/dev/shm``: made, opened and removed in one place.

Every segment the package makes or opens through ``multiprocessing.shared_memory`` (the
MessageQueue's ring, the CPU all-reduce, the same-node probe, ModelOpt's gathers) goes
through these three functions, because that module has a trap: it registers a segment with
the process's *resource tracker*, which unlinks it when the process exits, and before
Python 3.13 it does so for a segment the process only *opened* too (python/cpython#82300),
so a reader that exits would remove the writer's segment from under everyone else.

* :func:`create` makes a new segment. ``tracked=True`` leaves it to the tracker as well, so
  that a creator killed before it removes its segment still leaves nothing behind (for
  segments only their creator removes); ``tracked=False`` is for segments another process
  removes.
* :func:`attach` opens another process's segment itself (an :class:`Attached`: the same
  names as SharedMemory's), so the tracker never hears of it, and checks it before anything
  is read from it (``files.open_peer_file``: not a link, this user's regular file, writable
  by this user only).
* :func:`unlink` removes a segment's name (the memory goes with its last mapping).
"""

from __future__ import annotations

import mmap
import os
import sys
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

from bridge_py.distributed.errors import SharedMemoryError
from bridge_py.distributed.shm.files import SHM_DIR, open_peer_file

__all__ = ["Attached", "Segment", "attach", "create", "fileno", "unlink", "view"]

# Python 3.13 lets a segment stay out of the tracker (``track=False``).
_HAS_TRACK = sys.version_info >= (3, 13)


def create(name: str, size: int, *, tracked: bool = True) -> SharedMemory:
    """A new segment ``name`` of ``size`` bytes (FileExistsError if the name is taken)."""
    if _HAS_TRACK:
        return SharedMemory(name=name, create=True, size=size, track=tracked)  # type: ignore[call-arg]
    segment = SharedMemory(name=name, create=True, size=size)
    if not tracked:
        _untrack(segment)
    return segment


class Attached:
    """Another process's segment, opened and mapped: what ``SharedMemory(name)`` gives
    (``name``, ``size``, ``buf``, ``close``, ``unlink``), without its resource tracker."""

    def __init__(self, name: str) -> None:
        self.name = name.lstrip("/")
        path = f"{SHM_DIR}/{self.name}"
        self._fd = open_peer_file(path, os.O_RDWR)  # checked: this user's file only
        try:
            self.size = os.fstat(self._fd).st_size
            self._mmap = mmap.mmap(self._fd, self.size)
        except BaseException:
            os.close(self._fd)
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

    def fileno(self) -> int:
        """The open file descriptor of the segment."""
        return self._fd


# Either kind of segment: one made here (SharedMemory), or one opened (Attached).
Segment = SharedMemory | Attached


def attach(name: str) -> Attached:
    """Open the existing segment ``name`` that another process made, never telling the
    resource tracker; UntrustedFileError (a PermissionError) naming the file when it is not
    this user's own regular file, or others may write it, or it is a link."""
    return Attached(name)


def fileno(segment: SharedMemory | Attached) -> int:
    """The file descriptor of a segment from :func:`create` or :func:`attach`."""
    if isinstance(segment, Attached):
        return segment.fileno()
    return int(segment._fd)  # type: ignore[attr-defined]  # SharedMemory keeps it private


def unlink(segment: SharedMemory | Attached, *, tracked: bool = True) -> None:
    """Remove ``segment``'s name; FileNotFoundError if it is gone already.

    ``tracked`` says how it was made (or False for one from :func:`attach`): an untracked
    segment is removed without telling the tracker, which does not know it.
    """
    if tracked or _HAS_TRACK or isinstance(segment, Attached):
        segment.unlink()
        return
    from multiprocessing.shared_memory import _posixshmem  # type: ignore[attr-defined]

    _posixshmem.shm_unlink(segment._name)  # type: ignore[attr-defined]


def _untrack(segment: SharedMemory) -> None:
    # Before 3.13 the constructor registered the segment; the tracker reads its requests in
    # order, so this undoes it.
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]


def view(segment: SharedMemory | Attached) -> memoryview:
    """The memory of ``segment``; SharedMemoryError naming it once it has been closed."""
    buf = segment.buf
    if buf is None:
        raise SharedMemoryError(f"shared-memory segment {segment.name!r} is closed")
    return buf
