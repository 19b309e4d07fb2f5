"""`plan_pipeline`: stages over one mesh axis, chosen by cost with everything else.

For each stage count S dividing the pipeline axis, one layer's training step is planned by the optimizer on the
sub-mesh a stage gets (the axis shrunk S times): explored once, and its fastest plan extracted (over more than one
stage, with the transfers its input and incoming gradient make between stages priced: `boundary.BoundaryPriced`;
the optimizer prices placing an input as free), then leaner layer
plans one at a time (where the fastest does not fit or shards less than it could; `Explored.leaner_plans`), each
the fastest under less memory than the last, while the last one's ideal time (`ideal_time`, a floor under the
next one's step) beats the best step found: each leaner plan is an extraction under a memory budget, the dearest
calls of the search. Stage counts go largest first (the smallest
sub-meshes: cheapest to plan, and most often the fastest), so the best step is known early; after the first, a
layer's fusion-priced refit (half an extraction's CP-SAT runs) is made only where its plain fit's floor comes within
FUSION_REFIT_MARGIN of that step (not an exact bound), and the smaller stage counts are not tried at all once one's
fastest layer plan's floor is STAGE_STOP_MARGIN above it (not an exact bound either). Identical layers reuse
the layer plan: 80 layers cost one optimization per sub-mesh. Every layer plan of the front is then tried under
every schedule (GPipe, 1F1B, interleaved 1F1B with v chunks per device), with on each device the fewest recomputed
layers that fit the memory budget; the fastest configuration that fits wins. S = 1 is no pipeline: gradient
accumulation over the micro-batches on the whole mesh. Stage boundaries cost one point-to-point transfer of the
layer's input per micro-batch each way, over the pipeline axis's link. The model's ends (its embedding; its final
norm, head and loss), when given, are planned once per sub-mesh too and ride with the first and the last layer
(`model.Ends`).

A plan runs with `tapestry.parallelize_step(..., pipeline=plan)` (spmd/pipelined.py): each stage on its own
devices, its layers laid out as the stage plan lays the layer out (spmd/stage_plan.py).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tapestry.cost import CostModel, Link
from tapestry.egraph.driver import Budget
from tapestry.graph import Graph
from tapestry.optimizer import FUSED_EXTRACTION_DEVICES, MemoryBudgetError, OptimizeResult, explore
from tapestry.pipeline.boundary import BoundaryPriced
from tapestry.pipeline.layer import layer_cost
from tapestry.pipeline.model import (
    PRECISIONS,
    Ends,
    LayerCost,
    Precision,
    Priced,
    chunk_times,
    device_memory,
    exposed_hops,
    partition,
    price,
)
from tapestry.pipeline.schedule import SCHEDULES, Schedule, simulate
from tapestry.plan import Plan
from tapestry.sharding import Mesh

Step = Graph | Callable[[int], Graph]  # a training step, or a function from the micro-batch size to it
CHUNKS = (2, 4)  # virtual stages per device tried by the interleaved schedule
DRAWN = 4  # micro-batches per stage a drawing shows by default
REBALANCE_TRIES = 16  # layer moves `rebalanced` prices at most
# the least a leaner layer plan must be able to gain (of the best step so far, by its floor `ideal_time`) for the
# front to be extracted: the leaner plans' extractions under memory budgets were 70% of the 7B step's planning time
# on 64 GPUs (docs/benchmarks.md), and are kept there even at 5%: its chosen layer plan (4.48 s) is a leaner one
LEANER_SLACK = 0.02
# each layer extraction's `time_limit` (the ILP's budget of counted work, `extract_ilp`), half `optimize`'s 10: on
# the 7B step on 64 GPUs every stage count's best configuration and floor came out the same at 5 as at 10, in 297
# CPU s of plan_pipeline instead of 454 (docs/benchmarks.md, "7B on 64 GPUs at 4M tokens per step")
LAYER_TIME_LIMIT = 5.0
# A layer extraction's second, fusion-priced fit (`Explored.extract(..., fusion_refit=)`, half its CP-SAT runs) is made
# for a stage count after the first only where the plain fit's floor (`ideal_time`) is less than this share above
# the best step found. NOT an exact bound: no floor known before that fit bounds its plan (the exact LP floor of
# benchmarks/stage_floor.py is below the best step for every stage count of the 7B step on 64 GPUs); the fused fit
# found the 7B block 2.2% faster on 8x8, and on that step no stage count's plan but the first's came from it
# (docs/benchmarks.md, "7B on 64 GPUs at 4M tokens per step")
FUSION_REFIT_MARGIN = 0.25
# Stage counts go largest first; once one's fastest layer plan has a floor (`ideal_time`) this share or more above the
# best step found, the smaller ones (larger sub-meshes, dearer to plan) are not tried. NOT an exact bound: no floor
# known before a sub-mesh's extraction separates them (compute spreads alike over every stage count; the LP floor of
# benchmarks/stage_floor.py is below the best step for every stage count of the 7B step on 64 GPUs). What it rests on:
# the searches on larger sub-meshes find layer plans that scale worse than the devices they add, the floors rising as
# the stage count falls (the 7B step on 8x8: 4.4, 7.9, 12.5, 21.9 s a step for S = 8, 4, 2, 1; the 70B step on 8x8x8:
# a best step of 12.7 s with S = 8, then 29.9, 54.5, 117.9 s): S = 2 and 1 were 36% of the 70B plan_pipeline's CPU s
# and 68% of the 7B's (docs/benchmarks.md, "70B on 512 GPUs (8x8x8) at 4M tokens per step"). math.inf tries every
# stage count.
STAGE_STOP_MARGIN = 0.5


@dataclass(frozen=True)
class PipelinePlan:
    """A pipelined training step: which layers run where and when, and what that costs."""

    mesh: Mesh
    axis: int  # the mesh axis the stages are laid over
    schedule: Schedule
    chunks: tuple[tuple[int, ...], ...]  # layer indices per model chunk; chunk c runs on pipeline position c % S
    recompute: tuple[bool, ...]  # per layer: its forward is run again in the backward, only its input kept
    precision: Precision
    micro_batch: int  # sequences per micro-batch
    layer: LayerCost  # one layer on its stage's sub-mesh
    # that layer's plan on `stage_mesh` (every stage runs it on its own devices): the optimizer's (over more than one
    # stage extracted with its hops priced, `BoundaryPriced`, which its plan's cost includes; `layer` has none), or
    # a Plan given (training.plans'); None: the layer's cost was given
    stage_plan: OptimizeResult | Plan | None
    transfer: float  # seconds per stage-boundary hop
    cost: float  # predicted seconds per step
    memory: tuple[float, ...]  # bytes per device, by pipeline position
    # per device, the spec sheet's FLOP/s of the layer's compute dtype (`mfu`'s denominator; not the rate the
    # profile prices with); None: the profile gives none
    spec_peak_flops: float | None = None
    ends: Ends = Ends()  # the embedding before the first layer and the head and loss after the last, as priced

    @property
    def stages(self) -> int:
        return self.schedule.stages

    @property
    def stage_mesh(self) -> Mesh:
        return stage_mesh(self.mesh, self.axis, self.stages)

    @property
    def peak_memory(self) -> int:
        return int(max(self.memory))

    @property
    def layer_plan(self) -> Plan | None:
        """The stage plan as a Plan (what a stage's layers run under), or None where none was planned."""
        return self.stage_plan.plan if isinstance(self.stage_plan, OptimizeResult) else self.stage_plan

    @property
    def layers_by_stage(self) -> tuple[tuple[int, ...], ...]:
        """Per pipeline position, the layers it holds (all its chunks)."""
        return tuple(tuple(i for c, chunk in enumerate(self.chunks) if c % self.stages == d for i in chunk)
                     for d in range(self.stages))

    @property
    def flops(self) -> float:
        """Model FLOPs per step: every layer's step for every micro-batch, recomputation not counted."""
        return self.schedule.micro_batches * sum(c.flops for c in self.costs)

    @property
    def costs(self) -> list[LayerCost]:
        """Per layer, what it costs: the layer's, with the first and last joined to the model's ends."""
        return self.ends.stack(self.layer, len(self.recompute))

    @property
    def mfu(self) -> float:
        """Model FLOPs over predicted time x devices x the spec sheet's peak (`DeviceProfile.mfu`)."""
        if self.spec_peak_flops is None:
            raise ValueError("PipelinePlan.mfu: the profile that priced the plan gives no spec-sheet peak for its "
                             "compute dtype (spec_peak_flops_by_dtype), and MFU divides by the spec sheet's peak")
        return self.flops / (self.cost * self.mesh.size * self.spec_peak_flops)

    def describe(self) -> str:
        s = self.schedule
        name = "gradient accumulation (no pipeline)" if s.stages == 1 else \
            f"{s.name}" + (f" with {s.chunks} chunks per device" if s.chunks > 1 else "")
        lines = [f"{s.stages} stages over mesh axis {self.axis} of {self.mesh} (each stage on {self.stage_mesh}); "
                 f"{name}; {s.micro_batches} micro-batches of {self.micro_batch}; bubble {s.bubble:.1%}",
                 f"predicted {self.cost * 1e3:.1f} ms per step, "
                 + ("MFU unknown (no spec-sheet peak), " if self.spec_peak_flops is None else f"MFU {self.mfu:.1%}, ")
                 + 
                 f"{max(self.memory) / 2**30:.2f} GiB on the fullest device ({self.precision.name}); "
                 f"{sum(self.recompute)} of {len(self.recompute)} layers recomputed"]
        last = (len(self.chunks) - 1) % s.stages
        for d, mine in enumerate(self.layers_by_stage):
            recomputed = sum(self.recompute[i] for i in mine)
            held = (["first (embedding)"] if d == 0 and self.ends.first else []) + [f"layers {_ranges(mine)}"] + \
                (["last (head, loss)"] if d == last and self.ends.last else [])
            lines.append(f"  stage {d}: {' + '.join(held)}" + (f" ({recomputed} recomputed)" if recomputed else "")
                         + f", {self.memory[d] / 2**30:.2f} GiB")
        return "\n".join(lines)

    def draw(self, path: str | Path, micro_batches: int | None = None) -> Path:
        """The schedule as a Gantt chart, with `micro_batches` of the step's (default: up to 4 per stage, enough
        to show warm-up, steady state and cool-down; the step's own count when fewer)."""
        from tapestry.pipeline.draw import draw_timeline

        s = self.schedule
        shown = min(s.micro_batches, micro_batches or DRAWN * s.stages)
        if s.name == "interleaved":
            shown = max(s.stages, shown - shown % s.stages)
        forward, backward, kept = chunk_times(self.costs, self.chunks, self.recompute)
        timeline = simulate(Schedule(s.name, s.stages, shown, s.chunks), forward, backward, self.transfer, kept)
        title = self.describe().splitlines()[0] + (f"\n(drawn with {shown} of its {s.micro_batches} micro-batches)"
                                                   if shown < s.micro_batches else "")
        return draw_timeline(timeline, path, title=title)


@dataclass(frozen=True)
class Candidate:
    """The best configuration found for one stage count (None: nothing fit), for the report: of its fastest layer
    plan only where the leaner ones could not have won by more than the slack (`ideal_time`); `why` says why none
    fit and where leaner plans were not extracted."""

    stages: int
    plan: PipelinePlan | None
    why: str = ""


@dataclass(frozen=True)
class PipelineResult:
    """The chosen pipeline plan (`plan.cost`, `peak_memory` as `tapestry.optimize`'s result has them) and the
    best of every stage count tried."""

    plan: PipelinePlan
    candidates: tuple[Candidate, ...]

    @property
    def peak_memory(self) -> int:
        return self.plan.peak_memory

    def explain(self) -> str:
        rows = [self.plan.describe(), "stage counts tried:"]
        for c in self.candidates:
            rows.append(f"  S={c.stages}: " + (c.why if c.plan is None else
                                               f"{c.plan.schedule.name} v={c.plan.schedule.chunks}, "
                                               f"{c.plan.cost * 1e3:.1f} ms, {max(c.plan.memory) / 2**30:.2f} GiB"
                                               + (f" ({c.why})" if c.why else "")))
        return "\n".join(rows)


def stage_mesh(mesh: Mesh, axis: int, stages: int) -> Mesh:
    """The devices of one stage: `mesh` with axis `axis` shrunk `stages` times (dropped when it is used up)."""
    if mesh.shape[axis] % stages:
        raise ValueError(f"{stages} stages do not divide mesh axis {axis} of {mesh} (size {mesh.shape[axis]})")
    shape = [n // stages if a == axis else n for a, n in enumerate(mesh.shape)]
    kept = [n for a, n in enumerate(shape) if n > 1 or a != axis]
    return Mesh(*kept) if kept else Mesh(1)


def _ranges(indices: Sequence[int]) -> str:
    parts, start = [], None
    for k, i in enumerate(indices):
        if start is None:
            start = i
        if k + 1 == len(indices) or indices[k + 1] != i + 1:
            parts.append(f"{start}" if start == i else f"{start}-{i}")
            start = None
    return ", ".join(parts)


def configurations(stages: int, micro_batches: int, layers: int, schedules: Sequence[str],
                   chunks: Sequence[int]) -> list[Schedule]:
    """The schedules worth pricing: with one stage, only 1F1B (gradient accumulation: one micro-batch in flight;
    GPipe would hold all); interleaving only where every chunk gets a layer and micro-batches group by S."""
    if stages == 1:
        return [Schedule("1f1b", 1, micro_batches)]
    found = [Schedule(name, stages, micro_batches) for name in schedules if name != "interleaved"]
    if "interleaved" in schedules and micro_batches % stages == 0:
        found += [Schedule("interleaved", stages, micro_batches, v) for v in chunks if stages * v <= layers]
    return found


Fitted = tuple[Priced, tuple[tuple[int, ...], ...], tuple[bool, ...]]  # priced, chunks, recomputed per layer


def fit(layer: LayerCost, layers: int, schedule: Schedule, precision: Precision, transfer: float,
        memory_budget: float | None, sizes: Sequence[int] | None = None, ends: Ends = Ends()) -> Fitted | None:
    """`layers` copies of `layer`, the model's `ends` joined to the first and last, in the schedule's chunks
    (`sizes` layers each, in order; default the split whose costliest chunk costs least), with on each device the
    fewest recomputed layers per chunk (the first ones of each) that fit `memory_budget`: a device's memory
    depends on its own recomputation alone (`model.device_memory`), and each layer recomputed only lowers it and
    only adds time, so the least per device is the fastest. None when even recomputing every layer does not fit."""
    s = schedule.stages
    copies = ends.stack(layer, layers)
    if sizes is None:
        chunk_list = partition([c.forward + c.backward for c in copies], s * schedule.chunks)
    else:
        stops = list(itertools.accumulate(sizes))
        chunk_list = tuple(tuple(range(stop - n, stop)) for n, stop in zip(sizes, stops))

    def flags(per_device: Sequence[int]) -> tuple[bool, ...]:
        return tuple(k < per_device[c % s] for c, chunk in enumerate(chunk_list) for k in range(len(chunk)))

    def held(per_device: Sequence[int]) -> tuple[float, ...]:
        return device_memory(copies, schedule, chunk_list, flags(per_device), precision)

    most = max(map(len, chunk_list)) if layer.activations > layer.boundary else 0  # else recomputing saves nothing
    recomputed = [0] * s
    if memory_budget is not None:
        if max(held([most] * s)) > memory_budget:
            return None
        for d in range(s):  # the least count that fits device d (the others' counts do not change its memory)
            low, high = 0, most
            while low < high:
                mid = (low + high) // 2
                if held([*recomputed[:d], mid, *recomputed[d + 1:]])[d] <= memory_budget:
                    high = mid
                else:
                    low = mid + 1
            recomputed[d] = low
    chosen = flags(recomputed)
    return price(copies, schedule, chunk_list, chosen, precision, transfer), chunk_list, chosen


def rebalanced(layer: LayerCost, layers: int, schedule: Schedule, precision: Precision, transfer: float,
               memory_budget: float | None, start: Fitted, ends: Ends = Ends()) -> Fitted:
    """`start` (a `fit`), then one layer at a time moved from the most loaded device to the least loaded (forward,
    backward and recomputed forwards per micro-batch) while the step gets no slower (a move that ties can open
    the next), at most REBALANCE_TRIES times: the stages that hold the most micro-batches in flight recompute
    the most, so they are better off with fewer layers. A greedy search: not proven best."""
    best, s = start, schedule.stages
    copies = ends.stack(layer, layers)
    for _ in range(REBALANCE_TRIES):
        _, chunk_list, flags = best
        per_chunk = [sum(copies[i].forward + copies[i].backward + copies[i].forward * flags[i] for i in chunk)
                     for chunk in chunk_list]
        load = [sum(per_chunk[c::s]) for c in range(s)]
        heavy, light = load.index(max(load)), load.index(min(load))
        a = max(range(heavy, len(chunk_list), s), key=lambda c: len(chunk_list[c]))
        b = min(range(light, len(chunk_list), s), key=lambda c: len(chunk_list[c]))
        if heavy == light or len(chunk_list[a]) == 1:
            break
        sizes = [len(chunk) - (c == a) + (c == b) for c, chunk in enumerate(chunk_list)]
        found = fit(layer, layers, schedule, precision, transfer, memory_budget, sizes, ends)
        if found is None or found[0].step_time > best[0].step_time * (1 + 1e-9):
            break
        best = found
    return best


def exposed_share(tried: Sequence[Schedule], layers: int, micro_batches: int) -> float:
    """A layer's share, per micro-batch, of the stage round trips (its input forward, its gradient back) that a step
    of `layers` layers leaves on its critical path, under the schedule with the most chunks `tried` (the least
    exposed of those: GPipe's over 1F1B's without interleaving): a device's L/S layers pay the exposed hops once
    per step, as `price` prices them. The other hops are sent while the receiver computes: charging every hop (S v
    round trips a micro-batch) priced the 7B step's interleaved transfers 33-146 times what its step pays for them
    and chose slower stage plans for S = 2 and 4 (docs/benchmarks.md, "7B on 64 GPUs at 4M tokens per step")."""
    most = max(s.chunks for s in tried)
    stages = tried[0].stages
    return min(exposed_hops(s) for s in tried if s.chunks == most) / 2 * stages / (layers * micro_batches)


def ideal_time(layer: LayerCost, layers: int, stages: int, micro_batches: int, precision: Precision,
               ends: Ends = Ends()) -> float:
    """A floor under the step time of `layers` copies of `layer` (the model's `ends` joined) in `stages` stages,
    whatever the schedule, split or recomputation: every micro-batch's forward and backward of every layer, and
    every layer's update and exposed reductions once, shared evenly by the devices, with no bubble or transfer
    (a device's makespan is at least its share of the compute, its update at least its share of the updates).
    The update is counted at min(1, `precision`'s update scale) of its imported time, and so the floor floors a
    leaner plan of the layer too, as far as `layer`'s plan is the cheapest by the objective layer plans are
    extracted by (`Explored.extract` with `micro_batches`: forward and backward per micro-batch, the update
    and reductions once; `plan_pipeline` extracts a leaner plan only where the last one's floor beats the best
    step so far). Over more than one stage that objective prices the stage transfers too, those the schedule with
    the most chunks leaves exposed (`BoundaryPriced`, `exposed_share`), so there the floor holds as far as the
    schedule chosen exposes no fewer of the transfers a leaner plan saves."""
    copies = ends.stack(layer, layers)
    least = min(1.0, *(precision.update_scale(c) for c in copies))
    return least * sum(micro_batches * (c.forward + c.backward) + c.update + c.reduce for c in copies) / stages


def best_configuration(layer: LayerCost, layers: int, mesh: Mesh, axis: int, stages: int, micro_batches: int,
                       precision: Precision, link: Link, memory_budget: float | None,
                       schedules: Sequence[str] = SCHEDULES, chunks: Sequence[int] = CHUNKS,
                       spec_peak_flops: float | None = None,
                       stage_plan: OptimizeResult | None = None, micro_batch: int = 1, ends: Ends = Ends()
                       ) -> PipelinePlan | None:
    """The fastest schedule (and recomputation) for `layers` copies of `layer` (the model's `ends` joined to the
    first and the last) in `stages` stages over mesh axis `axis`, `micro_batches` per step, that fits
    `memory_budget`, its layers then `rebalanced`; None when none fits."""
    transfer = link.alpha + layer.boundary / link.beta if stages > 1 else 0.0
    fitted = [(schedule, found) for schedule in configurations(stages, micro_batches, layers, schedules, chunks)
              for found in [fit(layer, layers, schedule, precision, transfer, memory_budget, ends=ends)]
              if found is not None]
    if not fitted:
        return None
    schedule, even = min(fitted, key=lambda f: (f[1][0].step_time, max(f[1][0].memory)))
    priced, chunk_list, flags = rebalanced(layer, layers, schedule, precision, transfer, memory_budget, even, ends)
    return PipelinePlan(mesh, axis, schedule, chunk_list, flags, precision, micro_batch, layer, stage_plan,
                        transfer, priced.step_time, priced.memory, spec_peak_flops, ends)


def plan_pipeline(layer: Step, layers: int, mesh: Mesh, global_batch: int,
                  cost_model: CostModel, micro_batch_sizes: Sequence[int] | None = None, axis: int = 0,
                  stages: Sequence[int] | None = None, memory_budget: float | None = 80 * 10**9,
                  precision: str | Precision = "mixed", schedules: Sequence[str] = SCHEDULES,
                  chunks: Sequence[int] = CHUNKS, budget: Budget = Budget(), extractor: str = "ilp",
                  time_limit: float = LAYER_TIME_LIMIT, pareto_points: int = 3, first: Step | None = None,
                  last: Step | None = None, leaner_slack: float = LEANER_SLACK,
                  stop_margin: float = STAGE_STOP_MARGIN) -> PipelineResult:
    """The fastest pipelined training step of `layers` identical layers on `mesh` that fits `memory_budget`
    bytes per device, `global_batch` sequences per step.

    `layer` is one layer's training step (`pipeline.layer_step`) at one micro-batch size, or a function from
    a micro-batch size (sequences) to it; `micro_batch_sizes` lists the sizes to try (default: the graph's
    batch, read off its first user input). `stages` lists the stage counts to try (default: every divisor of
    mesh axis `axis`). The optimizer's knobs (`budget`, `extractor`, `time_limit`) plan each layer;
    `pareto_points` bounds the layer plans extracted per sub-mesh (the fastest, then each the fastest under less
    memory than the last), the next extracted only where the last one's ideal time (a floor under every leaner
    plan's step) is more than `leaner_slack` below the best step so far, the stage count's own configurations
    included: a skipped plan could have made the step that much faster at most (the candidates say where leaner
    plans were skipped). `first` and `last` are the training steps of what runs before the first layer and
    after the last (`pipeline.first_step`, `pipeline.last_step`: the embedding; the final norm, head and loss),
    graphs or functions of the micro-batch size like `layer`; each is planned (its fastest plan) on every stage
    sub-mesh and rides with the first or last layer. Stage counts go largest first; once one's fastest layer plan
    has a floor `stop_margin` or more above the best step found, the smaller ones are not tried (not an exact bound:
    STAGE_STOP_MARGIN; their candidates say so). MemoryBudgetError when no configuration fits."""
    if not 0 <= axis < mesh.ndim:
        raise ValueError(f"pipeline axis {axis} is not an axis of {mesh}")
    profile = getattr(cost_model, "profile", None)
    if profile is None:
        raise ValueError(f"plan_pipeline prices stage transfers on the profile's link of axis {axis}; "
                         f"{type(cost_model).__name__} has no `profile` (use DefaultCostModel)")
    link = profile.axis_links(mesh.shape)[axis]
    if isinstance(precision, str) and precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)} (or a pipeline.Precision)")
    chosen_precision = PRECISIONS[precision] if isinstance(precision, str) else precision
    build = layer if callable(layer) else (lambda _: layer)
    if micro_batch_sizes is not None:
        sizes = tuple(micro_batch_sizes)
    elif isinstance(layer, Graph):
        sizes = (_batch(layer),)
    else:
        raise ValueError("plan_pipeline: give micro_batch_sizes (sequences per micro-batch) with a layer builder")
    if isinstance(layer, Graph) and len(sizes) != 1:
        raise ValueError("plan_pipeline: one layer graph has one micro-batch size; pass a builder to try several")
    bad = [b for b in sizes if b < 1 or global_batch % b]
    if bad:
        raise ValueError(f"micro-batch size {bad[0]} does not divide the global batch {global_batch}")
    counts = tuple(stages) if stages is not None else tuple(
        s for s in range(1, mesh.shape[axis] + 1) if mesh.shape[axis] % s == 0 and s <= layers)
    graphs = {b: build(b) for b in sizes}
    end_graphs = {b: tuple(None if end is None else end(b) if callable(end) else end for end in (first, last))
                  for b in sizes}
    candidates = []
    leading = math.inf  # the fastest step so far, of any stage count
    stopped = ""  # why the smaller stage counts are not tried
    for s in sorted(counts, reverse=True):  # the smallest sub-meshes first: cheapest to plan, often fastest
        if stopped:
            candidates.append(Candidate(s, None, stopped))
            continue
        best: PipelinePlan | None = None
        why, floors = [], []
        for b, graph in graphs.items():  # one call per (sub-mesh, micro-batch size): its e-graph freed on return
            found, said, floor = _stage_plan(graph, end_graphs[b], layers, mesh, axis, s, global_batch // b, b,
                                      chosen_precision, link, profile.device.spec_peak(_compute_dtype(graph)),
                                      memory_budget, schedules, chunks, budget, extractor,
                                      time_limit, pareto_points, leaner_slack, cost_model, leading)
            why += [f"micro-batch {b}: {said}"] if said else []
            floors.append(floor)
            if found is not None and (best is None or (found.cost, found.peak_memory) < (best.cost,
                                                                                           best.peak_memory)):
                best = found
            if best is not None:
                leading = min(leading, best.cost)
        candidates.append(Candidate(s, best, "; ".join(why)))
        floor = min(floors)
        if math.isfinite(floor) and floor >= (1 + stop_margin) * leading:
            stopped = (f"not tried: S={s}'s fastest layer plan has a floor of {floor * 1e3:.1f} ms a step, "
                       f"{stop_margin:.0%} or more above the best step found ({leading * 1e3:.1f} ms), and fewer "
                       f"stages were not tried (not an exact bound)")
    candidates.sort(key=lambda c: c.stages)
    fitting = [c.plan for c in candidates if c.plan is not None]
    if not fitting:
        raise MemoryBudgetError("no pipeline configuration fits: " + "; ".join(f"S={c.stages}: {c.why}"
                                                                              for c in candidates))
    return PipelineResult(min(fitting, key=lambda p: (p.cost, p.peak_memory)), tuple(candidates))


def _stage_plan(graph: Graph, end_graphs: tuple[Graph | None, Graph | None], layers: int, mesh: Mesh, axis: int,
                stages: int, micro_batches: int, micro_batch: int, precision: Precision, link: Link,
                spec_peak: float | None,
                memory_budget: float | None, schedules: Sequence[str], chunks: Sequence[int], budget: Budget,
                extractor: str, time_limit: float, pareto_points: int, leaner_slack: float, cost_model: CostModel,
                leading: float) -> tuple[PipelinePlan | None, str, float]:
    """The best configuration of `stages` stages at one micro-batch size, what to report of it (why nothing
    fit, whether the fusion-priced refit and which leaner layer plans were not made and why) and its fastest layer
    plan's floor (`ideal_time`; inf where no layer plan was found). Its own function so
    that the sub-mesh's explored e-graph, pricing and extractions are freed before the next sub-mesh is explored (a
    loop's locals outlived the iteration: the 70B step's 4x8x8 e-graph was held while 8x8x8's was explored)."""
    sub = stage_mesh(mesh, axis, stages)
    # over more than one stage the layer's plans are ranked with the stage transfers they make the pipeline pay
    tried = configurations(stages, micro_batches, layers, schedules, chunks)
    ranking = cost_model if stages == 1 or not tried else \
        BoundaryPriced.of(cost_model, graph, link, exposed_share(tried, layers, micro_batches))
    said = []
    try:
        explored = explore(graph, sub, budget=budget)
        # where a best step is known, the plain fit first: its fusion-priced refit only if its floor comes near
        refit = math.isinf(leading) or sub.size < FUSED_EXTRACTION_DEVICES  # (below that no refit is made anyway)
        fastest = explored.extract(ranking, extractor, time_limit, micro_batches=micro_batches, fusion_refit=refit)
        ends = Ends(*(None if end is None else layer_cost(explore(end, sub, budget=budget).extract(
            cost_model, extractor, time_limit, micro_batches=micro_batches).plan, cost_model) for end in end_graphs))
        if not refit:
            floor = ideal_time(layer_cost(fastest.plan, cost_model), layers, stages, micro_batches, precision, ends)
            if floor < (1 + FUSION_REFIT_MARGIN) * leading:  # the plain fit's selection is not made again
                fastest = explored.extract(ranking, extractor, time_limit, micro_batches=micro_batches)
            else:
                said.append(f"no fusion-priced refit of the layer: its floor, {floor * 1e3:.1f} ms a step, is more "
                            f"than {FUSION_REFIT_MARGIN:.0%} above the best step found ({leading * 1e3:.1f} ms)")
    except (ValueError, MemoryBudgetError) as err:
        return None, f"no layer plan on {sub} ({err})", math.inf

    def configured(result: OptimizeResult, layer: LayerCost) -> PipelinePlan | None:
        return best_configuration(layer, layers, mesh, axis, stages, micro_batches, precision, link, memory_budget,
                                  schedules, chunks, spec_peak, result, micro_batch, ends)

    fastest_layer = layer_cost(fastest.plan, cost_model)
    best = configured(fastest, fastest_layer)
    if best is None:
        said.insert(0, f"the fastest layer plan does not fit {memory_budget:,.0f} bytes per device, even with every "
                       f"layer recomputed")
    leaner = explored.leaner_plans(fastest, ranking, extractor, time_limit, micro_batches)
    last, extracted = fastest_layer, 1
    fastest_floor = ideal_time(fastest_layer, layers, stages, micro_batches, precision, ends)
    while extracted < pareto_points:
        # the next leaner plan is the fastest that needs less memory than the last: no faster by the objective
        # they are extracted by, so the last one's floor floors it (where the stage transfers it saves are exposed
        # as that objective prices them: `BoundaryPriced`)
        floor = fastest_floor if extracted == 1 else ideal_time(last, layers, stages, micro_batches, precision, ends)
        beaten = min(leading, math.inf if best is None else best.cost)
        if floor >= (1 - leaner_slack) * beaten:  # no leaner plan could beat the best step by more than the slack
            said.append(("leaner layer plans" if extracted == 1 else
                         f"layer plans leaner than the {extracted - 1} extracted") + " not extracted: their floor, "
                        f"{floor * 1e3:.1f} ms a step, is "
                        + (f"above the best step found ({beaten * 1e3:.1f} ms)" if floor > beaten else
                           f"within {leaner_slack:.0%} of the best step found ({beaten * 1e3:.1f} ms)"))
            break
        result = next(leaner, None)
        if result is None:  # no plan needs less memory
            break
        extracted += 1
        last = layer_cost(result.plan, cost_model)
        found = configured(result, last)
        if found is not None and (best is None or (found.cost, found.peak_memory) < (best.cost, best.peak_memory)):
            best = found
    if best is None and extracted > 1:
        said[0] = (f"nothing fits {memory_budget:,.0f} bytes per device, even with every layer recomputed, of the "
                   f"fastest layer plan and its {extracted - 1} leaner ones")
    return best, "; ".join(said), fastest_floor


def _batch(graph: Graph) -> int:
    """Sequences per micro-batch of a layer step: the leading dim of its first user input."""
    users = [n for n in graph.inputs if n.name not in graph.carried.values() and n.name not in graph.static
             and n.shape]
    if not users:
        raise ValueError("plan_pipeline: the layer graph has no batched input to read the micro-batch size from")
    return users[0].shape[0]


def _compute_dtype(graph: Graph) -> str:
    """The dtype the layer computes in: its weights' (what MFU's spec-sheet peak is read for)."""
    weights = [n for n in graph.inputs if n.name in graph.carried.values() and n.shape]
    return weights[0].dtype if weights else "float32"
