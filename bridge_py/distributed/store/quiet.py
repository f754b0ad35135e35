"""Keeping torch's C++ logger quiet while a group's store requests run.

torch's TCPStore client logs every failed request and connect attempt through c10's logger
(``[W ... TCPStore.cpp] recvValue failed ...`` or ``[E ... socket.cpp] The client socket has
timed out ...``) before it raises, and the logged text carries the C++ stack trace. A group
turns those failures into its own errors (naming the rank and the key), so the log lines only
repeat them, on every rank, as stack-trace spam on stderr.

c10 reads ``TORCH_CPP_LOG_LEVEL`` once, at start-up, into the flag ``FLAGS_caffe2_log_level``
of ``libc10``, and compares each message against the flag when it is logged. :data:`QUIET`
raises the flag to FATAL for the length of a ``with QUIET:`` block (nesting and threads
counted; the level c10 set at start-up is put back after the last one) and
costs two stores to an int. It does nothing when ``TORCH_CPP_LOG_LEVEL`` is set (whoever set
it wants to see what torch logs) or when the flag cannot be found in this torch build.
"""

from __future__ import annotations

import ctypes
import os
from types import TracebackType

__all__ = ["QUIET", "enabled"]

_FATAL = 3  # c10's severities: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL


def _flag() -> ctypes.c_int | None:
    """c10's log-level flag, or None (the user chose a level, or no such symbol)."""
    if os.environ.get("TORCH_CPP_LOG_LEVEL"):
        return None
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        return ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
    except (OSError, ValueError):  # not Linux, or a build without the flag
        return None


class _Quiet:
    """``with QUIET:``: c10 logs only fatal messages inside the block."""

    __slots__ = ("_depth", "_flag", "_saved")

    def __init__(self, flag: ctypes.c_int | None) -> None:
        # The level to put back: the one c10 set at start-up (nothing else changes it). A
        # level that is FATAL already needs nothing.
        self._saved = flag.value if flag is not None else _FATAL
        self._flag = flag if self._saved < _FATAL else None
        # One item per block inside (list append and pop are atomic: threads need no lock).
        self._depth: list[None] = []

    def __enter__(self) -> None:
        flag = self._flag
        if flag is not None:
            self._depth.append(None)
            flag.value = _FATAL

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        flag = self._flag
        if flag is not None:
            depth = self._depth
            depth.pop()
            if not depth:
                flag.value = self._saved


QUIET = _Quiet(_flag())


def enabled() -> bool:
    """Whether ``with QUIET:`` silences anything here."""
    return QUIET._flag is not None
