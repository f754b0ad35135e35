"""The raw peer of the port benchmarks: echo {:packet, 4} frames from stdin to stdout.

Each frame is a 4-byte big-endian length and that many bytes, written back unchanged.
Nothing is decoded and nothing but the standard library is imported, so this is the floor
for any Python process behind an Erlang Port. Exits when stdin closes.

``--spin-us N`` reads the way the worker does (``PollingInput``: keep reading for N us
before sleeping), so a benchmark can also show ours beside a floor that reads alike.
"""

from __future__ import annotations

import os
import struct
import sys

_HEADER = struct.Struct(">I")


def _read_exact(stream, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        k = stream.readinto(view[got:])
        if not k:
            return False
        got += k
    return True


def _input() -> object:
    if sys.argv[1:2] == ["--spin-us"]:
        from bridge_py.worker.transports.polling_input import PollingInput

        return PollingInput(os.dup(0), float(sys.argv[2]) * 1e-6)
    return os.fdopen(os.dup(0), "rb", buffering=1 << 16)


def main() -> int:
    stream = _input()
    out = os.dup(1)
    header = bytearray(4)
    while _read_exact(stream, memoryview(header)):
        (size,) = _HEADER.unpack(header)
        payload = bytearray(size)
        if not _read_exact(stream, memoryview(payload)):
            break
        chunks = [memoryview(bytes(header)), memoryview(payload)]
        while chunks:
            written = os.writev(out, chunks)
            while chunks and written >= len(chunks[0]):
                written -= len(chunks[0])
                chunks.pop(0)
            if chunks and written:
                chunks[0] = chunks[0][written:]
    return 0


if __name__ == "__main__":
    sys.exit(main())
