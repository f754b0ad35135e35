"""Device communicators used directly on torch groups (2 gloo processes), and CUDA where
at least two GPUs are present."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from bridge_py.distributed.device_communicators import (
    CpuCommunicator,
    CudaCommunicator,
    DeviceCommunicatorBase,
    NaiveAll2AllManager,
)
from bridge_py.distributed.device_communicators.agreement import CHECK_ENV
from bridge_py.distributed.device_communicators.wire_dtypes import for_reduction, for_transport
from bridge_py.distributed.utils import stateless_init_torch_distributed_process_group
from tests.distributed.harness import free_port, run_ranks


def _init(rank: int, port: int, backend: str = "gloo") -> None:
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )


def _communicators(rank: int, port: int) -> str:
    _init(rank, port)
    cpu_group = dist.new_group([0, 1], backend="gloo")

    # The base class: collectives work, dispatch/combine are documented no-ops, and a
    # missing device group means the cpu group.
    base = DeviceCommunicatorBase(cpu_group)
    assert base.device_group is cpu_group and base.device == torch.device("cpu")
    assert (base.rank, base.world_size, base.ranks, base.rank_in_group) == (rank, 2, [0, 1], rank)
    assert base.use_all2all is False and base.all2all_manager is None
    assert torch.equal(base.all_reduce(torch.ones(2)), torch.full((2,), 2.0))
    hidden, logits = torch.ones(2, 3), torch.zeros(2, 4)
    out = base.dispatch_router_logits(hidden, logits)
    assert out[0] is hidden and out[1] is logits
    assert base.combine(hidden) is hidden
    base.prepare_communication_buffer_for_model(torch.nn.Linear(1, 1))
    base.destroy()

    # A CPU communicator with an all-to-all manager: dispatch gathers every rank's tokens
    # (uneven counts, extra tensors), combine reduce-scatters them back.
    comm = CpuCommunicator(cpu_group, unique_name="ep:7", use_all2all=True)
    assert isinstance(comm.all2all_manager, NaiveAll2AllManager)
    tokens = [3, 1][rank]
    hidden = torch.arange(tokens * 2, dtype=torch.float32).reshape(tokens, 2) + 100 * rank
    logits = torch.full((tokens, 5), float(rank))
    ids = torch.full((tokens,), rank, dtype=torch.int64)
    all_hidden, all_logits, extra = comm.dispatch_router_logits(hidden, logits, False, [ids])
    assert all_hidden.shape == (4, 2) and all_logits.shape == (4, 5)
    assert extra[0].tolist() == [0, 0, 0, 1]
    mine = slice(0, 3) if rank == 0 else slice(3, 4)
    assert torch.equal(all_hidden[mine], hidden)
    combined = comm.combine(all_hidden * (rank + 1))
    assert torch.equal(combined, hidden * 3)  # (1 + 2) x this rank's tokens
    comm.destroy()
    with pytest.raises(AttributeError):
        comm.all2all_manager.combine(hidden)  # type: ignore[union-attr]

    # With checks off (same setting on every rank), local errors still raise at once.
    os.environ[CHECK_ENV] = "0"
    quick = CpuCommunicator(cpu_group, unique_name="quick")
    assert quick.agreement.enabled is False
    with pytest.raises(ValueError, match="not divisible"):
        quick.reduce_scatter(torch.ones(3), 0)
    assert torch.equal(quick.all_gather(torch.tensor([rank])), torch.tensor([0, 1]))
    del os.environ[CHECK_ENV]

    with pytest.raises(ValueError, match="needs a CUDA device"):
        CudaCommunicator(cpu_group, device=torch.device("cpu"))
    dist.destroy_process_group()
    return "ok"


def test_base_cpu_and_all2all_communicators() -> None:
    assert run_ranks(_communicators, 2, free_port(), timeout=60) == ["ok"] * 2


def test_wire_dtypes_round_trip() -> None:
    for dtype in (torch.int16, torch.uint16, torch.bool, torch.float8_e4m3fn, torch.int32):
        t = torch.tensor([1, 0, 1], dtype=torch.float32).to(dtype)
        wire, restore = for_transport(t, "gloo")
        back = restore(wire).reshape(t.shape)
        assert back.dtype == dtype and back.float().tolist() == [1.0, 0.0, 1.0]
    wire, restore = for_reduction(torch.tensor([True, False]), "gloo")
    assert wire.dtype == torch.int32 and restore(wire * 3).tolist() == [True, False]
    wire, restore = for_reduction(torch.tensor([30000], dtype=torch.int16), "gloo")
    assert restore(wire * 2).tolist() == [-5536]  # wraps as int16 arithmetic would
    with pytest.raises(TypeError, match="cannot be summed"):
        for_reduction(torch.empty(1, dtype=torch.bits8), "gloo")


def _cuda(rank: int, port: int) -> str:
    torch.cuda.set_device(rank)
    _init(rank, port, backend="nccl")
    from bridge_py.distributed.parallel_state import GroupCoordinator

    g = GroupCoordinator([[0, 1]], rank, "nccl", True, group_name="tp")
    assert isinstance(g.device_communicator, CudaCommunicator)
    x = torch.full((4,), float(rank + 1), device=g.device)
    assert torch.equal(g.all_reduce(x).cpu(), torch.full((4,), 3.0))
    assert torch.equal(x.cpu(), torch.full((4,), float(rank + 1))), "out of place, as vLLM's"
    assert g.all_gather(x, 0).shape == (8,)
    assert torch.equal(g.reduce_scatter(x, 0).cpu(), torch.full((2,), 3.0))
    got = g.all_gatherv(torch.ones(rank + 1, 2, device=g.device), 0, [1, 2])
    assert got.shape == (3, 2)
    flags = torch.tensor([rank == 0, False], device=g.device)
    assert g.all_reduce(flags).tolist() == [True, False]
    with g.graph_capture() as context:
        assert context.stream is not None
    g.destroy()
    dist.destroy_process_group()
    return "ok"


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_cuda_communicator() -> None:
    assert run_ranks(_cuda, 2, free_port(), timeout=90) == ["ok"] * 2


def _vllm_034_calls(rank: int, port: int, stateless_port: int) -> str:
    """vLLM 0.34's calls of a communicator: the constructor's positional parameters,
    broadcast's ``tensor``, the memory no-ops; a stateless group refused by name."""
    _init(rank, port)
    world = dist.new_group([0, 1])
    # (cpu_group, device, device_group, unique_name, global_ranks, global_world_size,
    # use_all2all): the world says the ranks, so the given ones are not needed
    base = DeviceCommunicatorBase(world, None, None, "tp:0", [0, 1], 2, False)
    assert (base.ranks, base.global_world_size, base.use_all2all) == ([0, 1], 2, False)
    cpu = CpuCommunicator(world, None, None, "tp:0", False)
    for comm in (base, cpu):
        got = comm.broadcast(tensor=torch.full((3,), float(rank)), src=1)
        assert torch.equal(got, torch.full((3,), 1.0))
        for step in (comm.checkpoint_prepare, comm.suspend, comm.resume, comm.checkpoint_restore):
            assert step() is None
    stateless = stateless_init_torch_distributed_process_group(
        "127.0.0.1", stateless_port, rank, 2, "gloo", None, False, None, 30.0
    )
    with pytest.raises(NotImplementedError, match="stateless group"):
        DeviceCommunicatorBase(stateless, None, None, "", [0, 1], 2)
    dist.barrier()
    dist.destroy_process_group()
    return "ok"


def test_vllm_034_calls_of_a_communicator() -> None:
    assert run_ranks(_vllm_034_calls, 2, free_port(), free_port(), timeout=120) == ["ok"] * 2
