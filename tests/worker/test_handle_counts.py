"""Each hand-out of a handle is counted: an object given to two callers lives until both
released it (issue 40: one release broke another caller's ref)."""

from __future__ import annotations

import pytest

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN
from tests.worker.port_client import PortClient, WorkerError

pytestmark = pytest.mark.timeout(60)


def _value(worker: PortClient, ref: object) -> int:
    return int(worker.request(pb.GetAttribute(ref.handle, "value")))  # type: ignore[attr-defined]


def test_an_object_handed_out_twice_lives_until_both_are_released(worker: PortClient) -> None:
    counter = worker.create("Counter", 7)
    # The same object comes back from a second call (a ping of its ref): the same handle,
    # held twice, as two callers of get_world_group() hold the world group.
    again = worker.request(pb.Ping(PLAIN.encode(counter)))
    assert again.handle == counter.handle
    assert worker.request(pb.ReleaseHandles([counter.handle])) == 0  # the other hold stays
    assert _value(worker, again) == 7
    assert worker.request(pb.ReleaseHandles([counter.handle])) == 1  # the last: freed
    with pytest.raises(WorkerError) as info:
        _value(worker, again)
    assert info.value.error.category == "not_found"
    assert worker.request(pb.ReleaseHandles([counter.handle])) == 0  # a third: harmless


def test_a_release_naming_a_handle_twice_gives_back_two_holds(worker: PortClient) -> None:
    counter = worker.create("Counter")
    for _ in range(2):
        worker.request(pb.Ping(PLAIN.encode(counter)))
    assert worker.request(pb.ReleaseHandles([counter.handle] * 2)) == 0
    assert _value(worker, counter) == 0
    assert worker.request(pb.ReleaseHandles([counter.handle] * 5)) == 1


def test_releasing_the_session_frees_every_hold(worker: PortClient) -> None:
    counter = worker.create("Counter", session="counted")
    for _ in range(3):
        worker.request(pb.Ping(PLAIN.encode(counter)), session="counted")
    assert worker.request(pb.ReleaseSession(), session="counted") == 1
