"""Call plans: a call made before skips decoding and resolving, and answers as the full way.

The dispatcher is driven the way both transports drive it (``admit`` on the frame, then
``run``; a planned method call takes its turn from the plan's sequencer as it runs), and
once through the real ``PortTransport``. Planned replies are compared with what the full
way answers.
"""

from __future__ import annotations

import gc
import io
import struct
import tempfile
import threading
import time
import weakref

import pytest
import torch

from bridge_py.worker import dispatcher
from bridge_py.worker import envelope as pb
from bridge_py.worker.call_plans import MAX_PLANNED_BYTES, CallPlan, CallPlans, split_call
from bridge_py.worker.codec import PLAIN, RefValue
from bridge_py.worker.dispatcher import Dispatcher, Job
from bridge_py.worker.registry import Lifetime
from bridge_py.worker.transports.frames import FrameReader
from bridge_py.worker.transports.port import PortTransport
from tests.worker.sample_exports import table

pytestmark = pytest.mark.timeout(60)


def _frame(
    request_id: int, handle: int, method: str, args: bytes = b"", kwargs: bytes = b""
) -> bytes:
    return pb.encode_request(
        pb.Request(request_id, "", pb.CallMethod(handle, method, args, kwargs))
    )


def _request(request_id: int, op: pb.Operation, session: str = "", deadline_ms: int = 0) -> bytes:
    return pb.encode_request(pb.Request(request_id, session, op, deadline_ms))


def _counter(d: Dispatcher, step: object = 1) -> int:
    reply = d.dispatch(pb.Request(1, "", pb.CreateInstance("Counter")))
    handle = PLAIN.decode(reply.value).handle
    d.registry.get(handle, "default").step = step
    return handle


def _is_planned(job: Job) -> bool:
    return type(job[0]) is CallPlan


def _reply(d: Dispatcher, job: Job) -> pb.Reply:
    return pb.decode_reply(b"".join(d.run(job)))


def _full(d: Dispatcher, frame: bytes) -> pb.Reply:
    job = d.admit(frame)
    assert not _is_planned(job), "this call has a plan already"
    return _reply(d, job)


def _planned(d: Dispatcher, frame: bytes) -> pb.Reply:
    job = d.admit(frame)
    assert _is_planned(job), "no plan for this call"
    return _reply(d, job)


def test_a_call_is_planned_after_it_succeeds_and_its_arguments_may_change() -> None:
    d = Dispatcher(table())
    handle = _counter(d)
    assert PLAIN.decode(_full(d, _frame(2, handle, "incr")).value) == 1
    for i in range(3, 6):
        reply = _planned(d, _frame(i, handle, "incr"))
        assert (reply.id, PLAIN.decode(reply.value)) == (i, i - 1)
    # Large ids (multi-byte varints) find the same plan, up to 63 bits; beyond, the full way.
    for big in (300, 2**14 + 1, 2**21 + 1, 2**40 + 7, 2**63 - 1):
        assert _planned(d, _frame(big, handle, "incr")).id == big
    assert _full(d, _frame(2**63, handle, "incr")).id == 2**63
    # The same plan serves the method with other arguments, positional or keyword,
    # short or long, each decoded and checked as the full way does.
    value = PLAIN.decode(_planned(d, _frame(7, handle, "incr")).value)
    for by in (1, 10, 2**40, -3):
        value += by
        assert (
            PLAIN.decode(_planned(d, _frame(8, handle, "incr", PLAIN.encode([by]))).value) == value
        )
        kwargs = PLAIN.encode({"by": by})
        value += by
        assert PLAIN.decode(_planned(d, _frame(9, handle, "incr", b"", kwargs)).value) == value
    # Another session's bytes are another call: no plan for them.
    other = pb.encode_request(pb.Request(9, "s2", pb.CallMethod(handle, "incr")))
    assert _full(d, other).error.category == "not_found"


def test_getters_functions_and_pings_are_planned_too() -> None:
    d = Dispatcher(table())
    handle = _counter(d)
    getter = pb.GetAttribute(handle, "value")
    assert PLAIN.decode(_full(d, _request(2, getter)).value) == 0
    for i in range(4, 7):
        d.run(d.admit(_frame(i, handle, "incr")))
        assert PLAIN.decode(_planned(d, _request(i, getter, deadline_ms=5000)).value) == i - 3
    for value in ([1, "two", {"3": 4.0}], None, b"\x00" * 300):
        echo = pb.CallFunction("echo", PLAIN.encode([value]))
        if len(d.plans) < 3:
            _full(d, _request(10, echo))
        assert PLAIN.decode(_planned(d, _request(11, echo)).value) == value
    for payload in (b"", PLAIN.encode("hello"), PLAIN.encode(list(range(100)))):
        ping = pb.Ping(payload)
        if not any(p.op is pb.Ping for p in d.plans._plans.values()):
            _full(d, _request(12, ping))
        reply = _planned(d, _request(13, ping))
        assert reply.value == (payload or PLAIN.encode(None))
    assert {p.op for p in d.plans._plans.values()} == {
        pb.CallMethod,
        pb.GetAttribute,
        pb.CallFunction,
        pb.Ping,
    }


def test_constructors_are_planned_and_each_call_makes_a_new_object() -> None:
    d = Dispatcher(table())
    make = pb.CreateInstance("Counter", PLAIN.encode([5]), PLAIN.encode({"step": 2}))
    first = PLAIN.decode(_full(d, _request(2, make, "s1")).value)
    refs = [first] + [PLAIN.decode(_planned(d, _request(3, make, "s1")).value) for _ in range(3)]
    assert [type(r) for r in refs] == [RefValue] * 4
    assert len({r.handle for r in refs}) == 4 and {r.class_name for r in refs} == {"Counter"}
    for ref in refs:  # each a Counter of its own, made with the arguments, in the session
        counter = d.registry.get(ref.handle, "s1")
        assert (counter.value, counter.step) == (5, 2)
    other = pb.CreateInstance("Counter", PLAIN.encode([7]))  # other arguments: the same plan
    assert d.registry.get(PLAIN.decode(_planned(d, _request(4, other, "s1")).value).handle,
                          "s1").value == 7  # fmt: skip
    # Bad arguments answer as the full way; so does a constructor that raises.
    _same_error(d, _request(5, pb.CreateInstance("Counter", PLAIN.encode(["five"])), "s1"))
    _same_error(d, _request(6, pb.CreateInstance("Counter", b"", PLAIN.encode({"x": 1})), "s1"))
    assert d.registry.get(refs[0].handle, "s1") is not d.registry.get(refs[1].handle, "s1")


def test_planned_calls_with_bad_arguments_answer_as_the_full_way() -> None:
    d = Dispatcher(table())
    handle = _counter(d)
    _full(d, _frame(2, handle, "incr", PLAIN.encode([1])))
    for args, kwargs in (
        (PLAIN.encode(["one"]), b""),  # the wrong type
        (PLAIN.encode([1, 2, 3]), b""),  # too many
        (b"", PLAIN.encode({"nope": 1})),  # an unknown keyword
        (b"\xc1", b""),  # not msgpack
        (PLAIN.encode({"by": 1}), b""),  # args that are not an array
    ):
        frame = _frame(3, handle, "incr", args, kwargs)
        planned = _planned(d, frame).error
        full = d.dispatch(pb.decode_request(frame)).error
        assert planned is not None and full is not None
        assert (planned.category, planned.message) == (full.category, full.message)
        assert planned.category == "bad_args"
    assert PLAIN.decode(_planned(d, _frame(4, handle, "incr", PLAIN.encode([5]))).value) == 6


def _same_error(d: Dispatcher, frame: bytes) -> pb.Error:
    """The error a planned ``frame`` answers, checked to be the full way's."""
    planned = _planned(d, frame).error
    full = d.dispatch(pb.decode_request(frame)).error
    assert planned is not None and full is not None
    assert (planned.category, planned.message, planned.python_type) == (
        full.category,
        full.message,
        full.python_type,
    )
    return planned


def test_planned_calls_check_and_convert_arguments_as_the_full_way() -> None:
    # A function with annotated parameters, planned once: each later call, positional or
    # by keyword, is checked (and its dtype converted) as the first one was.
    d = Dispatcher(table())

    def zeros(args: object, kwargs: object = None) -> bytes:
        encoded = b"" if kwargs is None else PLAIN.encode(kwargs)
        return _request(2, pb.CallFunction("zeros", PLAIN.encode(args), encoded))

    _full(d, zeros([[2]]))
    for frame in (zeros([[3], ["f", 64]]), zeros([[3]], {"dtype": "float64"})):
        tensor = PLAIN.decode(_planned(d, frame).value)
        assert tensor.dtype == torch.float64 and tensor.shape == (3,)
    for args, kwargs, message in (
        ([[3], "float33"], None, "zeros: argument 'dtype': "),
        ([[3]], {"dtype": 5}, "zeros: argument 'dtype': "),
        ([[3], None, 1], None, "zeros(shape: 'list[int]', dtype: 'torch.dtype' = torch.float32)"),
        ([], None, "missing a required argument: 'shape'"),
        ([[3]], {"nope": 1}, "unexpected keyword argument 'nope'"),
        ([[3]], {1: 2}, "kwargs must be a msgpack map with string keys"),
        ([[3]], ["dtype"], "kwargs must be a msgpack map with string keys"),
    ):
        error = _same_error(d, zeros(args, kwargs))
        assert error.category == "bad_args" and message in error.message
    # The method the module's tests plan: incr(by: int | None).
    handle = _counter(d)
    _full(d, _frame(3, handle, "incr", PLAIN.encode([1])))
    for value in (2.5, "2", [2]):
        error = _same_error(d, _frame(4, handle, "incr", PLAIN.encode([value])))
        assert "Counter.incr: argument 'by' must be int or None, got" in error.message
    assert PLAIN.decode(_planned(d, _frame(5, handle, "incr", PLAIN.encode([True]))).value) == 2
    assert (
        PLAIN.decode(_planned(d, _frame(6, handle, "incr", b"", PLAIN.encode({"by": 3}))).value)
        == 5
    )


def test_a_planned_result_that_cannot_be_encoded_answers_as_the_full_way() -> None:
    d = Dispatcher(table())
    _full(d, _request(2, pb.CallFunction("nested", PLAIN.encode([1]))))
    error = _same_error(d, _request(3, pb.CallFunction("nested", PLAIN.encode([400]))))
    assert error.category == "encode" and "nested deeper" in error.message


def test_a_planned_call_resolves_refs_in_its_arguments_each_time() -> None:
    d = Dispatcher(table())
    first, second = _counter(d), _counter(d)

    def open_gate(handle: int) -> bytes:
        return _request(
            2, pb.CallFunction("open_gate", PLAIN.encode([RefValue(handle, "Counter")]))
        )

    _full(d, open_gate(first))
    assert _planned(d, open_gate(second)).error is None  # the plan's ref is not reused
    assert d.registry.get(second, "default")._gate.is_set()
    d.dispatch(pb.Request(4, "", pb.ReleaseHandles([first])))
    # The function's plan holds no object, so it stays: the released ref in its
    # arguments is refused as the full way refuses it.
    planned = _planned(d, open_gate(first)).error
    assert planned is not None and planned.category == "not_found"
    assert str(first) in planned.message


def test_calls_that_fail_and_odd_layouts_get_no_plan() -> None:
    d = Dispatcher(table())
    handle = _counter(d, step=None)  # incr() raises TypeError
    assert _full(d, _frame(3, handle, "incr")).error is not None
    assert _full(d, _frame(4, handle, "secret")).error.category == "not_exported"
    assert _full(d, _request(5, pb.GetAttribute(handle, "_gate"))).error is not None
    # The id again after the call: valid protobuf (the last id wins), not the layout
    # whose bytes name the call alone.
    d.registry.get(handle, "default").step = 1
    odd = _frame(5, handle, "incr") + b"\x08\x09"
    assert _full(d, odd).id == 9
    assert len(d.plans) == 0
    for _ in range(2):  # nor does it make one (each is admitted, and run: it holds a turn)
        assert _full(d, odd).error is None
    assert len(d.plans) == 0


def test_a_planned_call_that_raises_answers_as_the_full_path() -> None:
    d = Dispatcher(table())
    handle = _counter(d)
    _full(d, _frame(2, handle, "incr"))
    d.registry.get(handle, "default").step = None
    planned = _planned(d, _frame(3, handle, "incr")).error
    full = d.dispatch(pb.decode_request(_frame(3, handle, "incr"))).error
    assert planned is not None and full is not None
    assert (planned.category, planned.message, planned.python_type) == (
        full.category,
        full.message,
        full.python_type,
    )
    assert planned.category == "python" and "TypeError" in planned.traceback


@pytest.mark.parametrize("release", ["handle", "session"])
def test_a_release_makes_plans_stale(release: str) -> None:
    d = Dispatcher(table())
    handle = _counter(d)
    _full(d, _frame(2, handle, "incr"))
    # Admitted with its plan, run only after the release: the plan is not used.
    admitted = d.admit(_frame(4, handle, "incr"))
    assert _is_planned(admitted)
    if release == "handle":
        d.dispatch(pb.Request(3, "", pb.ReleaseHandles([handle])))
    else:
        d.dispatch(pb.Request(3, "", pb.ReleaseSession()))
    assert len(d.plans) == 0  # dropped: a plan would keep the released object alive
    reply = _reply(d, admitted)
    assert (reply.id, reply.error.category) == (4, "not_found")
    assert str(handle) in reply.error.message
    assert not _is_planned(d.admit(_frame(5, handle, "incr")))


def test_a_release_leaves_the_plans_of_everything_else() -> None:
    # Objects made and released all the time (one per request, say) must not cost every
    # other call its plan: only the released object's plans go.
    d = Dispatcher(table())
    kept, released = _counter(d), _counter(d)
    calls = [
        _frame(2, kept, "incr"),
        _request(3, pb.GetAttribute(kept, "value")),
        _request(4, pb.CallFunction("echo", PLAIN.encode([1]))),
        _request(5, pb.CreateInstance("Counter")),
    ]
    for frame in [*calls, _frame(6, released, "incr")]:
        _full(d, frame)
    assert len(d.plans) == 5
    d.dispatch(pb.Request(7, "", pb.ReleaseHandles([released])))
    assert len(d.plans) == 4
    for frame in calls:
        assert _planned(d, frame).error is None
    gone = d.admit(_frame(8, released, "incr"))
    assert not _is_planned(gone)
    assert _reply(d, gone).error.category == "not_found"
    # A session's release drops that session's plans (its codec goes too), not others'.
    _full(d, _request(9, pb.CallFunction("echo", PLAIN.encode([1])), "other"))
    assert len(d.plans) == 5
    d.dispatch(pb.Request(10, "", pb.ReleaseSession()))
    assert len(d.plans) == 1
    assert not d.plans._keys_of  # nothing stays behind for the session's objects either
    assert (
        _planned(d, _request(11, pb.CallFunction("echo", PLAIN.encode([2])), "other")).error is None
    )


def test_sessions_leave_nothing_behind_once_their_plans_are_gone() -> None:
    # A plan holds its session's lifetime; the registry keeps it no longer (session
    # names are the client's, and may come and go without a release).
    d = Dispatcher(table())
    for i in range(50):
        _full(d, _request(i + 1, pb.CallFunction("echo", PLAIN.encode([1])), f"s{i}"))
    assert len(d.registry._session_lifetimes) == 50
    d.plans.clear()
    gc.collect()
    assert len(d.registry._session_lifetimes) == 0


def test_a_released_object_is_not_kept_alive_by_its_plan() -> None:
    d = Dispatcher(table())
    handle = _counter(d)
    _full(d, _frame(2, handle, "incr"))
    alive = weakref.ref(d.registry.get(handle, "default"))
    d.dispatch(pb.Request(3, "", pb.ReleaseHandles([handle])))
    gc.collect()
    assert alive() is None


def test_a_planned_call_waits_for_its_turn() -> None:
    # wait_gate (blocking) is admitted first, incr (planned) second: incr runs after it,
    # whichever thread gets to run first.
    d = Dispatcher(table())
    handle = _counter(d)
    _full(d, _frame(2, handle, "incr"))
    blocking = d.admit(_frame(3, handle, "wait_gate", PLAIN.encode([5.0])))
    planned = d.admit(_frame(4, handle, "incr"))
    assert _is_planned(planned)
    results: dict[str, pb.Reply] = {}
    threads = [
        threading.Thread(target=lambda: results.update(incr=_reply(d, planned))),
        threading.Thread(target=lambda: results.update(gate=_reply(d, blocking))),
    ]
    for t in threads:
        t.start()
        time.sleep(0.1)
    time.sleep(0.2)
    assert results == {}  # incr waits behind the blocked call
    d.registry.get(handle, "default")._gate.set()
    for t in threads:
        t.join(10)
    assert PLAIN.decode(results["gate"].value) is True
    assert PLAIN.decode(results["incr"].value) == 2


def test_frames_with_long_arguments_take_the_full_way(monkeypatch: pytest.MonkeyPatch) -> None:
    # Slicing their arguments out would copy them: even with a plan for the function,
    # they are decoded the full way (and answered as the planned ones are), and they are
    # neither split nor encoded again to learn from (gRPC hands them over as bytes).
    d = Dispatcher(table())
    _full(d, _request(1, pb.CallFunction("echo", PLAIN.encode([1]))))
    big = PLAIN.encode([b"x" * MAX_PLANNED_BYTES])
    frames = [_request(i, pb.CallFunction("echo", big)) for i in range(2, 4)]
    looked_at: list[int] = []
    for module, name in ((dispatcher, "split_call"), (pb, "encode_request")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda x, f=original: looked_at.append(1) or f(x))
    for frame in frames:
        assert len(frame) > MAX_PLANNED_BYTES
        assert len(PLAIN.decode(_full(d, frame).value)) == MAX_PLANNED_BYTES
    assert looked_at == []
    monkeypatch.undo()
    assert (
        PLAIN.decode(_planned(d, _request(4, pb.CallFunction("echo", PLAIN.encode([2])))).value)
        == 2
    )


def test_plans_are_bounded() -> None:
    plans = CallPlans(limit=2)
    plan = CallPlan(lambda a, k: None, None, None, Lifetime())  # type: ignore[arg-type]
    for handle in range(1, 6):
        split = split_call(_frame(1, handle, "incr"))
        assert split is not None
        plans.learn(split[1], plan)
        assert len(plans) <= 2
    split = split_call(_frame(9, 5, "incr", PLAIN.encode([1])))
    assert split is not None and plans.get(split[1]) is plan


def test_the_port_transport_decodes_a_repeated_call_once(monkeypatch) -> None:
    d = Dispatcher(table())
    handle = _counter(d)
    frames = [_frame(100 + i, handle, "incr", PLAIN.encode([1 + i % 2])) for i in range(50)]
    data = b"".join(struct.pack(">I", len(f)) + f for f in frames)
    decoded: list[int] = []
    decode = pb.decode_request

    def counting(frame: bytes) -> pb.Request:
        decoded.append(1)
        return decode(frame)

    monkeypatch.setattr(pb, "decode_request", counting)
    with tempfile.TemporaryFile() as out:
        PortTransport(d, io.BufferedReader(io.BytesIO(data)), out.fileno()).serve()
        out.seek(0)
        reader = FrameReader(out, max_frame=1 << 20)  # type: ignore[arg-type]
        replies = [pb.decode_reply(reader.read()) for _ in frames]
    values = [PLAIN.decode(r.value) for r in replies]
    assert [r.id for r in replies] == [100 + i for i in range(50)]
    assert values == [sum(1 + j % 2 for j in range(i + 1)) for i in range(50)]
    assert len(decoded) == 1
