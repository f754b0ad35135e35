"""A port worker leaves with its parent, even when stdin stays open and a call is stuck.

The parent here is a small launcher process, as the BEAM's port helper is: it starts the
worker with a pipe for stdin, hands a copy of that pipe's write end to a sleeping child
of its own (so the worker never reads end of input), starts a call that blocks in
Python, and is then killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.worker.conftest import SAMPLE
from tests.worker.processes import ROOT

pytestmark = pytest.mark.timeout(120)

LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from bridge_py.worker import envelope as pb
    from bridge_py.worker.codec import PLAIN
    from tests.worker.processes import start_worker

    worker = start_worker(exports=sys.argv[1], stderr=subprocess.DEVNULL)
    # A child that holds the worker's stdin open for as long as it lives.
    keeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        pass_fds=[worker.stdin.fileno()],
    )
    def send(rid, op):
        frame = pb.encode_request(pb.Request(id=rid, op=op))
        worker.stdin.write(len(frame).to_bytes(4, "big") + frame)
        worker.stdin.flush()
    send(1, pb.Ping(PLAIN.encode("up")))
    size = int.from_bytes(worker.stdout.read(4), "big")
    worker.stdout.read(size)  # the worker serves
    send(2, pb.CallFunction("sleep", PLAIN.encode([600.0])))  # stuck in Python
    time.sleep(0.3)
    print(worker.pid, keeper.pid, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_stuck_worker_whose_stdin_stays_open_leaves_with_its_killed_parent() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, SAMPLE],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        text=True,
    )
    worker_pid = keeper_pid = 0
    try:
        assert launcher.stdout is not None
        worker_pid, keeper_pid = map(int, launcher.stdout.readline().split())
        assert _alive(worker_pid) and _alive(keeper_pid)
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        while _alive(worker_pid) and time.monotonic() - killed < 5:
            time.sleep(0.02)
        took = time.monotonic() - killed
        assert not _alive(worker_pid), "the worker outlived its parent by 5 s"
        assert took < 2.0, f"the worker outlived its parent by {took:.2f} s"
        assert _alive(keeper_pid)  # its stdin was still open all along
    finally:
        for pid in (worker_pid, keeper_pid):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
