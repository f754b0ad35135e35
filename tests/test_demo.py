"""``python -m bridge_py.demo`` runs, checks what it shows, and fails loudly when a check fails.

Both run the demo in a fresh interpreter (it spawns its own three ranks) with a hard limit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 150  # seconds: three processes import torch on a busy machine

STEPS = [
    "form a StatelessProcessGroup: every rank joined",
    "broadcast_obj from rank 0: every rank got",
    "all_gather_obj of (rank, rank * 1.5): [(0, 0.0), (1, 1.5), (2, 3.0)]",
    "around the ring (rank r -> r+1): rank 1 got [0.0, 1.0, 2.0, 3.0] from rank 0",
    "init_distributed_environment (gloo), get_world_group: a 3-rank GroupCoordinator",
    "GroupCoordinator.all_reduce of [r + 1, 10 * (r + 1)]: every rank got [6.0, 60.0]",
    "MessageQueue (create_mq_broadcaster): rank 0 broadcasts 3 objects: ranks 1 and 2 read",
    "PyNcclCommunicator('cpu'): rank 0 broadcasts a state dict, then a barrier: every rank "
    "holds embed, qkv",
    "kill -9 rank 2 mid-barrier: ranks [0, 1] failed with BarrierFailure",
    "rank 0: BarrierFailure: barrier 1 failed on rank 0: ranks [2] exited",
    "rank 1: BarrierFailure: barrier 1 failed on rank 1: ranks [2] exited",
    "all checks passed",
]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )


def test_the_demo_runs_every_step_and_checks_it() -> None:
    done = _run("-m", "bridge_py.demo")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    at = 0
    for step in STEPS:  # each step once, in this order
        found = [i for i, line in enumerate(lines) if step in line]
        assert len(found) == 1 and found[0] >= at, f"{step!r} not in order in:\n{done.stdout}"
        at = found[0]
    # every step line but the rank details carries its time
    timed = [line for line in lines if " ms  " in line]
    assert len(timed) == 10, done.stdout


def test_a_failed_check_exits_non_zero() -> None:
    # The parent expects another payload than the ranks (fresh imports) broadcast.
    code = (
        "import sys, bridge_py.demo as d\n"
        "d.PAYLOAD = {'expected': 'something else'}\n"
        "sys.exit(d.main(['--timeout', '30']))\n"
    )
    done = _run("-c", code)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED: rank 0 got {'model': 'demo'" in done.stdout, done.stdout
    assert "all checks passed" not in done.stdout
