"""The ILP's time limit as counts of work, so that what it returns does not depend on the machine's load.

`extract_ilp`'s limit is a number of seconds of *work*: each phase counts what it does (greedy-dag's local search
its tries, HiGHS its simplex iterations, the path cuts the nodes of their graphs and flows, building a CP-SAT model
its nodes, CP-SAT its deterministic time) and charges a `Meter` at a rate calibrated on a quiet machine (each
phase's module names its rate), so a phase's share of the limit ends at the same point of its work at any load.
CPU seconds did not: under load (cache contention, other processes' threads) the same call stopped elsewhere, and
a 2-class part could be dropped by its CPU share (docs/extraction.md, "Deterministic budgets"). The CPU clock
(`tapestry.clock`) is only a safety net, as saturation's is (egraph.driver): a phase still running SAFETY_NET times
past its end in CPU seconds stops, and the selection says so (`Selection.stopped_by` = SAFETY_NET_STOP).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tapestry.clock import SAFETY_NET_STOP, clock

SAFETY_NET = 10  # times a phase's end (seconds of work from the start), in CPU seconds, after which it stops
SAFETY_FLOOR = 2.0  # CPU seconds the safety net adds, for short limits (Python's set-up alone takes a share)

T = TypeVar("T")


class Meter:
    """The work one extraction has done, in seconds at the phases' calibrated rates (`spent`), and whether the
    safety net stopped a phase (`fired`: then the selection may depend on the load)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.started = clock()
        self.spent = 0.0
        self.fired = False

    def charge(self, seconds: float) -> None:
        self.spent += seconds

    def until(self, end: float) -> Deadline:
        """The deadline `end` seconds of work after the start."""
        return Deadline(self, end)

    def within(self, seconds: float, run: Callable[[Meter], T]) -> T:
        """`run` on a meter of its own with `seconds` of work (a nested extraction), its work charged here."""
        inner = Meter(seconds)
        try:
            return run(inner)
        finally:
            self.spent += inner.spent
            self.fired = self.fired or inner.fired

    @property
    def stop(self) -> str | None:
        """SAFETY_NET_STOP if the safety net stopped a phase, else None."""
        return SAFETY_NET_STOP if self.fired else None


@dataclass(frozen=True)
class Deadline:
    """A phase's end on its meter: `end` seconds of work after the extraction's start."""

    meter: Meter
    end: float

    def left(self) -> float:
        """Seconds of work left to the end (0 past it)."""
        return max(0.0, self.end - self.meter.spent)

    def passed(self) -> bool:
        """Whether the work charged reached the end, or the CPU clock passed the safety net (recorded)."""
        return self.meter.spent >= self.end or self.safety()

    def safety(self) -> bool:
        """Whether the CPU clock passed SAFETY_NET times the end (plus SAFETY_FLOOR); recorded on the meter."""
        if clock() - self.meter.started > SAFETY_NET * self.end + SAFETY_FLOOR:
            self.meter.fired = True
            return True
        return False

    def seconds(self) -> float:
        """The CPU seconds left to the safety net (a solver's own time limit, in seconds of its clock)."""
        return max(0.0, self.meter.started + SAFETY_NET * self.end + SAFETY_FLOOR - clock())


def unbounded() -> Deadline:
    """A deadline nothing reaches: a phase run to its end (benchmarks, bounds asked for whatever they cost)."""
    return Meter(math.inf).until(math.inf)
