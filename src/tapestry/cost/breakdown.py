"""Where a plan's predicted time goes: seconds per phase and kind of work, beside what its FLOPs need.

`plan_cost` is one number; to see why a training step's MFU is low, its steps are sorted by phase (forward: what
the loss needs; update: what reads optimizer state the forward never reads, Adam's moments and step count;
backward: the rest) and by what bounds them on the roofline: compute at the peak of their dtype (bfloat16 on
tensor cores, float32 far slower), memory bandwidth (elementwise kernels, softmax, casts), the launch each kernel
pays, and collectives by kind, each step priced alone; what fusing elementwise chains saves (`cost.fusion`: the
model's `step_costs` below the steps' own) and the part the backward hides of the gradient reductions
(`cost.overlap`) are listed apart, negative.
`model_seconds` is what the plan's compute needs at the profile's bfloat16 rate with no launch and no byte: the
floor the roofline prices toward (the time at 100% MFU only where that rate is the spec sheet's; a calibrated
profile's is lower, and MFU is against the spec sheet: `DeviceProfile.mfu`).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from tapestry.cost.model import CostModel, alike_key, from_costs, step_costs
from tapestry.cost.overlap import forward_outputs, overlap, upstream
from tapestry.cost.profile import DeviceProfile
from tapestry.cost.roofline import compute_dtype
from tapestry.plan.plan import Compute, Place, Plan, Reshard, Step
from tapestry.sharding import Mesh
from tapestry.sharding.collectives import classify_reshard
from tapestry.sharding.partition import exchange_work

HIDDEN = "hidden reductions"  # the kind under which the overlap credit is listed (negative seconds)
FUSED = "fused away"  # the kind under which a phase's fusion saving is listed (negative seconds)


@dataclass(frozen=True)
class Breakdown:
    """Seconds per (phase, kind); they sum to `plan_cost` (fusion savings and hidden reductions enter negative)."""

    seconds: Mapping[tuple[str, str], float] = field(default_factory=dict)
    count: Mapping[tuple[str, str], int] = field(default_factory=dict)
    model_seconds: float = 0.0  # the slowest device's FLOPs at the profile's bfloat16 rate, summed over computes

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def by_kind(self) -> dict[str, float]:
        found: dict[str, float] = defaultdict(float)
        for (_, kind), s in self.seconds.items():
            found[kind] += s
        return dict(found)

    def table(self) -> str:
        """A markdown table: phase, kind, steps, ms, share of the total."""
        lines = ["| phase | kind | steps | ms | share |", "|---|---|---:|---:|---:|"]
        total = self.total
        for key in sorted(self.seconds, key=lambda k: (PHASES.index(k[0]), -self.seconds[k])):
            lines.append(f"| {key[0]} | {key[1]} | {self.count.get(key, 0)} | {self.seconds[key] * 1e3:.2f} | "
                         f"{self.seconds[key] / total:.1%} |")
        lines.append(f"| all | total (FLOPs at the bfloat16 peak: {self.model_seconds * 1e3:.2f} ms) | "
                     f"{sum(self.count.values())} | {total * 1e3:.2f} | 100% |")
        return "\n".join(lines)


PHASES = ("forward", "backward", "update", "step")


def _args(by_id: Mapping[str, Step], value: str) -> tuple[str, ...]:
    step = by_id[value]
    return step.args if isinstance(step, Compute) else () if isinstance(step, Place) else (step.src,)


def phases(plan: Plan, update_inputs: Collection[str] = ()) -> dict[str, str]:
    """Phase of each step's value: forward, update (downstream of carried inputs the forward never reads, and of
    `update_inputs`: a learning rate), or backward; a plan without carried state is all forward."""
    by_id = plan.by_id
    if not plan.graph.carried:
        return {s.out: "forward" for s in plan.steps}
    forward = upstream(forward_outputs(plan.outputs, plan.graph.carried), lambda v: _args(by_id, v))
    sources = set(plan.graph.carried.values()) | set(update_inputs)
    update = {s.out for s in plan.steps if isinstance(s, Place) and s.input in sources and s.out not in forward}
    found = {}
    for step in plan.steps:  # steps come in a valid order: arguments first
        if step.out in forward:
            found[step.out] = "forward"
        elif step.out in update or any(a in update for a in _args(by_id, step.out)):
            update.add(step.out)
            found[step.out] = "update"
        else:
            found[step.out] = "backward"
    return found


@dataclass(frozen=True)
class PhaseTimes:
    """A training step's seconds by how often gradient accumulation (or a pipeline stage) pays them: per
    micro-batch its forward and backward (activation and weight gradients, and their communication each
    micro-batch), per update the optimizer's update and the weight gradients' reductions, run once on the
    accumulated gradients and hidden behind one micro-batch's backward compute as far as it lasts (`cost.overlap`'s
    credit, given to the last micro-batch)."""

    forward: float
    backward: float
    update: float
    reduce: float  # the reductions' seconds the backward does not hide

    def accumulated(self, micro_batches: int) -> float:
        """Seconds per update of `micro_batches` micro-batches run one after another on these devices."""
        return micro_batches * (self.forward + self.backward) + self.update + self.reduce


def phase_times(plan: Plan, model: CostModel, update_inputs: Collection[str] = ()) -> PhaseTimes:
    """`plan`'s per-run steps (priced by `step_costs`: fused chains as one kernel) split as `PhaseTimes` says, by
    `phases`: the weight gradients' reductions are the Reshards out of a partial layout off the forward path that
    only the update reads (a tensor-parallel backward's activation-gradient sums run every micro-batch)."""
    phase = phases(plan, update_inputs)
    by_id = plan.by_id
    readers: dict[str, list[str]] = {}
    for step in plan.steps:
        for a in _args(by_id, step.out):
            readers.setdefault(a, []).append(step.out)
    per_run = [s for s in plan.steps if not isinstance(s, Place) and s.out not in plan.prepared]
    cost = step_costs(plan, model)
    reductions = {s.out for s in per_run if isinstance(s, Reshard) and s.src_layout.partial
                  and phase[s.out] != "forward" and all(phase[r] == "update" for r in readers.get(s.out, ()))}
    backward = [s for s in per_run if phase[s.out] == "backward" and s.out not in reductions]
    hidden_behind = sum(cost[s.out] for s in backward if isinstance(s, Compute))
    return PhaseTimes(forward=sum(cost[s.out] for s in per_run if phase[s.out] == "forward"),
                      backward=sum(cost[s.out] for s in backward),
                      update=sum(cost[s.out] for s in per_run if phase[s.out] == "update"),
                      reduce=max(0.0, sum(cost[v] for v in reductions) - hidden_behind))


def compute_kind(step: Compute, device: DeviceProfile) -> str:
    """What bounds a compute step on the roofline of its slowest device: its dtype's peak or memory bandwidth."""
    sig = step.signature
    if sig.kernel.is_view:
        return "views"
    block = max((b for b in step.blocks if b is not None and not b.is_empty), key=lambda b: sig.cost(b)[0],
                default=None)
    if block is None:
        return "idle"
    flops, nbytes = sig.cost(block)
    dtype = compute_dtype(sig)
    if flops / device.peak(dtype) >= nbytes / device.mem_bandwidth:
        return f"compute-bound {dtype}"
    return "memory-bound"


def breakdown(plan: Plan, model: CostModel, device: DeviceProfile) -> Breakdown:
    """`plan`'s time per phase and kind (module docstring), priced by `model`; `device` says the roofline's
    peaks and launch overhead (the model's profile device), which the launches are split off by. Steps alike but
    for their names (`alike_key`: an expanded plan's later copies) are priced and classified once."""
    phase = phases(plan)
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    count: dict[tuple[str, str], int] = defaultdict(int)
    model_seconds = 0.0
    costs = step_costs(plan, model)
    launch = device.launch_overhead * device.oversubscription(plan.mesh.size)
    seen: dict[tuple, _Priced] = {}
    for step in plan.steps:
        if isinstance(step, Place) or step.out in plan.prepared:
            continue
        key = alike_key(step)
        if key not in seen:
            seen[key] = _priced(step, plan.mesh, model, device)
        cost, kind, flops_seconds = seen[key]
        if costs[step.out] < cost:
            seconds[phase[step.out], FUSED] += costs[step.out] - cost
        if kind not in ("views", "idle") and isinstance(step, Compute):
            seconds[phase[step.out], "launch"] += min(launch, cost)
            count[phase[step.out], "launch"] += 1
            cost -= min(launch, cost)
        model_seconds += flops_seconds
        seconds[phase[step.out], kind] += cost
        count[phase[step.out], kind] += 1
    hidden = overlap(plan, from_costs(costs)).hidden
    if hidden:
        seconds["step", HIDDEN] -= hidden
    return Breakdown(dict(seconds), dict(count), model_seconds)


_Priced = tuple[float, str, float]  # a step's own seconds, its kind, its FLOPs' seconds at the bfloat16 peak


def _priced(step: Compute | Reshard, mesh: Mesh, model: CostModel, device: DeviceProfile) -> _Priced:
    """What `breakdown` reads of one step: its seconds priced alone, what bounds it (`compute_kind`, or a
    Reshard's collective) and, for a Compute, the slowest device's FLOPs at the bfloat16 peak."""
    cost = model.step_cost(step, mesh)
    if isinstance(step, Reshard):
        return cost, str(classify_reshard(step.src_layout, step.layout, step.shape, mesh)), 0.0
    sig = step.signature  # an exchange step's work: its experts with every row of its group (exchange_work)
    work = exchange_work(sig, step.blocks, step.exchange, mesh, step.exchange_group)
    flops = max((sig.cost(b)[0] for b in work if b is not None and not b.is_empty), default=0.0)
    return cost, compute_kind(step, device), flops / device.peak("bfloat16")
