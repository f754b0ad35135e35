"""The reader's measure of how much of its time it spends waiting for a CPU."""

from __future__ import annotations

import threading
import time

import pytest

from bridge_py.worker.transports.run_delay import RunDelay
from tests.worker.processes import every_cpu_taken, kernel_keeps_run_delay

pytestmark = pytest.mark.skipif(
    not kernel_keeps_run_delay(), reason="the kernel keeps no time waited for a CPU"
)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_thread_beside_more_busy_processes_than_cpus_waits_for_a_cpu() -> None:
    delay = RunDelay(period=0.05)
    assert delay.share() is None  # a first sample: nothing to compare with
    with every_cpu_taken() as cpus:
        delay.share()
        assert delay.share() is None  # too soon after the last sample
        _spin(0.3)
        share = delay.share()
    # cpus + 2 threads that want a CPU, on cpus: each waits 1 - cpus / (cpus + 2) of
    # the time (0.5 on two CPUs, 2/3 on one); 0.2 leaves room for an uneven scheduler.
    assert share is not None and 0.2 < share <= 1.05, f"{share} on {cpus} CPUs"


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
