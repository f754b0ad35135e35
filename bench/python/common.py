"""Shared pieces of the Python benchmarks: statistics, result rows, the printed table.

Every benchmark measures our code and its peer in the same run, interleaved round by
round, and reports medians (p99 where asked) and their ratio. Rows are printed as a table
and, when ``BENCH_OUT`` names a file, appended to it as JSON lines for ``bench/run``.
Nothing here asserts on speed: a benchmark fails only on wrong results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # tests.distributed.harness lives in the repository
    sys.path.insert(0, str(ROOT))

from tests.distributed.harness import free_port, run_ranks  # noqa: E402

__all__ = [
    "ROOT",
    "Row",
    "emit",
    "fmt_time",
    "free_port",
    "median",
    "p99",
    "parse_args",
    "run_ranks",
    "speed_row",
    "thread_counts",
    "threads_label",
    "time_row",
]


def parse_args(description: str) -> argparse.Namespace:
    """``--quick``: tiny iteration counts (``make bench-quick``), same code paths."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny iteration counts")
    return parser.parse_args()


def thread_counts() -> list[int]:
    """The torch thread counts a benchmark's ranks run with, each rank setting its own:
    one (as torchrun sets ``OMP_NUM_THREADS=1`` for several processes per node), then
    torch's default when nothing sets it, one per CPU."""
    return [1, len(os.sched_getaffinity(0))]


def threads_label(threads: int) -> str:
    """What a row's name adds for ranks that ran with ``threads`` torch threads."""
    return "" if threads == 1 else f", {threads} torch threads per rank (torch's default)"


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def p99(values: Sequence[float]) -> float:
    """The nearest-rank 99th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


@dataclass
class Row:
    bench: str
    what: str
    ours: str
    peer: str
    ratio: str
    target: str
    met: bool | None


def time_row(
    bench: str,
    what: str,
    ours: float,
    peer: float,
    peer_name: str,
    *,
    at_most: float | None = None,
    faster_by: float | None = None,
    ours_extra: str = "",
    peer_extra: str = "",
) -> Row:
    """A row comparing two times; ratio is ours/peer (below 1: ours is faster).

    ``at_most=k``: the target is ours <= k x peer. ``faster_by=k``: ours <= peer / k.
    Neither: informational (no target).
    """
    ratio = ours / peer if peer > 0 else math.inf
    if at_most is not None:
        target, met = f"<= {at_most:g}x peer", ratio <= at_most
    elif faster_by is not None:
        target, met = f">= {faster_by:g}x faster (<= {1 / faster_by:.3g}x)", ratio <= 1 / faster_by
    else:
        target, met = "(info)", None
    return Row(
        bench,
        what,
        fmt_time(ours) + ours_extra,
        f"{peer_name}: {fmt_time(peer)}{peer_extra}",
        f"{ratio:.2f}x",
        target,
        met,
    )


def speed_row(
    bench: str,
    what: str,
    ours: float,
    peer: float,
    peer_name: str,
    unit: str,
    *,
    at_least: float | None = None,
) -> Row:
    """A row comparing two rates (higher is better); ratio is ours/peer."""
    ratio = ours / peer if peer > 0 else math.inf
    target, met = (f">= {at_least:g}x peer", ratio >= at_least) if at_least else ("(info)", None)
    return Row(
        bench,
        what,
        f"{ours:,.0f} {unit}",
        f"{peer_name}: {peer:,.0f} {unit}",
        f"{ratio:.2f}x",
        target,
        met,
    )


def emit(title: str, rows: list[Row]) -> None:
    """Print the table; append the rows to $BENCH_OUT (JSON lines) when set."""
    print(f"\n## {title}\n")
    print(render(rows))
    out = os.environ.get("BENCH_OUT")
    if out:
        with open(out, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(asdict(row)) + "\n")


def render(rows: list[Row]) -> str:
    head = ["what", "ours", "peer", "ratio", "target", "met?"]
    body = [[r.what, r.ours, r.peer, r.ratio, r.target, _met(r.met)] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"
        for line in [head, ["-" * w for w in widths], *body]
    ]
    return "\n".join(lines)


def _met(met: bool | None) -> str:
    return "-" if met is None else ("yes" if met else "NO")
