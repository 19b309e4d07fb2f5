"""Pipeline schedules: which micro-batch each device runs when, simulated task by task.

A model cut into S * v chunks runs on S devices along one mesh axis, chunk c on device c % S (v > 1: each
device holds v "virtual stages", Megatron-LM's interleaving). Each micro-batch goes forward through the chunks
in order and backward in reverse. The schedules differ only in the order each device runs its tasks:

- GPipe (Huang et al. 2019): every forward, then every backward; m micro-batches in flight.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): S - d - 1 forwards of warm-up on device d, then one forward one
  backward; at most S - d micro-batches in flight on device d.
- interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): 1F1B over v chunks per device, in groups of S
  micro-batches; the bubble shrinks v times, at the price of v times more stage-boundary transfers.

`simulate` is the cost: list scheduling of each device's order with the data dependencies (a forward waits for
the chunk before it, a backward for the chunk after it, and a transfer across devices adds its seconds). The
closed forms (`Schedule.bubble`, `Schedule.in_flight`) are what the literature states; tests check them against
the simulation.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True, order=True)
class Task:
    """One chunk's forward ("F") or backward ("B") of one micro-batch."""

    kind: str
    micro_batch: int
    chunk: int


@dataclass(frozen=True)
class Schedule:
    """`name` one of SCHEDULES, over `stages` devices, `micro_batches` per step, `chunks` per device (v)."""

    name: str
    stages: int
    micro_batches: int
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"schedule {self.name!r} is not one of {', '.join(SCHEDULES)}")
        if self.stages < 1 or self.micro_batches < 1 or self.chunks < 1:
            raise ValueError(f"schedule {self.name}: stages, micro-batches and chunks must be >= 1; got "
                             f"{self.stages}, {self.micro_batches}, {self.chunks}")
        if (self.chunks > 1) != (self.name == "interleaved"):
            raise ValueError(f"schedule {self.name}: {self.chunks} chunks per device; only 'interleaved' has more "
                             "than one, and it needs at least two")
        if self.name == "interleaved" and self.micro_batches % self.stages:
            raise ValueError(f"interleaved 1F1B runs micro-batches in groups of the stage count (Megatron-LM): "
                             f"{self.micro_batches} micro-batches is not a multiple of {self.stages} stages")

    @property
    def bubble(self) -> float:
        """Idle time over the ideal m * (F + B) of uniform chunks without transfers: (S - 1) / (v * m)."""
        return (self.stages - 1) / (self.chunks * self.micro_batches)

    def in_flight(self, device: int) -> int:
        """Most chunk-micro-batches device `device` holds activations for at once (forward done, backward not)."""
        total = self.micro_batches * self.chunks
        return min(total, self.warmup(device) + 1) if self.name != "gpipe" else total

    def warmup(self, device: int) -> int:
        """Forwards device `device` runs before its first backward (1F1B and interleaved)."""
        s, v, total = self.stages, self.chunks, self.micro_batches * self.chunks
        if self.name == "gpipe":
            return total
        return min(total, (s - device - 1) * 2 + (v - 1) * s if v > 1 else s - device - 1)

    def device_of(self, chunk: int) -> int:
        return chunk % self.stages

    def order(self, device: int) -> list[Task]:
        """The tasks device `device` runs, in the order it runs them."""
        s, v, m = self.stages, self.chunks, self.micro_batches
        forwards = [Task("F", self._micro_batch(k), self._chunk(k, device, True)) for k in range(m * v)]
        backwards = [Task("B", self._micro_batch(k), self._chunk(k, device, False)) for k in range(m * v)]
        if self.name == "gpipe":
            return forwards + backwards
        w = self.warmup(device)
        steady = [t for pair in zip(forwards[w:], backwards) for t in pair]
        return forwards[:w] + steady + backwards[len(forwards) - w:]

    def _micro_batch(self, k: int) -> int:
        """The micro-batch of a device's k-th forward (or backward): groups of S micro-batches per chunk sweep."""
        s, v = self.stages, self.chunks
        return (k // (s * v)) * s + k % s if v > 1 else k

    def _chunk(self, k: int, device: int, forward: bool) -> int:
        s, v = self.stages, self.chunks
        local = (k % (s * v)) // s if v > 1 else 0
        return (local if forward else v - 1 - local) * s + device


@dataclass(frozen=True)
class Slot:
    device: int
    task: Task
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """A simulated step: every task's slot, the makespan, and per device the most activation bytes held."""

    schedule: Schedule
    slots: tuple[Slot, ...]
    makespan: float
    peak_activations: tuple[float, ...]  # per device
    peak_in_flight: tuple[int, ...]  # per device: chunk-micro-batches with forward done and backward not

    def busy(self, device: int) -> float:
        return sum(s.end - s.start for s in self.slots if s.device == device)


def simulate(schedule: Schedule, forward: Sequence[float], backward_seconds: Sequence[float], transfer: float = 0.0,
             activations: Sequence[float] | None = None) -> Timeline:
    """Run `schedule` with chunk c's forward taking forward[c] seconds and its backward backward_seconds[c] (one per
    chunk, S * v of them), `transfer` seconds per stage-boundary hop between devices (sent without blocking
    the sender), and chunk c keeping activations[c] bytes per micro-batch from its forward to its backward."""
    chunks = schedule.stages * schedule.chunks
    kept = [0.0] * chunks if activations is None else list(activations)
    if not len(forward) == len(backward_seconds) == len(kept) == chunks:
        raise ValueError(f"simulate: {schedule.name} over {schedule.stages} stages x {schedule.chunks} chunks "
                         f"needs {chunks} chunk times; got {len(forward)} forward, {len(backward_seconds)} backward, "
                         f"{len(kept)} activations")
    # tasks as (kind, micro-batch, chunk) tuples, kind 0 forward and 1 backward: hashing them is the hot loop
    orders = [[(int(t.kind == "B"), t.micro_batch, t.chunk) for t in schedule.order(d)]
              for d in range(schedule.stages)]
    done: dict[tuple[int, int, int], float] = {}
    free = [0.0] * schedule.stages
    at = [0] * schedule.stages
    held, peak_held = [0.0] * schedule.stages, [0.0] * schedule.stages
    count, peak_count = [0] * schedule.stages, [0] * schedule.stages
    slots: list[tuple[int, tuple[int, int, int], float, float]] = []
    last, stages, total = chunks - 1, schedule.stages, sum(map(len, orders))
    while len(slots) < total:
        progressed = False
        for d, order in enumerate(orders):
            while at[d] < len(order):
                task = order[at[d]]
                backward, mb, c = task
                after = ((0, mb, c - 1) if c > 0 else None) if not backward else (1, mb, c + 1) if c < last \
                    else (0, mb, c)
                if after is None:
                    ready = 0.0
                elif after in done:
                    ready = done[after] + (transfer if after[2] % stages != d else 0.0)
                else:
                    break
                start = free[d] if free[d] > ready else ready
                end = start + (backward_seconds[c] if backward else forward[c])
                done[task] = free[d] = end
                slots.append((d, task, start, end))
                sign = -1 if backward else 1
                held[d] += sign * kept[c]
                count[d] += sign
                peak_held[d], peak_count[d] = max(peak_held[d], held[d]), max(peak_count[d], count[d])
                at[d] += 1
                progressed = True
        if not progressed:
            stuck = {d: orders[d][at[d]] for d in range(stages) if at[d] < len(orders[d])}
            raise AssertionError(f"schedule {schedule} deadlocks: devices wait on (backward, micro-batch, chunk) "
                                 f"{stuck}")
    made = tuple(Slot(d, Task("FB"[k], mb, c), start, end) for d, (k, mb, c), start, end in slots)
    return Timeline(schedule, made, max(s.end for s in made), tuple(peak_held), tuple(peak_count))
