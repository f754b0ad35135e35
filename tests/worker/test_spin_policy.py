"""The port transport's choice to spin or sleep while waiting, driven by measured waits."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from bridge_py.worker.transports.polling_input import PollingInput
from bridge_py.worker.transports.spin_policy import SpinPolicy
from tests.worker.processes import every_cpu_taken, kernel_keeps_run_delay


def _run(
    policy: SpinPolicy, waits: int, spin_wait: float, sleep_wait: float, pause_every: int = 0
) -> int:
    """Feed ``waits`` waits, each as long as the current mode takes (but every
    ``pause_every``-th spinning one, a pause of the caller of 0.6 ms, under IDLE); count
    those spent spinning."""
    spun = 0
    for _ in range(waits):
        if policy.spinning:
            spun += 1
            paused = pause_every and spun % pause_every == 0
            policy.record(0.6e-3 if paused else spin_wait)
        else:
            policy.record(sleep_wait)
    return spun


def test_where_wake_ups_are_slow_it_settles_on_spinning() -> None:
    policy = SpinPolicy()
    spun = _run(policy, 100_000, spin_wait=15e-6, sleep_wait=120e-6)
    assert policy.spinning
    assert policy.estimates == {True: pytest.approx(15e-6), False: pytest.approx(120e-6)}
    assert 100_000 - spun < 100_000 / 200  # the losing mode is tried rarely once settled


def test_where_spinning_slows_the_caller_it_settles_on_sleeping() -> None:
    policy = SpinPolicy()
    spun = _run(policy, 100_000, spin_wait=28e-6, sleep_wait=16e-6)
    assert not policy.spinning
    assert spun < 100_000 / 200


def test_where_spinning_saves_little_it_sleeps() -> None:
    # A spin takes a CPU: it is kept only for a wait at least MARGIN shorter (so the
    # policy is within MARGIN of never spinning and of always spinning, whichever wins).
    for spin_wait, spinning in ((19.5e-6, False), (18.5e-6, True)):
        policy = SpinPolicy()
        _run(policy, 20_000, spin_wait=spin_wait, sleep_wait=20e-6)
        assert policy.spinning is spinning, spin_wait


def test_it_follows_a_machine_whose_behaviour_changes() -> None:
    policy = SpinPolicy()
    _run(policy, 100_000, spin_wait=15e-6, sleep_wait=120e-6)
    assert policy.spinning
    # The longest run between measurements bounds how long a stale choice lasts.
    _run(policy, 2 * SpinPolicy.LONGEST_RUN + 4 * SpinPolicy.WINDOW, 60e-6, 20e-6)
    assert not policy.spinning


def test_spinning_that_turns_slower_for_a_while_costs_one_window_of_sleeping() -> None:
    # Spinning's median jumps for a window or two now and then (in spells of slow
    # wake-ups). Sleeping for a run after each jump made the worker 1.10-1.22x slower
    # than one that always spins; a fresh measurement of both modes finds spinning
    # faster again at once.
    policy = SpinPolicy()
    _run(policy, 100_000, spin_wait=5e-6, sleep_wait=40e-6)
    assert policy.spinning
    spun = _run(policy, SpinPolicy.LOSING_WINDOWS * SpinPolicy.WINDOW, 60e-6, 40e-6)
    assert spun == SpinPolicy.LOSING_WINDOWS * SpinPolicy.WINDOW and not policy.spinning
    slept = SpinPolicy.FIRST_RUN - _run(policy, SpinPolicy.FIRST_RUN, 5e-6, 40e-6)
    assert slept == SpinPolicy.WINDOW and policy.spinning


def test_a_spin_that_stays_slower_ends_within_three_windows_and_sleeps_a_run() -> None:
    # Beside a busy program: the CPUs were free enough for spinning to win, then the
    # program takes back its CPU and spins grow past sleeps.
    policy = SpinPolicy()
    _run(policy, 100_000, spin_wait=5e-6, sleep_wait=20e-6)
    assert policy.spinning
    # One slow window is noise; two in a row end the run; sleeping and spinning are
    # measured afresh, and sleeping is kept for a run.
    _run(policy, SpinPolicy.WINDOW, spin_wait=85e-6, sleep_wait=20e-6)
    _run(policy, SpinPolicy.WINDOW, spin_wait=5e-6, sleep_wait=20e-6)
    assert policy.spinning
    windows = SpinPolicy.LOSING_WINDOWS + 2  # then one of sleeping, one of spinning
    spun = _run(policy, windows * SpinPolicy.WINDOW, spin_wait=85e-6, sleep_wait=20e-6)
    assert spun == (SpinPolicy.LOSING_WINDOWS + 1) * SpinPolicy.WINDOW
    assert not policy.spinning
    assert _run(policy, SpinPolicy.FIRST_RUN, spin_wait=85e-6, sleep_wait=20e-6) == 0


def test_a_crowd_during_a_measurement_of_spinning_keeps_the_run_of_sleeping() -> None:
    # Settled on sleeping, in the longest runs; a crowd comes while spinning is being
    # measured again (beside a busy program, the verdict changes every 30-60 ms).
    policy = SpinPolicy()
    _run(policy, 200_000, spin_wait=28e-6, sleep_wait=16e-6)
    assert not policy.spinning
    for _ in range(2 * SpinPolicy.LONGEST_RUN):
        if policy.spinning:
            break
        policy.record(16e-6)
    assert policy.spinning  # measuring spinning again
    for _ in range(SpinPolicy.WINDOW // 2):
        policy.record(28e-6)
    for _ in range(SpinPolicy.CROWDED_SHARES):
        policy.crowding(0.3)
    assert policy.crowded and not policy.spinning
    for _ in range(SpinPolicy.CROWDED_SHARES):
        policy.crowding(0.01)
    assert not policy.crowded
    # Sleeping goes on for a whole long run, as it would have without the crowd,
    # rather than spinning being measured again after the first run's length.
    assert _run(policy, SpinPolicy.LONGEST_RUN // 2, spin_wait=28e-6, sleep_wait=16e-6) == 0
    assert _run(policy, 2 * SpinPolicy.LONGEST_RUN, spin_wait=28e-6, sleep_wait=16e-6) > 0


def test_the_callers_own_pauses_are_left_out() -> None:
    policy = SpinPolicy()
    for _ in range(1000):  # a caller that pauses 5 ms between calls decides nothing
        policy.record(5e-3)
    assert policy.spinning and policy.estimates == {}


def test_short_pauses_of_the_caller_do_not_decide() -> None:
    # Pauses under IDLE (the caller starting a new batch of calls, a garbage collection)
    # land in whichever mode's window is being measured; two of 0.6 ms in a window of 32
    # turnarounds of 15 us would triple its mean, and make sleeping (40 us) look faster.
    policy = SpinPolicy()
    spun = _run(policy, 100_000, spin_wait=15e-6, sleep_wait=40e-6, pause_every=16)
    assert policy.spinning
    assert policy.estimates == {True: pytest.approx(15e-6), False: pytest.approx(40e-6)}
    assert 100_000 - spun < 100_000 / 200


def test_a_spin_lasts_no_longer_than_a_sleeping_wait() -> None:
    policy = SpinPolicy()
    assert policy.spin_time(200e-6) == 200e-6  # nothing measured yet
    _run(policy, 5 * SpinPolicy.WINDOW, spin_wait=5e-6, sleep_wait=17e-6)
    assert policy.spinning
    assert policy.spin_time(200e-6) == pytest.approx(17e-6)
    assert policy.spin_time(10e-6) == 10e-6  # never beyond the reader's own bound
    slow = SpinPolicy()  # where a sleeping wait outlasts the bound, the bound holds
    _run(slow, 5 * SpinPolicy.WINDOW, spin_wait=15e-6, sleep_wait=500e-6)
    assert slow.spin_time(200e-6) == 200e-6


def test_spins_that_delay_the_request_do_not_lengthen_the_spin() -> None:
    # A spin that holds the CPU the caller's side needs makes the request come only
    # once the spin gives up: those waits are long because of the spin. They must not
    # make the next spin longer, only, when they are most waits, sleeping the choice.
    policy = SpinPolicy()
    _run(policy, 5 * SpinPolicy.WINDOW, spin_wait=5e-6, sleep_wait=17e-6)
    _run(policy, 2 * SpinPolicy.FIRST_RUN + 4 * SpinPolicy.WINDOW, 90e-6, 17e-6)
    assert policy.spin_time(200e-6) == pytest.approx(17e-6)
    assert not policy.spinning


def test_where_every_cpu_is_taken_it_sleeps_however_fast_spinning_looks() -> None:
    policy = SpinPolicy()
    _run(policy, 10_000, spin_wait=15e-6, sleep_wait=120e-6)
    assert policy.spinning
    for _ in range(SpinPolicy.CROWDED_SHARES - 1):  # a burst of the machine's other work
        policy.crowding(0.3)
    policy.crowding(0.01)
    policy.crowding(0.3)
    assert policy.spinning and not policy.crowded
    for _ in range(SpinPolicy.CROWDED_SHARES - 1):  # in a row: believed
        policy.crowding(0.3)
    assert policy.crowded and not policy.spinning
    # While crowded it measures spinning no more, however much faster it was.
    spun = _run(policy, 10 * SpinPolicy.LONGEST_RUN, spin_wait=15e-6, sleep_wait=120e-6)
    assert spun == 0 and not policy.spinning
    # A free moment does not change its mind either; as many shares in a row under
    # CROWDED do: spinning is measured again, and chosen if faster.
    for _ in range(SpinPolicy.CROWDED_SHARES - 1):
        policy.crowding(SpinPolicy.CROWDED / 2)
    policy.crowding(0.3)
    assert policy.crowded
    for _ in range(SpinPolicy.CROWDED_SHARES):
        policy.crowding(SpinPolicy.CROWDED / 2)
    assert not policy.crowded
    _run(policy, 2 * SpinPolicy.FIRST_RUN + 4 * SpinPolicy.WINDOW, 15e-6, 120e-6)
    assert policy.spinning


def test_a_crowded_policy_still_measuring_the_modes_sleeps_from_then_on() -> None:
    policy = SpinPolicy()  # still measuring: its first window spins
    for _ in range(SpinPolicy.WINDOW // 2):
        policy.record(15e-6)
    for _ in range(SpinPolicy.CROWDED_SHARES):
        policy.crowding(0.5)
    assert not policy.spinning
    assert policy.estimates == {}  # the crowded window's spins were dropped
    spun = _run(policy, 4 * SpinPolicy.FIRST_RUN, spin_wait=15e-6, sleep_wait=120e-6)
    assert spun == 0
    # Crowded while measuring sleeping, before spinning had been chosen or not: the same.
    policy = SpinPolicy()
    _run(policy, SpinPolicy.WINDOW + 1, spin_wait=15e-6, sleep_wait=120e-6)
    assert not policy.spinning
    for _ in range(SpinPolicy.CROWDED_SHARES):
        policy.crowding(0.5)
    spun = _run(policy, 4 * SpinPolicy.FIRST_RUN, spin_wait=15e-6, sleep_wait=120e-6)
    assert spun == 0


# Writes a byte to fd argv[2] for each byte it reads from fd argv[1], at once.
_ECHO = """
import os, sys
go, out = int(sys.argv[1]), int(sys.argv[2])
while os.read(go, 1):
    os.write(out, b"x")
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a reader with one CPU never spins")
@pytest.mark.skipif(
    not kernel_keeps_run_delay(), reason="the kernel keeps no time waited for a CPU"
)
def test_the_reader_stops_spinning_where_every_cpu_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One busy process more than there are CPUs, and a sequential "caller" in another
    # process: the reader, which would spin (a 2 s spin, and slow wake-ups), finds
    # itself waiting for a CPU, and sleeps from then on.
    monkeypatch.setattr(SpinPolicy, "IDLE", 10.0)  # a loaded machine's waits count too
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        with every_cpu_taken():
            caller = subprocess.Popen(
                [sys.executable, "-c", _ECHO, str(go_r), str(w)], pass_fds=(go_r, w)
            )
            try:
                reader = PollingInput(r, 2.0)
                assert reader.policy is not None and reader.spinning
                deadline = time.monotonic() + 20
                while not reader.policy.crowded and time.monotonic() < deadline:
                    os.write(go_w, b"g")
                    assert reader.read1(1) == b"x"
                assert reader.policy.crowded, "20 s beside busy processes never showed a crowd"
                assert not reader.spinning
            finally:
                os.close(go_w)
                caller.wait(10)
    finally:
        for fd in (r, w, go_r):
            os.close(fd)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a reader with one CPU never spins")
def test_the_reader_spins_no_longer_than_its_policy_says(monkeypatch: pytest.MonkeyPatch) -> None:
    # A reader allowed to spin 2 s whose measured sleeping waits take 2 ms: a request
    # that comes 0.4 s later costs it about 2 ms of CPU, not 0.4 s of spinning.
    monkeypatch.setattr(SpinPolicy, "IDLE", 10.0)
    r, w = os.pipe()
    try:
        reader = PollingInput(r, 2.0)
        assert reader.policy is not None
        _run(reader.policy, 4 * SpinPolicy.WINDOW, spin_wait=1e-3, sleep_wait=2e-3)
        assert reader.spinning and reader.policy.spin_time(2.0) == pytest.approx(2e-3)
        writer = threading.Timer(0.4, os.write, (w, b"x"))
        writer.start()
        cpu = time.thread_time()
        assert reader.read1(1) == b"x"
        cpu = time.thread_time() - cpu
        writer.join(10)
        assert cpu < 0.2, f"the reader spun for {cpu:.3f} s of CPU"
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a reader with one CPU never spins")
def test_the_reader_records_each_wait_and_a_fixed_spin_measures_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(SpinPolicy, "IDLE", 10.0)  # a loaded machine's waits count too
    r, w = os.pipe()
    try:
        measured = PollingInput(r, 200e-6)
        assert measured.policy is not None
        for i in range(SpinPolicy.WINDOW):
            os.write(w, bytes([i]))
            assert measured.read1(1) == bytes([i])  # already there: no wait to record
        assert measured.policy.estimates == {}
        # Reads that wait, the byte written 2 ms after the reader is told to go: each is
        # recorded, a window spinning and then one sleeping, each mean its estimate.
        go = threading.Event()

        def writer() -> None:
            for i in range(4 * SpinPolicy.WINDOW):
                go.wait(10)
                go.clear()
                time.sleep(0.002)
                os.write(w, bytes([i]))

        thread = threading.Thread(target=writer)
        thread.start()
        for i in range(4 * SpinPolicy.WINDOW):
            go.set()
            assert measured.read1(1) == bytes([i])
        thread.join(10)
        estimates = measured.policy.estimates
        assert set(estimates) == {True, False}
        assert all(1e-3 < wait < 10.0 for wait in estimates.values())
        fixed = PollingInput(r, 200e-6, measured=False)
        assert fixed.policy is None and fixed.spinning
        assert PollingInput(r, 0.0).policy is None  # never spins: nothing to choose
    finally:
        os.close(r)
        os.close(w)
