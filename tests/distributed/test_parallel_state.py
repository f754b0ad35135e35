"""The module functions of parallel_state and communication_op on 4 gloo processes, and the
pure helpers of utils.

One spawned run goes init -> TP 2 -> destroy -> init -> TP 2 x PP 2 -> destroy -> init ->
TP 2 x DP 2 (expert parallel dispatch/combine) -> destroy, in the same processes.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bridge_py.distributed import communication_op as ops
from bridge_py.distributed import parallel_state as ps
from bridge_py.distributed import utils
from bridge_py.distributed.errors import StateError
from bridge_py.distributed.spg.group import StatelessProcessGroup
from bridge_py.distributed.utils import (
    divide,
    ensure_divisibility,
    get_pp_indices,
    split_tensor_along_last_dim,
)
from tests.distributed.harness import free_port, join_gloo, run_ranks


def _init(rank: int, port: int) -> None:
    ps.init_distributed_environment(
        world_size=4,
        rank=rank,
        distributed_init_method=ps.get_distributed_init_method("127.0.0.1", port),
        backend="nccl",  # falls back to gloo without CUDA, as in vLLM
    )


def _destroy() -> None:
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()
    assert not dist.is_initialized()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(StateError, match="world group is not initialized"):
        ps.get_world_group()
    with pytest.raises(StateError, match="no node count"):
        ps.get_node_count()
    assert ps.is_global_first_rank() and ps.is_local_first_rank()  # no world: one process


def _tensor_parallel(rank: int) -> None:
    world = ps.get_world_group()
    assert (world.world_size, world.rank_in_group, world.local_rank) == (4, rank, rank)
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(StateError, match="tensor model parallel group is not initialized"):
        ps.get_tp_group()
    ps.initialize_model_parallel(2, 1, 1, 1, "gloo")  # vLLM's order: backend comes fifth
    assert ps.model_parallel_is_initialized()
    tp = ps.get_tp_group()
    assert tp.ranks == ([0, 1] if rank < 2 else [2, 3])
    assert ps.get_tensor_model_parallel_rank() == rank % 2
    assert ps.get_tensor_model_parallel_world_size() == 2
    assert tp.mq_broadcaster is not None  # vLLM broadcasts TP objects through shared memory
    assert ps.get_pp_group().ranks == [rank]  # TP 2 on 4 ranks: 2 external data replicas
    assert ps.get_dp_group().ranks == [rank]
    assert ps.get_ep_group().ranks == tp.ranks
    ps.ensure_model_parallel_initialized(2, 1)
    ps.ensure_model_parallel_initialized(2, 1, 1, None, "gloo")
    with pytest.raises(StateError, match="unexpected size"):
        ps.ensure_model_parallel_initialized(4, 1)
    with pytest.raises(StateError, match="already initialized"):
        ps.initialize_model_parallel(2)

    x = torch.arange(6.0).reshape(2, 3) + rank
    peer = x - rank + (rank ^ 1)
    low, high = (x, peer) if rank % 2 == 0 else (peer, x)
    assert torch.equal(tp.all_reduce(x.clone()), low + high)  # (may sum into its input)
    assert torch.equal(ops.tensor_model_parallel_all_reduce(x.clone()), low + high)
    assert torch.equal(ops.tensor_model_parallel_all_gather(x), torch.cat([low, high], -1))
    assert torch.equal(ops.tensor_model_parallel_all_gather(x, 0), torch.cat([low, high], 0))
    y = torch.arange(8.0).reshape(2, 4) * (rank + 1)
    scattered = ops.tensor_model_parallel_reduce_scatter(y)
    pair = tp.ranks
    expected = (torch.arange(8.0).reshape(2, 4) * sum(r + 1 for r in pair)).chunk(2, -1)
    assert torch.equal(scattered, expected[rank % 2])
    gathered = ops.tensor_model_parallel_gather(x, dst=1, dim=0)
    assert (gathered is None) == (rank % 2 == 0)
    if gathered is not None:
        assert torch.equal(gathered, torch.cat([low, high], 0))
    sent = {"x": torch.ones(2) * tp.ranks[0], "step": 7} if rank % 2 == 0 else None
    got = ops.broadcast_tensor_dict(sent, src=0)
    assert (
        got is not None and got["step"] == 7 and torch.equal(got["x"], torch.ones(2) * tp.ranks[0])
    )
    ps.prepare_communication_buffer_for_model(torch.nn.Linear(2, 2))
    with ps.graph_capture(torch.device("cpu")) as context:
        assert context.stream is None
    with ps.graph_capture(torch.device("cpu"), None) as context:  # (0.34: a stream to reuse)
        assert context.stream is None
    world.barrier()


def _pipeline(rank: int) -> None:
    ps.initialize_model_parallel(2, 2)
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    assert ps.get_pipeline_model_parallel_rank() == pp.rank_in_group == rank // 2
    # vLLM 0.34's: the world's node count (one machine here) and first ranks
    assert ps.get_node_count() == 1
    assert ps.is_global_first_rank() == (rank == 0)
    assert ps.is_local_first_rank() == (rank == 0)
    assert pp.ranks == ([0, 2] if rank % 2 == 0 else [1, 3])
    assert pp.is_first_rank == (rank < 2) and pp.is_last_rank == (rank >= 2)
    assert ps.get_dp_group().ranks == [rank]
    assert ps.get_ep_group().ranks == tp.ranks
    hidden = torch.arange(12.0).reshape(3, 4)
    if pp.is_first_rank:
        pp.send_tensor_dict({"hidden": hidden, "pos": 5}, all_gather_group=tp)
    else:
        got = pp.recv_tensor_dict(all_gather_group=tp)
        assert got is not None and got["pos"] == 5 and torch.equal(got["hidden"], hidden)


def _expert_parallel(rank: int) -> None:
    ps.initialize_model_parallel(2, 1, data_parallel_size=2)
    tp, dp, ep = ps.get_tp_group(), ps.get_dp_group(), ps.get_ep_group()
    assert tp.ranks == ([0, 1] if rank < 2 else [2, 3])
    assert dp.ranks == ([0, 2] if rank % 2 == 0 else [1, 3])
    assert ep.ranks == [0, 1, 2, 3]
    comm = ep.device_communicator
    assert comm is not None and comm.all2all_manager is not None  # EP while DP > 1
    assert tp.device_communicator is not None and tp.device_communicator.all2all_manager is None
    tokens = rank + 1  # uneven token counts
    hidden = torch.full((tokens, 3), float(rank))
    logits = torch.full((tokens, 2), float(10 * rank))
    all_hidden, all_logits = ep.dispatch_router_logits(hidden, logits)
    counts = [1, 2, 3, 4]
    expected = torch.cat([torch.full((n, 3), float(r)) for r, n in enumerate(counts)])
    assert torch.equal(all_hidden, expected)
    assert all_logits.shape == (10, 2)
    # Each rank's "experts" scale every token; combine sums over ranks, keeps its own rows.
    out = ep.combine(all_hidden * (rank + 1))
    assert torch.equal(out, hidden * sum(range(1, 5)))


def _in_the_same_node(rank: int, port: int) -> None:
    world = ps.get_world_group()
    assert ps.in_the_same_node_as(world.cpu_group, source_rank=0) == [True] * 4
    assert ps.in_the_same_node_as(world.cpu_group, source_rank=3) == [True] * 4
    spg = StatelessProcessGroup.create("127.0.0.1", port, rank, 4)
    assert ps.in_the_same_node_as(spg, source_rank=1) == [True] * 4
    # Rank 0 serves the store: it must not drop the group (and stop serving) while the
    # others still read their last broadcasts. Its barrier returns after every rank left.
    spg.barrier(timeout=30)


def _lifecycle(rank: int, ports: list[int]) -> str:
    _init(rank, ports[0])
    _tensor_parallel(rank)
    _in_the_same_node(rank, ports[3])
    _destroy()
    _init(rank, ports[1])
    _pipeline(rank)
    _destroy()
    _init(rank, ports[2])
    _expert_parallel(rank)
    _destroy()
    return "ok"


def test_init_model_parallel_destroy_and_init_again() -> None:
    ports = [free_port() for _ in range(4)]
    assert run_ranks(_lifecycle, 4, ports, timeout=120) == ["ok"] * 4


def _own_shared_memory() -> bool:
    """Give this process a /dev/shm of its own (a private tmpfs), as on another node;
    False where that is not permitted (it takes CAP_SYS_ADMIN)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS: a mount namespace of its own
        return False
    libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None)  # MS_REC | MS_PRIVATE
    mount = ["mount", "-t", "tmpfs", "tmpfs", "/dev/shm"]
    try:
        return subprocess.run(mount, capture_output=True, timeout=10).returncode == 0
    except OSError:  # no mount(8)
        return False


def _node_counts(rank: int, ports: list[int], world_size: int, apart: int | None) -> tuple:
    """``_node_count`` of a gloo ProcessGroup and of a StatelessProcessGroup of every rank,
    rank ``apart`` on a node of its own when it can be; and whether it could."""
    alone = rank == apart and _own_shared_memory()
    join_gloo(rank, ports[0], world_size)
    spg = StatelessProcessGroup.create("127.0.0.1", ports[1], rank, world_size)
    counts = (ps._node_count(dist.group.WORLD), ps._node_count(spg))
    spg.barrier(timeout=30)  # rank 0 serves the store until every rank is done
    dist.destroy_process_group()
    return alone, counts


def test_node_count() -> None:
    results = run_ranks(_node_counts, 2, [free_port(), free_port()], 2, None, timeout=60)
    assert results == [(False, (1, 1))] * 2
    results = run_ranks(_node_counts, 3, [free_port(), free_port()], 3, 2, timeout=60)
    nodes = 2 if results[2][0] else 1  # rank 2 alone on its /dev/shm: a second node
    assert [counts for _, counts in results] == [(nodes, nodes)] * 3


@pytest.mark.parametrize(
    "call",
    [
        lambda: ps.initialize_model_parallel(1, 1, 2),
        lambda: ps.initialize_model_parallel(1, 1, 1, 2),
        lambda: ps.ensure_model_parallel_initialized(1, 1, 2),
    ],
    ids=["prefill", "decode", "ensure"],
)
def test_context_parallelism_is_refused_clearly(call: Callable[[], None]) -> None:
    with pytest.raises(NotImplementedError, match="context parallelism is not supported"):
        call()


def test_get_distributed_init_method() -> None:
    assert ps.get_distributed_init_method("127.0.0.1", 1234) == "tcp://127.0.0.1:1234"
    assert ps.get_distributed_init_method("::1", 1234) == "tcp://[::1]:1234"
    assert ps.get_distributed_init_method("[::1]", 1234) == "tcp://[::1]:1234"


def test_divide_and_split() -> None:
    assert divide(12, 4) == 3
    ensure_divisibility(12, 3)
    with pytest.raises(ValueError, match="13 is not divisible by 4"):
        divide(13, 4)
    t = torch.arange(12).reshape(2, 6)
    parts = split_tensor_along_last_dim(t, 3)
    assert [p.shape for p in parts] == [torch.Size([2, 2])] * 3
    assert not parts[1].is_contiguous()
    assert all(p.is_contiguous() for p in split_tensor_along_last_dim(t, 3, True))
    assert torch.equal(torch.cat(list(parts), -1), t)


def test_get_pp_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert [get_pp_indices(8, r, 2) for r in range(2)] == [(0, 4), (4, 8)]
    # 10 layers on 4 stages: the 2 extra layers go to the stages before the last.
    assert [get_pp_indices(10, r, 4) for r in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    assert [get_pp_indices(4, r, 2) for r in range(2)] == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="does not match"):
        get_pp_indices(5, 0, 2)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "a,b")
    with pytest.raises(ValueError, match="Invalid partition string"):
        get_pp_indices(4, 0, 2)
    # vLLM 0.34 refuses a negative count (it would give a stage a backwards range)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "5,-1")
    with pytest.raises(ValueError, match="Negative layer count"):
        get_pp_indices(4, 0, 2)


def _env_launched(rank: int, port: int) -> tuple[int, int, bool]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0")
    ps.init_distributed_environment(
        world_size=1, rank=0, distributed_init_method="env://", backend="gloo"
    )
    world = ps.get_world_group()
    result = (world.local_rank, ps.get_node_count(), ps.is_local_first_rank())
    _destroy()
    return result


def test_an_env_launched_rank_takes_its_local_rank_from_the_environment() -> None:
    # local_rank=-1 with env:// reads $LOCAL_RANK; the node count and first-rank checks too
    assert run_ranks(_env_launched, 1, free_port(), timeout=60) == [(0, 1, True)]


def _agree_on_int(rank: int, port: int) -> tuple[int, int, int]:
    join_gloo(rank, port, 2)
    world = dist.group.WORLD
    result = (
        utils.all_reduce_int(world, 10 + rank),  # MIN
        utils.all_reduce_int(world, 10 + rank, dist.ReduceOp.MAX),
        utils.all_reduce_int(None, 7),  # no group: the value itself
    )
    dist.destroy_process_group()
    return result


def test_vllm_034_utils() -> None:
    assert run_ranks(_agree_on_int, 2, free_port(), timeout=60) == [(10, 11, 7)] * 2
    assert utils.sched_yield() is None
    utils.verify_group_size_divides_partition(256, 128)
    with pytest.raises(ValueError, match="input_size_per_partition=100 for layer 'q' is not"):
        utils.verify_group_size_divides_partition(100, 64, "q")
    base = torch.arange(12.0).reshape(3, 4)
    assert utils.is_weak_contiguous(base) and utils.is_weak_contiguous(base.t())
    assert not utils.is_weak_contiguous(base[:, :2])  # a slice: gaps in its storage


def _cpu_sums(rank: int, port: int, stateless_port: int) -> list:
    ps.init_distributed_environment(
        world_size=2,
        rank=rank,
        distributed_init_method=ps.get_distributed_init_method("127.0.0.1", port),
        backend="gloo",
    )
    ps.initialize_model_parallel(2, 1)
    tp = ps.get_tp_group()
    # in place, the same bits on every rank; a strided tensor through a copy
    summed = tp.cpu_all_reduce_(torch.full((4,), rank + 0.25))
    strided = torch.arange(8.0).reshape(2, 4).t()[1]  # (not contiguous)
    utils.cpu_all_reduce_(strided, tp.cpu_group)
    sibling = tp.make_sibling_device_group("sibling")
    assert sibling is not tp.device_group
    assert dist.get_process_group_ranks(sibling) == tp.ranks
    dist.all_reduce(ones := torch.ones(2), group=sibling)
    stateless = utils.stateless_init_torch_distributed_process_group(
        "127.0.0.1", stateless_port, rank, 2, "gloo"
    )
    alone = utils.cpu_all_reduce_(torch.tensor([rank + 1]), stateless, timedelta(seconds=30))
    _destroy()
    return [summed.tolist(), strided.tolist(), ones.tolist(), alone.tolist()]


def test_cpu_all_reduce_and_a_sibling_device_group() -> None:
    results = run_ranks(_cpu_sums, 2, free_port(), free_port(), timeout=120)
    assert results == [[[1.5] * 4, [2.0, 10.0], [2.0, 2.0], [3]]] * 2


def _gloo_timeouts(rank: int, port: int) -> tuple:
    ps.init_distributed_environment(
        world_size=2,
        rank=rank,
        distributed_init_method=ps.get_distributed_init_method("127.0.0.1", port),
        backend="gloo",
        timeout=timedelta(seconds=60),
    )
    timeouts = (
        utils.get_distributed_timeout_or_none(),
        utils.get_cpu_distributed_timeout_or_none(),
    )
    lone = dist.new_group([0, 1], backend="gloo")
    utils.set_gloo_backend_timeout(lone, timedelta(seconds=2))
    took = None
    if rank == 0:  # rank 1 never joins: gives up at the new 2 s, not the group's 60 s
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1), group=lone)
        took = time.monotonic() - start
    ps.get_world_group().barrier()
    _destroy()
    return timeouts, took


def test_vllm_034_timeouts_and_steady_state() -> None:
    assert utils.get_distributed_timeout_or_none() is None  # no distributed environment
    results = run_ranks(_gloo_timeouts, 2, free_port(), timeout=120)
    assert [timeouts for timeouts, _ in results] == [(timedelta(seconds=60),) * 2] * 2
    assert 1.5 < results[0][1] < 20, results
    assert not utils.steady_state_entered()
    utils.enter_steady_state()
    assert utils.steady_state_entered()
