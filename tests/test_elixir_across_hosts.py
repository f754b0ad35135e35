"""Two BEAM nodes on two hosts (``tests.hosts``), joined by Erlang distribution over
their link, one group spanning both nodes' pools; then one node's BEAM is killed.

Each host runs its own epmd and one BEAM with the app compiled in ``_build/dev``
(``make test`` compiles it first): ``tests/elixir_hosts/node.exs`` on host b (a pool of
2, and nothing else), ``tests/elixir_hosts/driver.exs`` on host a, which drives a 4-rank
StatelessProcessGroup (ranks 0-1 on its pool, 2-3 on b's) through the generated module
and ``VllmBridge.Runtime``, then waits while this test kills b's BEAM (SIGKILL, the host
stays), and reports what the calls after that did.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bridge_py.distributed.store.watchdog import GRACE
from bridge_py.worker.codec import PLAIN
from tests.hosts import ROOT, Host, Process, hosts

pytestmark = pytest.mark.timeout(180)

APP = ROOT / "_build/dev/lib/vllm_bridge"
SCRIPTS = ROOT / "tests/elixir_hosts"
TIMEOUT = 5  # s: the barrier's and all_gather_obj's timeout on the surviving ranks


def _beam(host: Host, name: str, cookie: str, script: str, *args: str) -> Process:
    """``elixir --name name@<address>`` running ``script`` on ``host``, after starting
    the host's own epmd (and waiting until it answers)."""
    start = (
        "epmd -daemon && for i in $(seq 100); do epmd -names >/dev/null 2>&1 && break; "
        'sleep 0.1; done && exec elixir "$@"'
    )
    argv = ["--name", f"{name}@{host.address}", "--cookie", cookie]
    argv += ["-pa", str(APP / "consolidated"), "-pa", str(APP / "ebin")]
    python = os.environ.get("VLLM_BRIDGE_PYTHON") or sys.executable
    return host.run(
        ["sh", "-c", start, "sh", *argv, str(SCRIPTS / script), *args],
        f"{script} ({name})",
        env={"VLLM_BRIDGE_PYTHON": python},
    )


def _beam_pid(process: Process) -> int:
    """The PID (here) of the BEAM a ``_beam`` process runs: nsenter's child, exec'd
    from ``sh`` through ``elixir`` and ``erlexec`` into ``beam.smp``."""
    pid = process.popen.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    assert Path(f"/proc/{children[0]}/comm").read_text().strip() == "beam.smp", children
    return int(children[0])


def _decode(line: str) -> Any:
    """The driver's result: the bridge's msgpack, base64, read with the worker's codec."""
    return PLAIN.decode(base64.b64decode(line))


def _wait_for(path: Path, driver: Process, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if driver.popen.poll() is not None or time.monotonic() > deadline:
            driver.result(0.1)  # raises with its output
            raise AssertionError(f"the driver exited without creating {path.name}")
        time.sleep(0.05)


def _failed_within(outcome: dict[str, Any], seconds: float) -> None:
    assert not outcome.get("hung") and "ok" not in outcome, outcome
    assert outcome["ms"] < seconds * 1000, outcome


def test_a_group_across_two_beam_nodes_outlives_one_nodes_beam(tmp_path: Path) -> None:
    if not (APP / "ebin" / "vllm_bridge.app").is_file():
        pytest.skip(f"{APP / 'ebin'} is not built (make setup compiles it)")
    if shutil.which("elixir") is None or shutil.which("epmd") is None:
        pytest.skip("BEAM nodes on hosts need elixir and epmd on PATH")
    cookie = secrets.token_hex(16)
    with hosts(2) as (a, b):
        peer = _beam(b, "b", cookie, "node.exs")
        driver = _beam(a, "a", cookie, "driver.exs", f"b@{b.address}", str(tmp_path))
        _wait_for(tmp_path / "formed", driver, 90)  # the group ran every operation

        os.kill(_beam_pid(peer), 9)  # b's BEAM, not its workers: they must go with it
        assert peer.popen.wait(10) != 0
        b_left = b.leftovers(5, daemons=("epmd",))
        seen = driver.result(75, parse=_decode)
        a_left = a.leftovers(5, daemons=("epmd",))

    # the killed node's workers went with its BEAM, and the driver's with its clean exit
    assert b_left == [], b_left
    assert a_left == [], a_left
    assert seen["nodedown_ms"] < 10_000, seen

    # the ranks beside the dead ones fail the barrier at its timeout (plus the store
    # watchdog's grace and a small bound), saying what they waited for, and none hangs
    for rank, outcome in enumerate(seen["barrier"]):
        _failed_within(outcome, TIMEOUT + GRACE + 3)
        assert outcome["ms"] >= TIMEOUT * 1000 - 500, (rank, outcome)
    # then the group is unusable: the gather after it is refused at once
    for rank, outcome in enumerate(seen["all_gather_obj"]):
        _failed_within(outcome, 3)
        assert outcome["python_type"] == "StateError", outcome
        assert f"all_gather_obj on rank {rank} of a StatelessProcessGroup" in outcome["message"]
        assert re.search(r"refused: barrier \d+ failed on it", outcome["message"]), outcome
    for outcome in seen["barrier"]:  # the verdict of the rank that gave up, on both
        assert outcome["category"] == "python", outcome
        assert outcome["python_type"] in ("BarrierTimeout", "BarrierFailure"), outcome
        verdict = r"rank [01] timed out after 5 s in phase 1 \(arrival\): 2 of 4 ranks arrived"
        assert re.search(verdict + r", ranks \[2, 3\] did not", outcome["message"]), outcome

    # calls on the dead node's refs: a :worker error naming that node, at once
    for call, outcome in seen["remote"].items():
        _failed_within(outcome, 3)
        assert outcome["category"] == "worker", (call, outcome)
        assert f"b@{b.address}" in outcome["message"], (call, outcome)
        assert "down or unreachable" in outcome["message"], (call, outcome)
    assert seen["released"]["ok"] == 2, seen["released"]  # the dead node's count as 0

    # the driver's pool keeps serving, with the same workers: a fresh group on it alone
    assert seen["fresh"] == [
        {"ok": {"gathered": [0, 10], "node": True}, "ms": seen["fresh"][i]["ms"]} for i in range(2)
    ], seen["fresh"]
    assert seen["workers_after"] == seen["workers_before"], seen
    assert seen["connected"] == [], seen
