"""Weight sync on CPU: PyNcclCommunicator broadcasts against plain gloo broadcasts.

One trainer rank broadcasts a state dict (100 float32 tensors, 200 MiB) to 3 inference
ranks, tensor by tensor, then the group meets at a barrier, as TRL and TorchRL sync weights
into vLLM. Ours: `PyNcclCommunicator(StatelessProcessGroup.create(...), device="cpu")`,
`comm.broadcast` per tensor and `comm.group.barrier()` (shared memory when the ranks share a
machine). Peer: torch's `ProcessGroupGloo` made from a TCPStore, `broadcast` per tensor and
its `barrier`. Both in the same four processes over the same tensors, in alternating order,
each sync after a barrier, timed at the slowest rank; medians over rounds. The trainer
writes new values before every sync and the receivers check every tensor afterwards. The
ranks run with one torch thread each, then (not with ``--quick``) with as many as there
are CPUs, torch's default when nothing sets ``OMP_NUM_THREADS``.

    python bench/python/weight_sync.py [--quick]
"""

from __future__ import annotations

import datetime
import os
import time

from common import (
    emit,
    free_port,
    median,
    parse_args,
    run_ranks,
    thread_counts,
    threads_label,
    time_row,
)

BENCH = "weight_sync"
WORLD = 4  # 1 trainer + 3 inference ranks


def _rank(
    rank: int, spg_port: int, gloo_port: int, rounds: int, count: int, numel: int, threads: int
) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore

    torch.set_num_threads(threads)

    from bridge_py.distributed import StatelessProcessGroup
    from bridge_py.distributed.device_communicators.pynccl import PyNcclCommunicator

    timeout = datetime.timedelta(seconds=120)
    pg = StatelessProcessGroup.create("127.0.0.1", spg_port, rank, WORLD, store_timeout=120)
    comm = PyNcclCommunicator(pg, device="cpu")
    store = TCPStore("127.0.0.1", gloo_port, WORLD, rank == 0, timeout=timeout)
    gloo = dist.ProcessGroupGloo(PrefixStore("peer/", store), rank, WORLD, timeout)
    state = {f"layer{i}.weight": torch.zeros(numel) for i in range(count)}

    def ours() -> None:
        for tensor in state.values():
            comm.broadcast(tensor, src=0)
        comm.group.barrier()

    def peer() -> None:
        for tensor in state.values():
            gloo.broadcast([tensor]).wait()  # root 0 by default
        gloo.barrier().wait()

    times: dict[str, list[float]] = {"ours": [], "peer": []}
    for r in range(rounds):
        sides = [("ours", ours), ("peer", peer)]
        for step, (side, sync) in enumerate(sides if r % 2 == 0 else sides[::-1]):
            value = float(2 * r + step + 1)
            if rank == 0:
                for i, tensor in enumerate(state.values()):
                    tensor.fill_(value + i)
            gloo.barrier().wait()
            t0 = time.perf_counter()
            sync()
            times[side].append(time.perf_counter() - t0)
            for i, tensor in enumerate(state.values()):  # wrong results fail the benchmark
                if not bool((tensor == value + i).all()):
                    raise AssertionError(f"rank {rank}: {side} round {r} tensor {i} is wrong")
    transport = "shared memory" if comm._shm is not None else "gloo"
    gloo.barrier().wait()
    comm.destroy()
    return {"times": times, "transport": transport}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rounds, count, numel = (2, 4, 4096) if args.quick else (9, 100, 512 * 1024)
    size = count * numel * 4
    label = f"{size / 2**20:g} MiB" if size >= 2**20 else f"{size / 2**10:g} KiB"
    rows = []
    rates = []
    for threads in thread_counts()[:1] if args.quick else thread_counts():
        results = run_ranks(
            _rank, WORLD, free_port(), free_port(), rounds, count, numel, threads,
            timeout=90 if args.quick else 600,
        )  # fmt: skip
        per = {
            side: [max(ts) for ts in zip(*(r["times"][side] for r in results), strict=True)]
            for side in ("ours", "peer")
        }
        ours, peer = median(per["ours"]), median(per["peer"])
        what = (
            f"PyNcclCommunicator weight sync, {label} in {count} f32 tensors, 1 -> {WORLD - 1} "
            f"ranks + barrier (via {results[0]['transport']}){threads_label(threads)}"
        )
        rows.append(time_row(BENCH, what, ours, peer, "gloo broadcasts", faster_by=2.0))
        rates.append(f"{size / ours / 2**30:.2f} GiB/s vs {size / peer / 2**30:.2f} GiB/s")
    emit(f"Weight sync on CPU vs gloo (slowest rank, median per sync: {'; '.join(rates)})", rows)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # each rank sets its own count
    main()
