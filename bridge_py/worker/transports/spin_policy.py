"""Whether the port transport should spin while it waits for the next request, by measurement.

Spinning saves the wake-up of a sleeping reader, which costs 50-150 us on a virtual
machine whose idle CPU has halted, and a few microseconds where wake-ups are fast. It
also takes a CPU away from the BEAM, which on a machine with few cores is the process
that must produce the next request. Which effect wins depends on the machine, so the
worker measures it instead of guessing: the time from asking for the next request to
getting it (the BEAM's turnaround, plus our wake-up when we slept) is exactly what the
choice changes, and is what a sequential caller waits for.

The policy alternates between the two modes: it measures a window of waits in each, keeps
the one with the shorter median (spinning only when it is shorter by ``MARGIN``: a spin
takes a CPU, so a tie goes to sleeping), and tries the other again after a run that
doubles each time the same mode wins again (up to ``LONGEST_RUN`` waits), so once the
choice is settled fewer than one wait in 200 is spent trying the losing mode. Waits
longer than ``IDLE`` are the caller's own pauses, which no waiting strategy changes, and
are left out; so are shorter pauses, by the median: one pause of 0.5 ms in a window of
32 turnarounds of 15 us would double the window's mean and decide the choice alone (seen
in ``bench/elixir/calls.exs``, where each batch of calls starts with such a pause).

A spin lasts no longer than the median wait measured while sleeping
(:meth:`SpinPolicy.spin_time`): past that, a sleeping reader would usually have had its
request already, so spinning on gains nothing, and it can delay the request. The spinner
holds a CPU that a thread of the BEAM may need before the next request can be written
(on two CPUs: the caller's scheduler, and the thread that brings the caller its reply),
and then the request comes only once the spin gives up. With a fixed spin of 200 us,
1-5% of a sequential caller's calls took 200 us longer. The bound comes from sleeping
waits because those cannot be delayed that way; a bound from spinning waits would grow
with the very delays it should cut.

This module is pure bookkeeping: it reads no clock and does no I/O.
"""

from __future__ import annotations

__all__ = ["SpinPolicy"]


class SpinPolicy:
    """Chooses spinning or sleeping from the waits it is told about (:meth:`record`).

    ``spinning`` is the mode to use for the next wait. Starts by measuring spinning,
    then sleeping, then keeps the faster one.
    """

    WINDOW = 32  # waits measured per estimate of one mode
    FIRST_RUN = 256  # waits in the chosen mode before the other one is measured again
    LONGEST_RUN = 32768
    IDLE = 1e-3  # seconds: a longer wait is the caller pausing, not its turnaround
    MARGIN = 0.05  # spinning is kept only when its median wait is this much shorter

    __slots__ = ("_chosen", "_estimates", "_run", "_run_left", "_waits", "spinning")

    def __init__(self) -> None:
        self.spinning = True
        self._chosen: bool | None = None  # none yet: both modes still to be measured
        self._estimates: dict[bool, float] = {}
        self._run = self.FIRST_RUN
        self._run_left = 0
        self._waits: list[float] = []  # the current window's

    @property
    def estimates(self) -> dict[bool, float]:
        """The last median wait measured in each mode (seconds), keyed by ``spinning``."""
        return dict(self._estimates)

    def spin_time(self, longest: float) -> float:
        """How long the next wait should spin before it sleeps: the median wait measured
        while sleeping, at most ``longest`` seconds (``longest`` until that is measured)."""
        return min(longest, self._estimates.get(False, longest))

    def record(self, wait: float) -> None:
        """Account for one wait of ``wait`` seconds spent in the current mode."""
        if wait > self.IDLE:
            return
        waits = self._waits
        waits.append(wait)
        if len(waits) < self.WINDOW:
            return
        waits.sort()
        self._estimates[self.spinning] = waits[len(waits) // 2]
        waits.clear()
        if self.spinning == self._chosen:
            self._run_left -= self.WINDOW
            if self._run_left <= 0:
                self.spinning = not self._chosen  # measure the other mode again
        elif len(self._estimates) < 2:
            self.spinning = not self.spinning  # the first measurement of the other mode
        else:
            self._choose()

    def _choose(self) -> None:
        faster = self._estimates[True] < self._estimates[False] * (1.0 - self.MARGIN)
        if faster == self._chosen:
            self._run = min(2 * self._run, self.LONGEST_RUN)
        else:
            self._run = self.FIRST_RUN
        self._chosen = faster
        self.spinning = faster
        self._run_left = self._run
