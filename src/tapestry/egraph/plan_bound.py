"""A lower bound of `plan_cost` over every plan the searched e-graph can yield: what `OptimizeResult.gap` measures.

The extractor's own bound (`Selection.bound`) is of the sum of the node costs it was handed, which is not the plan's
time where fusion (`cost.fusion`) or a training step's overlap credit (`cost.overlap`) price the plan: the 2-layer
LLaMA-7B training step on 2x4 summed 20.42 ms by node costs and cost 12.70 ms by `plan_cost`. This bounds the time:

- plan_cost = sum of the steps' costs f(s), fusion groups charged their share (each member f(s) >= `node_floors`'
  floor of its node), less min(R, B): R the gradient reductions' and B the backward compute's summed f. For any
  lambda in [0, 1], min(R, B) <= lambda R + (1 - lambda) B, so plan_cost >= sum over steps of w(s) f(s), w(s) being
  1 - lambda for a reduction, lambda for a backward Compute, 1 else: each term is 0 or more, so a step a plan makes
  twice (a hand plan's recomputed forward value) only adds. Which steps are reductions or backward depends on the
  plan's forward path; a node that COULD be one (`overlap_roles`: any Reshard out of a partial layout; any Compute
  upstream of one's source) gets its weight, the lower, whatever the selection.
- The least sum of w(n) floor(n) over the e-graph's selections is an extraction; the Lagrangian bound of its LP
  (extract.relax, or the contracted LP on large graphs: extract.contract) is below it. Each chosen node is one
  step, so a plan costs at least that; steps no node prices only add.
- floor(n) is the node's cost (prepared nodes are 0 there, as prepared steps are in `plan_cost`; unpriced or
  dropped moves are infinite: no selection the search could make chooses them), but a fusible Compute's under a
  fusing DefaultCostModel (`node_floors`): a member of a fusion group is charged a share of the group's time, which
  is at least every device's bytes over bandwidth, its writes included. So a fusible non-view Run whose value every
  reader in the e-graph reads from memory (a Reshard, a library kernel, the output: outside any group) is charged
  its write on the average device, no more than its cost; one linked to no possible fusible reader or argument (a
  group of one) its cost; any other 0. Where the whole-space floor's fusion part is known (cost.floor.FloorParts.fusion:
  the bytes every plan's fusion groups move across their edges), the LP at lambda 1 prices fusible nodes 0 instead
  and adds it: the fusible steps are never hidden there. Unfolded, it adds each group's launch too, for as many
  groups as every plan of the e-graph makes (egraph.group_launches: fusible steps an unfusible one separates on a
  path lie in distinct groups), as a group's charge holds its boundary bytes and one launch.
- The whole-space floor (cost.floor.step_floor) bounds every plan of the graph, so those of the e-graph too; and
  where plan_cost is the node-cost sum (no fusion, nothing hidden) the extractor's own bound. The largest is kept.

Lambda: 1 (reductions hidden whole: the plan's time where its backward pass is the longer); where the plan kept has
reductions longer than its backward, also 0 and the crossings of the LPs' lines (Kelley's cutting planes on the
concave function of lambda, `WEIGHT_ROUNDS`), on e-graphs of up to `SEARCH_NODES`. Any of them is a bound.

Folded (`periodic`: egraph.layered, one layer's plan for every copy): `egraph` is the folded e-graph as searched,
copy 1's nodes at m-1 times their cost (`Layered.costs`), and the plan is a periodic selection of it expanded onto
the whole graph: prefix, copy 0 and suffix steps once, copy 1's once per later copy, each priced as its node (the
same step, renamed), so the expanded plan's steps, less the reductions, sum to at least the selection's weighted
node sum. Only the LP at lambda 1 is made, and only where its node prices hold per expanded step: a reduction
(a partial layout's Reshard, whatever copy) weighs 0, the backward 1, so which compute is backward does not enter;
the fusible Runs are priced 0 and the whole graph's fusion floor (a bound of every plan's fusion groups, the
expanded plan's among them) added, or there is no fusion and every other node is priced at its cost. Where a fused
model's fusion floor is unknown the node floors would be read off copy 1's neighbours in the fold, not those of
each copy it stands for (a middle copy's readers are the next layer's, not the suffix's): the whole-space floor
is the bound then (`floor_bound`). Dropping the ties to copy 0 lets the LP pick copies unalike: a relaxation,
below the least periodic selection's sum. It bounds the periodic plans of the fold, not plans whose layers differ:
the whole-space floor, kept where larger, bounds those.

Not covered (None, with the reason): cost models that price steps together otherwise (a `plan_step_costs` of a
model other than DefaultCostModel), folded extractions of a fused model without a whole-space floor, and an LP not
solved within its work budget (`BOUND_SECONDS`) where no other bound is known. A pipeline's stages are each a
result with its own bound; the pipeline's schedule has none.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial

from tapestry.clock import clock
from tapestry.cost import CostModel, DefaultCostModel
from tapestry.cost.fusion import fusible
from tapestry.cost.memory import layout_bytes
from tapestry.cost.model import from_costs, step_costs
from tapestry.cost.overlap import overlap, upstream
from tapestry.egraph.decode import Decoder, DNode
from tapestry.egraph.group_launches import group_launches
from tapestry.extract import EGraph as ExtractGraph
from tapestry.extract.contract import contracted_bound
from tapestry.extract.ilp import CONTRACT_FROM, LP_NODES_PER_SECOND, reduced_blocks
from tapestry.extract.relax import LpBound, lp_bound
from tapestry.extract.tree import solvable_tree
from tapestry.extract.work import Deadline, Meter
from tapestry.plan import Plan

BOUND_SECONDS = 20.0  # seconds of counted work (extract.work) for all of the bound's LPs: the same stop at any load
WEIGHT_ROUNDS = 3  # LPs after the first two (lambda 1 and 0) at the crossing of their lines
# The most nodes whose e-graph gets LPs below lambda 1: on the 2-layer 7B training step on 8x8 (its plan's reductions
# outlast its backward) lambda 0 and a crossing took 30 CPU s at load 5, raising nothing (benchmarks/plan_bound.py)
SEARCH_NODES = 150_000
RUN_OPS = ("Place", "Reshard", "Deliver")  # the node ops that are no Compute
# HiGHS's first-order LP solver: its duals need not be optimal, and any duals give a Lagrangian bound (relax.Lp.solve).
# On the 2-layer LLaMA-7B training step on 2x4 it took 1.9 CPU s where the dual simplex took 9.2 and the interior
# point 4.7, for a bound 5e-8 of it lower (benchmarks/cluster.py's row, timed around `plan_bound`; docs/benchmarks.md).
# Where it stops short of its tolerances (the LP at lambda 0 of a LLaMA block's training step on Mesh(2, 2), most of
# whose costs are 0 there), the dual simplex solves it.
SOLVER = "pdlp"
# Seconds of counted work (simplex iterations) the dual simplex gets where PDLP stopped short: the lambda-0 LP of the
# 7B training step on 8x8 took the simplex 30 CPU s (at load 5) and raised no bound (benchmarks/plan_bound.py)
FALLBACK = 2.0


@dataclass(frozen=True)
class PlanBound:
    """Seconds no plan of the searched e-graph costs less (None where no bound is known, `why` saying why), the
    lambda that gave it, the LPs solved for it and their CPU seconds, and what gave it."""

    seconds: float | None
    why: str = ""
    weight: float | None = None
    lps: int = 0
    cpu_s: float = 0.0
    source: str = ""  # which bound was the largest: an LP's (at its lambda), the extractor's or the floor

    def gap(self, cost: float) -> float | None:
        """(cost - bound) / cost; None without a bound or for a free plan."""
        if self.seconds is None or cost <= 0.0:
            return None
        return (cost - self.seconds) / cost  # below 0 only if the bound is wrong: not clipped, so that tests see it


def no_bound(why: str) -> PlanBound:
    return PlanBound(None, why)


def floor_bound(floor: float | None, why: str) -> PlanBound:
    """The whole-space `floor` (cost.floor.step_floor) as the bound where no LP is made (a fold's of a fused model
    without the fusion floor: its plans are some of the graph's, above the floor of them all); else `no_bound(why)`."""
    return no_bound(why) if floor is None else PlanBound(floor, source="the whole-space floor")


def node_floors(decoder: Decoder, costs: Sequence[float], model: CostModel) -> list[float] | None:
    """Per node, the least its step adds to `plan_cost` before the overlap credit (module docstring); None for a
    model that prices steps together in a way not known here."""
    together = getattr(model, "plan_step_costs", None)
    if together is None:
        return list(costs)
    if not isinstance(model, DefaultCostModel) or type(model).plan_step_costs is not DefaultCostModel.plan_step_costs:
        return None
    if not model.fuse:
        return list(costs)
    device = model.profile.device
    devices = decoder.mesh.size
    stretch = device.oversubscription(devices) / device.mem_bandwidth
    memory_read, fusibly_made = _fusion_neighbours(decoder)
    floors = list(costs)
    writes: dict[str, float] = {}
    for i, node in enumerate(decoder.nodes):
        if node.op in RUN_OPS or not math.isfinite(costs[i]) or decoder.prepared(node):
            continue
        step = decoder.interner.runs[node.key]
        if not fusible(step) or node.eclass in memory_read and fusibly_made.isdisjoint(node.children):
            continue  # no group: linked to no reader and no argument (a group of one is priced as it is)
        if step.signature.kernel.is_view or node.eclass not in memory_read:
            floors[i] = 0.0
            continue
        if node.eclass not in writes:
            held = layout_bytes(decoder.interner.layouts[node.layout][1], decoder.class_dtype[node.eclass])
            writes[node.eclass] = sum(held) / devices * stretch
        floors[i] = min(costs[i], writes[node.eclass])
    return floors


def _fusion_neighbours(decoder: Decoder) -> tuple[set[str], set[str]]:
    """(the classes every reader of which lies outside any fusion group: a Reshard, a Deliver, or a Run of a kernel
    that is not fusible (cost.fusion.fusible), classes nothing reads left out; the classes a fusible Run, prepared
    or not, can make)."""
    readers_fuse: dict[str, bool] = {}
    made: set[str] = set()
    for node in decoder.nodes:
        fuses = _fusible(decoder, node)
        if fuses:
            made.add(node.eclass)
        for c in node.children:
            readers_fuse[c] = readers_fuse.get(c, False) or fuses
    return {c for c, fuses in readers_fuse.items() if not fuses}, made


def overlap_roles(decoder: Decoder, carried: Collection[str]) -> tuple[frozenset[int], frozenset[int]]:
    """(nodes that could be a gradient reduction, nodes that could be backward compute) in some plan of the
    e-graph (cost.overlap): every per-run Reshard out of a partial layout, and every per-run Compute of a class
    upstream of one's source. Empty without carried state (nothing is hidden)."""
    if not carried:
        return frozenset(), frozenset()
    layouts = decoder.interner.layouts
    reductions = frozenset(n for n, node in enumerate(decoder.nodes) if node.op == "Reshard"
                           and layouts[decoder.class_layout[node.children[0]]][1].partial
                           and not decoder.prepared(node))
    made: dict[str, list[int]] = {}
    for n, node in enumerate(decoder.nodes):
        made.setdefault(node.eclass, []).append(n)

    def children(c: str) -> Iterator[str]:
        return (d for n in made.get(c, ()) for d in decoder.nodes[n].children)

    waited_for = upstream((decoder.nodes[n].children[0] for n in reductions), children)
    backward = frozenset(n for n, node in enumerate(decoder.nodes) if node.eclass in waited_for
                         and node.op not in RUN_OPS and not decoder.prepared(node))
    return reductions, backward


def plan_bound(decoder: Decoder, egraph: ExtractGraph, model: CostModel, plan: Plan,
               extractor_bound: float | None = None, floor: float | None = None, fusion: float | None = None,
               seconds: float = BOUND_SECONDS, periodic: bool = False) -> PlanBound:
    """The bound of the module docstring over the selections of `egraph` (the extraction graph at the node costs the
    plan's steps are priced at, or below: floor-priced moves); `plan` is the one kept, a selection of it: lambda 0
    and between are tried only where its reductions outlast its backward (else one LP). Where the floors are the
    node costs and nothing is hidden (no fusion, no carried state), `plan_cost` is the node-cost sum, and
    `extractor_bound` (the extractor's bound of that sum on `egraph`, where the caller has one) bounds it too; so
    does the whole-space `floor` (cost.floor.step_floor), and with `fusion` (cost.floor.FloorParts.fusion: what every
    plan's fusible steps cost at least) the LP at lambda 1 prices fusible nodes 0 and adds it. `periodic`: `egraph`
    is a fold's (module docstring), the plan its expansion: the LP at lambda 1 only, or the floor."""
    return lazy_bound(decoder, egraph, model, plan, extractor_bound, floor, fusion, periodic, seconds)()


def lazy_bound(decoder: Decoder, egraph: ExtractGraph, model: CostModel, plan: Plan,
               extractor_bound: float | None = None, floor: float | None = None, fusion: float | None = None,
               periodic: bool = False, seconds: float = BOUND_SECONDS) -> Callable[[], PlanBound]:
    """`plan_bound`, its inputs read off `decoder` now and its LPs solved when called (`seconds` of work for them):
    what a result keeps, which would otherwise keep the decoder (and the extraction graphs it caches) alive."""
    started = clock()
    floors = node_floors(decoder, egraph.node_cost, model)
    if floors is None:
        known = no_bound(f"cost model {type(model).__name__} prices steps together (plan_step_costs) in a way the "
                         f"bound does not know")
        return lambda: known
    reductions, backward = overlap_roles(decoder, plan.graph.carried)
    plain = extractor_bound if not reductions and floors == list(egraph.node_cost) and not periodic else None
    fused = getattr(model, "fused_device", None) is not None and fusion is not None
    if periodic and not fused and floors != list(egraph.node_cost):  # fusion's floors are of one copy's neighbours
        known = floor_bound(floor, "periodic, and no floor of the fused steps")
        return lambda: known
    unfused = [0.0 if fused and _fusible(decoder, node) else f for f, node in zip(floors, decoder.nodes)]
    if fused and not periodic:  # the fusion groups' launches, which no node is charged (egraph.group_launches)
        device = model.profile.device  # type: ignore[attr-defined]
        launch = device.launch_overhead * device.oversubscription(decoder.mesh.size)
        fusion = (fusion or 0.0) + group_launches(decoder, egraph, launch) * launch
    # a copy without what the extractors cached on the graph (`EGraph.by_costs`: their reduced problems), unread here
    return partial(BoundInputs(replace(egraph), model, plan, floors, unfused if fused else None, fusion or 0.0,
                               reductions, backward, plain, floor, periodic, clock() - started), seconds)


@dataclass(frozen=True, eq=False)
class BoundInputs:
    """What `plan_bound`'s LPs need, and nothing of the decoder: the extraction graph, the node floors (`unfused`:
    fusible nodes at 0, where the LP at lambda 1 adds the fused steps' floor `fusion` instead; None unfused), the
    overlap roles, the other bounds known (`plain`: the extractor's, where it bounds the plan) and the CPU seconds
    spent reading them. Called, it solves the LPs (`seconds` of counted work for them all)."""

    egraph: ExtractGraph
    model: CostModel
    plan: Plan
    floors: list[float]
    unfused: list[float] | None
    fusion: float
    reductions: frozenset[int]
    backward: frozenset[int]
    plain: float | None
    floor: float | None
    periodic: bool
    read_s: float

    def __call__(self, seconds: float = BOUND_SECONDS) -> PlanBound:
        started = clock() - self.read_s
        egraph, reductions, backward, plan = self.egraph, self.reductions, self.backward, self.plan
        carried = plan.graph.carried
        deadline = Meter(seconds).until(seconds)
        found: list[tuple[float, float, float, float]] = []  # (lambda, bound, R, B) of each LP solved

        def solve(weight: float) -> tuple[float, float, float, float] | None:
            """The LP at `weight`; at 1 with the fusible steps' floor (`fusion`) added where known."""
            base, added = (self.unfused, self.fusion) if weight == 1.0 and self.unfused is not None \
                else (self.floors, 0.0)
            costs = [f * (1 - weight if n in reductions else weight if n in backward else 1.0)
                     if math.isfinite(f) else f for n, f in enumerate(base)]
            solved = _lp(egraph.with_costs(costs), deadline)
            if solved.values is None:
                return None
            parts = [sum(base[n] * x for n, x in solved.values.items() if n in role) for role in (reductions, backward)]
            found.append((weight, solved.bound + added, *parts))
            return found[-1]

        first = solve(1.0)
        if first is not None and reductions and carried and egraph.num_nodes <= SEARCH_NODES and not self.periodic \
                and _exposed(plan, self.model):
            second = solve(0.0)
            for _ in range(WEIGHT_ROUNDS if second is not None else 0):
                (a, fa, ra, ba), (b, fb, rb, bb) = sorted(found, key=lambda f: -f[1])[:2]
                slope_a, slope_b = ba - ra, bb - rb  # each LP's line in lambda: its bound + slope (lambda - its lambda)
                if abs(slope_a - slope_b) <= 1e-15:
                    break
                crossing = (fb - fa + slope_a * a - slope_b * b) / (slope_a - slope_b)
                if not 0.0 < crossing < 1.0 or any(abs(crossing - f[0]) < 1e-3 for f in found):
                    break
                if solve(crossing) is None:
                    break
        known = [(f[1], f"LP at lambda {f[0]:.3g}", f[0]) for f in found]
        known += [(b, why, None) for b, why in ((self.plain, "the extractor's"), (self.floor, "the whole-space floor"))
                  if b is not None]
        unsolved = f"no LP solved within {seconds:g} s of work"
        if not known:
            return PlanBound(None, unsolved, None, 0, clock() - started)
        bound, source, weight = max(known, key=lambda k: k[0])
        return PlanBound(bound, "", weight, len(found), clock() - started, source + ("" if found else f" ({unsolved})"))


def _fusible(decoder: Decoder, node: DNode) -> bool:
    """Whether `node` is a Run of a fusible kernel (cost.fusion.fusible)."""
    return node.op not in RUN_OPS and fusible(decoder.interner.runs[node.key])


def _exposed(plan: Plan, model: CostModel) -> bool:
    """Whether the plan's gradient reductions outlast its backward compute (cost.overlap)."""
    found = overlap(plan, from_costs(step_costs(plan, model)))
    return found.reductions > found.backward


def _lp(egraph: ExtractGraph, deadline: Deadline) -> LpBound:
    """The LP of `egraph`'s selections (its contracted problem's past CONTRACT_FROM candidates); unsolved (bound 0, no
    values) where its candidates are more than the work left takes on (ilp.LP_NODES_PER_SECOND): building it alone would
    outrun it."""
    reduced, block = reduced_blocks(egraph, solvable_tree(egraph))
    size = sum(map(len, reduced.candidates.values()))
    if size > LP_NODES_PER_SECOND * deadline.left():
        return LpBound(0.0)
    solve = contracted_bound if size > CONTRACT_FROM else lp_bound
    return solve(egraph, reduced.candidates, block, reduced.needs, deadline, SOLVER, FALLBACK)
