"""``--output frames``: what the worker's process prints comes back as Output frames,
bounded in line length and rate (bridge_py.worker.output)."""

from __future__ import annotations

import time

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN
from bridge_py.worker.output import LineLimiter
from tests.worker.port_client import PortClient

SAMPLE = "tests.worker.sample_exports:table"


def test_lines_are_cut_at_newlines_and_kept_whole_across_reads() -> None:
    limiter = LineLimiter()
    assert limiter.feed(b"one\ntw", 0.0) == [b"one\n"]
    assert limiter.feed(b"o\n\nthr", 0.0) == [b"two\n", b"\n"]
    assert limiter.finish() == b"thr\n"
    assert limiter.finish() == b""
    assert limiter.dropped == 0


def test_a_long_line_keeps_its_start_and_says_what_was_left_out() -> None:
    limiter = LineLimiter(max_line=8)
    assert limiter.feed(b"x" * 5, 0.0) == []
    assert limiter.feed(b"y" * 1000, 0.0) == []  # holds at most max_line bytes
    assert len(limiter._partial) == 8
    [line] = limiter.feed(b"z\nok\n", 0.0)[:1]
    assert line == b"xxxxxyyy [... 998 more bytes of this line left out]\n"
    assert limiter.finish() == b""


def test_lines_over_the_rate_are_dropped_and_counted() -> None:
    limiter = LineLimiter(rate=10.0, burst=3)
    assert limiter.feed(b"a\nb\nc\nd\ne\n", 0.0) == [b"a\n", b"b\n", b"c\n"]
    assert limiter.dropped == 2
    assert limiter.feed(b"f\n", 0.05) == []  # half a line's worth of time
    assert limiter.feed(b"g\n", 0.1) == [b"g\n"]
    assert limiter.take_dropped() == 3
    assert limiter.dropped == 0
    assert limiter.feed(b"h\n" * 100, 10.0) == [b"h\n"] * 3  # the burst, no more


def _outputs(worker: PortClient, until: bytes, timeout: float = 30.0) -> tuple[bytes, int]:
    """All Output text and dropped lines until ``until`` appears in the text."""
    deadline = time.monotonic() + timeout
    while True:
        text = b"".join(o.text for o in worker.outputs)
        if until in text:
            return text, sum(o.dropped for o in worker.outputs)
        assert time.monotonic() < deadline, f"no {until!r} in {text[-200:]!r}"
        worker.request(pb.Ping(PLAIN.encode("tick")))
        time.sleep(0.05)


def test_prints_from_python_and_c_come_back_as_output_frames() -> None:
    worker = PortClient("--output", "frames", exports=SAMPLE)
    try:
        ref = worker.create("Counter")
        assert worker.call(ref, "noisy", 10) == 10
        text, dropped = _outputs(worker, b"c" * 10 + b"\n")
        assert b"p" * 10 + b"\n" in text and dropped == 0
        worker.stderr.seek(0)
        assert worker.stderr.read() == b""  # nothing on the inherited stderr
    finally:
        assert worker.close() == 0


def test_a_flood_is_bounded_and_the_worker_keeps_answering() -> None:
    worker = PortClient("--output", "frames", exports=SAMPLE)
    try:
        ref = worker.create("Counter")
        # 2 MB on one line from Python and from C, three times: lines are cut
        for _ in range(3):
            assert worker.call(ref, "noisy", 2_000_000) == 2_000_000
            assert worker.request(pb.Ping(PLAIN.encode("clean"))) == "clean"
        text, _dropped = _outputs(worker, b"left out]\n")
        assert max(len(line) for line in text.split(b"\n")) < 4200
        assert len(text) < 50_000
    finally:
        assert worker.close() == 0


def test_many_lines_are_dropped_counted_and_reported() -> None:
    worker = PortClient("--output", "frames", exports=SAMPLE)
    calls = 5000
    try:
        ref = worker.create("Counter")
        # Counter.noisy(1) prints two lines (one from Python, one from C) per call
        for _ in range(calls):
            worker.send(pb.CallMethod(ref.handle, "noisy", PLAIN.encode([1])))
        assert worker.request(pb.Ping(PLAIN.encode("after")), timeout=60) == "after"
        deadline = time.monotonic() + 10  # the last dropped lines are reported within 1 s
        while True:
            sent = sum(o.text.count(b"\n") for o in worker.outputs)
            dropped = sum(o.dropped for o in worker.outputs)
            if sent + dropped == 2 * calls or time.monotonic() > deadline:
                break
            worker.request(pb.Ping(PLAIN.encode("tick")))
            time.sleep(0.1)
        assert dropped > 0 and sent + dropped == 2 * calls
        assert sent <= 1000 + 200  # the burst and a few seconds at 100 lines/s
    finally:
        worker.close()


def test_a_start_that_fails_sends_its_traceback_before_exiting() -> None:
    worker = PortClient("--output", "frames", exports="no_such_module:table")
    try:
        frames = []
        while True:
            try:
                frames.append(pb.decode_reply(worker.read_frame(30)))
            except EOFError:
                break
        text = b"".join(f.output.text for f in frames if f.output is not None)
        assert b"ModuleNotFoundError: No module named 'no_such_module'" in text
        assert text.startswith(b"Traceback")
    finally:
        assert worker.close() == 1
