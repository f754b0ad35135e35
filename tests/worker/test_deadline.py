"""Deadlines: a request's ``deadline_ms`` through the dispatcher to the code it calls.

A request whose deadline has passed when its turn comes is not run; while one runs, its
deadline is ``bridge_py.deadline``'s, and waits clamped to it give up in time; a
TimeoutError raised past it is a ``timeout`` error. Call plans serve requests whatever
their deadline.
"""

from __future__ import annotations

import threading
import time

import pytest

from bridge_py import deadline
from bridge_py.worker import envelope as pb
from bridge_py.worker.call_plans import CallPlan
from bridge_py.worker.codec import PLAIN
from bridge_py.worker.dispatcher import Dispatcher, Job
from bridge_py.worker.exports import ExportedClass, ExportTable

pytestmark = pytest.mark.timeout(60)


class Waiter:
    """Reports its caller's deadline, and waits on a gate as a group's receive does."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate = threading.Event()

    def left(self) -> float | None:
        """Seconds left before the caller's deadline (None: none)."""
        self.calls += 1
        return deadline.remaining()

    def wait(self, timeout: float) -> bool:
        """Wait for the gate at most ``timeout`` s (clamped); TimeoutError if it stays shut."""
        self.calls += 1
        if not self.gate.wait(deadline.clamp(timeout)):
            raise TimeoutError(f"the gate stayed shut for {timeout} s")
        return True

    def open(self) -> None:
        """Open the gate."""
        self.gate.set()


def _table() -> ExportTable:
    return ExportTable.build(
        classes=[
            ExportedClass(
                name="Waiter",
                cls=Waiter,
                elixir_module="T.Waiter",
                methods=("left", "wait", "open"),
            )
        ],
        functions=[],
    )


def _frame(rid: int, op: pb.Operation, deadline_ms: int = 0, session: str = "") -> bytes:
    return pb.encode_request(pb.Request(rid, session, op, deadline_ms))


def _reply(d: Dispatcher, job: Job) -> pb.Reply:
    return pb.decode_reply(b"".join(d.run(job)))


def _waiter(d: Dispatcher) -> tuple[int, Waiter]:
    reply = _reply(d, d.admit(_frame(1, pb.CreateInstance("Waiter"))))
    handle = PLAIN.decode(reply.value).handle
    return handle, d.registry.get(handle, "default")


@pytest.mark.parametrize("session", ["", "s1"])
def test_the_call_sees_its_deadline_and_plans_serve_every_deadline(session: str) -> None:
    d = Dispatcher(_table())
    reply = _reply(d, d.admit(_frame(1, pb.CreateInstance("Waiter"), session=session)))
    handle = PLAIN.decode(reply.value).handle
    left = pb.CallMethod(handle, "left")
    assert PLAIN.decode(_reply(d, d.admit(_frame(2, left, session=session))).value) is None
    for i, ms in enumerate([5_000, 60_000, 0, 300]):
        job = d.admit(_frame(3 + i, left, ms, session))
        assert type(job[0]) is CallPlan  # the first call left a plan; deadlines aside
        got = PLAIN.decode(_reply(d, job).value)
        if ms:
            assert ms / 1000 - 1 < got <= ms / 1000
        else:
            assert got is None
    assert deadline.remaining() is None  # set for the call only


def test_a_decoded_call_sees_its_deadline() -> None:
    d = Dispatcher(_table())
    handle, _ = _waiter(d)
    # Arguments: never planned.
    job = d.admit(_frame(2, pb.CallMethod(handle, "wait", PLAIN.encode([5.0])), 50))
    assert type(job[0]) is pb.Request
    reply = _reply(d, job)
    assert reply.error is not None and reply.error.category == "timeout", reply


@pytest.mark.parametrize("planned", [False, True])
def test_a_request_whose_deadline_passed_before_its_turn_is_not_run(planned: bool) -> None:
    d = Dispatcher(_table())
    handle, waiter = _waiter(d)
    if planned:
        _reply(d, d.admit(_frame(2, pb.CallMethod(handle, "left"))))  # leaves a plan
    calls = waiter.calls
    # A call that holds the object's turn for 0.3 s, then one with a 50 ms deadline.
    blocking = d.admit(_frame(3, pb.CallMethod(handle, "wait", PLAIN.encode([0.3]))))
    late = d.admit(_frame(4, pb.CallMethod(handle, "left"), 50))
    assert (type(late[0]) is CallPlan) is planned
    first = threading.Thread(target=_reply, args=(d, blocking), daemon=True)
    first.start()
    reply = _reply(d, late)
    first.join(10)
    assert reply.id == 4 and reply.error is not None, reply
    assert reply.error.category == "timeout"
    assert reply.error.message.startswith("not run:")
    assert waiter.calls == calls + 1  # the blocking call only


def test_a_wait_clamped_to_the_deadline_gives_up_with_a_timeout_error() -> None:
    d = Dispatcher(_table())
    handle, waiter = _waiter(d)
    start = time.monotonic()
    job = d.admit(_frame(2, pb.CallMethod(handle, "wait", PLAIN.encode([30.0])), 200))
    reply = _reply(d, job)
    took = time.monotonic() - start
    assert 0.15 < took < 2.0
    assert reply.error is not None and reply.error.category == "timeout"
    assert reply.error.python_type == "TimeoutError"
    assert "Traceback" in reply.error.traceback
    # The same exception before the deadline is a python error, as ever.
    waiter.gate.clear()
    job = d.admit(_frame(3, pb.CallMethod(handle, "wait", PLAIN.encode([0.05])), 10_000))
    reply = _reply(d, job)
    assert reply.error is not None and reply.error.category == "python"


def test_dispatch_takes_the_deadline_of_the_request() -> None:
    d = Dispatcher(_table())
    handle, _ = _waiter(d)
    reply = d.dispatch(pb.Request(2, "", pb.CallMethod(handle, "left"), 1_000))
    assert 0 < PLAIN.decode(reply.value) <= 1.0


# -- bridge_py.deadline on its own ------------------------------------------------------


def test_clamp_without_a_deadline_changes_nothing() -> None:
    assert deadline.remaining() is None
    assert deadline.clamp(300.0) == 300.0
    assert deadline.clamp_until(12.5) == 12.5


def test_clamp_keeps_to_the_deadline() -> None:
    now = time.monotonic()
    with deadline.until(now + 2.0):
        assert 1.0 < deadline.clamp(300.0) <= 2.0
        assert deadline.clamp(0.5) == 0.5
        assert deadline.clamp_until(now + 100) == now + 2.0
        assert deadline.clamp_until(now + 1) == now + 1
    with deadline.until(now - 1.0):  # passed: one quick look
        assert deadline.clamp(300.0) == pytest.approx(0.001)
        left = deadline.remaining()
        assert left is not None and left < 0
    assert deadline.remaining() is None


def test_the_deadline_is_per_thread() -> None:
    seen: list[float | None] = []
    with deadline.until(time.monotonic() + 5):
        other = threading.Thread(target=lambda: seen.append(deadline.remaining()))
        other.start()
        other.join()
    assert seen == [None]
