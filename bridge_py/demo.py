"""A tour of bridge_py.distributed in one command: ``python -m bridge_py.demo``.

It spawns three local processes (``multiprocessing``, ``spawn``), one rank each, and
runs, printing each step with its time (the slowest rank's) and checking its result:

1. a ``StatelessProcessGroup`` formed over a TCPStore on 127.0.0.1;
2. ``broadcast_obj`` from rank 0, ``all_gather_obj``, and ``send_obj``/``recv_obj`` of a
   tensor around the ring (rank r sends to r+1);
3. ``init_distributed_environment`` (gloo) on every rank, then
   ``get_world_group().all_reduce`` of a tensor, checked against the sum;
4. a shared-memory ``MessageQueue`` made by ``create_mq_broadcaster`` on the world group,
   rank 0 broadcasting three objects to the others;
5. a weight sync as RL trainers do it: a ``PyNcclCommunicator`` on ``"cpu"`` over the
   group, rank 0 broadcasting a small state dict tensor by tensor, then a barrier;
6. rank 2 killed (SIGKILL) while ranks 0 and 1 wait in a ``barrier(timeout=30)``: both
   fail at once with ``BarrierFailure``, naming the rank that never arrived, long before
   the timeout.

Everything is bounded in time: ``--timeout`` seconds per step (default 30), and
``--start-timeout`` for the first, which imports torch in every process (default 120).
A step that does not finish in time, a wrong result, or a rank that raises prints
``FAILED: ...`` and exits with status 1. Every child process is killed before the demo
exits, whatever happened.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import re
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["main"]

WORLD_SIZE = 3
VICTIM = 2  # the rank killed in the barrier
BARRIER_TIMEOUT = 30.0  # what the survivors would wait for a rank that never comes
PAYLOAD = {"model": "demo", "layers": [1, 2, 3], "dtype": "bfloat16", "ok": True}
MQ_MESSAGES: list[Any] = [{"step": 1}, [0.5, 1.5, 2.5], "done"]
# The trainer's weights (exact in float32): what every rank holds after the sync.
WEIGHTS: dict[str, list[Any]] = {"embed": [[0.5, -1.0], [2.0, 4.0]], "qkv": [1.5, -2.5, 8.0]}

# A child's report: (kind, rank, step, seconds, value), kind being "ok" (value: what the
# step returned), "failed" (value: (exception type, message), for the expected failure)
# or "error" (value: a traceback; the demo fails).
Report = tuple[str, int, str, float, Any]


class DemoFailure(Exception):
    """A check of the demo failed: a wrong value, a rank that raised, or a step too slow."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _rank_main(rank: int, spg_port: int, dist_port: int, out: Any) -> None:
    """One rank: every step in order, each reported on ``out`` (runs in a child process)."""
    step = "start"

    def report(start: float, value: Any, kind: str = "ok") -> None:
        out.put((kind, rank, step, time.monotonic() - start, value))

    try:
        start = time.monotonic()
        import torch

        from bridge_py.distributed import StatelessProcessGroup
        from bridge_py.distributed.errors import BarrierFailure
        from bridge_py.distributed.parallel_state import (
            get_world_group,
            init_distributed_environment,
        )

        step = "group"
        pg = StatelessProcessGroup.create(
            "127.0.0.1", spg_port, rank=rank, world_size=WORLD_SIZE, store_timeout=60
        )
        report(start, (pg.rank, pg.world_size))

        step, start = "broadcast", time.monotonic()
        report(start, pg.broadcast_obj(PAYLOAD if rank == 0 else None, src=0))

        step, start = "all_gather", time.monotonic()
        report(start, pg.all_gather_obj((rank, rank * 1.5)))

        step, start = "send_recv", time.monotonic()
        pg.send_obj(torch.arange(4, dtype=torch.float32) + 10 * rank, (rank + 1) % WORLD_SIZE)
        got = pg.recv_obj((rank - 1) % WORLD_SIZE)
        report(start, got.tolist())

        step, start = "init", time.monotonic()
        init_distributed_environment(
            world_size=WORLD_SIZE,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{dist_port}",
            local_rank=rank,
            backend="gloo",
        )
        world = get_world_group()
        report(start, (world.rank_in_group, world.world_size))

        step, start = "all_reduce", time.monotonic()
        summed = world.all_reduce(torch.tensor([rank + 1.0, 10.0 * (rank + 1)]))
        report(start, summed.tolist())

        step, start = "mq", time.monotonic()
        mq = world.create_mq_broadcaster(writer_rank=0)
        received = [
            mq.broadcast_object(message if rank == 0 else None, timeout=30)
            for message in MQ_MESSAGES
        ]
        mq.close()
        report(start, received)

        step, start = "weights", time.monotonic()
        from bridge_py.distributed.device_communicators.pynccl import PyNcclCommunicator

        comm = PyNcclCommunicator(pg, device="cpu")
        state = {name: torch.tensor(values) for name, values in WEIGHTS.items()}
        for tensor in state.values():
            if rank != 0:
                tensor.zero_()
            comm.broadcast(tensor, src=0)
        comm.group.barrier()
        report(start, {name: tensor.tolist() for name, tensor in state.items()})

        step, start = "barrier", time.monotonic()
        if rank == VICTIM:
            report(start, "waiting to be killed", kind="victim")
            time.sleep(3 * BARRIER_TIMEOUT)  # the parent kills this process long before
            return
        report(start, "entering", kind="entering")
        try:
            pg.barrier(timeout=BARRIER_TIMEOUT)
        except BarrierFailure as exc:
            report(start, (type(exc).__name__, str(exc)), kind="failed")
        else:
            report(start, "the barrier passed without rank 2")
    except BaseException:
        out.put(("error", rank, step, 0.0, traceback.format_exc()))


class _Demo:
    """The parent: starts the ranks, collects their reports step by step, checks them."""

    def __init__(self, step_timeout: float, first_timeout: float) -> None:
        self.step_timeout = step_timeout
        self.first_timeout = first_timeout
        ctx = multiprocessing.get_context("spawn")
        self.out: Any = ctx.Queue()
        spg_port, dist_port = _free_port(), _free_port()
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, spg_port, dist_port, self.out),
                name=f"demo-rank-{rank}",
                daemon=True,
            )
            for rank in range(WORLD_SIZE)
        ]
        self.pending: list[Report] = []

    def collect(
        self, step: str, ranks: list[int], timeout: float, kinds: tuple[str, ...] = ("ok",)
    ) -> dict[int, Report]:
        """The reports of ``step`` from ``ranks``; raises DemoFailure on an error report, a
        report of another kind than ``kinds``, or when they do not all come in time."""
        got: dict[int, Report] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(ranks):
            match = next((r for r in self.pending if r[2] == step and r[1] in ranks), None)
            if match is not None:
                self.pending.remove(match)
                kind, rank, _, _, value = match
                if kind not in kinds:
                    raise DemoFailure(f"rank {rank}, step {step!r}: {kind}: {value}")
                got[rank] = match
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(ranks) - set(got))
                raise DemoFailure(f"step {step!r}: ranks {missing} did not report in {timeout:g} s")
            report = self._next(min(left, 0.5))
            if report is None:
                dead = [r for r in ranks if r not in got and self.procs[r].exitcode is not None]
                # a report written just before exiting may still be in the pipe
                if dead and (report := self._next(1.0)) is None:
                    raise DemoFailure(f"step {step!r}: ranks {dead} exited without a report")
                if report is None:
                    continue
            if report[0] == "error":
                raise DemoFailure(f"rank {report[1]} raised in step {report[2]!r}:\n{report[4]}")
            self.pending.append(report)
        return got

    def _next(self, timeout: float) -> Report | None:
        try:
            report: Report = self.out.get(timeout=timeout)
        except queue.Empty:
            return None
        return report

    def step(
        self,
        step: str,
        title: str,
        check: Callable[[dict[int, Any]], str],
        ranks: list[int] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Collects ``step`` from every rank (or ``ranks``), checks the values and prints."""
        ranks = list(range(WORLD_SIZE)) if ranks is None else ranks
        reports = self.collect(step, ranks, self.step_timeout if timeout is None else timeout)
        seconds = max(r[3] for r in reports.values())
        summary = check({rank: r[4] for rank, r in reports.items()})
        _line(seconds, f"{title}: {summary}")

    def run(self) -> None:
        """Every step in order; raises DemoFailure at the first check that fails."""
        started = time.monotonic()
        for proc in self.procs:
            proc.start()
        self.step(
            "group",
            f"spawn {WORLD_SIZE} processes (import torch), form a StatelessProcessGroup",
            lambda v: _expect(v, {r: (r, WORLD_SIZE) for r in v}, "every rank joined"),
            timeout=self.first_timeout,
        )
        self.step(
            "broadcast",
            "broadcast_obj from rank 0",
            lambda v: _same(v, PAYLOAD, f"every rank got {PAYLOAD}"),
        )
        gathered = [(r, r * 1.5) for r in range(WORLD_SIZE)]
        self.step(
            "all_gather",
            "all_gather_obj of (rank, rank * 1.5)",
            lambda v: _same(v, gathered, str(gathered)),
        )
        ring = {r: [10.0 * ((r - 1) % WORLD_SIZE) + i for i in range(4)] for r in range(WORLD_SIZE)}
        self.step(
            "send_recv",
            "send_obj/recv_obj of a tensor around the ring (rank r -> r+1)",
            lambda v: _expect(v, ring, f"rank 1 got {ring[1]} from rank 0"),
        )
        self.step(
            "init",
            "init_distributed_environment (gloo), get_world_group",
            lambda v: _expect(v, {r: (r, WORLD_SIZE) for r in v}, "a 3-rank GroupCoordinator"),
        )
        total = [float(sum(range(1, WORLD_SIZE + 1))), 10.0 * sum(range(1, WORLD_SIZE + 1))]
        self.step(
            "all_reduce",
            "GroupCoordinator.all_reduce of [r + 1, 10 * (r + 1)]",
            lambda v: _same(v, total, f"every rank got {total}"),
        )
        self.step(
            "mq",
            "MessageQueue (create_mq_broadcaster): rank 0 broadcasts 3 objects",
            lambda v: _same(v, MQ_MESSAGES, f"ranks 1 and 2 read {MQ_MESSAGES}"),
        )
        self.step(
            "weights",
            "PyNcclCommunicator('cpu'): rank 0 broadcasts a state dict, then a barrier",
            lambda v: _same(v, WEIGHTS, f"every rank holds {', '.join(WEIGHTS)}"),
        )
        self.kill_in_barrier()
        _line(time.monotonic() - started, "the whole demo")

    def kill_in_barrier(self) -> None:
        """Ranks 0 and 1 enter a barrier, rank 2 is killed; both must fail at once."""
        survivors = [r for r in range(WORLD_SIZE) if r != VICTIM]
        self.collect("barrier", [VICTIM], self.step_timeout, kinds=("victim",))
        self.collect("barrier", survivors, self.step_timeout, kinds=("entering",))
        time.sleep(0.5)  # they are waiting in the barrier's first phase by now
        killed_at = time.monotonic()
        self.procs[VICTIM].kill()
        failures = self.collect("barrier", survivors, self.step_timeout, kinds=("failed",))
        after = time.monotonic() - killed_at
        if after > BARRIER_TIMEOUT / 3:
            raise DemoFailure(f"the barrier failed {after:.1f} s after the kill: not fast")
        victim = re.compile(rf"\branks? \[?{VICTIM}\b")
        lines = []
        for rank, report in sorted(failures.items()):
            name, message = report[4]
            if not victim.search(message):
                raise DemoFailure(f"rank {rank}'s error does not name rank {VICTIM}: {message}")
            lines.append(f"{'':13}rank {rank}: {name}: {message.splitlines()[0]}")
        _line(
            after,
            f"kill -9 rank {VICTIM} mid-barrier: ranks {survivors} failed with BarrierFailure "
            f"{after:.2f} s after the kill (timeout {BARRIER_TIMEOUT:g} s)",
        )
        print("\n".join(lines), flush=True)

    def close(self) -> None:
        """Kills every child still running and waits for them (bounded)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)
        self.out.close()
        self.out.cancel_join_thread()


def _line(seconds: float, text: str) -> None:
    print(f"{seconds * 1000:9.1f} ms  {text}", flush=True)


def _expect(values: dict[int, Any], expected: dict[int, Any], summary: str) -> str:
    for rank, value in sorted(values.items()):
        if value != expected[rank]:
            raise DemoFailure(f"rank {rank} got {value!r}, expected {expected[rank]!r}")
    return summary


def _same(values: dict[int, Any], expected: Any, summary: str) -> str:
    return _expect(values, dict.fromkeys(values, expected), summary)


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns 0 when every check passed, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m bridge_py.demo", description=__doc__)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per step")
    parser.add_argument(
        "--start-timeout", type=float, default=120.0, help="seconds for the first step"
    )
    args = parser.parse_args(argv)
    demo = _Demo(args.timeout, args.start_timeout)
    try:
        demo.run()
    except DemoFailure as exc:
        print(f"FAILED: {exc}", flush=True)
        return 1
    finally:
        demo.close()
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
