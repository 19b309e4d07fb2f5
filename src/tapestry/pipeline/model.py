"""The cost and memory of a pipelined training step, from what one layer's plan costs.

A layer is priced once on its stage's sub-mesh (`LayerCost`, made by `tapestry.pipeline.layer`); a stage of l
layers costs l times as much, and the step is the schedule's simulation over the stages (`schedule.simulate`)
plus each device's optimizer update and the gradient reductions its last backward does not hide. Memory per
device is the resident state of its layers under the precision (`Precision`), the activations of the
micro-batches in flight (the schedule's peak, from the simulation), and the largest working set of one layer.

Recomputation is a choice per layer: a recomputed layer keeps only its input from forward to backward and runs
its forward again in the backward (Chen et al. 2016; Megatron's full recomputation per layer).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from tapestry.pipeline.schedule import Schedule, Timeline, simulate


@dataclass(frozen=True)
class LayerCost:
    """One layer's training step on its stage's sub-mesh, per device, as its plan prices it."""

    forward: float  # seconds per micro-batch
    backward: float  # seconds per micro-batch: activation and weight gradients, their per-micro-batch communication
    update: float  # seconds per step: the optimizer's update
    params: int  # parameter elements per device
    state: int  # optimizer-state elements per device (Adam: m and v)
    slots: int  # optimizer-state tensors per parameter (Adam 2, SGD without momentum 0)
    activations: int  # bytes per micro-batch the forward keeps for the backward
    boundary: int  # bytes per micro-batch of the layer's input: what a recomputed layer keeps, what a stage sends
    working: int  # bytes beyond the resident state and the kept activations while the layer runs
    flops: float  # model FLOPs per micro-batch (the whole layer step, unsharded, no recomputation)
    itemsize: int = 2  # bytes per parameter element as the layer was imported (bfloat16: 2)
    reduce: float = 0.0  # seconds per step of weight-gradient reductions the last micro-batch's backward does not hide


def joined(a: LayerCost, b: LayerCost) -> LayerCost:
    """`a` then `b` as one piece of a stage (an embedding and the first layer; the last layer and the head): times,
    state and activations add; its input, so what recomputing it keeps and what a stage sends it, is `a`'s."""
    return LayerCost(forward=a.forward + b.forward, backward=a.backward + b.backward, update=a.update + b.update,
                     params=a.params + b.params, state=a.state + b.state, slots=a.slots or b.slots,
                     activations=a.activations + b.activations, boundary=a.boundary,
                     working=max(a.working, b.working), flops=a.flops + b.flops, itemsize=a.itemsize,
                     reduce=a.reduce + b.reduce)


@dataclass(frozen=True)
class Ends:
    """What a model runs before its first layer (`first`: the embedding) and after its last (`last`: the final
    norm, the head and the loss), each priced on a stage's sub-mesh; None where it is left out. They ride with the
    first and the last layer, so the stages holding them run and hold more, and get fewer layers."""

    first: LayerCost | None = None
    last: LayerCost | None = None

    def stack(self, layer: LayerCost, layers: int) -> list[LayerCost]:
        """The per-layer costs of `layers` copies of `layer` with the ends joined to the first and the last."""
        copies = [layer] * layers
        if self.first is not None:
            copies[0] = joined(self.first, copies[0])
        if self.last is not None:
            copies[-1] = joined(copies[-1], self.last)
        return copies


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter held between steps. `param`: the copy the compute reads; `grad`: the accumulated
    gradient; `master`: a higher-precision copy kept with the optimizer state (0: none); `state`: each
    optimizer-state element."""

    name: str
    param: int
    grad: int
    master: int
    state: int

    def bytes_per_param(self, slots: int) -> int:
        return self.param + self.grad + self.master + slots * self.state

    def resident(self, layer: LayerCost) -> float:
        """Bytes one device holds of `layer` between steps: its parameter and gradient shards, and (sharded as
        the optimizer state is) the master copy and the state."""
        optimizer_params = layer.state / layer.slots if layer.slots else layer.params
        return layer.params * (self.param + self.grad) + optimizer_params * self.master + layer.state * self.state

    def update_scale(self, layer: LayerCost) -> float:
        """How much longer the (memory-bound) update runs than as imported: bytes it touches per parameter."""
        imported = layer.itemsize * (2 + layer.slots)
        return self.bytes_per_param(layer.slots) / imported


# ZeRO (Rajbhandari et al. 2020): mixed-precision Adam holds 2 + 2 + 12 = 16 bytes per parameter: bfloat16
# parameters and gradients, float32 master weights and both moments
MIXED = Precision("mixed (bf16 compute, fp32 master + Adam)", param=2, grad=2, master=4, state=4)
BF16 = Precision("bf16 throughout", param=2, grad=2, master=0, state=2)  # everything as a bfloat16 import holds it
PRECISIONS = {"mixed": MIXED, "bf16": BF16}


def partition(costs: Sequence[float], parts: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous groups of the indices of `costs`, `parts` of them (none empty), whose largest sum is least;
    among those, the one whose groups come first as late as possible (exact: dynamic programming)."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} layers into {parts} stages (each stage needs a layer)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: least largest sum splitting the first i costs into k groups; cut[k][i]: where the last begins
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12 * max(1.0, abs(value)):
                    best[k][i], cut[k][i] = value, j
    groups, end = [], n
    for k in range(parts, 0, -1):
        start = cut[k][end]
        groups.append(tuple(range(start, end)))
        end = start
    return tuple(reversed(groups))


STEADY = 6  # groups of S micro-batches between the two simulated counts `price` extrapolates from


@dataclass(frozen=True)
class Priced:
    """A pipeline configuration priced: the step's seconds, bytes per device (by pipeline position), and the
    simulated timeline (of `simulated` micro-batches; the step's time is extrapolated from it when fewer)."""

    step_time: float
    memory: tuple[float, ...]
    timeline: Timeline

    @property
    def simulated(self) -> int:
        return self.timeline.schedule.micro_batches


def chunk_times(layers: Sequence[LayerCost], chunks: Sequence[Sequence[int]], recompute: Sequence[bool]
                ) -> tuple[list[float], list[float], list[float]]:
    """Per chunk: forward seconds, backward seconds (recomputed forwards included), bytes kept per micro-batch."""
    forward = [sum(layers[i].forward for i in chunk) for chunk in chunks]
    backward = [sum(layers[i].backward + (layers[i].forward if recompute[i] else 0.0) for i in chunk)
                for chunk in chunks]
    kept = [float(sum(layers[i].boundary if recompute[i] else layers[i].activations for i in chunk))
            for chunk in chunks]
    return forward, backward, kept


@cache
def in_flight_counts(schedule: Schedule, device: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The micro-batches in flight per chunk on `device` (pairs chunk, count) after each of its forwards, only
    those no other such point holds at least as many of in every chunk: with bytes kept per chunk >= 0, the most
    a device holds is at one of them. A schedule's steady state repeats the same counts, so these are few (an
    interleaved step of 256 micro-batches on 8 stages, v = 4: 1024 forwards per device, at most 16 points), where
    walking the order once per query (`fit`'s binary searches over recomputation ask thousands) took 80 of the 722
    profiled seconds of the 7B benchmark (docs/benchmarks.md, "7B on 64 GPUs at 4M tokens per step")."""
    held: dict[int, int] = {}
    points: set[tuple[tuple[int, int], ...]] = set()
    for task in schedule.order(device):
        held[task.chunk] = held.get(task.chunk, 0) + (1 if task.kind == "F" else -1)
        if task.kind == "F":
            points.add(tuple(sorted((c, n) for c, n in held.items() if n)))
    vectors = [dict(p) for p in points]
    kept = [p for p, v in zip(points, vectors)  # points are distinct: one covering v in every chunk exceeds it
            if not any(w is not v and all(w.get(c, 0) >= n for c, n in v.items()) for w in vectors)]
    return tuple(sorted(kept)) or ((),)


def device_memory(layers: Sequence[LayerCost], schedule: Schedule, chunks: Sequence[Sequence[int]],
           recompute: Sequence[bool], precision: Precision) -> tuple[float, ...]:
    """Bytes per device (by pipeline position): its layers' resident state, the most activations it holds at once,
    and its largest layer's working set. What a device holds follows its own order alone (a forward keeps its
    chunk's activations, the backward frees them), so no timing is needed, and a device's memory depends only
    on its own layers' recomputation."""
    _, _, kept = chunk_times(layers, chunks, recompute)
    found = []
    for d in range(schedule.stages):
        most = max(sum(n * kept[c] for c, n in counts) for counts in in_flight_counts(schedule, d))
        mine = [i for c, chunk in enumerate(chunks) if c % schedule.stages == d for i in chunk]
        found.append(sum(precision.resident(layers[i]) for i in mine) + most + max(layers[i].working for i in mine))
    return tuple(found)


def price(layers: Sequence[LayerCost], schedule: Schedule, chunks: Sequence[Sequence[int]],
          recompute: Sequence[bool], precision: Precision, transfer: float) -> Priced:
    """The step time and memory per device (`device_memory`) of `layers` cut into `chunks` (chunk c on device c % S)
    under `schedule`, with `transfer` seconds per stage-boundary hop. Many micro-batches are simulated as few:
    past the warm-up the schedule reaches a steady state where each micro-batch adds the same time, so the time
    is extrapolated linearly from two simulated counts STEADY groups of S apart (exact for equal chunks; within
    ~1% where chunks differ, whose steady state can repeat over more groups)."""
    forward, backward, kept = chunk_times(layers, chunks, recompute)
    s, v, m = schedule.stages, schedule.chunks, schedule.micro_batches
    small = s * (v + 2)  # past every device's warm-up: (S - d - 1) * 2 + (v - 1) * S + 1 <= (v + 1) * S
    if m <= small + STEADY * s:
        timeline = simulate(schedule, forward, backward, transfer, kept)
        makespan = timeline.makespan
    else:
        first = simulate(Schedule(schedule.name, s, small, v), forward, backward, transfer, kept)
        timeline = simulate(Schedule(schedule.name, s, small + STEADY * s, v), forward, backward, transfer, kept)
        per_micro_batch = (timeline.makespan - first.makespan) / (STEADY * s)
        makespan = timeline.makespan + per_micro_batch * (m - timeline.schedule.micro_batches)
    devices = [[i for c, chunk in enumerate(chunks) if c % s == d for i in chunk] for d in range(s)]
    update = max(sum(layers[i].update * precision.update_scale(layers[i]) + layers[i].reduce for i in mine)
                 for mine in devices)
    return Priced(makespan + update, device_memory(layers, schedule, chunks, recompute, precision), timeline)


@cache
def exposed_hops(schedule: Schedule) -> float:
    """Stage-boundary hops on the critical path of a step under `schedule` (`price`'s step time grows by this many
    times each hop's seconds, while hops are short beside the chunks' compute): the rest are sent while the
    receiver computes. Of uniform chunks, whose times do not change it (GPipe 2(S - 1), interleaved 1F1B
    2(S v - 1), 1F1B one to two a micro-batch: its strict alternation waits on the round trips)."""
    chunks = schedule.stages * schedule.chunks
    uniform = [LayerCost(forward=1.0, backward=2.0, update=0.0, params=0, state=0, slots=0, activations=0,
                         boundary=0, working=0, flops=0.0)] * chunks
    one_each = tuple((c,) for c in range(chunks))
    hop = 1e-4  # seconds: far below a chunk's, so the critical path is the one without transfers
    kept = [False] * chunks
    grown = price(uniform, schedule, one_each, kept, BF16, hop).step_time - \
        price(uniform, schedule, one_each, kept, BF16, 0.0).step_time
    return grown / hop
