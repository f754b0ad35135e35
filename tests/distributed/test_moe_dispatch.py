"""vLLM 0.34's mixture-of-experts token exchange, on 2 real gloo processes.

``dispatch`` (routed tokens: top-k weights and ids) beside ``dispatch_router_logits``,
``combine`` and its into-an-output form, at every layer (All2AllManagerBase and the naive
manager, the device communicators, GroupCoordinator); and the point-to-point calls of
vLLM 0.34's communicators (``batch_isend_irecv``, the CPU communicator's tensor dicts).
Rank ``r`` has ``[3, 1][r]`` tokens, so every gather and reduce-scatter is uneven.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed import P2POp

from bridge_py.distributed.device_communicators import (
    CpuCommunicator,
    DeviceCommunicatorBase,
    NaiveAll2AllManager,
)
from bridge_py.distributed.device_communicators.base_device_communicator import (
    All2AllManagerBase,
)
from bridge_py.distributed.errors import StateError
from bridge_py.distributed.parallel_state import GroupCoordinator
from bridge_py.distributed.spg.group import StatelessProcessGroup
from tests.distributed.harness import free_port, join_gloo, run_ranks

pytestmark = pytest.mark.timeout(120)

COUNTS = [3, 1]


def _tokens(r: int) -> dict[str, torch.Tensor]:
    """Rank ``r``'s tokens: hidden states, top-k (2) weights and ids, logits, a scale."""
    n = COUNTS[r]
    return {
        "hidden": torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + 100 * r,
        "weights": torch.full((n, 2), 0.25 + r),
        "ids": torch.arange(n * 2, dtype=torch.int64).reshape(n, 2) + 10 * r,
        "logits": torch.full((n, 4), float(r)),
        "scale": torch.full((n,), float(r + 1)),
    }


def _all(key: str) -> torch.Tensor:
    """Every rank's ``key`` tensor, in rank order: what a gathering dispatch returns."""
    return torch.cat([_tokens(r)[key] for r in range(2)])


def _equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


def _check_gathering(rank: int, mover: object) -> None:
    """``mover`` (a manager, communicator or coordinator that gathers tokens) dispatches
    both ways and combines, with and without extra tensors."""
    mine = _tokens(rank)
    out = mover.dispatch(mine["hidden"], mine["weights"], mine["ids"])  # type: ignore[attr-defined]
    assert isinstance(out, tuple) and len(out) == 3
    for got, key in zip(out, ("hidden", "weights", "ids"), strict=True):
        _equal(got, _all(key))
    out = mover.dispatch(  # type: ignore[attr-defined]
        mine["hidden"], mine["weights"], mine["ids"], False, extra_tensors=[mine["scale"]]
    )
    assert len(out) == 4 and isinstance(out[3], list) and len(out[3]) == 1
    _equal(out[3][0], _all("scale"))
    out = mover.dispatch_router_logits(mine["hidden"], mine["logits"])  # type: ignore[attr-defined]
    assert len(out) == 2
    _equal(out[0], _all("hidden"))
    _equal(out[1], _all("logits"))
    out = mover.dispatch_router_logits(mine["hidden"], mine["logits"], True, [mine["ids"]])  # type: ignore[attr-defined]
    assert len(out) == 3 and isinstance(out[2], list)
    _equal(out[2][0], _all("ids"))
    # Each rank's "experts" scale every token; combine sums over ranks and keeps this
    # rank's rows: (1 + 2) x its own tokens.
    expert_out = out[0] * (rank + 1)
    _equal(mover.combine(expert_out), mine["hidden"] * 3)  # type: ignore[attr-defined]
    buffer = torch.empty_like(mine["hidden"])
    assert mover.combine_into_output(expert_out, buffer) is buffer  # type: ignore[attr-defined]
    _equal(buffer, mine["hidden"] * 3)
    shape, cpu = (4, 2), torch.device("cpu")
    assert mover.allocate_combine_input(shape, torch.float32, cpu) is None  # type: ignore[attr-defined]


class _Doubling(All2AllManagerBase):
    """A manager whose combine doubles its input (for the base's combine_into_output)."""

    def combine(
        self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False
    ) -> torch.Tensor:
        return hidden_states * 2


def _manager_base(rank: int, port: int, store_port: int) -> str:
    join_gloo(rank, port)
    group = dist.new_group([0, 1], backend="gloo")
    base = All2AllManagerBase(group)
    assert (base.cpu_group, base.tcp_store_group) == (group, None)
    assert (base.rank, base.world_size, base.support_fault_tolerance) == (rank, 2, False)
    assert base.internode is False
    store = StatelessProcessGroup.create("127.0.0.1", store_port, rank, 2)
    assert All2AllManagerBase(group, tcp_store_group=store).internode is False

    hidden = torch.ones(2, 2)
    calls = {
        "get_handle": lambda: base.get_handle({}),
        "dispatch_router_logits": lambda: base.dispatch_router_logits(hidden, hidden),
        "dispatch": lambda: base.dispatch(hidden, hidden, hidden),
        "query_active_mask": base.query_active_mask,
        "query_fault": base.query_fault,
        "clean_buffers": base.clean_buffers,
        "update_mask": lambda: base.update_mask(1, True),
        "combine": lambda: base.combine(hidden),
    }
    for name, call in calls.items():
        with pytest.raises(NotImplementedError, match=rf"All2AllManagerBase\.{name} is not"):
            call()
    assert base.set_num_sms(8) is None and base.max_sms_used() is None
    for step in (base.stage_ep_size, base.commit_ep_size, base.destroy):
        assert step() is None
    with base.mask_remote_ranks():
        entered = True
    assert entered
    assert base.allocate_combine_input((2, 2), torch.float32, torch.device("cpu")) is None

    # checkpoint_prepare/restore warn once per class that there is nothing to do.
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("bridge_py.distributed.device_communicators.all2all_base").addHandler(handler)
    for _ in range(2):
        base.checkpoint_prepare()
        base.checkpoint_restore()
    assert [r.getMessage() for r in records] == [
        "All2AllManagerBase.checkpoint_prepare is not implemented; skipping.",
        "All2AllManagerBase.checkpoint_restore is not implemented; skipping.",
    ]

    doubling = _Doubling(group)
    output = torch.empty(2, 2)
    assert doubling.combine_into_output(hidden, output) is output
    _equal(output, hidden * 2)
    store.barrier(timeout=30)  # rank 0 serves the store: every rank leaves it first
    dist.destroy_process_group()
    return "ok"


def test_all2all_manager_base_has_vllm_0_34_methods_and_defaults() -> None:
    assert run_ranks(_manager_base, 2, free_port(), free_port(), timeout=60) == ["ok"] * 2


def _naive(rank: int, port: int) -> str:
    join_gloo(rank, port)
    group = dist.new_group([0, 1], backend="gloo")
    mine = _tokens(rank)

    # Made as vLLM makes its managers, from the cpu group (it makes its own communicator).
    manager = NaiveAll2AllManager(group)
    _check_gathering(rank, manager)
    for name, call in {
        "get_handle": lambda: manager.get_handle({}),
        "update_mask": lambda: manager.update_mask(0),
    }.items():
        with pytest.raises(NotImplementedError, match=rf"NaiveAll2AllManager\.{name} is not"):
            call()
    # A bad output, or bad hidden states on one rank: every rank raises, the group stays.
    with pytest.raises(ValueError, match=r"combine_into_output on rank .*output has shape"):
        manager.combine_into_output(_all("hidden"), torch.empty(5, 2))
    bad = torch.tensor(1.0) if rank == 1 else mine["hidden"]
    with pytest.raises(ValueError, match=r"dispatch on rank .*dim 0\) on group ranks \[1\]"):
        manager.dispatch(bad, mine["weights"], mine["ids"])
    _equal(manager.dispatch(mine["hidden"], mine["weights"], mine["ids"])[1], _all("weights"))
    manager.destroy()
    with pytest.raises(StateError, match="combine called before dispatch"):
        manager.combine(_all("hidden"))

    # A CPU communicator with all-to-all runs its manager's collectives itself.
    comm = CpuCommunicator(group, unique_name="ep:5", use_all2all=True)
    assert isinstance(comm.all2all_manager, NaiveAll2AllManager)
    assert comm.all2all_manager.communicator is comm
    _check_gathering(rank, comm)
    assert comm.get_symmetric_memory_buffer("moe", (2, 2), torch.float32, comm.device) is None
    comm.destroy()

    # Without a manager both dispatches and combine hand back what they were given.
    base = DeviceCommunicatorBase(group)
    h, w, i, s = mine["hidden"], mine["weights"], mine["ids"], [mine["scale"]]
    out = base.dispatch(h, w, i)
    assert len(out) == 3 and all(a is b for a, b in zip(out, (h, w, i), strict=True))
    out = base.dispatch(h, w, i, False, s)
    assert len(out) == 4 and out[3] is s
    out = base.dispatch_router_logits(h, mine["logits"], False, s)
    assert len(out) == 3 and out[1] is mine["logits"] and out[2] is s
    buffer = torch.empty_like(h)
    assert base.combine_into_output(h, buffer) is buffer and torch.equal(buffer, h)
    assert base.allocate_combine_input((1,), torch.float32, base.device) is None

    # reduce_scatterv_into_output: the sum over ranks, this rank's rows, in the output.
    summed = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    output = torch.empty(COUNTS[rank], 2)
    got = base.reduce_scatterv_into_output(summed * (rank + 1), output, 0, COUNTS)
    assert got is output
    _equal(output, (summed * 3)[:3] if rank == 0 else (summed * 3)[3:])
    with pytest.raises(ValueError, match=r"reduce_scatterv_into_output on rank .*output has"):
        base.reduce_scatterv_into_output(summed, torch.empty(2, 2), 0, COUNTS)
    dist.destroy_process_group()
    return "ok"


def test_naive_manager_and_communicators_dispatch_both_ways_and_combine() -> None:
    assert run_ranks(_naive, 2, free_port(), timeout=60) == ["ok"] * 2


def _point_to_point(rank: int, port: int) -> str:
    join_gloo(rank, port)
    group = dist.new_group([0, 1], backend="gloo")
    comm = CpuCommunicator(group, unique_name="pp:2")
    peer = 1 - rank

    # Both ranks send and receive in one batch; int16 travels as bytes over gloo, and a
    # strided receive tensor gets its values copied in.
    sent = torch.arange(4, dtype=torch.int16) + 10 * rank
    into = torch.zeros(4, 2, dtype=torch.int16)[:, 0]
    floats = torch.zeros(3)
    ops = [
        P2POp(dist.isend, sent, group=group, group_peer=peer),
        P2POp(dist.irecv, into, group=group, group_peer=peer),
    ]
    # As vLLM builds them: only op, tensor and group_peer.
    for op, tensor in ((dist.isend, torch.full((3,), float(rank))), (dist.irecv, floats)):
        entry = object.__new__(P2POp)
        entry.op, entry.tensor, entry.group_peer = op, tensor, peer
        ops.append(entry)
    assert comm.batch_isend_irecv(ops) is None
    _equal(into, torch.arange(4, dtype=torch.int16) + 10 * peer)
    _equal(floats, torch.full((3,), float(peer)))

    # A message of another shape is received, dropped and reported; the pair stays in step.
    if rank == 0:
        comm.batch_isend_irecv([P2POp(dist.isend, torch.ones(3), group=group, group_peer=1)])
    else:
        wrong = [P2POp(dist.irecv, torch.zeros(4), group=group, group_peer=0)]
        with pytest.raises(ValueError, match=r"expected shape \(4,\) .* sent shape \(3,\)"):
            comm.batch_isend_irecv(wrong)
    with pytest.raises(TypeError, match=r"batch_isend_irecv on rank .*p2p_ops\[0\]\.op"):
        comm.batch_isend_irecv([object()])
    with pytest.raises(ValueError, match=r"p2p_ops\[0\]\.group_peer \(\d\) is this rank"):
        comm.batch_isend_irecv([P2POp(dist.isend, sent, group=group, group_peer=rank)])

    # Tensor dicts: keys in order, dtypes and shapes as sent (empty and bf16 included).
    sent_dict = {
        "hidden": torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank,
        "empty": torch.zeros(0, 4, dtype=torch.int64),
        "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    }
    for src in (0, 1):
        if rank == src:
            assert comm.send_tensor_dict(sent_dict, dst=peer) is None
        else:
            got = comm.recv_tensor_dict(src=src)
            assert list(got) == list(sent_dict)
            expected = dict(sent_dict, hidden=sent_dict["hidden"] - rank + src)
            for key, value in expected.items():
                _equal(got[key], value)
    with pytest.raises(RuntimeError, match=r"tensor_dict\['n'\] is a int: only tensors"):
        comm.send_tensor_dict({"n": 1}, dst=peer)
    with pytest.raises(ValueError, match=r"send_tensor_dict on rank .*dst \(\d\) is this rank"):
        comm.send_tensor_dict(sent_dict, dst=rank)
    comm.destroy()
    dist.destroy_process_group()
    return "ok"


def test_batch_isend_irecv_and_the_cpu_communicators_tensor_dicts() -> None:
    assert run_ranks(_point_to_point, 2, free_port(), timeout=60) == ["ok"] * 2


def _coordinator(rank: int, port: int) -> str:
    join_gloo(rank, port)
    ep = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="ep", use_all2all=True)
    assert ep.device_communicator is not None
    assert isinstance(ep.device_communicator.all2all_manager, NaiveAll2AllManager)
    _check_gathering(rank, ep)
    # Along the last dim: rank r keeps COUNTS[r] columns of the sum.
    summed = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    output = torch.empty(2, COUNTS[rank])
    assert ep.reduce_scatterv_into_output(summed * (rank + 1), output, -1, COUNTS) is output
    _equal(output, (summed * 3)[:, :3] if rank == 0 else (summed * 3)[:, 3:])

    # A group without an all-to-all manager leaves the tokens where they are.
    tp = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="tp")
    mine = _tokens(rank)
    out = tp.dispatch(mine["hidden"], mine["weights"], mine["ids"])
    assert [t is mine[k] for t, k in zip(out, ("hidden", "weights", "ids"), strict=True)] == [
        True
    ] * 3
    buffer = torch.empty_like(mine["hidden"])
    assert tp.combine_into_output(mine["hidden"], buffer) is buffer
    _equal(buffer, mine["hidden"])
    tp.destroy()
    ep.destroy()
    dist.destroy_process_group()
    return "ok"


def test_group_coordinator_dispatches_both_ways() -> None:
    assert run_ranks(_coordinator, 2, free_port(), timeout=60) == ["ok"] * 2
