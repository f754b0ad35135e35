"""MessageQueue broadcast of a small object to 2 readers, against gloo broadcast_object_list.

Three processes (a writer and two local readers) hold both a MessageQueue made with
``create_from_process_group`` over a StatelessProcessGroup (ours) and a gloo group (peer).
Each round times a block of broadcasts of each, in alternating order, after a gloo
barrier, at the slowest rank; medians over rounds. Every received object is checked.

    python bench/python/mq.py [--quick]
"""

from __future__ import annotations

import datetime
import os
import time

from common import emit, free_port, median, parse_args, run_ranks, time_row

BENCH = "mq"
SMALL = {"step": 1, "ids": list(range(10)), "name": "small"}


def _rank(rank: int, ws: int, ports: tuple[int, int], rounds: int, reps: int) -> dict:
    import torch.distributed as dist

    from bridge_py.distributed import StatelessProcessGroup
    from bridge_py.distributed.device_communicators.shm_broadcast import MessageQueue

    gloo_port, spg_port = ports
    # Our store first: gloo's connections take ephemeral ports, which could be spg_port.
    pg = StatelessProcessGroup.create("127.0.0.1", spg_port, rank, ws, store_timeout=120)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=ws,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    mq = MessageQueue.create_from_process_group(pg, 1 << 20, 10, writer_rank=0)
    if rank != 0 and not mq._is_local_reader:
        raise AssertionError(f"rank {rank} is not a local (shared-memory) reader")

    def ours() -> object:
        return mq.broadcast_object(SMALL if rank == 0 else None)

    def peer() -> object:
        box = [SMALL if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    times: dict[str, list[float]] = {"ours": [], "peer": []}
    for r in range(rounds):
        sides = [("ours", ours), ("peer", peer)]
        for side, fn in sides if r % 2 == 0 else sides[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            got = [fn() for _ in range(reps)]
            times[side].append((time.perf_counter() - t0) / reps)
            if got != [SMALL] * reps:  # wrong results fail the benchmark
                raise AssertionError(f"rank {rank}: {side} broadcast delivered a wrong object")
    dist.barrier()
    mq.close()
    return times


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rounds, reps = (2, 3) if args.quick else (15, 200)
    ws = 3
    ports = (free_port(), free_port())
    results = run_ranks(_rank, ws, ws, ports, rounds, reps, timeout=90 if args.quick else 300)
    ours, peer = (
        median([max(ts) for ts in zip(*(r[side] for r in results), strict=True)])
        for side in ("ours", "peer")
    )
    what = "MessageQueue.broadcast_object small, 1 writer + 2 readers"
    rows = [time_row(BENCH, what, ours, peer, "gloo broadcast_object_list", faster_by=10.0)]
    emit("MessageQueue vs gloo (slowest rank, median per broadcast)", rows)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
