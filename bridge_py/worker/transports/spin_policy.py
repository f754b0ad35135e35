"""Whether the port transport should spin while it waits for the next request, by measurement.

Spinning saves the wake-up of a sleeping reader, which is slow on a virtual machine whose
idle CPU has halted and fast elsewhere. It also takes a CPU away from the BEAM, which on a
machine with few cores is the process that must produce the next request. Which effect
wins depends on the machine, so the worker measures it instead of guessing: the time from
asking for the next request to getting it (the BEAM's turnaround, plus our wake-up when we
slept) is exactly what the choice changes, and is what a sequential caller waits for.

The rules (bench/README.md, "Where the time goes today", has what they were measured
against):

* The policy alternates between the two modes: it measures a window of ``WINDOW`` waits
  in each, keeps the one with the shorter median (spinning only when it is shorter by
  ``MARGIN``: a spin takes a CPU, so a tie goes to sleeping), and tries the other again
  after a run of ``FIRST_RUN`` waits that doubles each time the same mode wins again (up
  to ``LONGEST_RUN``). Waits longer than ``IDLE`` are the caller's own pauses, which no
  waiting strategy changes, and are left out; shorter pauses are left out by taking the
  median rather than the mean.
* A spin lasts no longer than the median wait measured while sleeping
  (:meth:`SpinPolicy.spin_time`): past that, a sleeping reader would usually have had its
  request already, and the spinner may hold the CPU that the BEAM needs to write it. The
  bound comes from sleeping waits because a bound from spinning waits would grow with the
  very delays it should cut.
* A spin needs a CPU that nobody else is waiting for. The reader reports how much of the
  recent time it spent ready to run but without a CPU
  (:class:`~bridge_py.worker.transports.run_delay.RunDelay`); after ``CROWDED_SHARES``
  such shares in a row above ``CROWDED`` the policy sleeps, and measures spinning again
  only after as many in a row below it (:meth:`SpinPolicy.crowding`). A crowd that comes
  while spinning is being measured again ends that measurement, and sleeping goes on for
  as long a run as before.
* A chosen run of spinning ends early once ``LOSING_WINDOWS`` windows in a row measure no
  shorter than sleeping did (one alone is noise). Such an early end does not choose
  sleeping: it measures both modes afresh, sleeping first, and the faster one starts a
  first run.

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
    CROWDED = 0.05  # share of the time waiting for a CPU above which nobody should spin
    CROWDED_SHARES = 3  # shares in a row on the other side of it that change its mind
    LOSING_WINDOWS = 2  # chosen spinning windows in a row no faster than sleeping: it ends

    __slots__ = (
        "_chosen",
        "_crowded",
        "_disagreeing",
        "_estimates",
        "_losing",
        "_run",
        "_run_left",
        "_waits",
        "spinning",
    )

    def __init__(self) -> None:
        self.spinning = True
        self._chosen: bool | None = None  # none yet: both modes still to be measured
        self._estimates: dict[bool, float] = {}
        self._run = self.FIRST_RUN
        self._run_left = 0
        self._waits: list[float] = []  # the current window's
        self._crowded = False
        self._disagreeing = 0  # shares in a row on the other side of CROWDED
        self._losing = 0  # windows in a row in which the chosen spinning measured slower

    @property
    def estimates(self) -> dict[bool, float]:
        """The last median wait measured in each mode (seconds), keyed by ``spinning``."""
        return dict(self._estimates)

    def spin_time(self, longest: float) -> float:
        """How long the next wait should spin before it sleeps: the median wait measured
        while sleeping, at most ``longest`` seconds (``longest`` until that is measured)."""
        return min(longest, self._estimates.get(False, longest))

    @property
    def crowded(self) -> bool:
        """Whether the policy holds that every CPU is taken: it does once
        ``CROWDED_SHARES`` shares in a row were above ``CROWDED``, and no longer once as
        many in a row were not."""
        return self._crowded

    def crowding(self, share: float) -> None:
        """Account for the share of the recent time that the reader was ready to run but
        had no CPU. While :attr:`crowded`, sleep (for at least a run, however the modes
        compare). One share alone does not change the policy's mind either way: a lone
        worker sees a crowd now and then, when the machine's other work comes in a
        burst, and a crowded one a free moment."""
        if (share > self.CROWDED) == self._crowded:
            self._disagreeing = 0
            return
        self._disagreeing += 1
        if self._disagreeing < self.CROWDED_SHARES:
            return
        self._crowded = not self._crowded
        self._disagreeing = 0
        if self.crowded and self.spinning:
            self._waits.clear()  # this window's spins took a CPU someone was waiting for
            if self._chosen is not False:
                self._run = self.FIRST_RUN  # the choice changes
            self._chosen = False
            self.spinning = False
            self._run_left = self._run

    def record(self, wait: float) -> bool:
        """Account for one wait of ``wait`` seconds spent in the current mode. True when
        that completed a window of measurements (a moment to report :meth:`crowding`)."""
        if wait > self.IDLE:
            return False
        waits = self._waits
        waits.append(wait)
        if len(waits) < self.WINDOW:
            return False
        waits.sort()
        self._estimates[self.spinning] = waits[len(waits) // 2]
        waits.clear()
        if self.spinning == self._chosen:
            self._run_left -= self.WINDOW
            self._losing = self._losing + 1 if self.spinning and not self._spin_is_faster() else 0
            if self._losing >= self.LOSING_WINDOWS:
                self._measure_afresh()
            elif self._run_left <= 0:
                self._losing = 0
                if self.crowded:
                    self._run_left = self._run  # no CPU to spin on: sleep on
                else:
                    self.spinning = not self._chosen  # measure the other mode again
        elif len(self._estimates) < 2:
            self.spinning = not self.spinning  # the first measurement of the other mode
        else:
            self._choose()
        return True

    def _spin_is_faster(self) -> bool:
        """Whether the last median spinning wait is ``MARGIN`` shorter than the last
        sleeping one."""
        return self._estimates[True] < self._estimates[False] * (1.0 - self.MARGIN)

    def _measure_afresh(self) -> None:
        """Drop the choice of spinning and measure both modes again, sleeping first."""
        self._losing = 0
        self._chosen = None
        del self._estimates[True]
        self.spinning = False

    def _choose(self) -> None:
        faster = self._spin_is_faster() and not self.crowded
        if faster == self._chosen:
            self._run = min(2 * self._run, self.LONGEST_RUN)
        else:
            self._run = self.FIRST_RUN
        self._chosen = faster
        self.spinning = faster
        self._run_left = self._run
