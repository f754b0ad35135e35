"""Named shared-memory segments for one gather: one per writing rank, unique per call.

A segment holds one message: the shared-memory header (``shm.header``: magic ``VBGA``,
layout version, the JSON header's length and the body's), the JSON header (what the body is:
a tensor's dtype and shape), padding up to a 64-byte boundary, then the body bytes. Segment
names are ``bpd<token>r<rank>``: the token is drawn afresh for every call and agreed through
the group, so concurrent calls and concurrent jobs on one node never share a name.

Who removes what: a writer creates its segment, fills it and closes its mapping (the segment
lives on under its name). The reader (the first rank of the gather) copies each message out
and unlinks the name at once. Removal is idempotent, so on any failure a writer removes its
own segment and the reader removes every writer's, whoever is left standing: a rank that dies
leaves nothing behind once the others have finished.

Python's resource tracker is kept out of it (``shm.posix``, untracked): it would otherwise
unlink segments that another process still needs when a process exits, and warn about
"leaked" segments that the protocol removes itself.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from bridge_py.distributed.errors import SharedMemoryError
from bridge_py.distributed.shm import posix
from bridge_py.distributed.shm.header import Header

__all__ = ["NAME_PREFIX", "ShmChannel", "segment_name"]

NAME_PREFIX = "bpd"
_ALIGN = 64
_HEADER = Header(b"VBGA", 1, "2xIQ")  # JSON header length, body length


def segment_name(token: int, rank: int) -> str:
    """The name (without the leading slash) of ``rank``'s segment in the call ``token``."""
    return f"{NAME_PREFIX}{token:016x}r{rank}"


def _data_offset(header_len: int) -> int:
    return (_HEADER.size + header_len + _ALIGN - 1) // _ALIGN * _ALIGN


class ShmChannel:
    """The segments of one gather call, named by its agreed ``token``."""

    def __init__(self, token: int) -> None:
        self.token = token

    def name(self, rank: int) -> str:
        """The segment name of ``rank`` in this call."""
        return segment_name(self.token, rank)

    def publish(self, rank: int, header: dict[str, Any], body: Any) -> None:
        """Create ``rank``'s segment holding ``header`` and ``body`` (a bytes-like object).

        The mapping is closed before returning: the segment lives on under its name until the
        reader (or a cleanup) unlinks it.
        """
        body_view = memoryview(body).cast("B")
        head = json.dumps(header).encode()
        offset = _data_offset(len(head))
        shm = posix.create(self.name(rank), offset + body_view.nbytes, tracked=False)
        try:
            buf = posix.view(shm)
            _HEADER.pack_into(buf, len(head), body_view.nbytes)
            buf[_HEADER.size : _HEADER.size + len(head)] = head
            buf[offset : offset + body_view.nbytes] = body_view
            del buf
        except BaseException:
            with contextlib.suppress(OSError):
                posix.unlink(shm, tracked=False)
            raise
        finally:
            shm.close()

    def take(self, rank: int, read_body: Any) -> Any:
        """Read ``rank``'s message, unlink its segment, and return ``read_body(header, view)``.

        ``view`` is a memoryview of the body, valid only during the call: ``read_body`` must
        copy what it keeps. Raises SharedMemoryError when the segment is missing,
        truncated or not a gather's (its header says so), and ``UntrustedFileError``
        (naming it) when it is not a file of this user's that only this user may write.
        """
        try:
            # Made by rank ``rank``: read only if it is this user's, writable by it alone.
            shm = posix.attach(self.name(rank))
        except FileNotFoundError:
            raise SharedMemoryError(
                f"shared-memory segment {self.name(rank)!r} of rank {rank} is missing"
            ) from None
        try:
            posix.unlink(shm, tracked=False)
            return self._read(shm, rank, read_body)
        finally:
            shm.close()

    def _read(self, shm: posix.Segment, rank: int, read_body: Any) -> Any:
        buf = posix.view(shm)
        head_len, nbytes = _HEADER.unpack_from(buf, self.name(rank))
        offset = _data_offset(head_len)
        if offset + nbytes > shm.size:
            raise self._truncated(shm, rank, offset + nbytes)
        with buf[_HEADER.size : _HEADER.size + head_len] as raw_head:
            header = json.loads(bytes(raw_head))
        with buf[offset : offset + nbytes] as view:
            return read_body(header, view)

    def _truncated(self, shm: posix.Segment, rank: int, needed: int) -> SharedMemoryError:
        return SharedMemoryError(
            f"shared-memory segment {self.name(rank)!r} of rank {rank} is truncated: "
            f"{shm.size} bytes, its header needs {needed}"
        )

    def remove(self, rank: int) -> None:
        """Unlink ``rank``'s segment if it still exists (idempotent)."""
        try:
            shm = posix.attach(self.name(rank))
        except (FileNotFoundError, PermissionError):
            return  # gone, or not one of ours to remove
        try:
            posix.unlink(shm, tracked=False)
        except FileNotFoundError:
            pass
        finally:
            shm.close()
