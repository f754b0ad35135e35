"""The worker over its real stdin/stdout framing, as a subprocess."""

from __future__ import annotations

import struct
import time

import pytest
import torch

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN, Atom
from tests.worker.port_client import PortClient, WorkerError


def _error(worker: PortClient, op: pb.Operation, session: str = "") -> pb.Error:
    with pytest.raises(WorkerError) as info:
        worker.request(op, session)
    return info.value.error


def test_ping_round_trips_values(worker: PortClient) -> None:
    value = {"a": [1, 2.5, (Atom("ok"), None)], "b": b"\x00\xff", 3: "three"}
    assert worker.request(pb.Ping(PLAIN.encode(value))) == value
    assert worker.request(pb.Ping()) is None


def test_create_call_and_get_attribute(worker: PortClient) -> None:
    ref = worker.create("Counter", 10, step=5)
    assert ref.class_name == "Counter" and ref.handle > 0
    assert worker.call(ref, "incr") == 15
    assert worker.call(ref, "incr", 2) == 17
    assert worker.request(pb.GetAttribute(ref.handle, "value")) == 17
    assert worker.request(pb.GetAttribute(ref.handle, "step")) == 5


def test_tensors_cross_in_both_directions(worker: PortClient) -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    got = worker.function("double", t)
    assert got.dtype == torch.float32 and torch.equal(got, t * 2)
    big = torch.randn(1 << 20)
    assert torch.equal(worker.function("echo", big), big)


def test_dtype_arguments_accept_nx_types_and_names(worker: PortClient) -> None:
    t = worker.function("zeros", [2, 3], (Atom("bf"), 16))
    assert t.dtype == torch.bfloat16 and t.shape == (2, 3)
    assert worker.function("zeros", [1], "float64").dtype == torch.float64
    assert worker.function("zeros", [1], dtype=Atom("int8")).dtype == torch.int8
    assert worker.function("zeros", [1], (Atom("pred"), 8)).dtype == torch.bool
    assert worker.function("zeros", [1]).dtype == torch.float32
    # dtypes come back as the same Nx-style tuples.
    assert worker.function("dtype_of", torch.ones(1, dtype=torch.bfloat16)) == (Atom("bf"), 16)
    for bad in [(Atom("f"), 7), "nonsense", 3]:
        err = _error(worker, pb.CallFunction("zeros", PLAIN.encode([[1], bad])))
        assert err.category == "bad_args" and "'dtype'" in err.message, err


def test_blocking_call_does_not_stall_other_calls(worker: PortClient) -> None:
    gate = worker.create("Counter")
    other = worker.create("Counter")
    blocked = worker.send(pb.CallMethod(gate.handle, "wait_gate", PLAIN.encode([60.0])))
    # While wait_gate blocks a thread, calls on other handles and pings are answered,
    # and their replies overtake the blocked one.
    fast = [
        worker.send(pb.CallMethod(other.handle, "incr")),
        worker.send(pb.Ping(PLAIN.encode("still here"))),
        worker.send(pb.CallFunction("sleep", PLAIN.encode([0.2]))),
    ]
    arrived = [pb.decode_reply(worker.read_frame()).id for _ in fast]
    assert sorted(arrived) == sorted(fast)
    # A function (no handle lock) opens the gate through a ref argument.
    assert worker.function("open_gate", gate) is None
    assert PLAIN.decode(worker.reply(blocked).value) is True


def test_replies_come_back_out_of_order(worker: PortClient) -> None:
    slow = worker.send(pb.CallFunction("sleep", PLAIN.encode([0.5])))
    fast = worker.send(pb.Ping(PLAIN.encode(1)))
    first = pb.decode_reply(worker.read_frame())
    assert first.id == fast
    second = pb.decode_reply(worker.read_frame())
    assert second.id == slow and PLAIN.decode(second.value) == 0.5


def test_calls_on_one_handle_run_in_arrival_order(worker: PortClient) -> None:
    ref = worker.create("Counter")
    ids = [worker.send(pb.CallMethod(ref.handle, "incr", PLAIN.encode([1]))) for _ in range(50)]
    values = [PLAIN.decode(worker.reply(i).value) for i in ids]
    assert values == list(range(1, 51))


def test_malformed_frames_get_protocol_errors_and_worker_keeps_serving(
    worker: PortClient,
) -> None:
    for junk in [b"\xff\xff\xff", b"\x08", b"\x12\x05ab", b"\x08\x07\x52\x03\xff\xff\xff"]:
        worker.send_raw(junk)
        reply = pb.decode_reply(worker.read_frame())
        assert reply.error is not None and reply.error.category == "protocol"
    # A readable id is echoed so the client can pair the error with its request.
    worker.send_raw(b"\x08\x2a\x52\x02\x0a")
    reply = pb.decode_reply(worker.read_frame())
    assert reply.id == 42 and reply.error is not None and reply.error.category == "protocol"
    assert worker.request(pb.Ping(PLAIN.encode("ok"))) == "ok"


def test_bad_msgpack_arguments_are_bad_args(worker: PortClient) -> None:
    err = _error(worker, pb.CallFunction("echo", b"\xc1"))
    assert err.category == "bad_args" and "args" in err.message
    err = _error(worker, pb.CallFunction("echo", PLAIN.encode({"not": "a list"})))
    assert err.category == "bad_args"
    assert worker.function("echo", 5) == 5


def test_unknown_handle_is_not_found(worker: PortClient) -> None:
    err = _error(worker, pb.CallMethod(999, "incr"))
    assert err.category == "not_found" and "999" in err.message


def test_only_exported_names_are_reachable(worker: PortClient) -> None:
    ref = worker.create("Counter")
    for op in [
        pb.CallMethod(ref.handle, "secret"),
        pb.CallMethod(ref.handle, "__init__"),
        pb.CallMethod(ref.handle, "__class__"),
        pb.GetAttribute(ref.handle, "__dict__"),
        pb.GetAttribute(ref.handle, "_gate"),
        pb.CreateInstance("os.system"),
        pb.CreateInstance("Lock"),
        pb.CallFunction("os.system", PLAIN.encode(["true"])),
        pb.CallFunction("builtins.eval", PLAIN.encode(["1"])),
        pb.CallFunction("Counter.__init__"),
        pb.CallFunction("__import__", PLAIN.encode(["os"])),
    ]:
        err = _error(worker, op)
        assert err.category == "not_exported", (op, err)
    assert worker.call(ref, "incr") == 1


def test_wrong_arity_and_types_are_bad_args(worker: PortClient) -> None:
    ref = worker.create("Counter")
    err = _error(worker, pb.CallMethod(ref.handle, "incr", PLAIN.encode([1, 2])))
    assert err.category == "bad_args" and "Counter.incr" in err.message
    err = _error(worker, pb.CallMethod(ref.handle, "incr", b"", PLAIN.encode({"nope": 1})))
    assert err.category == "bad_args" and "nope" in err.message
    err = _error(worker, pb.CallMethod(ref.handle, "incr", PLAIN.encode(["1"])))
    assert err.category == "bad_args" and "'by'" in err.message and "str" in err.message
    err = _error(worker, pb.CreateInstance("Counter", PLAIN.encode(["zero"])))
    assert err.category == "bad_args"
    assert worker.call(ref, "incr") == 1


def test_python_exceptions_carry_type_message_and_traceback(worker: PortClient) -> None:
    ref = worker.create("Counter")
    err = _error(worker, pb.CallMethod(ref.handle, "fail", PLAIN.encode(["boom"])))
    assert err.category == "python"
    assert err.python_type == "ValueError"
    assert "boom" in err.message
    assert "Traceback" in err.traceback and "in fail" in err.traceback
    assert worker.call(ref, "incr") == 1


def test_unencodable_results_come_back_as_refs(worker: PortClient) -> None:
    ref = worker.function("make_unencodable")
    assert ref.class_name == "_thread.lock"
    # A ref argument resolves to the live object in this worker.
    assert worker.function("echo", ref) == ref


def test_printing_never_corrupts_frames(worker: PortClient) -> None:
    ref = worker.create("Counter")
    for _ in range(3):
        assert worker.call(ref, "noisy", 1 << 20) == 1 << 20
        assert worker.request(pb.Ping(PLAIN.encode("clean"))) == "clean"


def test_sessions_own_their_handles(worker: PortClient) -> None:
    a = worker.create("Counter", session="a")
    b = worker.create("Counter", session="b")
    err = _error(worker, pb.CallMethod(a.handle, "incr"), session="b")
    assert err.category == "not_found" and "another session" in err.message
    err = _error(worker, pb.CallFunction("echo", PLAIN.encode([a])), session="b")
    assert err.category == "not_found"
    assert worker.request(pb.ReleaseHandles([a.handle, 12345]), session="a") == 1
    assert _error(worker, pb.CallMethod(a.handle, "incr"), session="a").category == "not_found"
    worker.create("Counter", session="b")
    assert worker.request(pb.ReleaseSession(), session="b") == 2
    assert _error(worker, pb.CallMethod(b.handle, "incr"), session="b").category == "not_found"


def test_describe_lists_the_export_table(worker: PortClient) -> None:
    table = worker.request(pb.Describe())
    counter = table["classes"]["Counter"]
    assert set(counter["methods"]) == {"incr", "wait_gate", "fail", "noisy"}
    assert "secret" not in counter["methods"]
    assert "echo" in table["functions"]


def test_worker_exits_when_stdin_closes() -> None:
    client = PortClient(exports="tests.worker.sample_exports:table")
    ref = client.create("Counter")
    # A call blocked inside Python must not keep the process alive.
    client.send(pb.CallMethod(ref.handle, "wait_gate", PLAIN.encode([60.0])))
    time.sleep(0.2)
    start = time.monotonic()
    assert client.close(timeout=10) == 0
    assert time.monotonic() - start < 5


def test_oversized_frames_are_refused_and_skipped() -> None:
    client = PortClient("--max-frame-bytes", "1000", exports="tests.worker.sample_exports:table")
    try:
        client.send_raw(b"\x00" * 5000)
        reply = pb.decode_reply(client.read_frame())
        assert reply.error is not None and reply.error.category == "protocol"
        assert "5000" in reply.error.message
        assert client.request(pb.Ping(PLAIN.encode("after"))) == "after"
        # A frame header promising more than arrives: the worker waits, then exits at EOF.
        client.proc.stdin.write(struct.pack(">I", 100) + b"abc")  # type: ignore[union-attr]
    finally:
        assert client.close() == 0


@pytest.mark.parametrize("spin_us", ["0", "5000"])
def test_the_worker_serves_with_any_read_spin(spin_us: str) -> None:
    # --spin-us 0 sleeps between requests at once; a long spin still reads every frame,
    # large ones too, and still exits at end of input.
    client = PortClient("--spin-us", spin_us, exports="tests.worker.sample_exports:table")
    try:
        big = b"\x01" * 300_000
        for value in ["one", big, None]:
            assert client.request(pb.Ping(PLAIN.encode(value))) == value
    finally:
        assert client.close() == 0


def test_a_negative_read_spin_is_refused_at_start() -> None:
    client = PortClient("--spin-us", "-5")
    try:
        assert client.proc.wait(timeout=60) == 2
        client.stderr.seek(0)
        assert b"--spin-us: must be a number >= 0, got -5" in client.stderr.read()
    finally:
        client.close()


def test_a_reader_that_went_away_stops_the_worker_quietly(tmp_path) -> None:
    # The BEAM closed the port while a call was running: the reply's write fails with
    # EPIPE. The worker stops serving without a traceback on stderr.
    from tests.worker.processes import start_worker

    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        proc = start_worker(exports="tests.worker.sample_exports:table", stderr=stderr)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        for id_, op in [(1, pb.Ping()), (2, pb.CallFunction("sleep", args=PLAIN.encode([0.3])))]:
            frame = pb.encode_request(pb.Request(id=id_, op=op))
            proc.stdin.write(struct.pack(">I", len(frame)) + frame)
            proc.stdin.flush()
            if id_ == 1:  # the worker is up once it answers
                (size,) = struct.unpack(">I", proc.stdout.read(4))
                proc.stdout.read(size)
        proc.stdout.close()  # nobody reads the sleep's reply
        time.sleep(1.5)  # the call ends, its reply's write fails
        proc.stdin.close()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.read_text(errors="replace")
    assert proc.returncode == 0
    for noise in ("Traceback", "BrokenPipeError", "Exception in thread"):
        assert noise not in text, text
