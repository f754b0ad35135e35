"""Values built to break the worker get one error reply each, and the worker serves on.

Each test speaks to a real worker subprocess over its stdin/stdout frames, as the
Elixir runtime does, with bytes written by hand: the encoders on both sides refuse
these values, so an attacker would write them this way too.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import EXT_ATOM, EXT_TENSOR, EXT_TUPLE, MAX_DEPTH, PLAIN
from tests.worker.conftest import SAMPLE
from tests.worker.port_client import PortClient, WorkerError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def worker() -> Iterator[PortClient]:
    """A worker of its own per test: a crash must not hide behind another test's."""
    client = PortClient(exports=SAMPLE)
    yield client
    client.close()


def _tuples(depth: int) -> bytes:
    """Msgpack of a tuple nested ``depth`` deep, ``{{...{1}...}}``, as Elixir writes it."""
    value = b"\x01"
    for _ in range(depth):
        body = b"\x91" + value  # a one-element array
        value = _ext(EXT_TUPLE, body)
    return value


def _ext(code: int, payload: bytes) -> bytes:
    n = len(payload)
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if n in fixed:
        return bytes((fixed[n], code)) + payload
    if n <= 0xFF:
        return bytes((0xC7, n, code)) + payload
    if n <= 0xFFFF:
        return b"\xc8" + struct.pack(">H", n) + bytes((code,)) + payload
    return b"\xc9" + struct.pack(">I", n) + bytes((code,)) + payload


def _lists(depth: int) -> bytes:
    return b"\x91" * depth + b"\x01"


def _error(worker: PortClient, op: pb.Operation) -> pb.Error:
    reply = worker.reply(worker.send(op), timeout=20)
    assert reply.error is not None, f"expected an error reply, got a value {reply.value!r}"
    return reply.error


def _still_serving(worker: PortClient, pid: int) -> None:
    assert worker.proc.poll() is None, f"the worker exited with status {worker.proc.returncode}"
    assert worker.proc.pid == pid
    assert worker.request(pb.Ping(PLAIN.encode("still here"))) == "still here"


def test_a_tuple_nested_300_deep_is_refused_not_a_crash(worker: PortClient) -> None:
    payload = _tuples(300)
    assert len(payload) < 1500  # the 1.4 KB value
    error = _error(worker, pb.Ping(payload))
    assert error.category == "bad_args"
    assert f"nested deeper than {MAX_DEPTH}" in error.message
    # as an argument of a call too
    error = _error(worker, pb.CallFunction("echo", b"\x91" + payload))
    assert error.category == "bad_args" and f"nested deeper than {MAX_DEPTH}" in error.message
    _still_serving(worker, worker.proc.pid)


def test_a_list_nested_100000_deep_says_why(worker: PortClient) -> None:
    error = _error(worker, pb.Ping(_lists(100_000)))
    assert error.category == "bad_args"
    assert error.message.endswith(f"nested deeper than {MAX_DEPTH}")
    _still_serving(worker, worker.proc.pid)


@pytest.mark.parametrize("make", [_lists, _tuples], ids=["lists", "tuples"])
def test_the_limit_is_exact_both_ways(worker: PortClient, make) -> None:
    # The args array is level 1, so echo's argument may nest MAX_DEPTH - 1 deep.
    deepest = worker.request(pb.CallFunction("echo", b"\x91" + make(MAX_DEPTH - 1)))
    depth = 0
    while isinstance(deepest, (list, tuple)):
        deepest, depth = deepest[0], depth + 1
    assert (depth, deepest) == (MAX_DEPTH - 1, 1)
    error = _error(worker, pb.CallFunction("echo", b"\x91" + make(MAX_DEPTH)))
    assert error.category == "bad_args" and f"nested deeper than {MAX_DEPTH}" in error.message


def test_results_nested_too_deep_or_in_a_cycle_are_encode_errors(worker: PortClient) -> None:
    assert worker.function("nested", MAX_DEPTH) is not None
    for args in ([MAX_DEPTH + 1], [1, True]):
        with pytest.raises(WorkerError) as info:
            worker.function("nested", *args)
        assert info.value.error.category == "encode"
        assert f"nested deeper than {MAX_DEPTH}" in info.value.error.message
    _still_serving(worker, worker.proc.pid)


def _huge_empty_tensor() -> bytes:
    """``%Tensor{type: {:f, 32}, shape: {0, 2^62, 4}, data: <<>>}``: no data, as its
    shape says, but a shape torch cannot hold (its strides overflow 64 bits)."""
    header = b"f" + bytes((32, 3)) + struct.pack(">3Q", 0, 2**62, 4)
    return _ext(EXT_TENSOR, header)


def test_300_tensors_with_impossible_shapes_get_300_replies(worker: PortClient) -> None:
    pid = worker.proc.pid
    ids = [worker.send(pb.Ping(_huge_empty_tensor())) for _ in range(300)]
    for rid in ids:
        reply = worker.reply(rid, timeout=20)
        assert reply.error is not None and reply.error.category == "bad_args"
        assert "shape (0, 4611686018427387904, 4) is too large" in reply.error.message
    _still_serving(worker, pid)


def test_a_call_that_raises_system_exit_is_an_error_reply(worker: PortClient) -> None:
    for _ in range(3):
        with pytest.raises(WorkerError) as info:
            worker.function("leave", 3)
        assert info.value.error.category == "python"
        assert info.value.error.python_type == "SystemExit"
    _still_serving(worker, worker.proc.pid)


def _peak_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024


def test_a_binary_nested_120_tuples_deep_costs_a_few_times_its_size(worker: PortClient) -> None:
    """Decoding copied a tuple's payload once per level: 8 MiB nested 120 deep took
    the worker's peak up by 976 MiB. Now each level's payload is let go once read."""
    blob = bytes(8 << 20)
    value = b"\xc6" + struct.pack(">I", len(blob)) + blob  # bin32
    for _ in range(120):
        value = _ext(EXT_TUPLE, b"\x91" + value)
    worker.request(pb.Ping(PLAIN.encode("warm")))
    before = _peak_mib(worker.proc.pid)
    got = worker.request(pb.Ping(value), timeout=60)
    for _ in range(120):
        assert isinstance(got, tuple) and len(got) == 1
        got = got[0]
    assert got == blob
    grew = _peak_mib(worker.proc.pid) - before
    assert grew < 8 * 8, f"the worker's peak grew by {grew:.0f} MiB for an 8 MiB value"


def test_map_keys_that_are_one_key_in_python_are_bad_args(worker: PortClient) -> None:
    """Written by hand (the Elixir encoder refuses these before sending): each is one
    error reply naming both keys, not a map that silently kept one of the values."""
    atom_a = _ext(EXT_ATOM, b"a")
    cases = {
        "true and 1": (b"\x82\xc3\x01\x01\x02", "True and 1"),
        "1 and 1.0": (b"\x82\x01\x01" + msgpack.packb(1.0) + b"\x02", "1 and 1.0"),
        ":a and 'a'": (b"\x82" + atom_a + b"\x01\xa1a\x02", "Atom('a') and 'a'"),
        "{:a, 1} and {'a', true}": (
            b"\x82"
            + _ext(EXT_TUPLE, b"\x92" + atom_a + b"\x01")
            + b"\x01"
            + _ext(EXT_TUPLE, b"\x92\xa1a\xc3")
            + b"\x02",
            "(Atom('a'), 1) and ('a', True)",
        ),
    }
    for what, (payload, keys) in cases.items():
        error = _error(worker, pb.Ping(payload))
        assert error.category == "bad_args", what
        assert f"map keys {keys} are one key in Python" in error.message, (what, error.message)
    assert worker.request(pb.Ping(b"\x82\x01\x01\xa11\x02")) == {1: 1, "1": 2}
    _still_serving(worker, worker.proc.pid)


def test_unhashable_and_malformed_values_are_bad_args(worker: PortClient) -> None:
    tuple_with_list = _ext(EXT_TUPLE, b"\x91\x91\x01")  # {[1]}: not hashable
    timestamp = msgpack.packb(msgpack.Timestamp(1))
    cases = {
        "a map key that cannot be one": b"\x81" + tuple_with_list + b"\x01",
        "a tuple that is not an array": _ext(EXT_TUPLE, b"\x01"),
        "a truncated array": b"\x93\x01",
        "a timestamp inside a tuple": _ext(EXT_TUPLE, b"\x91" + timestamp),
        "a tensor with 255 dims and no shape": _ext(EXT_TENSOR, b"f\x20\xff"),
    }
    for what, payload in cases.items():
        error = _error(worker, pb.Ping(payload))
        assert error.category == "bad_args", what
        assert error.message, what
    _still_serving(worker, worker.proc.pid)


def test_with_every_thread_blocked_calls_are_busy_and_the_rest_is_answered() -> None:
    worker = PortClient("--max-threads", "4", exports=SAMPLE)
    try:
        planned = worker.create("Counter")
        for _ in range(2):  # the second time from a call plan
            worker.call(planned, "incr")
        counters = [worker.create("Counter") for _ in range(3)]
        blocked = [
            worker.send(pb.CallMethod(c.handle, "wait_gate", PLAIN.encode([3.0]))) for c in counters
        ]
        # three calls hold three threads; the fourth reads on, with nobody behind it
        time.sleep(0.5)
        assert worker.request(pb.Ping(PLAIN.encode("up"))) == "up"
        assert worker.request(pb.GetAttribute(planned.handle, "value")) == 2
        refused = [
            pb.CallMethod(planned.handle, "incr"),  # a planned call
            pb.CallMethod(planned.handle, "incr", PLAIN.encode([5])),
            pb.CallFunction("echo", PLAIN.encode([1])),
            pb.CreateInstance("Counter"),
        ]
        for op in refused:
            error = _error(worker, op)
            assert error.category == "busy", op
            assert "3 calls blocked" in error.message and "--max-threads 4" in error.message
        assert worker.request(pb.GetAttribute(planned.handle, "value")) == 2  # not run
        for rid in blocked:  # the gates time out: False
            reply = worker.reply(rid, timeout=20)
            assert reply.error is None and PLAIN.decode(reply.value) is False
        deadline = time.monotonic() + 10
        while True:  # the threads come back
            reply = worker.reply(worker.send(pb.CallMethod(planned.handle, "incr")))
            if reply.error is None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert reply.error is None and PLAIN.decode(reply.value) == 3
    finally:
        worker.close()


def test_max_threads_below_two_is_refused_at_start() -> None:
    worker = PortClient("--max-threads", "1", exports=SAMPLE)
    try:
        assert worker.proc.wait(60) == 2
        worker.stderr.seek(0)
        assert b"--max-threads: must be at least 2, got 1" in worker.stderr.read()
    finally:
        worker.close()
