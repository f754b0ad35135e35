"""GroupCoordinator's non-blocking point to point (vLLM 0.34): isend_object,
isend_tensor_dict and irecv_tensor_dict, on 4 real gloo processes (TP 2 x PP 2, as in
test_group_coordinator_p2p, whose sample dictionaries are reused)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from bridge_py import deadline
from bridge_py.distributed.coordinator.p2p import MAX_PENDING_SENDS
from bridge_py.distributed.errors import CollectiveTimeout, StateError
from bridge_py.distributed.parallel_state import GroupCoordinator
from tests.distributed.harness import free_port, join_gloo, run_ranks
from tests.distributed.test_group_coordinator_p2p import _init, _same_dict, _sample_dict, value


def _objects(pp: GroupCoordinator) -> None:
    """isend_object: the object is taken when posted, the handle waits once, recv_object
    gets it."""
    if pp.rank_in_group == 0:
        obj = {"step": 1, "ids": [1, 2, 3]}
        handle = pp.isend_object(obj, dst=1)
        obj["ids"].append(4)  # after posting: not what travels
        handle.wait()
        handle.wait()  # a second wait returns at once (gloo's own would never return)
        assert handle.is_completed()
        with pytest.raises(ValueError, match="dst"):
            pp.isend_object("x", dst=0)  # itself
        with pytest.raises(ValueError, match="dst"):
            pp.isend_object("x", dst=2)
    else:
        assert pp.recv_object(src=0) == {"step": 1, "ids": [1, 2, 3]}


def _dicts(rank: int, tp: GroupCoordinator, pp: GroupCoordinator) -> None:
    """isend_tensor_dict to irecv_tensor_dict, with and without the all-gather over TP."""
    first = pp.rank_in_group == 0
    sent = {**_sample_dict(7), "residual": value(torch.float32, (2, 4), seed=pp.ranks[0])}
    overrides = {"residual": False}
    if first:
        with pytest.raises(TypeError, match="dictionary"):
            pp.isend_tensor_dict([1, 2])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="no all_gather_group"):
            pp.isend_tensor_dict(sent, all_gather_tensors={"hidden": True})
        with pytest.raises(TypeError, match="all_gather_group must be a GroupCoordinator"):
            pp.isend_tensor_dict(sent, all_gather_group="tp")  # type: ignore[arg-type]
        # Nothing went out for those: the next dictionary is the first the peer gets.
        handles = pp.isend_tensor_dict(sent)
        sent_tensors = [v for v in sent.values() if isinstance(v, torch.Tensor) and v.numel()]
        assert len(handles) == 1 + len(sent_tensors)  # the metadata, then each tensor
        for handle in handles:
            handle.wait()
        assert all(handle.is_completed() for handle in handles)
        handles = pp.isend_tensor_dict(sent, all_gather_group=tp, all_gather_tensors=overrides)
        for handle in handles:
            handle.wait()
        return
    received, handles, postprocess = pp.irecv_tensor_dict()
    assert postprocess == []
    for handle in handles:
        handle.wait()
    _same_dict(received, sent)  # int16 and bool arrive through their wire copies too

    received, handles, postprocess = pp.irecv_tensor_dict(
        all_gather_group=tp, all_gather_tensors=overrides
    )
    for handle in handles:
        handle.wait()
    # "hidden" came as this TP rank's half; "ids" (5), "odd" (3) and "residual" whole.
    assert len(postprocess) == 2  # "hidden" (24 elements) and "mask" (6)
    assert received["hidden"].shape == (12,)
    assert torch.equal(received["hidden"], sent["hidden"].reshape(2, -1)[tp.rank_in_group])
    for step in postprocess:
        step()
    _same_dict(received, sent)


def _fire_and_forget(pp: GroupCoordinator) -> None:
    """Handles dropped at once: the dictionaries still arrive whole and in order, and
    the coordinator keeps at most MAX_PENDING_SENDS of them."""
    count = MAX_PENDING_SENDS + 8
    if pp.rank_in_group == 0:
        for i in range(count):
            pp.isend_tensor_dict({"i": i, "x": torch.full((1000,), float(i))})
            assert len(pp._pending_sends) <= MAX_PENDING_SENDS
        pp.send_tensor_dict({"i": "last"})  # blocking, after the others: waits for them
    else:
        for i in range(count):
            got = pp.recv_tensor_dict()
            assert (
                got is not None
                and got["i"] == i
                and torch.equal(got["x"], torch.full((1000,), float(i)))
            )
        assert pp.recv_tensor_dict() == {"i": "last"}


def _ring(rank: int, world: GroupCoordinator) -> None:
    """Every rank sends 8 MiB to the next and receives from the previous at once: each
    posts its send before it receives, which blocking sends of this size could not do."""
    big = torch.full((2 << 20,), float(rank))
    handles = world.isend_tensor_dict({"from": rank, "big": big})
    received, recv_handles, _ = world.irecv_tensor_dict()
    for handle in [*recv_handles, *handles]:
        handle.wait()
    prev = (rank - 1) % 4
    assert received is not None and received["from"] == prev
    assert torch.equal(received["big"], torch.full((2 << 20,), float(prev)))


def _async_p2p(rank: int, port: int) -> str:
    world, tp, pp = _init(rank, port)
    _objects(pp)
    _dicts(rank, tp, pp)
    _fire_and_forget(pp)
    _ring(rank, world)
    alone = GroupCoordinator([[0], [1], [2], [3]], rank, "gloo", False, group_name="alone")
    assert alone.isend_tensor_dict({"x": torch.ones(1)}) == []
    assert alone.irecv_tensor_dict() == (None, [], [])
    world.barrier()
    for group in (alone, pp, tp, world):
        group.destroy()
    dist.destroy_process_group()
    return "ok"


def test_isend_object_and_the_non_blocking_tensor_dicts() -> None:
    assert run_ranks(_async_p2p, 4, free_port(), timeout=90) == ["ok"] * 4


def _unusable_after_timeout(rank: int, port: int) -> str:
    """A handle whose wait times out (the peer never receives) leaves the group unusable,
    as blocking calls do: the next send is refused at once."""
    join_gloo(rank, port, 2)
    group = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="g")
    if rank == 0:
        handles = group.isend_tensor_dict({"x": torch.zeros(4 << 20)})
        with deadline.until(time.monotonic() + 0.5), pytest.raises(CollectiveTimeout):
            for handle in handles:
                handle.wait()
        with pytest.raises(StateError, match="unusable"):
            group.isend_object("again", dst=1)
    dist.barrier()  # (rank 1 never receives)
    return "ok"


def test_a_wait_that_times_out_makes_the_group_unusable() -> None:
    assert run_ranks(_unusable_after_timeout, 2, free_port(), timeout=60) == ["ok"] * 2
