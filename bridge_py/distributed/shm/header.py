"""The one header format of a shared-memory segment: magic, layout version, fixed fields.

Every segment starts with a 4-byte magic (what kind of segment it is), a little-endian
``u16`` layout version, then the kind's own fixed little-endian fields (a ``struct``
format). A rank that opens another rank's segment reads the header through
:meth:`Header.unpack_from` before anything else, so a file that is too short, of another
kind, or of another layout is refused with a :class:`SharedMemoryError` naming the file,
instead of being misread. Writers fill it with :meth:`Header.pack_into`.
"""

from __future__ import annotations

import os
import struct
from typing import Any

from bridge_py.distributed.errors import SharedMemoryError

__all__ = ["Header"]


class Header:
    """The header of one kind of segment: ``magic`` (4 bytes), ``version``, then ``fields``
    (a ``struct`` format without byte order: little-endian, no implicit padding)."""

    def __init__(self, magic: bytes, version: int, fields: str) -> None:
        if len(magic) != 4:
            raise ValueError(f"a segment magic is 4 bytes, got {magic!r}")
        self.magic = magic
        self.version = version
        self._struct = struct.Struct("<4sH" + fields)
        self.size = self._struct.size  # where the fields end

    def pack_into(self, buf: Any, *fields: Any) -> None:
        """Write the header, with ``fields``, at the start of ``buf``."""
        self._struct.pack_into(buf, 0, self.magic, self.version, *fields)

    def unpack_from(self, buf: Any, name: str) -> tuple[Any, ...]:
        """The fields of the header at the start of ``buf``, the memory of segment ``name``.

        Raises SharedMemoryError naming the segment when it is shorter than the header, or
        its magic or version is not this header's.
        """
        if len(buf) < self.size:
            raise SharedMemoryError(
                f"shared-memory segment {name!r} is too short for its header: "
                f"{len(buf)} bytes, need {self.size}"
            )
        magic, version, *fields = self._struct.unpack_from(buf, 0)
        if magic != self.magic:
            raise SharedMemoryError(
                f"shared-memory segment {name!r} is not of the expected kind: "
                f"magic {bytes(magic)!r}, expected {self.magic!r}"
            )
        if version != self.version:
            raise SharedMemoryError(
                f"shared-memory segment {name!r} has layout version {version}, "
                f"expected {self.version}"
            )
        return tuple(fields)

    def read(self, fd: int, name: str) -> tuple[Any, ...]:
        """:meth:`unpack_from` of the segment open as ``fd`` (one ``pread``)."""
        return self.unpack_from(os.pread(fd, self.size, 0), name)
