"""stateless_init_torch_distributed_process_group: real collectives, no global state."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group

from bridge_py.distributed import (
    StoreError,
    stateless_destroy_torch_distributed_process_group,
    stateless_init_torch_distributed_process_group,
)
from tests.distributed.harness import free_port, run_ranks


def _collectives(rank: int, port: int, world_size: int) -> dict:
    pg = stateless_init_torch_distributed_process_group(
        "127.0.0.1", port, rank, world_size, backend="gloo", timeout=60
    )
    summed = torch.arange(4, dtype=torch.float64) * (rank + 1)
    pg.allreduce([summed]).wait()
    shared = torch.full((3,), float(rank))
    pg.broadcast(shared, 1).wait()  # group rank 1 is the root
    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
    pg.allgather([gathered], [torch.tensor([rank, rank * rank])]).wait()
    result = {
        "rank": pg.rank(),
        "size": pg.size(),
        "summed": summed.tolist(),
        "shared": shared.tolist(),
        "gathered": [t.tolist() for t in gathered],
        "initialized": dist.is_initialized(),
    }
    stateless_destroy_torch_distributed_process_group(pg)
    result["initialized_after"] = dist.is_initialized()
    return result


def test_gloo_collectives_without_global_state() -> None:
    world_size = 3
    results = run_ranks(_collectives, world_size, free_port(), world_size)
    total = sum(range(1, world_size + 1))
    for rank, result in enumerate(results):
        assert (result["rank"], result["size"]) == (rank, world_size)
        assert result["summed"] == [float(i * total) for i in range(4)]
        assert result["shared"] == [1.0] * 3
        assert result["gathered"] == [[r, r * r] for r in range(world_size)]
        assert result["initialized"] is False
        assert result["initialized_after"] is False


def _named_with_store(rank: int, port: int) -> dict:
    pg, store = stateless_init_torch_distributed_process_group(
        "127.0.0.1", port, rank, 2, "gloo", "side", True, timeout=60
    )
    result = {"name": pg.group_name, "found": _resolve_process_group("side") is pg}
    with pytest.raises(ValueError, match="'side' exists in this process already"):
        stateless_init_torch_distributed_process_group("127.0.0.1", 0, 0, 1, "gloo", pg.group_name)
    summed = torch.ones(2) * (rank + 1)
    pg.allreduce([summed]).wait()
    store.set(f"from/{rank}", str(rank))  # the caller's own keys, beside the group's
    result["peer"] = store.get(f"from/{1 - rank}").decode()
    result["summed"] = summed.tolist()
    pg.barrier().wait()  # rank 0 serves the store: the peer has read its key
    stateless_destroy_torch_distributed_process_group(pg)
    with pytest.raises(RuntimeError, match="Could not resolve"):
        _resolve_process_group("side")
    return result


def test_group_name_and_return_store() -> None:
    results = run_ranks(_named_with_store, 2, free_port())
    for rank, result in enumerate(results):
        assert result == {
            "name": "side",
            "found": True,
            "peer": str(1 - rank),
            "summed": [3.0, 3.0],
        }


def test_port_in_use_is_reported_like_create() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(StoreError, match=f"127.0.0.1:{port} is already in use"):
            stateless_init_torch_distributed_process_group("127.0.0.1", port, 0, 2, timeout=1)


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError):
        stateless_init_torch_distributed_process_group("127.0.0.1", 0, 0, 1, backend="carrier")


def _nccl_single_rank() -> list[float]:
    pg = stateless_init_torch_distributed_process_group(
        "127.0.0.1", 0, 0, 1, backend="nccl", timeout=60
    )
    tensor = torch.ones(4, device="cuda")
    pg.allreduce([tensor]).wait()
    torch.cuda.synchronize()
    stateless_destroy_torch_distributed_process_group(pg)
    return tensor.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nccl needs CUDA")
def test_nccl_single_rank_group() -> None:
    assert _nccl_single_rank() == [1.0] * 4
