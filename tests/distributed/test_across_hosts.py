"""StatelessProcessGroup across two hosts (namespaces the test makes: ``tests.hosts``)."""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge_py import deadline
from bridge_py.distributed import StatelessProcessGroup
from bridge_py.distributed.store.watchdog import GRACE
from tests.distributed.harness import free_port
from tests.hosts import Host, Process, hosts

pytestmark = pytest.mark.timeout(170)


def _four_ranks(
    a: Host, b: Host, target: Callable[..., Any], *args: Any, interface: bool = False
) -> list[Process]:
    """Ranks 0 and 1 on host ``a``, 2 and 3 on ``b``, each running ``target(a.address,
    port, rank, [its host's interface,] *args)``: a group whose store rank 0 serves on a
    fresh port of ``a``'s address on the link."""
    port = free_port()
    ranks = []
    for rank in range(4):
        host = a if rank < 2 else b
        own = (host.interface,) if interface else ()
        ranks.append(host.start(target, a.address, port, rank, *own, *args))
    return ranks


def _every_operation(address: str, port: int, rank: int, wire: str) -> dict[str, Any]:
    group = StatelessProcessGroup.create(address, port, rank, 4, store_timeout=60, wire=wire)
    for src in range(4):
        assert group.broadcast_obj({"from": src} if rank == src else None, src) == {"from": src}
    assert group.all_gather_obj(rank * 10) == [0, 10, 20, 30]
    group.send_obj(f"to {(rank + 1) % 4}", dst=(rank + 1) % 4)
    assert group.recv_obj((rank - 1) % 4) == f"to {rank}"
    big = torch.full((1024, 1024), float(rank), dtype=torch.float32)  # 4 MiB
    for src in (0, 3):
        got = group.broadcast(big.clone() if rank == src else torch.empty_like(big), src)
        assert torch.equal(got, torch.full_like(big, float(src)))
    assert torch.equal(group.all_reduce(torch.ones(3) * rank), torch.full((3,), 6.0))
    group.barrier(timeout=30)
    local = group._store_transport.local if wire == "bridge" else None
    group.barrier(timeout=30)
    return {"host": socket.gethostname(), "local": local}


@pytest.mark.parametrize("wire", ["bridge", "vllm"])
def test_four_ranks_on_two_hosts_run_every_operation(wire: str) -> None:
    with hosts(2) as (a, b):
        ranks = _four_ranks(a, b, _every_operation, wire)
        results = [rank.result(120) for rank in ranks]
    assert [r["host"] for r in results] == ["host0", "host0", "host1", "host1"]
    if wire == "bridge":  # shared memory between the ranks of one host only
        assert [r["local"] for r in results] == [
            [True, True, False, False],
            [True, True, False, False],
            [False, False, True, True],
            [False, False, True, True],
        ]


def _until_failure(address: str, port: int, rank: int, ready: str, op: str) -> dict[str, Any]:
    """Run ``op`` over and over (within 5 s each) until it fails."""
    wire = "vllm" if op.endswith("(vllm wire)") else "bridge"
    group = StatelessProcessGroup.create(address, port, rank, 4, store_timeout=20, wire=wire)
    done, last = 0, time.monotonic()
    try:
        while True:
            if op.startswith("barrier"):
                group.barrier(timeout=5)
            else:
                with deadline.until(time.monotonic() + 5):  # its timeout is the caller's
                    group.all_gather_obj(rank)
            done, last = done + 1, time.monotonic()
            if done == 3:
                Path(f"{ready}.{rank}").touch()
    except Exception as exc:
        return {"done": done, "after": time.monotonic() - last, "error": repr(exc)}


def _when_all(paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, [p.name for p in paths if not p.exists()]
        time.sleep(0.05)


@pytest.mark.parametrize("op", ["barrier", "all_gather_obj", "barrier (vllm wire)"])
def test_a_link_cut_fails_every_rank_within_the_timeout(tmp_path: Path, op: str) -> None:
    ready = str(tmp_path / "ready")
    with hosts(2) as (a, b):
        ranks = _four_ranks(a, b, _until_failure, ready, op)
        _when_all([Path(f"{ready}.{rank}") for rank in range(4)], 60)
        a.set_link(False)
        results = [rank.result(60) for rank in ranks]
        left = a.leftovers() + b.leftovers()  # every rank exited, its shared memory gone
    assert left == [], left
    for rank, result in enumerate(results):  # each within its timeout and the grace
        assert result["done"] >= 3, result
        assert result["after"] < 5 + GRACE + 3, (rank, result)
    for result in results[2:]:  # the side that cannot see the store says why
        assert "it stopped answering" in result["error"], result


def test_the_store_host_vanishing_fails_the_other_hosts_ranks_within_the_timeout(
    tmp_path: Path,
) -> None:
    ready = str(tmp_path / "ready")
    with hosts(2) as (a, b):
        ranks = _four_ranks(a, b, _until_failure, ready, "barrier")
        _when_all([Path(f"{ready}.{rank}") for rank in range(4)], 60)
        a.remove()  # ranks 0 and 1, the store with them, and the link: gone
        results = [rank.result(60) for rank in ranks[2:]]
        left = b.leftovers()
    assert left == [], left
    for result in results:
        assert result["done"] >= 3 and result["after"] < 5 + GRACE + 3, result
        assert "Barrier" in result["error"], result


def _world(address: str, port: int, rank: int, interface: str, timeout: timedelta | None) -> Any:
    """``parallel_state`` with the world group of 4 ranks over gloo across the two hosts
    (gloo's own addresses on the link: ``GLOO_SOCKET_IFNAME``)."""
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    from bridge_py.distributed import parallel_state as ps

    ps.init_distributed_environment(
        world_size=4,
        rank=rank,
        distributed_init_method=f"tcp://{address}:{port}",
        local_rank=rank % 2,
        backend="gloo",
        timeout=timeout,
    )
    return ps


def _broadcast_until_failure(
    address: str, port: int, rank: int, interface: str, ready: str
) -> dict[str, Any]:
    """64 MiB broadcasts from rank 0 on the world group (gloo, across the two hosts),
    made with a 5 s timeout, over and over until one fails."""
    ps = _world(address, port, rank, interface, timedelta(seconds=5))
    tensor = torch.full((16 << 20,), float(rank))  # 64 MiB
    done, last = 0, time.monotonic()
    try:
        while True:
            ps.get_world_group().broadcast(tensor, src=0)
            assert tensor[-1].item() == 0.0
            done, last = done + 1, time.monotonic()
            if done == 2:
                Path(f"{ready}.{rank}").touch()
    except Exception as exc:
        return {"done": done, "after": time.monotonic() - last, "error": repr(exc)}


def test_a_link_cut_fails_a_64_mib_gloo_broadcast_within_the_group_timeout(
    tmp_path: Path,
) -> None:
    ready = str(tmp_path / "ready")
    with hosts(2) as (a, b):
        ranks = _four_ranks(a, b, _broadcast_until_failure, ready, interface=True)
        _when_all([Path(f"{ready}.{rank}") for rank in range(4)], 90)
        a.set_link(False)
        # Each rank returns, and its process exits: gloo's thread gave up at the group's
        # timeout too (torch's new_group would have given it 30 minutes).
        results = [rank.result(60) for rank in ranks]
        left = a.leftovers() + b.leftovers()
    assert left == [], left
    for rank, result in enumerate(results):
        assert result["done"] >= 2 and result["after"] < 5 + 5, (rank, result)
        assert "CollectiveTimeout" in result["error"], result
        # The cut may come in the broadcast or in the argument check before it.
        assert re.search(rf"broadcast( \(its argument check\))? on rank {rank}", result["error"])


def _coordinator(address: str, port: int, rank: int, interface: str) -> dict[str, Any]:
    """The world group over gloo across the two hosts, and a MessageQueue whose readers
    are on both (rank 1 beside the writer, ranks 2 and 3 on the other host)."""
    ps = _world(address, port, rank, interface, None)
    world = ps.get_world_group()
    total = world.all_reduce(torch.ones(2) * rank)
    gathered = world.all_gather(torch.tensor([float(rank)]), dim=0)
    sent = world.broadcast(torch.full((3,), float(rank)), src=3)
    same = ps.in_the_same_node_as(world.cpu_group, source_rank=0)
    nodes = ps._node_count(world.cpu_group)
    queue = world.create_mq_broadcaster(writer_rank=0)
    got = queue.broadcast_object({"step": 7} if rank == 0 else None)
    if rank == 0:
        queue.enqueue(["to", "all"])
        dequeued = None
    else:
        dequeued = queue.dequeue(timeout=30)
    remote = queue.n_remote_reader if rank == 0 else None
    world.barrier()
    ps.destroy_distributed_environment()
    return {
        "sums": [total.tolist(), gathered.tolist(), sent.tolist()],
        "same": same,
        "nodes": nodes,
        "queue": [got, dequeued, remote],
    }


def test_the_world_group_and_a_message_queue_span_two_hosts() -> None:
    with hosts(2) as (a, b):
        ranks = _four_ranks(a, b, _coordinator, interface=True)
        results = [rank.result(120) for rank in ranks]
    for rank, result in enumerate(results):
        assert result["sums"] == [[6.0, 6.0], [0.0, 1.0, 2.0, 3.0], [3.0, 3.0, 3.0]], result
        assert result["same"] == [True, True, False, False], (rank, result)
        assert result["nodes"] == 2, result
        got, dequeued, _ = result["queue"]
        assert got == {"step": 7} and dequeued == (None if rank == 0 else ["to", "all"])
    assert results[0]["queue"][2] == 2  # ranks 2 and 3 read over TCP


def _dequeue_until_failure(address: str, port: int, rank: int, ready: str) -> dict[str, Any]:
    """A queue written by rank 0 (host 0), read by ranks 1 (beside it), 2 and 3 (host 1);
    the writer sends a message a second, the readers dequeue (5 s each) until one fails."""
    from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue

    group = StatelessProcessGroup.create(address, port, rank, 4, store_timeout=20)
    queue = MessageQueue.create_from_process_group(group, 1 << 20, 4, writer_rank=0)
    done, last = 0, time.monotonic()
    try:
        while True:
            if rank == 0:
                queue.enqueue(done, timeout=5)
                time.sleep(0.2)
            else:
                assert queue.dequeue(timeout=5) == done
            done, last = done + 1, time.monotonic()
            if done == 3:
                Path(f"{ready}.{rank}").touch()
            if rank == 0 and done == 60:  # the writer stops; its readers wait
                time.sleep(30)
                return {"done": done, "after": 0.0, "error": ""}
    except Exception as exc:
        return {"done": done, "after": time.monotonic() - last, "error": repr(exc)}


def test_a_link_cut_fails_a_remote_readers_dequeue_within_its_timeout(tmp_path: Path) -> None:
    ready = str(tmp_path / "ready")
    with hosts(2) as (a, b):
        ranks = _four_ranks(a, b, _dequeue_until_failure, ready)
        _when_all([Path(f"{ready}.{rank}") for rank in range(4)], 60)
        a.set_link(False)
        results = [rank.result(60) for rank in ranks[2:]]
        left = b.leftovers()
    assert left == [], left
    for result in results:  # the readers across the cut: within the timeout and a bound
        assert result["done"] >= 3 and result["after"] < 5 + GRACE + 3, result
        assert "Timeout" in result["error"] or "Gone" in result["error"], result
