"""``shm.wait.wait_until``, the one wait loop of every shared-memory wait: its pace.

The loop's users (MessageQueue, the CPU all-reduce, the StatelessProcessGroup's boards) are
tested through their own APIs elsewhere; these pin what the loop promises each of them.
"""

from __future__ import annotations

import time

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


def test_a_long_nap_ends_when_the_liveness_check_is_due() -> None:
    pace = Pace(spin=0.0, first_nap=_LONG, last_nap=_LONG, idle_after=1, idle_nap=_LONG,
                check_every=0.05)  # fmt: skip
    checks: list[float] = []

    def check() -> None:
        checks.append(time.monotonic())
        raise PeerGoneError("rank 1 exited")

    start = time.monotonic()
    with pytest.raises(PeerGoneError, match="rank 1 exited"):
        wait_until(lambda: False, "rank 1", start + _LONG, check=check, pace=pace)
    assert len(checks) == 1 and checks[0] - start < 5


def test_a_long_nap_ends_at_the_deadline() -> None:
    with pytest.raises(GroupTimeout, match="waiting for rank 1"):
        wait_until(lambda: False, "rank 1", time.monotonic() + 0.05, pace=DOORBELL)


def test_the_liveness_check_first_runs_once_its_period_has_passed() -> None:
    looks = iter(range(30))
    calls: list[float] = []
    pace = POLLING._replace(check_every=_LONG)
    wait_until(lambda: next(looks) == 29, "a value", None, check=lambda: calls.append(1),
               pace=pace)  # fmt: skip
    assert calls == []  # a wait that ends before its first period never checks
