"""The memory-bandwidth floor of a 4 MiB f32 all-reduce between 2 ranks on this machine.

In ``ShmCollectives`` (bridge_py/distributed/device_communicators/shm_collectives.py) each of
2 ranks, for a 4 MiB message: copies the half the other rank sums into the segment, sums
its own half (its input and the other's copy) into its result, copies that sum into the
segment, and copies the other's sum into its result: four 2 MiB passes, 18 MiB of reads
and writes. This script times exactly those passes in one process, one thread, with warm
caches and no other rank to wait for: no all-reduce of 2 ranks can take less on this
machine (both ranks do theirs at once, on their own cores). A plain 4 MiB copy is timed
beside it for the machine's copy bandwidth. Then the same all-reduce for real: 2 ranks,
``ShmCollectives.all_reduce`` back to back (no gloo between the calls to cool the caches,
as ``make bench`` has), and ``GroupCoordinator.all_reduce`` around it, median of 15
blocks of 20 calls, slowest rank.

    python bench/python/allreduce_bound.py

bench/README.md compares it with the ``make bench`` row of the all-reduce.
"""

from __future__ import annotations

import datetime
import os
import time
import timeit

import torch
from common import free_port, run_ranks  # this folder is on the path: a script
from report import cpu_model

N = 1 << 20  # 4 MiB of f32


def _rank(rank: int, port: int) -> dict[str, float]:
    """Milliseconds per call on this rank: the transport alone, and through the group."""
    import torch.distributed as dist

    from bridge_py.distributed.device_communicators.shm_collectives import _ROW_BYTES
    from bridge_py.distributed.parallel_state import GroupCoordinator

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    group = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="bound")
    shm = group.device_communicator.shm  # type: ignore[union-attr]
    assert shm is not None, "shared memory is off (VLLM_BRIDGE_CPU_SHM=0?)"
    data, result, row = torch.zeros(N), torch.empty(N), bytes(_ROW_BYTES)
    calls = {
        "ShmCollectives.all_reduce": lambda: shm.all_reduce(data, result, row, lambda rows: None),
        "GroupCoordinator.all_reduce": lambda: group.all_reduce(data),
    }
    times: dict[str, float] = {}
    for name, call in calls.items():
        blocks = []
        for _ in range(16):
            shm.exchange(row, lambda rows: None)  # start together
            start = time.perf_counter()
            for _ in range(20):
                call()
            blocks.append((time.perf_counter() - start) / 20 * 1e3)
        times[name] = sorted(blocks[1:])[7]  # the first block warms up
    return times


def main() -> None:
    torch.set_num_threads(1)
    source, result = torch.rand(N), torch.empty(N)
    mine, theirs = torch.empty(N), torch.rand(N)  # this rank's slot, the other rank's
    half = N // 2

    def one_rank() -> None:
        mine[half:].copy_(source[half:])  # the half the other rank sums
        torch.add(source[:half], theirs[:half], out=result[:half])  # this rank's half
        mine[:half].copy_(result[:half])  # its sum, for the other rank
        result[half:].copy_(theirs[half:])  # the other rank's sum

    def copy() -> None:
        mine.copy_(source)

    work = min(timeit.repeat(one_rank, number=50, repeat=7)) / 50
    plain = min(timeit.repeat(copy, number=50, repeat=7)) / 50
    rate = 2 * N * 4 / plain / (1 << 30)
    print(f"# {cpu_model()}, torch {torch.__version__}, 1 thread")
    print(f"one rank's memory passes of a 4 MiB all-reduce: {work * 1e3:.3f} ms")
    print(f"a 4 MiB copy: {plain * 1e3:.3f} ms ({rate:.0f} GiB/s read + write)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as bench/python/allreduce.py
    ranks = run_ranks(_rank, 2, free_port(), timeout=120)
    for name in ranks[0]:
        slowest = max(times[name] for times in ranks)
        print(f"{name}, 4 MiB f32, 2 ranks, back to back: {slowest:.3f} ms")


if __name__ == "__main__":
    main()
