"""`result.gap` bounds `plan.cost` (egraph.plan_bound): no plan the searched e-graph can yield is priced by
`plan_cost` below the bound, whatever the extractor chose, fusion merged or the overlap hid; where no bound is
known the gap is None and explain() says why."""
from __future__ import annotations

import functools
import gc
import math
import random
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_floor import mlp
from test_layers_fold import llama_step, residual_mlps
from training_helpers import adam_step

import tapestry
from tapestry.cost import DefaultCostModel, load_profile, plan_cost
from tapestry.cost.floor import floor_parts
from tapestry.cost.fusion import fusible, fusion_groups
from tapestry.egraph.embed import embedded_plans
from tapestry.egraph import plan_bound as plan_bound_module
from tapestry.cost.overlap import overlap
from tapestry.egraph.group_launches import group_launches
from tapestry.egraph.plan_bound import node_floors, overlap_roles, plan_bound
from tapestry.extract import extract
from tapestry.models import llama_decoder
from tapestry.optimizer import Explored, explore
from tapestry.plan import Compute, Plan, Reshard, Step
from tapestry.sharding import Mesh

FUSING = DefaultCostModel(load_profile("gpu-h100-nccl"))
MODELS = {"gpu fused": FUSING, "gpu unfused": DefaultCostModel(FUSING.profile, fuse=False),
          "cpu": DefaultCostModel(load_profile("cpu-gloo"))}


def llama_inference() -> tapestry.Graph:
    torch.manual_seed(0)
    return tapestry.from_torch(llama_decoder(layers=1), (torch.randint(0, 64, (2, 8)),), verbose=False).graph


GRAPHS = {"llama training": lambda: llama_step(1), "llama inference": llama_inference,
          "mlp training": lambda: adam_step(16, 64, 32)[0].graph, "mlp inference": lambda: mlp(2, 64)}


@functools.cache
def explored(graph: str, mesh: tuple[int, ...]) -> Explored:
    return explore(GRAPHS[graph](), Mesh(*mesh))


def plans(found: Explored, model: DefaultCostModel, seed: int, count: int) -> list[Plan]:
    """Plans of the e-graph: each extractor's at the node costs, and `count` more at costs drawn around them
    (near-optimal selections, where an unsound bound would show), decoded as the optimizer decodes them."""
    egraph = found.decoder.extraction_graph(list(found.roots), model, found.priced_moves)
    draw = random.Random(seed)
    graphs = [egraph] * 2 + [egraph.with_costs([c * draw.uniform(0.2, 1.8) if math.isfinite(c) else c
                                                for c in egraph.node_cost]) for _ in range(count)]
    selections = [extract(g, name, 5.0) for g, name in zip(graphs, ["bottom-up", *(["greedy-dag"] * (count + 1))])]
    return [found.decoder.plan(egraph, s, found.graph, found.names) for s in selections]


@pytest.fixture
def every_weight(monkeypatch):
    """Every lambda tried, not only where the plan's reductions outlast its backward: each LP's bound is checked."""
    monkeypatch.setattr(plan_bound_module, "_exposed", lambda plan, model: True)


CASES = [("llama training", (2, 2), "gpu fused"), ("llama training", (2,), "cpu"),
         ("llama inference", (2, 2), "gpu fused"), ("mlp training", (2, 2), "gpu unfused"),
         ("mlp training", (2,), "gpu fused"), ("mlp inference", (2,), "cpu")]


@pytest.mark.parametrize("graph, mesh, model", CASES)
def test_no_plan_of_the_egraph_costs_less_than_the_bound(graph, mesh, model, every_weight):
    """Every extractor's plan, near-optimal selections at drawn costs, the hand plans that lie in the e-graph and
    the optimizer's own: each at least the bound."""
    found, cost_model = explored(graph, mesh), MODELS[model]
    result = found.extract(cost_model)
    bound = result.bound.seconds
    assert bound is not None and bound > 0, result.bound.why
    egraph = found.decoder.extraction_graph(list(found.roots), cost_model, found.priced_moves)
    hands = [hand for hand, _ in embedded_plans(found.decoder, egraph, found.baselines, ())]
    for plan in [result.plan, *hands, *plans(found, cost_model, seed=len(graph) + len(mesh), count=2)]:
        assert bound <= plan_cost(plan, cost_model) * (1 + 1e-9)
    assert 0 <= result.gap < 1
    assert result.gap == pytest.approx((result.plan.cost - bound) / result.plan.cost)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), mesh=st.sampled_from([(2,), (2, 2)]), model=st.sampled_from(sorted(MODELS)))
def test_random_selections_of_a_training_step_cost_no_less_than_the_bound(seed, mesh, model):
    found, cost_model = explored("mlp training", mesh), MODELS[model]
    candidates = plans(found, cost_model, seed, count=2)
    egraph = found.decoder.extraction_graph(list(found.roots), cost_model, found.priced_moves)
    for plan in candidates:  # each plan's own bound: where its reductions outlast its backward, every lambda
        bound = plan_bound(found.decoder, egraph, cost_model, plan)
        assert bound.seconds is not None and all(bound.seconds <= plan_cost(p, cost_model) * (1 + 1e-9)
                                                 for p in candidates)


@pytest.mark.parametrize("graph, mesh", [("mlp training", (2, 2)), ("llama training", (2,))])
def test_every_step_a_plan_hides_or_hides_behind_is_of_a_node_weighted_so(graph, mesh):
    """What cost.overlap credits in a plan (its reductions and the backward compute they wait for) comes from nodes
    `overlap_roles` marks: only those are weighted below 1 (plans of random node costs, some of which hide)."""
    found = explored(graph, mesh)
    reductions, backward = overlap_roles(found.decoder, found.graph.carried)
    egraph = found.decoder.extraction_graph(list(found.roots), FUSING, found.priced_moves)
    hidden = 0
    for seed in range(6):
        draw = random.Random(seed)
        selection = extract(egraph.with_costs([draw.random() if math.isfinite(c) else c for c in egraph.node_cost]),
                            "greedy-dag", 5.0)
        plan = found.decoder.plan(egraph, selection, found.graph, found.names)
        node = dict(zip((s.out for s in plan.steps), found.decoder.step_nodes(egraph, selection)))
        credited: list[Step] = []
        overlap(plan, lambda step, mesh: credited.append(step) or 1.0)
        assert all(node[s.out] in (reductions if isinstance(s, Reshard) else backward) for s in credited)
        hidden += bool(credited)
    assert hidden  # the check saw plans that hide


def fusion_kernels(plan: Plan, model: DefaultCostModel) -> int:
    """The kernels `plan`'s fusible per-run steps launch (cost.fusion): its groups, and each fusible step in none,
    a view or a step priced below a launch left out (a group of those alone is charged next to nothing)."""
    launch = model.profile.device.launch_overhead * model.profile.device.oversubscription(plan.mesh.size)
    counted = {s.out for s in plan.steps if isinstance(s, Compute) and s.out not in plan.prepared and fusible(s)
               and not s.signature.kernel.is_view and model.step_cost(s, plan.mesh) >= launch * (1 - 1e-9)}
    groups = fusion_groups(plan)
    grouped = {v for g in groups for v in g.members}
    return sum(1 for g in groups if counted.intersection(g.members)) + len(counted - grouped)


@pytest.mark.parametrize("graph, mesh", [("llama training", (2, 2)), ("llama inference", (2, 2)),
                                         ("mlp training", (2,))])
def test_no_plan_of_the_egraph_launches_fewer_fusion_kernels_than_group_launches(graph, mesh):
    """What the bound adds for the fusion groups' launches (egraph.group_launches) is a count every plan makes:
    the extractors', near-optimal ones at drawn costs and the hand plans in the e-graph."""
    found = explored(graph, mesh)
    egraph = found.decoder.extraction_graph(list(found.roots), FUSING, found.priced_moves)
    device = FUSING.profile.device
    launch = device.launch_overhead * device.oversubscription(found.decoder.mesh.size)
    least = group_launches(found.decoder, egraph, launch)
    hands = [hand for hand, _ in embedded_plans(found.decoder, egraph, found.baselines, ())]
    made = [fusion_kernels(plan, FUSING) for plan in [*hands, *plans(found, FUSING, seed=3, count=4)]]
    assert least >= 3 and min(made) >= least


def test_the_bound_fails_with_the_launches_overstated(monkeypatch):
    """The launch term is what the bound can afford, not a guess that happens to sit low: half as many launches
    again, and the optimizer's plan of a LLaMA block's inference on Mesh(2, 2) costs less than the bound."""
    found, counted = explored("llama inference", (2, 2)), plan_bound_module.group_launches
    result = found.extract(FUSING)
    egraph = found.decoder.extraction_graph(list(found.roots), FUSING, found.priced_moves)
    arguments = (found.decoder, egraph, FUSING, result.plan, None, result.floor, floor_parts(
        found.graph, found.decoder.mesh, FUSING).fusion)
    assert plan_bound(*arguments).seconds <= result.plan.cost * (1 + 1e-9)
    monkeypatch.setattr(plan_bound_module, "group_launches", lambda *args: math.ceil(1.5 * counted(*args)))
    assert plan_bound(*arguments).seconds > result.plan.cost


def test_a_fusible_node_is_floored_below_its_cost_only_under_a_fusing_model():
    found = explored("llama training", (2,))
    egraph = found.decoder.extraction_graph(list(found.roots), FUSING, found.priced_moves)
    unfused = MODELS["gpu unfused"]
    assert node_floors(found.decoder, egraph.node_cost, unfused) == list(egraph.node_cost)
    floors = node_floors(found.decoder, egraph.node_cost, FUSING)
    assert all(f <= c for f, c in zip(floors, egraph.node_cost))
    assert sum(f < c for f, c in zip(floors, egraph.node_cost)) > 0


def test_a_proven_plan_of_a_plain_sum_has_no_gap():
    """No fusion, no carried state: plan_cost is the node-cost sum, and the ILP's proof bounds it."""
    result = explored("mlp inference", (2,)).extract(MODELS["gpu unfused"])
    assert result.status == "optimal" and result.gap == 0


class Together:
    """A cost model that prices a plan's steps together in its own way: no bound is known for it."""

    def step_cost(self, step, mesh):
        return FUSING.step_cost(step, mesh)

    def plan_step_costs(self, plan):
        return {s.out: 0.5 * self.step_cost(s, plan.mesh) for s in plan.steps if s.out not in plan.prepared}


class Unfloored(DefaultCostModel):
    """DefaultCostModel's prices, but a subclass: the whole-space floor is not known for it (cost.floor)."""


FOLDED = {"mlps": lambda: residual_mlps(4), "llama training": lambda: llama_step(3)}


@functools.cache
def folded(graph: str, mesh: tuple[int, ...]) -> Explored:
    found = explore(FOLDED[graph](), Mesh(*mesh), layers=True)
    assert found.layered is not None
    return found


def periodic_plans(found: Explored, model: DefaultCostModel, seed: int, count: int) -> list[Plan]:
    """Periodic plans of the folded e-graph the optimizer searches (its copy 1 priced once per later copy), every
    layer alike: the greedy fallback's candidates (egraph.pins.periodic_selections) of greedy-dag's choice at the
    node costs and at `count` draws around them, expanded onto the whole graph."""
    from tapestry.egraph.folded_candidates import FoldedCandidates
    from tapestry.egraph.pins import periodic_selections, steady_ties

    layered, decoder = found.layered, found.decoder
    carried = {out: name for out, name in found.whole.carried.items() if out in found.graph.outputs}
    egraph, ties = steady_ties(decoder, decoder.extraction_graph(list(found.roots), model, found.priced_moves), carried)
    egraph, ties = layered.costs(egraph), sorted([*ties, *layered.ties()])
    draw = random.Random(seed)
    graphs = [egraph] + [egraph.with_costs([c * draw.uniform(0.2, 1.8) if math.isfinite(c) else c
                                            for c in egraph.node_cost]) for _ in range(count)]
    candidates = [s for g in graphs for s in periodic_selections(layered, decoder, egraph, extract(g, "greedy-dag"),
                                                                 ties, carried)]
    expand = FoldedCandidates(layered, decoder, found.graph, found.folded.names)
    return [expand.decode(egraph, s)[0] for s in candidates]


@pytest.mark.parametrize("graph, mesh", [("mlps", (2, 2)), ("llama training", (2,))])
@pytest.mark.parametrize("model", list(MODELS))
def test_no_periodic_plan_costs_less_than_a_folded_results_bound(graph, mesh, model):
    """A folded (periodic) extraction, the only kind a real-depth model gets, reports a gap: the LP at lambda 1 of
    the folded e-graph (copy 1 at m-1 times its cost, its ties to copy 0 dropped) bounds every periodic plan of it,
    the optimizer's and the greedy fallback's candidates at drawn costs each at least the bound, which is at least
    the whole-space floor."""
    found, cost_model = folded(graph, mesh), MODELS[model]
    result = found.extract(cost_model)
    assert result.status == "periodic" and result.plan.graph is found.whole
    bound = result.bound.seconds
    assert bound is not None and result.bound.source == "LP at lambda 1" and bound >= result.floor > 0
    assert 0 <= result.gap < 1 and "no bound" not in result.explain().splitlines()[0]
    candidates = [result.plan, *periodic_plans(found, cost_model, 0, 3)]
    assert len(candidates) > 2
    assert all(bound <= plan_cost(plan, cost_model) * (1 + 1e-9) for plan in candidates)


def test_no_gap_and_the_reason_where_no_bound_is_known():
    result = explored("mlp inference", (2,)).extract(Together())
    assert result.gap is None and result.bound.seconds is None
    assert "Together prices steps together" in result.explain().splitlines()[0]
    unfloored = explore(residual_mlps(3), Mesh(2), layers=True).extract(Unfloored(FUSING.profile))
    assert unfloored.gap is None and "periodic, and no floor of the fused steps" in unfloored.explain().splitlines()[0]
    found = explored("mlp inference", (2,))
    egraph = found.decoder.extraction_graph(list(found.roots), FUSING, found.priced_moves)
    out_of_work = plan_bound(found.decoder, egraph, FUSING, found.extract(FUSING).plan, seconds=1e-9)
    assert out_of_work.seconds is None and out_of_work.gap(1.0) is None and "no LP solved" in out_of_work.why


def test_a_result_kept_for_its_bound_keeps_no_decoder():
    """The bound is solved when asked, from inputs read off the decoder at once: a result kept alive does not keep
    the decoder (and the extraction graphs it caches) alive with it."""
    found = explore(GRAPHS["mlp training"](), Mesh(2))
    decoder = weakref.ref(found.decoder)
    result = found.extract(FUSING)
    del found
    gc.collect()
    assert decoder() is None
    assert result.bound.seconds is not None and 0 <= result.gap < 1
