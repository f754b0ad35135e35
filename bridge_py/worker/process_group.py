"""The worker's process group: what exported code starts goes when the worker goes.

A worker serving a port makes itself the leader of a process group of its own
(:func:`lead`), so that every process started by exported code (a multiprocessing child,
its grandchildren, a ``sleep``) is in that group unless it leaves it. When the worker
exits (its input closed, its parent gone) it kills the rest of the group first
(:func:`end_others`), and the Elixir side's kill of an unresponsive worker signals the
whole group: nothing the worker started outlives it, whichever way it ends.

A worker started from a shell for gRPC stays in the shell's group (so that Ctrl-C
reaches it); the port's client, the BEAM, owns the worker's lifetime instead.
"""

from __future__ import annotations

import contextlib
import os
import signal

__all__ = ["end_others", "lead"]


def lead() -> bool:
    """Make this process the leader of a new process group; False where it cannot be
    (it leads a session already: it keeps the group it has)."""
    try:
        os.setpgid(0, 0)
    except OSError:
        return False
    return True


def end_others() -> None:
    """SIGKILL every other process of this process's group (when it leads one)."""
    me = os.getpid()
    if os.getpgid(0) != me:
        return
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            if int(fields[2]) == me:  # its process group
                os.kill(int(entry), signal.SIGKILL)
