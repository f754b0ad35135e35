"""Checks on a shared-memory file another rank made, before anything is read from it.

Ranks of one node hand each other names under ``/dev/shm`` (boards and their FIFO doorbells,
segments of large values, message-queue rings, probes), through the store or a handle. A
name is only a promise: whoever can write ``/dev/shm`` (any local user: it is world-writable)
may have put a file of their own there first, or a symbolic link to one, or, once the
creator has unlinked it, a new file under the same name. Everything a rank opens that
another rank created therefore goes through :func:`open_peer_file` (or, for a file opened
another way, :func:`check_peer_fd`), which accepts only what a rank of this user makes:

* not a symbolic link (``O_NOFOLLOW``; the check itself is on the open descriptor, so the
  file cannot be swapped between the check and the use);
* a regular file, or a FIFO where a doorbell is expected;
* owned by this process's effective uid (ranks of one group run as one user);
* not writable by group or others (the creators make them ``0o600``).

Anything else raises :class:`UntrustedFileError`, a PermissionError (so callers that treat
an unopenable file as "not on this node" skip their fast path) whose message names the file
and what is wrong with it.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["SHM_DIR", "UntrustedFileError", "check_peer_fd", "open_peer_file"]

SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux

_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UntrustedFileError(PermissionError):
    """A shared-memory file that is not one a rank of this user made: refused unread."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(errno.EPERM, f"refused shared-memory file {path!r}: {reason}", path)


def _problem(info: os.stat_result, fifo: bool) -> str | None:
    """What makes a file with ``info`` untrustworthy, or None."""
    if fifo and not stat.S_ISFIFO(info.st_mode):
        return "it is not a FIFO"
    if not fifo and not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    uid = os.geteuid()
    if info.st_uid != uid:
        return f"it is owned by uid {info.st_uid}, not by this process's uid {uid}"
    if info.st_mode & _SHARED_WRITE:
        return f"group or others may write it (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def check_peer_fd(fd: int, path: str, *, fifo: bool = False) -> None:
    """Raise :class:`UntrustedFileError` unless the file open as ``fd`` passes the checks.

    ``path`` names it in the message; ``fifo``: a doorbell (a FIFO) is expected.
    """
    problem = _problem(os.fstat(fd), fifo)
    if problem is not None:
        raise UntrustedFileError(path, problem)


def open_peer_file(path: str, flags: int, *, fifo: bool = False) -> int:
    """``os.open(path, flags)`` without following a link, checked; the descriptor.

    Raises :class:`UntrustedFileError` for a link, a directory or a file that fails the
    checks (the descriptor is closed then), and the OSError of ``os.open`` otherwise (a
    missing file is still FileNotFoundError).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedFileError(path, "it is a symbolic link") from None
        if exc.errno == errno.EISDIR:  # (opening it for writing fails before any check)
            raise UntrustedFileError(path, "it is a directory") from None
        raise
    try:
        check_peer_fd(fd, path, fifo=fifo)
    except BaseException:
        os.close(fd)
        raise
    return fd
