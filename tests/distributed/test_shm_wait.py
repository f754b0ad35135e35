"""``shm.wait.wait_until``, the one wait loop of every shared-memory wait: its pace.

The loop's users (MessageQueue, the CPU all-reduce, the StatelessProcessGroup's boards) are
tested through their own APIs elsewhere; these pin what the loop promises each of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from bridge_py.distributed.errors import GroupTimeout, PeerGoneError
from bridge_py.distributed.shm.wait import DOORBELL, POLLING, Pace, wait_until

pytestmark = pytest.mark.timeout(30)

# Naps far longer than any test: a sleep of this length would hit the test's timeout.
_LONG = 3600.0


def _never_sleep(seconds: float) -> None:
    raise AssertionError(f"slept {seconds} s")


def test_a_value_on_its_way_is_looked_for_again_without_sleeping() -> None:
    answers = iter([None, None, None, True])
    pace = Pace(spin=0.0, first_nap=_LONG, last_nap=_LONG, idle_after=1, idle_nap=_LONG,
                check_every=_LONG)  # fmt: skip
    wait_until(lambda: next(answers), "a value", time.monotonic() + 10, sleep=_never_sleep,
               pace=pace)  # fmt: skip


def test_a_wait_answered_within_its_spin_never_sleeps() -> None:
    # (the doorbell of a board is armed only by a sleep: an answer within the spin rings
    # nobody)
    looks = iter(range(10))
    wait_until(lambda: next(looks) == 9, "a value", time.monotonic() + 10,
               sleep=_never_sleep, pace=DOORBELL._replace(spin=_LONG))  # fmt: skip


def _slept(naps: list[float]) -> Callable[[float], None]:
    """A sleep that records how long it was asked to sleep, and returns at once."""
    return naps.append


def test_a_long_nap_ends_when_the_liveness_check_is_due() -> None:
    pace = Pace(spin=0.0, first_nap=_LONG, last_nap=_LONG, idle_after=1, idle_nap=_LONG,
                check_every=0.05)  # fmt: skip
    naps: list[float] = []
    checks = 0

    def check() -> None:
        nonlocal checks
        checks += 1
        if checks == 2:
            raise PeerGoneError("rank 1 exited")

    with pytest.raises(PeerGoneError, match="rank 1 exited"):
        wait_until(lambda: False, "rank 1", time.monotonic() + _LONG, check=check,
                   sleep=_slept(naps), pace=pace)  # fmt: skip
    assert naps and max(naps) <= 0.05  # every sleep ended by the next check, not the nap


def test_a_long_nap_ends_at_the_deadline() -> None:
    naps: list[float] = []
    with pytest.raises(GroupTimeout, match="waiting for rank 1"):
        wait_until(lambda: False, "rank 1", time.monotonic() + 0.05, sleep=_slept(naps),
                   pace=DOORBELL)  # fmt: skip
    assert naps and max(naps) <= 0.05  # not DOORBELL's nap of a second


def test_the_liveness_check_does_not_run_before_its_period() -> None:
    # Sleeping from the first miss (no spin): the check still waits for its period.
    looks = iter(range(30))
    calls: list[int] = []
    pace = POLLING._replace(spin=0.0, check_every=_LONG)
    wait_until(lambda: next(looks) == 29, "a value", None, check=lambda: calls.append(1),
               sleep=_slept([]), pace=pace)  # fmt: skip
    assert calls == []  # a wait that ends before its first period never checks
