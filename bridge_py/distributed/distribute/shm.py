"""Named shared-memory segments for one gather: one per writing rank, unique per call.

A segment holds one value as a one-shot segment of ``shm.segments`` (the format of a
StatelessProcessGroup's large values: the shared-memory header, with the value's size, then
the bytes its codec gives from the next page boundary on). A segment is named after the call
(``group.CallId``, agreed through the group): ``vbspg_<namespace>_<pid>_gather<token>r<rank>``,
where the PID and its namespace are the reader's and the token is drawn afresh for every
call, so concurrent calls and concurrent jobs on one node never share a name.

Who removes what: a writer creates its segment, fills it and closes it (the segment lives on
under its name). The reader (the first rank of the gather) checks each segment
(``shm.files``: this user's own file, writable by it alone), unlinks its name at once and
copies the value out. Removal is idempotent, so on any failure a writer removes its own
segment and the reader removes every writer's, whoever is left standing: a rank that dies
leaves nothing behind once the others have finished. Should every rank die, the segments
name a reader that has exited, and ``segments.remove_orphans`` (which every same-node group
runs) removes them as it removes a group's. Python's resource tracker never hears of them
(it would unlink segments another process still needs when a process exits).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from bridge_py.distributed.distribute.group import CallId
from bridge_py.distributed.errors import SharedMemoryError
from bridge_py.distributed.shm import segments

__all__ = ["ShmChannel", "segment_name"]


def segment_name(call: CallId, rank: int) -> str:
    """The name (without the leading slash) of ``rank``'s segment in the call ``call``."""
    return f"{segments.NAME_PREFIX}{call.namespace}_{call.pid}_gather{call.token:016x}r{rank}"


class ShmChannel:
    """The segments of one gather call, named after it (``call``, agreed by the group)."""

    def __init__(self, call: CallId) -> None:
        self.call = call

    def name(self, rank: int) -> str:
        """The segment name of ``rank`` in this call."""
        return segment_name(self.call, rank)

    def publish(self, rank: int, parts: Sequence[Any]) -> None:
        """Create ``rank``'s segment holding the bytes of ``parts`` (bytes-like objects),
        closed on return: it lives on under its name until the reader (or a cleanup)
        unlinks it. SharedMemoryError naming it if something else made that name first
        (the name is known to anyone who sees the segments of other ranks appear)."""
        name = self.name(rank)
        try:
            segments.write_once(name, parts)
        except FileExistsError:
            raise SharedMemoryError(
                f"shared-memory segment {name!r} of rank {rank} exists already: another "
                "process made it first"
            ) from None

    def take(self, rank: int, decode: Callable[[memoryview, str], Any]) -> Any:
        """Read ``rank``'s value, unlink its segment, and return ``decode(view, what)``.

        ``view`` holds the value's bytes, valid only during the call: ``decode`` must copy
        what it keeps. Raises SharedMemoryError (naming the segment and the rank) when the
        segment is missing, not a file of this user's that only this user may write (left
        unread where it is), truncated or not a gather's (its header says so).
        """
        name = self.name(rank)
        with segments.read_once(name, f" of rank {rank}") as view:
            return decode(view, f"the value of rank {rank} in shared-memory segment {name!r}")

    def remove(self, rank: int) -> None:
        """Unlink ``rank``'s segment if it still exists and is this user's (idempotent)."""
        with contextlib.suppress(SharedMemoryError):  # gone, or not ours to remove
            os.close(segments.open_value(self.name(rank), 0, 0, take=True)[0])
