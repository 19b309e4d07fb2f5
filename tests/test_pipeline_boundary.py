"""A layer's stage-boundary transfers priced into its extraction (pipeline.boundary), as plan_pipeline ranks layer
plans over more than one stage."""
from __future__ import annotations

from dataclasses import replace

import pytest

from test_pipeline import ResidualMLP, h100

SLOW = 1e3  # bytes per second across nodes: a stage transfer dearer than anything else the tiny layer does


@pytest.fixture(scope="module")
def mlp_step():  # noqa: ANN201
    return ResidualMLP.step()


def two_gpu_nodes() -> object:
    """h100's device, nodes of 2 GPUs on its NVLink, the nodes joined by a SLOW link: on Mesh(2, 2) the pipeline
    axis (0) crosses nodes and a stage's sub-mesh, Mesh(2), is one node."""
    from tapestry.cost import DefaultCostModel, Link
    from tapestry.cost.profile import Level

    profile = h100().profile
    fast = profile.levels[0].link
    return DefaultCostModel(replace(profile, levels=(Level("nvlink", fast, 2), Level("slow", Link(1e-6, SLOW)))))


def test_a_boundary_inputs_place_costs_one_hop_of_its_largest_block_and_nothing_else_changes(
        mlp_step) -> None:  # noqa: ANN001
    """Each Place of the layer's input and of the incoming gradient (a plan may place one in two layouts: each is
    priced as sent) costs its fullest device's bytes over the link, per step and in the plan's fused step costs;
    every other step costs what the model says, and the model's other attributes (its profile, fused_device) read
    through."""
    import tapestry
    from tapestry import dtypes
    from tapestry.cost import Link, step_costs
    from tapestry.optimizer import explore
    from tapestry.pipeline.boundary import BoundaryPriced, boundary_inputs
    from tapestry.plan import Place

    model, link = h100(), Link(1e-6, SLOW)
    plan = explore(mlp_step, tapestry.Mesh(2), budget=tapestry.Budget(seconds=30)).extract(model).plan
    priced = BoundaryPriced.of(model, mlp_step, link, 1.0)
    assert priced.profile is model.profile and priced.fused_device == model.fused_device
    crossing = boundary_inputs(mlp_step)
    assert len(crossing) == 2  # the input, the incoming gradient
    plain, hopped = step_costs(plan, model), step_costs(plan, priced)
    assert hopped.keys() == plain.keys()
    sent = set()
    for step in plan.steps:
        if step.out not in plain:
            continue
        hop = 0.0
        if isinstance(step, Place) and step.input in crossing:
            largest = max(b.size for b in step.layout.blocks if b is not None)
            hop = largest * dtypes.itemsize(plan.dtypes[step.out]) / SLOW
            sent.add(step.input)
        assert hopped[step.out] == pytest.approx(plain[step.out] + hop, rel=1e-12)
        assert priced.step_cost(step, plan.mesh) == pytest.approx(model.step_cost(step, plan.mesh) + hop, rel=1e-12)
    assert sent == set(crossing)


def test_what_extraction_reads_of_the_model_is_named_not_delegated_wholesale() -> None:
    """The profile, fused_device and reshard_floors read through; a model without the last two prices no fusion
    and no floors through the wrapper either; nothing else of the model is handed out (its own methods would price
    without the hops)."""
    from tapestry.pipeline.boundary import BoundaryPriced

    class Bare:
        profile = "a profile"

        def step_cost(self, step: object, mesh: object) -> float:
            return 1.0

    model = h100()
    priced = BoundaryPriced(model, ())
    assert priced.profile is model.profile and priced.fused_device == model.fused_device
    assert priced.reshard_floors == model.reshard_floors
    assert not hasattr(priced, "roofline") and hasattr(model, "roofline")
    bare = BoundaryPriced(Bare(), ())
    assert bare.profile == "a profile" and bare.fused_device is None and not hasattr(bare, "reshard_floors")


def test_extraction_priced_with_its_hops_splits_the_input_the_plain_one_keeps_whole(mlp_step) -> None:  # noqa: ANN001
    """Placing an input is free to the optimizer, so the tiny layer's fastest plan takes its input whole on both
    devices; priced with a slow link's hops, it takes it split: half the bytes per stage transfer."""
    import tapestry
    from tapestry.cost import Link
    from tapestry.optimizer import explore
    from tapestry.pipeline import layer_cost
    from tapestry.pipeline.boundary import BoundaryPriced

    model = h100()
    explored = explore(mlp_step, tapestry.Mesh(2), budget=tapestry.Budget(seconds=30))
    whole = layer_cost(explored.extract(model, micro_batches=8).plan, model).boundary
    split = layer_cost(explored.extract(BoundaryPriced.of(model, mlp_step, Link(1e-6, SLOW), 1.0),
                                        micro_batches=8).plan, model).boundary
    assert split == whole // 2


def extracted_models(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None]]:
    """Of every `Explored.extract` call from now on: its cost model's type and its memory budget, in order."""
    from tapestry.optimizer import Explored

    calls: list[tuple[str, int | None]] = []
    extract = Explored.extract

    def counted(self: Explored, cost_model: object = None, *args: object, **kw: object) -> object:
        calls.append((type(cost_model).__name__, kw.get("memory_budget")))
        return extract(self, cost_model, *args, **kw)

    monkeypatch.setattr(Explored, "extract", counted)
    return calls


def plan(step: object, stages: int, **kw: object) -> object:
    import tapestry

    return tapestry.plan_pipeline(step, 4, tapestry.Mesh(2, 2), global_batch=16, cost_model=two_gpu_nodes(),
                                  stages=(stages,), memory_budget=None, budget=tapestry.Budget(seconds=30), **kw)


def test_over_more_than_one_stage_every_layer_plan_is_ranked_with_its_hops(mlp_step,  # noqa: ANN001
                                                                           monkeypatch) -> None:
    """The fastest layer plan and the leaner ones are extracted with the stage transfers priced where there are
    stages to transfer between; with one stage (gradient accumulation), by the model as given."""
    from tapestry.pipeline import planner

    calls = extracted_models(monkeypatch)
    monkeypatch.setattr(planner, "ideal_time", lambda *args, **kw: 0.0)  # no floor: the leaner plan is extracted
    plan(mlp_step, 2, pareto_points=2)
    assert [(model, budget is None) for model, budget in calls] == [("BoundaryPriced", True),
                                                                   ("BoundaryPriced", False)]
    calls.clear()
    plan(mlp_step, 1, pareto_points=2)
    assert [(model, budget is None) for model, budget in calls] == [("DefaultCostModel", True),
                                                                   ("DefaultCostModel", False)]


def test_a_schedules_exposed_hops_are_its_fill_and_drain_and_one_a_micro_batch_in_1f1b() -> None:
    """The hops `price` puts on a step's critical path: GPipe's 2(S - 1) and interleaved 1F1B's 2(S v - 1) whatever
    the micro-batches (the rest are sent while the receiver computes); 1F1B on 2 stages waits on every round trip."""
    from tapestry.pipeline.model import exposed_hops
    from tapestry.pipeline.schedule import Schedule

    for stages in (2, 3, 4):
        for groups in (1, 2, 5, 40):
            m = stages * groups
            assert exposed_hops(Schedule("gpipe", stages, m)) == pytest.approx(2 * (stages - 1), rel=1e-6)
            for v in (2, 3):
                assert exposed_hops(Schedule("interleaved", stages, m, v)) == pytest.approx(2 * (stages * v - 1),
                                                                                           rel=1e-6)
    for m in (2, 4, 64):
        assert exposed_hops(Schedule("1f1b", 2, m)) == pytest.approx(m, rel=1e-6)


def test_the_hops_a_stage_is_charged_are_what_its_step_pays_for_them(mlp_step) -> None:  # noqa: ANN001
    """The layer's input and the incoming gradient, each placed once in the layout the pipeline sends (of
    `LayerCost.boundary` bytes): a stage's layers are charged, per step, what the pipeline model's step grows by
    for that transfer under the schedule the share was taken for (hops short beside the compute). Charging every
    hop (S v round trips a micro-batch, as before) priced them 2 v m / exposed times that."""
    import tapestry
    from tapestry.cost import Link
    from tapestry.optimizer import explore
    from tapestry.pipeline import MIXED, layer_cost
    from tapestry.pipeline.boundary import BoundaryPriced, boundary_inputs
    from tapestry.pipeline.model import partition, price
    from tapestry.pipeline.planner import exposed_share
    from tapestry.pipeline.schedule import Schedule
    from tapestry.plan import Place

    model, layers, m = h100(), 8, 16
    plan = explore(mlp_step, tapestry.Mesh(2), budget=tapestry.Budget(seconds=30)).extract(model).plan
    layer = layer_cost(plan, model)
    crossing = [next(s for s in plan.steps if isinstance(s, Place) and s.input == name
                     and max(b.size for b in s.layout.blocks if b is not None) * 4 == layer.boundary)  # float32
                for name in boundary_inputs(mlp_step)]
    beta = layer.boundary / (1e-3 * layer.forward)  # a hop a thousandth of a layer's forward
    for schedule in (Schedule("1f1b", 2, m), Schedule("interleaved", 2, m, 2), Schedule("interleaved", 4, m, 2)):
        s = schedule.stages
        priced = BoundaryPriced.of(model, mlp_step, Link(0.0, beta), exposed_share([schedule], layers, m))
        charged = layers // s * m * sum(priced.hop(step) for step in crossing)
        chunks = partition([1.0] * layers, s * schedule.chunks)
        steps = [price([layer] * layers, schedule, chunks, [False] * layers, MIXED, t).step_time
                 for t in (0.0, layer.boundary / beta)]
        assert charged == pytest.approx(steps[1] - steps[0], rel=1e-6)


def test_a_layer_is_charged_its_share_of_the_hops_under_the_schedule_with_the_most_chunks(mlp_step,  # noqa: ANN001
                                                                                          monkeypatch) -> None:
    """S stages over L layers, m micro-batches: a layer pays the round trips the schedule with the most chunks tried
    leaves exposed (`exposed_hops` / 2), shared by the L / S layers a device holds, per micro-batch: 1F1B on 2
    stages 4 hops, interleaved with 2 chunks 2(2 x 2 - 1) = 6."""
    from tapestry.pipeline import planner

    shares: list[float] = []
    made = planner.BoundaryPriced.of

    def spied(model: object, graph: object, link: object, hops: float) -> object:
        shares.append(hops)
        return made(model, graph, link, hops)

    monkeypatch.setattr(planner.BoundaryPriced, "of", spied)
    m = 16 // 4  # the step's batch is 4
    for schedules, exposed in [(("1f1b",), 4), (("1f1b", "interleaved"), 6)]:  # 4 layers: v = 2 at most
        share = exposed / 2 * 2 / (4 * m)
        shares.clear()
        plan(mlp_step, 2, pareto_points=1, schedules=schedules)
        assert shares == [pytest.approx(share, rel=1e-6)]


def test_across_a_slow_link_the_layer_plan_chosen_sends_half_the_bytes_for_a_faster_step(mlp_step,  # noqa: ANN001
                                                                                        monkeypatch) -> None:
    """Ranked as the optimizer prices it (Places free), the tiny layer's plan takes its input whole on both of a
    stage's devices; ranked with its hops, split, and the pipelined step across the slow link is faster."""
    from tapestry.pipeline import planner

    hopped = plan(mlp_step, 2, pareto_points=1).plan

    class Plain:
        @staticmethod
        def of(model: object, graph: object, link: object, hops: float) -> object:
            return model

    monkeypatch.setattr(planner, "BoundaryPriced", Plain)
    plain = plan(mlp_step, 2, pareto_points=1).plan
    assert hopped.layer.boundary == plain.layer.boundary // 2
    assert hopped.cost < plain.cost
