"""``Dispatcher.admit`` and ``run``: what both transports do with a frame.

``admit`` works out what a frame is and takes the call's turn; a transport's ``gate``
sees every request (planned or decoded) before any turn is taken, and may refuse it
(the request is answered and not run) or raise (nothing is taken). These tests drive the
dispatcher as the transports do, with the sample export table.
"""

from __future__ import annotations

import threading

import pytest

from bridge_py.worker import envelope as pb
from bridge_py.worker.call_plans import CallPlan
from bridge_py.worker.codec import PLAIN
from bridge_py.worker.dispatcher import Dispatcher, Job
from tests.worker.sample_exports import table

pytestmark = pytest.mark.timeout(60)


def _frame(request_id: int, op: pb.Operation, session: str = "") -> bytes:
    return pb.encode_request(pb.Request(request_id, session, op))


def _reply(d: Dispatcher, job: Job) -> pb.Reply:
    return pb.decode_reply(b"".join(d.run(job)))


def _counter(d: Dispatcher, session: str = "") -> int:
    reply = _reply(d, d.admit(_frame(1, pb.CreateInstance("Counter"), session)))
    return PLAIN.decode(reply.value).handle


def _answers_within(d: Dispatcher, frame: bytes, seconds: float = 10.0) -> pb.Reply:
    """Admit and run ``frame`` on another thread; fail if it does not answer in time (a
    turn that was taken and never used would hold it up for good)."""
    got: list[pb.Reply] = []
    runner = threading.Thread(target=lambda: got.append(_reply(d, d.admit(frame))), daemon=True)
    runner.start()
    runner.join(seconds)
    assert got, "the call did not run: a turn on its object was taken and never given back"
    return got[0]


def test_the_gate_sees_the_operation_and_session_of_decoded_and_planned_requests() -> None:
    d = Dispatcher(table())
    handle = _counter(d, "s1")
    seen: list[tuple[type[pb.Operation] | None, str]] = []

    def gate(op: type[pb.Operation] | None, session: str) -> pb.Error | None:
        seen.append((op, session))
        return None

    for i in range(3):  # the full way, then from a plan
        job = d.admit(_frame(10 + i, pb.CallMethod(handle, "incr"), "s1"), gate)
        assert (type(job[0]) is CallPlan) == (i > 0)
        assert PLAIN.decode(_reply(d, job).value) == i + 1
    _reply(d, d.admit(_frame(20, pb.Ping()), gate))
    _reply(d, d.admit(pb.encode_request(pb.Request(21, "s2")), gate))  # no operation
    _reply(d, d.admit(_frame(22, pb.GetAttribute(handle, "value"), "s1"), gate))
    assert seen == [
        (pb.CallMethod, "s1"),
        (pb.CallMethod, "s1"),
        (pb.CallMethod, "s1"),
        (pb.Ping, ""),
        (None, "s2"),
        (pb.GetAttribute, "s1"),
    ]


def test_bytes_that_are_not_a_request_never_reach_the_gate() -> None:
    d = Dispatcher(table())

    def gate(op: type[pb.Operation] | None, session: str) -> pb.Error | None:
        raise AssertionError("the gate saw a malformed frame")

    for junk in (b"\x08", b"\x08\x05\x5a\x03\x08", b"\xff" * 12, bytearray(b"\x08\x07\x12")):
        reply = _reply(d, d.admit(junk, gate))
        assert reply.error is not None and reply.error.category == "protocol"
        assert reply.error.message.startswith("malformed request: ")


@pytest.mark.parametrize("planned", [False, True], ids=["decoded", "planned"])
def test_a_refused_request_is_answered_not_run_and_takes_no_turn(planned: bool) -> None:
    d = Dispatcher(table())
    handle = _counter(d)
    if planned:
        _reply(d, d.admit(_frame(2, pb.CallMethod(handle, "incr"))))  # leaves a plan
    busy = pb.Error(category="busy", message="not now")
    for i in range(3):
        job = d.admit(_frame(30 + i, pb.CallMethod(handle, "incr")), lambda op, s: busy)
        reply = _reply(d, job)
        assert (reply.id, reply.error) == (30 + i, busy)
    reply = _answers_within(d, _frame(40, pb.GetAttribute(handle, "value")))
    assert PLAIN.decode(reply.value) == (1 if planned else 0)  # no refused call ran
    assert PLAIN.decode(_answers_within(d, _frame(41, pb.CallMethod(handle, "incr"))).value) == (
        2 if planned else 1
    )


@pytest.mark.parametrize("planned", [False, True], ids=["decoded", "planned"])
def test_a_gate_that_raises_leaves_nothing_taken(planned: bool) -> None:
    d = Dispatcher(table())
    handle = _counter(d)
    if planned:
        _reply(d, d.admit(_frame(2, pb.CallMethod(handle, "incr"))))

    class Aborted(Exception):
        pass

    def gate(op: type[pb.Operation] | None, session: str) -> pb.Error | None:
        raise Aborted

    for i in range(3):
        with pytest.raises(Aborted):
            d.admit(_frame(30 + i, pb.CallMethod(handle, "incr")), gate)
    reply = _answers_within(d, _frame(40, pb.CallMethod(handle, "incr")))
    assert PLAIN.decode(reply.value) == (2 if planned else 1)


def test_calls_on_one_object_run_in_the_order_they_were_admitted() -> None:
    # Admitted in one order, run by threads started in the reverse order.
    d = Dispatcher(table())
    handle = _counter(d)
    jobs = [
        d.admit(_frame(50 + i, pb.CallMethod(handle, "incr", PLAIN.encode([i])))) for i in range(8)
    ]
    results: dict[int, int] = {}

    def run(i: int) -> None:
        results[i] = PLAIN.decode(_reply(d, jobs[i]).value)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in reversed(range(8))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [results[i] for i in range(8)] == [sum(range(i + 1)) for i in range(8)]


def test_a_planned_call_holds_its_place_from_admission() -> None:
    # A planned call is admitted before a decoded one on the same object, and run after
    # it has started: it still runs first (a standby thread that took over from the
    # port's reader, or a gRPC handler thread, can get to run a later call first).
    d = Dispatcher(table())
    handle = _counter(d)
    _reply(d, d.admit(_frame(2, pb.CallMethod(handle, "incr"))))  # leaves a plan
    planned = d.admit(_frame(3, pb.CallMethod(handle, "incr")))
    assert type(planned[0]) is CallPlan
    decoded = d.admit(_frame(4, pb.CallMethod(handle, "incr", PLAIN.encode([10]))))
    later: list[pb.Reply] = []
    runner = threading.Thread(target=lambda: later.append(_reply(d, decoded)), daemon=True)
    runner.start()
    runner.join(0.3)
    assert later == []  # waits for the planned call's turn
    assert PLAIN.decode(_reply(d, planned).value) == 2
    runner.join(10)
    assert PLAIN.decode(later[0].value) == 12


def test_a_call_that_fails_gives_its_turn_back() -> None:
    d = Dispatcher(table())
    handle = _counter(d)
    failing = [
        (pb.CallMethod(handle, "secret"), "not_exported"),
        (pb.CallMethod(handle, "fail", PLAIN.encode(["no"])), "python"),
        (pb.CallMethod(handle, "incr", PLAIN.encode(["x"])), "bad_args"),
        (pb.CallMethod(handle, "incr", b"\xc1"), "bad_args"),
    ]
    for i, (op, category) in enumerate(failing):
        reply = _reply(d, d.admit(_frame(60 + i, op)))
        assert reply.error is not None and reply.error.category == category, op
    assert PLAIN.decode(_answers_within(d, _frame(70, pb.CallMethod(handle, "incr"))).value) == 1
