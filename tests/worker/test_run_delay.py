"""The reader's measure of how much of its time it spends waiting for a CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from bridge_py.worker.transports.run_delay import RunDelay

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/schedstat"), reason="the kernel does not say"
)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_thread_beside_more_busy_processes_than_cpus_waits_for_a_cpu() -> None:
    cpus = len(os.sched_getaffinity(0))
    delay = RunDelay(period=0.05)
    assert delay.share() is None  # a first sample: nothing to compare with
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus + 1)]
    try:
        time.sleep(0.2)  # let them start
        delay.share()
        assert delay.share() is None  # too soon after the last sample
        _spin(0.3)
        share = delay.share()
    finally:
        for process in busy:
            process.kill()
        for process in busy:
            process.wait(10)
    # cpus + 2 threads that want a CPU, on cpus: each waits 1 - cpus / (cpus + 2) of
    # the time, 0.5 on two CPUs; 0.2 leaves room for an uneven scheduler.
    assert share is not None and 0.2 < share <= 1.05, share


def test_a_sample_taken_on_another_thread_starts_over() -> None:
    delay = RunDelay(period=0.0)
    assert delay.share() is None
    assert delay.share() is not None
    shares: list[float | None] = []
    thread = threading.Thread(target=lambda: shares.append(delay.share()))
    thread.start()
    thread.join(10)
    assert shares == [None]  # another thread's counters: no figure
    assert delay.share() is None  # and back on this one, none either
    assert delay.share() is not None
