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
* :func:`attach` opens another process's segment, never registered, and checked before
  anything is read from it (``files.check_peer_fd``: this user's regular file, writable by
  this user only; ``shm_open`` does not follow links).
* :func:`unlink` removes a segment's name (the memory goes with its last mapping).
* :func:`view` is a segment's memory, typed: ``SharedMemory.buf`` is None once closed.
"""

from __future__ import annotations

import sys
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

from bridge_py.distributed.errors import SharedMemoryError
from bridge_py.distributed.shm.files import SHM_DIR, check_peer_fd

__all__ = ["attach", "create", "unlink", "view"]

# Python 3.13 lets a segment stay out of the tracker (``track=False``).
_HAS_TRACK = sys.version_info >= (3, 13)


def create(name: str, size: int, *, tracked: bool = True) -> SharedMemory:
    """A new segment ``name`` of ``size`` bytes (FileExistsError if the name is taken)."""
    if _HAS_TRACK:
        # mypy checks against Python 3.10 (pyproject), whose SharedMemory has no ``track``.
        return SharedMemory(name=name, create=True, size=size, track=tracked)  # type: ignore[call-arg]
    segment = SharedMemory(name=name, create=True, size=size)
    if not tracked:
        _untrack(segment)
    return segment


def attach(name: str) -> SharedMemory:
    """Open the existing segment ``name`` that another process made, without the resource
    tracker claiming it; UntrustedFileError (a PermissionError) naming the file when it is
    not this user's own, or others may write it."""
    if _HAS_TRACK:
        segment = SharedMemory(name=name, track=False)  # type: ignore[call-arg]  # 3.13+, as above
    else:
        segment = SharedMemory(name=name)
        _untrack(segment)
    try:
        fd: int = segment._fd  # type: ignore[attr-defined]  # private: the open descriptor
        check_peer_fd(fd, f"{SHM_DIR}/{name.lstrip('/')}")
    except BaseException:
        segment.close()
        raise
    return segment


def unlink(segment: SharedMemory, *, tracked: bool = True) -> None:
    """Remove ``segment``'s name; FileNotFoundError if it is gone already.

    ``tracked`` says how it was made (or False for one from :func:`attach`): an untracked
    segment is removed without telling the tracker, which does not know it.
    """
    if tracked or _HAS_TRACK:
        segment.unlink()
        return
    from multiprocessing.shared_memory import _posixshmem  # type: ignore[attr-defined]  # private

    _posixshmem.shm_unlink(segment._name)  # type: ignore[attr-defined]  # private: "/" + name


def _untrack(segment: SharedMemory) -> None:
    # Before 3.13 the constructor registered the segment; the tracker reads its requests in
    # order, so this undoes it.
    name: str = segment._name  # type: ignore[attr-defined]  # private: the name with its "/"
    resource_tracker.unregister(name, "shared_memory")


def view(segment: SharedMemory) -> memoryview:
    """The memory of ``segment``; SharedMemoryError naming it once it has been closed."""
    buf = segment.buf
    if buf is None:
        raise SharedMemoryError(f"shared-memory segment {segment.name!r} is closed")
    return buf
