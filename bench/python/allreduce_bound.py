"""The memory-bandwidth floor of a 4 MiB f32 all-reduce between 2 ranks on this machine.

In ``ShmCollectives`` (bridge_py/distributed/device_communicators/shm_allreduce.py) each of
2 ranks, for a 4 MiB message: copies the half the other rank sums into the segment, sums
its own half (its input and the other's copy) into its result, copies that sum into the
segment, and copies the other's sum into its result: four 2 MiB passes, 18 MiB of reads
and writes. This script times exactly those passes in one process, one thread, with warm
caches and no other rank to wait for: no all-reduce of 2 ranks can take less on this
machine (both ranks do theirs at once, on their own cores). A plain 4 MiB copy is timed
beside it for the machine's copy bandwidth.

    python bench/python/allreduce_bound.py

bench/README.md compares it with the ``make bench`` row of the all-reduce.
"""

from __future__ import annotations

import timeit

import torch
from report import cpu_model  # this folder is on the path when run as a script

N = 1 << 20  # 4 MiB of f32


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


if __name__ == "__main__":
    main()
