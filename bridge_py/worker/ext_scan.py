"""Finding large extension values inside a msgpack buffer, without decoding it.

msgpack-python hands every extension payload to its hook as a new ``bytes``: for a
64 MiB tensor argument that is a 64 MiB copy before the codec sees a byte of it. The
codec avoids it by finding the large tensor payloads first (:func:`find_large_exts`),
decoding each one straight from the frame, and letting msgpack decode the rest with
each of them replaced by a short placeholder (:func:`splice`).

The scan follows the msgpack format item by item, but only as far as a small budget of
items: a value with many small items (a long list of numbers) is left to msgpack, which
decodes it far faster than a Python loop could walk it. Whatever the scan cannot make
sense of (a truncated or malformed value, one nested too deep) it gives up on, and the
codec decodes the buffer as it always did, which reports the error. So the scan decides
only how fast a value is decoded, never what it decodes to.

:func:`first_large_ext_payload` is a cheaper guess from the first bytes of a frame, for
the frame reader: where the first large tensor's payload starts (the codec knows where
its elements start within it), so that the frame can be read in at an offset that puts
them on an aligned address.
"""

from __future__ import annotations

import struct

__all__ = ["Edit", "find_large_exts", "first_large_ext_payload", "splice"]

Edit = tuple[int, int, int]
"""``(start, end, what)``: replace ``buf[start:end]``. ``what >= 0``: a large extension
value (header and payload), to become placeholder number ``what``; ``what < 0``: the
header of a tuple extension whose payload shrank, to be rewritten with payload length
``-what - 1``."""

# Bytes after the type byte, by type byte, for the types 0xC4-0xDF: how the item's size
# is found. ("n", k): k bytes of fixed data; ("len", k): a k-byte length, then that many
# bytes; ("ext", k): a k-byte length, the extension type, then the payload; ("fixext", k):
# the extension type, then k bytes; ("array"/"map", k): a k-byte count of items (pairs).
_LAYOUT: dict[int, tuple[str, int]] = {
    0xC4: ("len", 1),
    0xC5: ("len", 2),
    0xC6: ("len", 4),
    0xC7: ("ext", 1),
    0xC8: ("ext", 2),
    0xC9: ("ext", 4),
    0xCA: ("n", 4),
    0xCB: ("n", 8),
    0xCC: ("n", 1),
    0xCD: ("n", 2),
    0xCE: ("n", 4),
    0xCF: ("n", 8),
    0xD0: ("n", 1),
    0xD1: ("n", 2),
    0xD2: ("n", 4),
    0xD3: ("n", 8),
    0xD4: ("fixext", 1),
    0xD5: ("fixext", 2),
    0xD6: ("fixext", 4),
    0xD7: ("fixext", 8),
    0xD8: ("fixext", 16),
    0xD9: ("len", 1),
    0xDA: ("len", 2),
    0xDB: ("len", 4),
    0xDC: ("array", 2),
    0xDD: ("array", 4),
    0xDE: ("map", 2),
    0xDF: ("map", 4),
}

PLACEHOLDER_SIZE = 18
"""A placeholder is a fixext 16 (``d8``, its type, 16 bytes): 18 bytes in all."""

_EXT32 = struct.Struct(">BIB")


class _GiveUp(Exception):
    """The scan stops: the value is left to msgpack as a whole."""


class _Scan:
    """One scan of one buffer: what it found, and how many items it may still look at."""

    __slots__ = (
        "budget",
        "buf",
        "edits",
        "ext_code",
        "found",
        "max_depth",
        "min_len",
        "tuple_code",
    )

    def __init__(
        self,
        buf: memoryview,
        ext_code: int,
        tuple_code: int,
        min_len: int,
        budget: int,
        max_depth: int,
    ) -> None:
        self.buf = buf
        self.ext_code = ext_code
        self.tuple_code = tuple_code
        self.min_len = min_len
        self.budget = budget
        self.max_depth = max_depth
        self.edits: list[Edit] = []
        self.found = 0  # large values found so far: the next one's number

    def value(self, pos: int, end: int, depth: int) -> tuple[int, int]:
        """Scan the one value at ``pos`` (it must end by ``end``); return where it ends
        and how much longer (negative: shorter) the edits found in it make it."""
        buf = self.buf
        open_items = [1]  # items still to scan in each container entered, outermost first
        delta = 0
        while open_items:
            if not open_items[-1]:
                open_items.pop()
                continue
            open_items[-1] -= 1
            self.budget -= 1
            if self.budget < 0 or pos >= end:
                raise _GiveUp
            b = buf[pos]
            if b <= 0x7F or b >= 0xE0 or b == 0xC0 or b == 0xC2 or b == 0xC3:
                pos += 1
                continue
            if b <= 0x9F:  # fixmap, fixarray
                count = (b & 0x0F) * (2 if b <= 0x8F else 1)
                pos += 1
            elif 0xA0 <= b <= 0xBF:
                pos += 1 + (b & 0x1F)
                continue
            else:
                kind, k = _LAYOUT.get(b, ("bad", 0))
                if kind == "n":
                    pos += 1 + k
                    continue
                if kind == "bad" or pos + 1 + k > end:
                    raise _GiveUp
                if kind == "fixext":
                    pos += 2 + k
                    continue
                size = int.from_bytes(buf[pos + 1 : pos + 1 + k], "big")
                if kind == "len":
                    pos += 1 + k + size
                    continue
                if kind == "ext":
                    pos, grew = self._ext(pos, pos + 2 + k, size, end, depth + len(open_items))
                    delta += grew
                    continue
                count = size * (2 if kind == "map" else 1)
                pos += 1 + k
            if depth + len(open_items) > self.max_depth:  # the new container's level
                raise _GiveUp
            open_items.append(count)
        if pos > end:
            raise _GiveUp
        return pos, delta

    def _ext(self, head: int, start: int, size: int, end: int, depth: int) -> tuple[int, int]:
        """An extension value: header at ``head``, payload ``buf[start:start + size]``."""
        stop = start + size
        if stop > end:
            raise _GiveUp
        code = self.buf[start - 1]
        if code == self.ext_code and size >= self.min_len:
            self.budget += 1  # a large value found is worth its look
            self.edits.append((head, stop, self.found))
            self.found += 1
            return stop, PLACEHOLDER_SIZE - (stop - head)
        if code == self.tuple_code and size:
            inner_end, grew = self.value(start, stop, depth + 1)
            if inner_end != stop:
                raise _GiveUp
            if grew:
                self.edits.append((head, start, -(size + grew) - 1))
                return stop, grew + _EXT32.size - (start - head)
        return stop, 0


def find_large_exts(
    data: bytes | memoryview,
    *,
    ext_code: int,
    tuple_code: int,
    min_len: int,
    budget: int,
    max_depth: int,
) -> list[Edit] | None:
    """The edits that cut every ``ext_code`` payload of at least ``min_len`` bytes out
    of the one msgpack value in ``data``, also inside ``tuple_code`` extensions (whose
    payload is a msgpack value too), in buffer order; None if there is none, or if the
    scan gave up (more than ``budget`` other items, nesting past ``max_depth``, or
    bytes that are not one whole msgpack value)."""
    buf = memoryview(data).cast("B")
    scan = _Scan(buf, ext_code, tuple_code, min_len, budget, max_depth)
    try:
        end, _ = scan.value(0, len(buf), 0)
    except _GiveUp:
        return None
    if end != len(buf) or not scan.edits:
        return None
    scan.edits.sort()
    return scan.edits


def splice(data: bytes | memoryview, edits: list[Edit], code: int, nonce: bytes) -> bytes:
    """``data`` with the edits made: each large value replaced by the placeholder
    ``fixext16(code, nonce + its number as 8 bytes)`` (``nonce`` is 8 bytes), each
    shrunk tuple's header rewritten as an ext 32 header. Only the bytes outside the
    large values are copied."""
    buf = memoryview(data).cast("B")
    pieces: list[bytes | memoryview] = []
    pos = 0
    for start, end, what in edits:
        pieces.append(buf[pos:start])
        if what >= 0:
            pieces.append(struct.pack(">Bb8sQ", 0xD8, code, nonce, what))
        else:
            pieces.append(_EXT32.pack(0xC9, -what - 1, buf[end - 1]))  # (its type byte)
        pos = end
    pieces.append(buf[pos:])
    return b"".join(pieces)


def first_large_ext_payload(
    prefix: bytes | memoryview, size: int, ext_code: int, min_len: int
) -> int:
    """Where the payload of the first large ``ext_code`` value starts in a frame of
    ``size`` bytes, guessed from the frame's first bytes ``prefix``: the first ext 32
    header there of that type with a payload of at least ``min_len`` bytes that fits the
    frame. 0 when none.

    A guess only (the bytes are not parsed as msgpack): the frame reader uses it to choose
    where the frame lands in memory; a wrong guess costs the tensor one copy (it is
    decoded from a misaligned address), never a wrong value."""
    data = bytes(prefix)
    at = data.find(b"\xc9")
    while 0 <= at <= len(data) - 6:
        length = int.from_bytes(data[at + 1 : at + 5], "big")
        if data[at + 5] == ext_code and length >= min_len and at + 6 + length <= size:
            return at + 6
        at = data.find(b"\xc9", at + 1)
    return 0
