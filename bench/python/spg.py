"""StatelessProcessGroup object collectives against torch.distributed gloo, real processes.

For 2 and 4 ranks, every rank joins three things at once: a StatelessProcessGroup (ours),
a gloo group from ``init_process_group`` (peer) and a bare TCPStore (one set+get round trip
per rank: the issue's yardstick for small objects). The hardware floor of a message between
two processes of one machine is measured too: a one-byte round trip between partner ranks
over a Unix datagram socket (a kernel copy and a wake-up each way, nothing else). Each
round times a block of ``reps`` calls of every op, ours and the peer in alternating order,
after a gloo barrier and one untimed call of the same op (which lines the ranks up: they
leave gloo's barrier up to milliseconds apart, which the set+get, a call of each rank
alone, never waits for); a block's time is that of the slowest rank, and each row is the
median over rounds.

    python bench/python/spg.py [--quick]
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from common import emit, free_port, median, parse_args, run_ranks, time_row

BENCH = "spg"
SMALL = {"step": 1, "ids": list(range(10)), "name": "small"}
BIG_BYTES = 4 * 1024 * 1024


def _big(rank: int) -> bytes:
    return bytes([rank + 1]) * BIG_BYTES


def _address(port: int, rank: int) -> str:
    """The abstract Unix socket name of ``rank``'s end of the floor's ping-pong."""
    return f"\0vllm-bridge-bench-{port}-{rank}"


def _ops(
    rank: int, ws: int, pg: Any, store: Any, sock: socket.socket, port: int
) -> dict[str, tuple[Callable, Callable, Any]]:
    """name -> (ours, peer, expected result); each callable runs one operation."""
    import torch.distributed as dist

    partner = rank ^ 1  # pairs (0, 1), (2, 3)
    there = _address(port, partner)

    def floor_rt() -> bytes:
        if rank % 2 == 0:
            sock.sendto(b"x", there)
            return sock.recv(1)
        got = sock.recv(1)
        sock.sendto(got, there)
        return got

    def gloo_bcast(obj: Any) -> Any:
        box = [obj if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gloo_gather(obj: Any) -> list:
        out: list = [None] * ws
        dist.all_gather_object(out, obj)
        return out

    def gloo_sendrecv(obj: Any) -> Any:
        box = [None]
        if rank % 2 == 0:
            dist.send_object_list([obj], dst=partner)
            dist.recv_object_list(box, src=partner)
        else:
            dist.recv_object_list(box, src=partner)
            dist.send_object_list([box[0]], dst=partner)
        return box[0]

    def spg_sendrecv(obj: Any) -> Any:
        if rank % 2 == 0:
            pg.send_obj(obj, partner)
            return pg.recv_obj(partner)
        got = pg.recv_obj(partner)
        pg.send_obj(got, partner)
        return got

    def store_rt() -> bytes:
        store.set(f"bench/{rank}", b"x")
        return store.get(f"bench/{rank}")

    ops: dict[str, tuple[Callable, Callable, Any]] = {}
    for label, obj_of in (("small", lambda r: SMALL), ("4 MiB", _big)):
        mine = obj_of(rank)
        ops[f"broadcast {label}"] = (
            lambda o=mine: pg.broadcast_obj(o if rank == 0 else None, 0),
            lambda o=mine: gloo_bcast(o),
            obj_of(0),
        )
        ops[f"all_gather {label}"] = (
            lambda o=mine: pg.all_gather_obj(o),
            lambda o=mine: gloo_gather(o),
            [obj_of(r) for r in range(ws)],
        )
        # The even rank's object goes out and comes back.
        ops[f"send/recv round trip {label}"] = (
            lambda o=mine: spg_sendrecv(o),
            lambda o=mine: gloo_sendrecv(o),
            obj_of(rank - rank % 2),
        )
    ops["barrier"] = (lambda: pg.barrier(30.0), lambda: dist.barrier(), None)
    ops["tcpstore set+get"] = (store_rt, store_rt, b"x")
    ops["floor"] = (floor_rt, floor_rt, b"x")
    return ops


def _rank(rank: int, ws: int, ports: tuple[int, int, int], rounds: int, reps: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from bridge_py.distributed import StatelessProcessGroup

    gloo_port, spg_port, store_port = ports
    timeout = datetime.timedelta(seconds=120)
    # The stores first: gloo's connections take ephemeral ports, which could be theirs.
    pg = StatelessProcessGroup.create("127.0.0.1", spg_port, rank, ws, store_timeout=120)
    store = TCPStore("127.0.0.1", store_port, ws, rank == 0, timeout=timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(_address(store_port, rank))  # bound before the rendezvous below
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=ws,
        timeout=timeout,
    )  # fmt: skip
    ops = _ops(rank, ws, pg, store, sock, store_port)

    # Wrong results fail the benchmark: check every op of both sides once, untimed.
    for name, (ours, peer, expected) in ops.items():
        for side, fn in (("ours", ours), ("peer", peer)):
            got = fn()
            if got != expected:
                raise AssertionError(f"rank {rank}: {side} {name} returned a wrong result")

    times: dict[str, dict[str, list[float]]] = {n: {"ours": [], "peer": []} for n in ops}
    for r in range(rounds):
        for name, (ours, peer, _) in ops.items():
            n = reps["big"] if "4 MiB" in name else reps["small"]
            sides = [("ours", ours), ("peer", peer)]
            for side, fn in sides if r % 2 == 0 else sides[::-1]:
                dist.barrier()
                # One op untimed: the ranks leave gloo's barrier up to milliseconds apart, and
                # a collective's first op would wait that out on the ranks that left first.
                fn()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                times[name][side].append((time.perf_counter() - t0) / n)
    dist.barrier()
    dist.destroy_process_group()
    sock.close()
    return times


def _slowest(results: list[dict], name: str, side: str) -> float:
    """Median over rounds of the slowest rank's time."""
    per_round = zip(*(r[name][side] for r in results), strict=True)
    return median([max(ts) for ts in per_round])


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rounds = 1 if args.quick else 15
    reps = {"small": 2, "big": 1} if args.quick else {"small": 20, "big": 3}
    rows = []
    for ws in (2, 4):
        ports = (free_port(), free_port(), free_port())
        results = run_ranks(_rank, ws, ws, ports, rounds, reps, timeout=90 if args.quick else 400)
        store_rt = _slowest(results, "tcpstore set+get", "ours")
        floor = _slowest(results, "floor", "ours")
        for name in results[0]:
            if name in ("tcpstore set+get", "floor"):
                continue
            ours, gloo = _slowest(results, name, "ours"), _slowest(results, name, "peer")
            what = f"{name}, {ws} ranks"
            if name == "barrier":
                rows.append(time_row(BENCH, what, ours, gloo, "gloo", at_most=1.0))
            elif name == "broadcast 4 MiB":
                rows.append(time_row(BENCH, what, ours, gloo, "gloo", faster_by=2.0))
            else:
                rows.append(time_row(BENCH, what, ours, gloo, "gloo"))
            if "small" in name or name == "barrier":
                rows.append(time_row(BENCH, what, ours, store_rt, "TCPStore set+get", at_most=0.5))
                rows.append(time_row(BENCH, what, ours, floor, "Unix socket round trip"))
        rows.append(time_row(BENCH, f"TCPStore set+get, {ws} ranks", store_rt, store_rt, "itself"))
        rows.append(
            time_row(
                BENCH, f"Unix socket round trip (the floor), {ws} ranks", floor, floor, "itself"
            )
        )
    emit("StatelessProcessGroup vs gloo (slowest rank, median per op)", rows)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
