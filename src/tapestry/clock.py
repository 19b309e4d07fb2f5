"""The clock planning's budgets are measured by: this process's CPU time, not the wall.

On a machine shared with other jobs the wall clock runs on while the search waits for a core: at a load
average of 11 on 2 cores, 30 s of wall gave the 2-layer LLaMA-7B training step on 8x8 about 4 s of CPU, and
generation stopped before any sharded run existed (every op replicated, 215 ms where a search with its CPU
seconds found 36 ms). Measured in CPU seconds, a budget buys the same search whatever the load, so the plan does
not depend on it. Even CPU seconds vary with the load (cache contention, other threads spinning), so saturation's
phases (egraph.driver) and extraction's (extract.work) stop on counts of work, and this clock is only their
safety net. CPU time counts every thread of the process; the phases it bounds run on one.
"""
from __future__ import annotations

import time

SAFETY_NET_STOP = "seconds (safety net)"  # what a phase says it was stopped by where the clock, not its count, did


def clock() -> float:
    """Seconds of CPU this process has used: the budgets' clock."""
    return time.process_time()
