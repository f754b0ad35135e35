"""vLLM 0.34's parallel_state functions beside the groups: the collectives by group name
and their fakes, the fan-out to every group's device communicator, the teardown
cleanup_dist_env_and_memory, and utils' get_worker_rank_suffix and init_gloo_process_group.
Real gloo processes, 2 ranks."""

from __future__ import annotations

import datetime
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from bridge_py.distributed import parallel_state as ps
from bridge_py.distributed.device_communicators.cpu_communicator import CpuCommunicator
from bridge_py.distributed.utils import get_worker_rank_suffix, init_gloo_process_group
from tests.distributed.harness import free_port, run_ranks


def _init(rank: int, port: int) -> None:
    method = ps.get_distributed_init_method("127.0.0.1", port)
    ps.init_distributed_environment(2, rank, method, backend="gloo")


def _by_name(rank: int, name: str) -> None:
    """The collectives find the group by its unique name; the fakes give their shapes."""
    summed = ps.all_reduce(torch.tensor([rank + 1.0, 10.0]), name)
    assert torch.equal(summed, torch.tensor([3.0, 20.0]))
    assert ps.all_reduce_fake(torch.ones(2, 3, dtype=torch.int8), name).shape == (2, 3)

    mine = torch.full((2, 3), float(rank))
    gathered = ps.all_gather(mine, 0, 2, name)
    assert torch.equal(gathered, torch.cat([torch.zeros(2, 3), torch.ones(2, 3)]))
    fake = ps.all_gather_fake(mine, 0, 2, name)
    assert (fake.shape, fake.dtype) == (gathered.shape, gathered.dtype)
    assert ps.all_gather_fake(mine, -1, 2, name).shape == (2, 6)

    scattered = ps.reduce_scatter(torch.arange(8.0).reshape(4, 2) * (rank + 1), 0, 2, name)
    assert torch.equal(scattered, torch.arange(8.0).reshape(4, 2)[2 * rank : 2 * rank + 2] * 3)
    fake = ps.reduce_scatter_fake(torch.empty(4, 2), 0, 2, name)
    assert (fake.shape, fake.dtype) == (scattered.shape, scattered.dtype)

    with pytest.raises(ValueError, match="'nope:0' names no group"):
        ps.all_reduce(torch.ones(1), "nope:0")
    with pytest.raises(TypeError, match="group_name must be a str"):
        ps.all_reduce(torch.ones(1), 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size is 3, but group"):
        ps.all_gather(mine, 0, 3, name)  # (on both ranks: nothing was sent)
    with pytest.raises(ValueError, match="world_size 2 does not divide dimension 0"):
        ps.reduce_scatter_fake(torch.empty(3, 2), 0, 2, name)
    with pytest.raises(ValueError, match="dim 2 is not a dimension"):
        ps.all_gather_fake(mine, 2, 2, name)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        ps.all_gather_fake(mine, 0, 0, name)


class Recording(CpuCommunicator):
    """A device communicator (as a platform may plug in) whose memory hooks record their
    calls and run a collective, so a rank that skipped one would leave the other waiting."""

    calls: list[tuple[str, float]]

    def _record(self, hook: str) -> None:
        self.calls.append((hook, self.all_reduce(torch.ones(1)).item()))

    def suspend(self) -> None:
        self._record("suspend")

    def resume(self) -> None:
        self._record("resume")

    def checkpoint_prepare(self) -> None:
        self._record("checkpoint_prepare")

    def checkpoint_restore(self) -> None:
        self._record("checkpoint_restore")


def _recording(group: ps.GroupCoordinator) -> Recording:
    comm = Recording(group.cpu_group, group.device, group.device_group, group.unique_name)
    comm.calls = []
    group.device_communicator = comm
    return comm


def _device_comms() -> None:
    """Every live group's device communicator gets each hook once; a destroyed group and
    one without a communicator (the world group) are passed over."""
    tp = _recording(ps.get_tp_group())
    gone_group = ps.init_model_parallel_group([[0, 1]], dist.get_rank(), "gloo", group_name="x")
    gone = _recording(gone_group)
    gone_group.destroy()
    assert ps.get_world_group().device_communicator is None
    ps.suspend_device_comms()
    ps.resume_device_comms()
    ps.checkpoint_prepare_distributed_state()
    ps.checkpoint_restore_distributed_state()
    hooks = ["suspend", "resume", "checkpoint_prepare", "checkpoint_restore"]
    assert tp.calls == [(hook, 2.0) for hook in hooks]
    assert gone.calls == []
    with pytest.raises(ValueError, match="names a group that was destroyed"):
        ps.all_reduce(torch.ones(1), gone_group.unique_name)


def _extras(rank: int, port: int, port2: int) -> str:
    assert get_worker_rank_suffix() == "" and get_worker_rank_suffix(7) == "rank7"
    _init(rank, port)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp = ps.get_tp_group()
    assert get_worker_rank_suffix() == f"dp0_pp0_tp{rank}_dcp0_ep{rank}"
    assert get_worker_rank_suffix(rank + 4) == f"dp0_pp0_tp{rank}_dcp0_ep{rank}_rank{rank + 4}"
    with pytest.raises(ValueError, match="global_rank must not be negative"):
        get_worker_rank_suffix(-1)
    _by_name(rank, tp.unique_name)
    _device_comms()

    name = tp.unique_name
    ps.cleanup_dist_env_and_memory()
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()
    with pytest.raises(ValueError, match="names a group that was destroyed"):
        ps.all_reduce(torch.ones(1), name)
    assert get_worker_rank_suffix(rank) == f"rank{rank}"

    # The process initializes again; a Ray it imported itself is shut down.
    _init(rank, port2)
    assert ps.all_reduce(torch.ones(1), ps.get_world_group().unique_name).item() == 2.0
    with pytest.raises(TypeError, match="shutdown_ray must be a bool"):
        ps.cleanup_dist_env_and_memory("yes")  # type: ignore[arg-type]
    assert dist.is_initialized()  # (refused before anything was torn down)
    shutdowns: list[bool] = []
    ray = types.ModuleType("ray")
    ray.shutdown = lambda: shutdowns.append(True)  # type: ignore[attr-defined]
    sys.modules["ray"] = ray
    ps.cleanup_dist_env_and_memory(shutdown_ray=True)
    assert shutdowns == [True] and not dist.is_initialized()
    return "ok"


def test_parallel_state_extras() -> None:
    assert run_ranks(_extras, 2, free_port(), free_port(), timeout=90) == ["ok"] * 2


def _gloo_group(rank: int, port: int) -> float:
    store = TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(30))
    timeout = datetime.timedelta(seconds=30)
    with pytest.raises(ValueError, match=r"group_rank must be in \[0, 2\), got 2"):
        init_gloo_process_group(PrefixStore("bad", store), 2, 2, timeout)
    with pytest.raises(TypeError, match=r"timeout must be a datetime\.timedelta"):
        init_gloo_process_group(PrefixStore("bad", store), rank, 2, 30)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prefix_store must be a torch Store"):
        init_gloo_process_group("store", rank, 2, timeout)  # type: ignore[arg-type]
    pg = init_gloo_process_group(PrefixStore("g", store), rank, 2, timeout)
    assert (pg.rank(), pg.size()) == (rank, 2) and not dist.is_initialized()
    tensor = torch.tensor([rank + 1.5])
    pg.allreduce([tensor]).wait()
    return tensor.item()


def test_init_gloo_process_group() -> None:
    assert run_ranks(_gloo_group, 2, free_port(), timeout=60) == [4.0, 4.0]
