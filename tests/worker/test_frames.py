"""The port transport's framing over a real pipe, whatever sizes the reads return."""

from __future__ import annotations

import fcntl
import io
import os
import random
import struct
import threading
import time
from pathlib import Path

import pytest

from bridge_py.worker.transports.frames import WIDE_PIPE, FrameReader, FrameTooLarge, FrameWriter
from bridge_py.worker.transports.polling_input import PollingInput


def _frames(rng: random.Random) -> list[bytes]:
    sizes = [0, 1, 3, 4, 5, 100, (1 << 16) - 1, 1 << 16, (1 << 16) + 1, 300_000]
    sizes += [rng.randrange(0, 2000) for _ in range(200)]
    rng.shuffle(sizes)
    return [rng.randbytes(n) for n in sizes]


def _write_in_random_pieces(fd: int, data: bytes, rng: random.Random) -> None:
    view = memoryview(data)
    while view:
        piece = rng.choice([1, 2, 3, 7, 4096, 70_000])
        view = view[os.write(fd, view[:piece]) :]
    os.close(fd)


@pytest.mark.parametrize("spin", [None, 0.0, 200e-6, 0.05], ids=["buffered", "0", "200us", "50ms"])
def test_frames_come_out_whole_however_the_bytes_arrive(spin: float | None) -> None:
    # Frames split anywhere (inside the length prefix too) or packed many to a read,
    # small ones sliced from a buffer and large ones read in place; from a buffered
    # file, or from the worker's own input (a non-blocking pipe that spins, then sleeps).
    rng = random.Random(3)
    frames = _frames(rng)
    data = b"".join(struct.pack(">I", len(f)) + f for f in frames)
    r, w = os.pipe()
    writer = threading.Thread(target=_write_in_random_pieces, args=(w, data, rng))
    writer.start()
    stream = os.fdopen(r, "rb", buffering=1 << 16) if spin is None else PollingInput(r, spin)
    try:
        reader = FrameReader(stream, max_frame=1 << 20)
        got = []
        while (frame := reader.read()) is not None:
            got.append(bytes(frame))
    finally:
        writer.join(30)
        if spin is None:
            stream.close()  # the file owns r
        else:
            os.close(r)
    assert got == frames


def test_a_polling_input_sleeps_while_no_request_comes() -> None:
    # The spin is bounded: a reader left waiting a second burns a sliver of it, not all.
    r, w = os.pipe()
    used: list[float] = []

    def read_one() -> None:
        source = PollingInput(r, spin=1e-3)
        start = time.thread_time()
        assert source.read1(10) == b"late"
        used.append(time.thread_time() - start)
        assert source.read1(10) == b""  # the writer closed

    reading = threading.Thread(target=read_one)
    reading.start()
    time.sleep(1.0)
    os.write(w, b"late")
    os.close(w)
    reading.join(30)
    os.close(r)
    assert used and used[0] < 0.3, f"the idle reader used {used} s of CPU in 1 s"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a reader with one CPU never spins")
def test_a_polling_input_stops_spinning_while_requests_are_sparse() -> None:
    # After a wait longer than the spin, the next wait sleeps at once (no CPU spent);
    # a wait shorter than the spin turns spinning back on.
    r, w = os.pipe()
    spin = 0.3
    source = PollingInput(r, spin=spin)
    used: list[float] = []
    got: list[bytes] = []
    gaps = [0.6, 0.6, 0.0]  # the last one: already there, or soon after the wait starts

    def read_all() -> None:
        for _ in gaps:
            start = time.thread_time()
            got.append(source.read1(10))
            used.append(time.thread_time() - start)

    try:
        assert source.spinning
        reading = threading.Thread(target=read_all)
        reading.start()
        for i, gap in enumerate(gaps):
            time.sleep(gap)
            if i == 2:
                assert not source.spinning  # the last wait outlasted the spin
            os.write(w, b"%d" % i)
            while len(got) <= i and reading.is_alive():
                time.sleep(0.005)
        reading.join(30)
        assert got == [b"0", b"1", b"2"]
        assert used[1] < spin / 2, f"the second wait spun: {used[1]} s of CPU"
        assert source.spinning  # the third wait was short
    finally:
        os.close(w)
        os.close(r)


def test_a_polling_input_reads_a_file_blocking(tmp_path: Path) -> None:
    # Not a pipe (a file here; a terminal alike): left blocking, as a shell sharing it
    # expects, and read without a spin.
    path = tmp_path / "frames"
    path.write_bytes(struct.pack(">I", 3) + b"abc")
    fd = os.open(path, os.O_RDONLY)
    try:
        source = PollingInput(fd, spin=1.0)
        assert os.get_blocking(fd) and not source.spinning
        reader = FrameReader(source, max_frame=100)
        assert reader.read() == b"abc"
        assert reader.read() is None
    finally:
        os.close(fd)


def test_a_polling_input_on_one_cpu_never_spins() -> None:
    # The process that would write the next request cannot run on the one CPU while
    # this one spins on it: a spin there only delays the request.
    allowed = os.sched_getaffinity(0)
    r, w = os.pipe()
    try:
        if len(allowed) < 2:
            pytest.skip("this machine gives the test one CPU: nothing to compare with")
        assert PollingInput(r, spin=1e-3).spinning
        os.sched_setaffinity(0, {min(allowed)})
        try:
            assert not PollingInput(r, spin=1e-3).spinning
        finally:
            os.sched_setaffinity(0, allowed)
    finally:
        os.close(w)
        os.close(r)


def test_a_negative_spin_is_refused() -> None:
    r, w = os.pipe()
    try:
        for bad in [-1.0, float("nan")]:
            with pytest.raises(ValueError, match="spin must be >= 0"):
                PollingInput(r, spin=bad)
    finally:
        os.close(r)
        os.close(w)


def test_an_oversized_frame_is_skipped_and_the_next_one_read() -> None:
    r, w = os.pipe()
    big, after = b"x" * 5000, b"next"
    data = struct.pack(">I", len(big)) + big + struct.pack(">I", len(after)) + after
    writer = threading.Thread(target=_write_in_random_pieces, args=(w, data, random.Random(1)))
    writer.start()
    with os.fdopen(r, "rb", buffering=1 << 16) as stream:
        reader = FrameReader(stream, max_frame=1000)
        with pytest.raises(FrameTooLarge, match="5000 bytes"):
            reader.read()
        assert reader.read() == after
        assert reader.read() is None
    writer.join(30)


def test_the_limit_holds_for_frames_that_arrive_whole_in_one_read() -> None:
    # Small frames are sliced straight out of what one read returned; the limit must
    # hold there too, not only for frames read in pieces.
    over, after = b"y" * 40, b"ok"
    data = struct.pack(">I", len(over)) + over + struct.pack(">I", len(after)) + after
    reader = FrameReader(io.BufferedReader(io.BytesIO(data)), max_frame=16)
    with pytest.raises(FrameTooLarge, match="40 bytes"):
        reader.read()
    assert reader.read() == after
    assert reader.read() is None


def test_a_frame_cut_short_by_the_end_of_input_is_not_returned() -> None:
    r, w = os.pipe()
    os.write(w, struct.pack(">I", 10) + b"abc")
    os.close(w)
    with os.fdopen(r, "rb") as stream:
        assert FrameReader(stream, max_frame=100).read() is None


def test_frames_written_from_many_threads_never_interleave() -> None:
    r, w = os.pipe()
    out = FrameWriter(w)
    payloads = {k: [bytes([k]) * (1 + (i * 7919) % 90_000) for i in range(40)] for k in range(6)}

    def send(k: int) -> None:
        for p in payloads[k]:
            out.write([p[:10], p[10:]] if len(p) > 10 else [p])

    def drain(into: list[bytes]) -> None:
        with os.fdopen(r, "rb") as stream:
            reader = FrameReader(stream, max_frame=1 << 20)
            while (frame := reader.read()) is not None:
                into.append(bytes(frame))

    got: list[bytes] = []
    reading = threading.Thread(target=drain, args=(got,))
    reading.start()
    senders = [threading.Thread(target=send, args=(k,)) for k in payloads]
    for t in senders:
        t.start()
    for t in senders:
        t.join(30)
    os.close(w)
    reading.join(30)
    for k, sent in payloads.items():
        assert [f for f in got if f[:1] == bytes([k])] == sent
    assert len(got) == sum(len(v) for v in payloads.values())


def _capacity(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)


def _drain(fd: int, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        got += os.read(fd, n - len(got))
    return bytes(got)


@pytest.mark.skipif(not hasattr(fcntl, "F_GETPIPE_SZ"), reason="no pipe sizes here")
@pytest.mark.parametrize("side", ["reader", "writer"])
def test_the_first_frame_larger_than_a_pipe_widens_it_and_small_ones_do_not(side: str) -> None:
    # A 64 KiB pipe hands a 64 MiB frame over a thousand times; a worker that only makes
    # small calls keeps the default (a user's pipe pages are limited). Each side widens
    # the pipe it uses; the other end here is plain reads and writes.
    default = 1 << 16
    r, w = os.pipe()
    try:
        if _capacity(r) != default:
            pytest.skip(f"pipes here hold {_capacity(r)} bytes by default")
        out = FrameWriter(w)
        # (a PollingInput makes its descriptor non-blocking: only on the reader's side)
        reader = FrameReader(PollingInput(r, 0.0), max_frame=1 << 22) if side == "reader" else None

        def through(payload: bytes) -> bytes:
            framed = struct.pack(">I", len(payload)) + payload
            if reader is not None:  # raw writes in, frames out
                sending = threading.Thread(target=os.write, args=(w, framed))
                sending.start()
                got = bytes(reader.read() or b"")
            else:  # frames in, raw reads out
                sending = threading.Thread(target=out.write, args=([payload],))
                sending.start()
                got = _drain(r, len(framed))[4:]
            sending.join(30)
            return got

        for small in (b"x", b"y" * 60_000):
            assert through(small) == small
        assert _capacity(r) == default
        large = os.urandom(3 << 20)
        assert through(large) == large
        assert _capacity(r) == WIDE_PIPE
    finally:
        os.close(r)
        os.close(w)
