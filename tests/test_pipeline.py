"""Pipeline parallelism (tapestry.pipeline): schedules against a brute-force clock, stage balance, the memory of
micro-batches in flight, recomputation and precision, and the choice of stages by cost."""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from tapestry.cost import Link
from tapestry.pipeline import BF16, MIXED, Ends, LayerCost, Schedule, partition, price, simulate
from tapestry.pipeline.planner import best_configuration, configurations, fit, stage_mesh
from tapestry.sharding import Mesh

SHAPES = [("gpipe", s, 1) for s in (1, 2, 3, 4)] + [("1f1b", s, 1) for s in (1, 2, 3, 4)] + \
    [("interleaved", s, v) for s in (2, 3, 4) for v in (2, 3)]


def brute_force(schedule: Schedule, forward: list[int], backward: list[int], transfer: int) -> int:
    """The makespan on a clock ticking one time unit at a time: each idle device starts its next task (in the
    schedule's order) once the task it needs is done and, across devices, `transfer` ticks have passed."""
    orders = [schedule.order(d) for d in range(schedule.stages)]
    last = schedule.stages * schedule.chunks - 1
    finished: dict[tuple[str, int, int], int] = {}
    running: dict[int, tuple[tuple[str, int, int], int]] = {}
    at = [0] * schedule.stages
    tick = 0
    while len(finished) < sum(map(len, orders)):
        for d, (task, end) in list(running.items()):
            if end == tick:
                finished[task] = tick
                del running[d]
        for d, order in enumerate(orders):
            if d in running or at[d] == len(order):
                continue
            t = order[at[d]]
            need = (("F", t.micro_batch, t.chunk - 1) if t.chunk > 0 else None) if t.kind == "F" else \
                ("B", t.micro_batch, t.chunk + 1) if t.chunk < last else ("F", t.micro_batch, t.chunk)
            delay = 0 if need is None or need[2] % schedule.stages == d else transfer
            if need is None or (need in finished and finished[need] + delay <= tick):
                seconds = forward[t.chunk] if t.kind == "F" else backward[t.chunk]
                running[d] = ((t.kind, t.micro_batch, t.chunk), tick + seconds)
                at[d] += 1
        tick += 1
        assert tick < 10**5, "the brute force found a deadlock"
    return max(finished.values())


@pytest.mark.parametrize("name,stages,chunks", SHAPES)
def test_simulation_matches_a_brute_force_clock(name: str, stages: int, chunks: int) -> None:
    rng = random.Random(f"{name}{stages}{chunks}")
    for m in (stages, 2 * stages, 3 * stages):
        n = stages * chunks
        forward = [rng.randint(1, 4) for _ in range(n)]
        backward = [rng.randint(1, 8) for _ in range(n)]
        for transfer in (0, 2):
            schedule = Schedule(name, stages, m, chunks)
            assert simulate(schedule, forward, backward, transfer).makespan == \
                brute_force(schedule, forward, backward, transfer)


@pytest.mark.parametrize("name,stages,chunks", SHAPES)
def test_step_time_is_the_ideal_plus_the_bubble(name: str, stages: int, chunks: int) -> None:
    """Equal chunks, free transfers: m (F + B) (1 + (S - 1) / (v m)), as GPipe and Megatron-LM state."""
    for m in (stages, 2 * stages, 5 * stages):
        schedule = Schedule(name, stages, m, chunks)
        timeline = simulate(schedule, [1.0 / chunks] * stages * chunks, [2.0 / chunks] * stages * chunks)
        assert timeline.makespan == pytest.approx(3.0 * m * (1 + (stages - 1) / (chunks * m)))
        assert schedule.bubble == pytest.approx((stages - 1) / (chunks * m))


@pytest.mark.parametrize("name,stages,chunks", SHAPES)
def test_micro_batches_in_flight_are_the_schedules(name: str, stages: int, chunks: int) -> None:
    """GPipe holds every micro-batch; 1F1B at most S - d on device d; interleaved its warm-up plus one."""
    for m in (stages, 4 * stages):
        schedule = Schedule(name, stages, m, chunks)
        timeline = simulate(schedule, [1.0] * stages * chunks, [2.0] * stages * chunks)
        assert timeline.peak_in_flight == tuple(schedule.in_flight(d) for d in range(stages))
        if name == "gpipe":
            assert set(timeline.peak_in_flight) == {m}
        if name == "1f1b":
            assert timeline.peak_in_flight == tuple(min(stages - d, m) for d in range(stages))


def test_every_task_runs_once_after_what_it_needs() -> None:
    schedule = Schedule("interleaved", 4, 8, 2)
    timeline = simulate(schedule, [1.0] * 8, [2.0] * 8, transfer=0.5)
    ends = {s.task: s.end for s in timeline.slots}
    assert len(ends) == len(timeline.slots) == 2 * 8 * 8
    for slot in timeline.slots:
        t = slot.task
        if t.kind == "F" and t.chunk > 0:
            assert slot.start >= ends[replace(t, chunk=t.chunk - 1)] + 0.5
        if t.kind == "B":
            assert slot.start >= ends[replace(t, kind="F")]
            if t.chunk < 7:
                assert slot.start >= ends[replace(t, chunk=t.chunk + 1)] + 0.5
    for d in range(4):
        mine = sorted((s.start, s.end) for s in timeline.slots if s.device == d)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:])), "a device runs one task at a time"


def test_interleaving_needs_micro_batches_in_groups_of_the_stages() -> None:
    with pytest.raises(ValueError, match="not a multiple of 4 stages"):
        Schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="only 'interleaved'"):
        Schedule("1f1b", 4, 8, 2)


@pytest.mark.parametrize("seed", range(5))
def test_stages_balance_as_well_as_any_split(seed: int) -> None:
    rng = random.Random(seed)
    costs = [rng.uniform(0.1, 3.0) for _ in range(9)]
    for parts in (1, 2, 3, 4):
        groups = partition(costs, parts)
        assert [i for g in groups for i in g] == list(range(9)) and all(groups)
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, 9)))
                   for cuts in itertools.combinations(range(1, 9), parts - 1))
        assert max(sum(costs[i] for i in g) for g in groups) == pytest.approx(best)


def test_identical_layers_split_evenly() -> None:
    assert [len(g) for g in partition([1.0] * 80, 8)] == [10] * 8
    assert sorted(len(g) for g in partition([1.0] * 10, 4)) == [2, 2, 3, 3]


LAYER = LayerCost(forward=1.0, backward=2.0, update=0.5, params=1000, state=2000, slots=2, activations=300,
                  boundary=20, working=50, flops=1e9)


def test_memory_grows_with_the_micro_batches_in_flight() -> None:
    """1F1B: device d holds min(S - d, m) micro-batches of its layers' activations; GPipe: all m."""
    chunks = partition([1.0] * 8, 4)
    flags = (False,) * 8
    resident = 2 * MIXED.resident(LAYER) + LAYER.working
    for m in (1, 2, 4, 8, 16):
        one_f_one_b = price([LAYER] * 8, Schedule("1f1b", 4, m), chunks, flags, MIXED, 0.0)
        assert one_f_one_b.memory == tuple(resident + min(4 - d, m) * 2 * 300 for d in range(4))
        gpipe = price([LAYER] * 8, Schedule("gpipe", 4, m), chunks, flags, MIXED, 0.0)
        assert gpipe.memory == tuple(resident + m * 2 * 300 for d in range(4))


@pytest.mark.parametrize(("name", "stages", "chunks"), SHAPES)
def test_a_devices_activation_peak_is_the_most_its_order_holds(name: str, stages: int, chunks: int) -> None:
    """The few in-flight counts device_memory reads give the peak of walking the device's order, whatever each
    chunk keeps (none, or some)."""
    from tapestry.pipeline.model import in_flight_counts

    rng = random.Random(stages * 10 + chunks)
    schedule = Schedule(name, stages, 4 * stages, chunks)
    for d in range(stages):
        for _ in range(5):
            kept = [rng.choice([0.0, rng.uniform(1, 9)]) for _ in range(stages * chunks)]
            held = walked = 0.0
            for task in schedule.order(d):
                held += kept[task.chunk] if task.kind == "F" else -kept[task.chunk]
                walked = max(walked, held)
            counted = max(sum(n * kept[c] for c, n in point) for point in in_flight_counts(schedule, d))
            assert counted == pytest.approx(walked, abs=1e-9)


def test_many_micro_batches_are_extrapolated_exactly_for_equal_chunks() -> None:
    chunks, flags = partition([1.0] * 8, 8), (False,) * 8
    for name, v in (("1f1b", 1), ("gpipe", 1)):
        schedule = Schedule(name, 8, 200, v)
        priced = price([LAYER] * 8, schedule, chunks, flags, BF16, 0.25)
        assert priced.simulated < 200
        full = simulate(schedule, [1.0] * 8, [2.0] * 8, 0.25, [300.0] * 8)
        assert priced.step_time == pytest.approx(full.makespan + 0.5 * BF16.update_scale(LAYER))
        assert max(priced.memory) == pytest.approx(8 * 0 + BF16.resident(LAYER) + max(full.peak_activations)
                                                   + LAYER.working)


def test_update_and_gradient_reductions_are_paid_once_per_step() -> None:
    """Gradients accumulate over the micro-batches: the update and the reductions run once, whatever m is;
    under mixed precision the (memory-bound) update moves 16 bytes per parameter where the import moved 8."""
    layer = replace(LAYER, reduce=0.25)
    chunks, flags = partition([1.0] * 4, 2), (False,) * 4
    for m in (2, 8, 32):
        schedule = Schedule("1f1b", 2, m)
        priced = price([layer] * 4, schedule, chunks, flags, MIXED, 0.0)
        makespan = simulate(schedule, [2.0, 2.0], [4.0, 4.0]).makespan
        assert priced.step_time == pytest.approx(makespan + 2 * (0.5 * 16 / 8 + 0.25))


def test_mixed_precision_holds_16_bytes_per_parameter_with_adam() -> None:
    assert MIXED.bytes_per_param(slots=2) == 16
    layer = replace(LAYER, params=10, state=20)  # Adam's m and v sharded like the parameters
    assert MIXED.resident(layer) == 160
    assert BF16.resident(layer) == 80  # as a bfloat16 import holds them: no master copy
    sharded = replace(LAYER, params=10, state=4)  # ZeRO-1: the optimizer state (and master) split 5 ways
    assert MIXED.resident(sharded) == 10 * 4 + 2 * 4 + 4 * 4


def test_recomputation_trades_time_for_memory() -> None:
    """A recomputed layer keeps only its input and runs its forward twice: the tighter the budget, the more
    layers recompute, each costing its forward on the stage that holds it."""
    schedule = Schedule("1f1b", 2, 8)
    free = fit(LAYER, 8, schedule, MIXED, 0.0, None)
    assert free is not None and sum(free[2]) == 0
    results = []
    for budget in sorted({max(free[0].memory) - k * 280 for k in range(0, 10, 2)}, reverse=True):
        found = fit(LAYER, 8, schedule, MIXED, 0.0, budget)
        assert found is not None and max(found[0].memory) <= budget
        results.append((sum(found[2]), found[0].step_time))
    recomputed = [r for r, _ in results]
    times = [t for _, t in results]
    assert recomputed == sorted(recomputed) and recomputed[-1] > 0
    assert times == sorted(times) and times[-1] > times[0]
    everything = fit(LAYER, 8, schedule, MIXED, 0.0, 2 * MIXED.resident(LAYER) + LAYER.working + 8 * 20 - 1)
    assert everything is None  # not even with every layer recomputed


def test_each_stage_recomputes_only_what_its_micro_batches_in_flight_need() -> None:
    """Under 1F1B stage d holds S - d micro-batches: the first stage recomputes the most, the last the least."""
    schedule = Schedule("1f1b", 4, 16)
    resident = 4 * MIXED.resident(LAYER) + LAYER.working
    found = fit(LAYER, 16, schedule, MIXED, 0.0, resident + 2 * 4 * 300)  # two micro-batches of four layers
    assert found is not None
    priced, chunks, flags = found
    recomputed = [sum(flags[i] for i in chunk) for chunk in chunks]
    assert recomputed == sorted(recomputed, reverse=True) and recomputed[0] > 0 and recomputed[-1] == 0
    assert max(priced.memory) <= resident + 2 * 4 * 300


def llama(params: float, activations: float, seconds: float, data_parallel: int) -> LayerCost:
    """A layer planned with tensor parallelism 8 inside a node and data parallelism over `data_parallel` nodes:
    parameters split 8 ways whatever the stage count, compute split by both, and the gradients all-reduced
    across the nodes (bf16 over 50 GB/s) once per step."""
    reduce = 2 * (data_parallel - 1) / data_parallel * 2 * params / 8 / 50e9
    return LayerCost(forward=seconds / data_parallel, backward=2 * seconds / data_parallel,
                     update=0.01 * seconds, reduce=reduce, params=int(params / 8), state=int(2 * params / 8), slots=2,
                     activations=int(activations / data_parallel), boundary=2 * 4096 * 8192, working=2 * 10**9,
                     flops=6 * params * 4096)


def test_pipeline_is_chosen_where_memory_forces_it_and_not_otherwise() -> None:
    """On 8 nodes of 8: 70B (80 layers of 0.86B parameters, 16 bytes each under mixed precision) needs 138 GB
    per device with the parameters split only by the 8 GPUs of a node, so one stage (data parallel across
    the nodes) does not fit in 80 GB, and 8 stages (one per node) do. A 7B-sized model fits whole, and there
    one stage (gradient accumulation, no bubble) is the faster."""
    mesh, link = Mesh(8, 8), Link(1e-5, 50e9)
    budget = 80 * 10**9
    assert best_configuration(llama(0.86e9, 1.5e9, 0.05, 8), 80, mesh, 0, 1, 64, MIXED, link, budget) is None
    piped = best_configuration(llama(0.86e9, 1.5e9, 0.05, 1), 80, mesh, 0, 8, 64, MIXED, link, budget)
    assert piped is not None and piped.stages == 8 and piped.peak_memory <= budget
    assert sorted(i for stage in piped.layers_by_stage for i in stage) == list(range(80))
    whole = best_configuration(llama(0.2e9, 0.3e9, 0.01, 8), 32, mesh, 0, 1, 64, MIXED, link, budget)
    staged = best_configuration(llama(0.2e9, 0.3e9, 0.01, 1), 32, mesh, 0, 8, 64, MIXED, link, budget)
    assert whole is not None and staged is not None and whole.cost < staged.cost


def test_the_stage_holding_the_head_gets_fewer_layers_and_holds_its_weights() -> None:
    """An LM head (and its loss) as costly as two layers rides with the last layer: 8 layers on 2 stages split 5/3,
    not 4/4, and the last device holds the head's parameters and optimizer state."""
    head = replace(LAYER, forward=2.0, backward=4.0, params=50_000, state=100_000, activations=5000, working=9000)
    embedding = replace(LAYER, forward=0.0, backward=0.0, update=0.0, params=50_000, state=100_000, activations=0,
                        working=0, flops=0.0)
    link = Link(0.0, 1e12)
    plain = best_configuration(LAYER, 8, Mesh(2), 0, 2, 4, MIXED, link, None, schedules=("1f1b",))
    both = best_configuration(LAYER, 8, Mesh(2), 0, 2, 4, MIXED, link, None, schedules=("1f1b",),
                              ends=Ends(first=embedding, last=head))
    assert plain is not None and both is not None
    assert [len(c) for c in plain.chunks] == [4, 4] and [len(c) for c in both.chunks] == [5, 3]
    assert both.cost > plain.cost and both.flops == plain.flops + 4 * head.flops
    # stage 0 holds one layer more, and its activations for the 2 micro-batches 1F1B keeps in flight there
    first_extra = both.memory[0] - plain.memory[0] - MIXED.resident(LAYER) - 2 * LAYER.activations
    assert first_extra == pytest.approx(MIXED.resident(embedding))
    assert both.memory[1] > plain.memory[1] - MIXED.resident(LAYER) + MIXED.resident(head)
    assert "stage 1: layers 5-7 + last (head, loss)" in both.describe()
    assert "stage 0: first (embedding) + layers 0-4" in both.describe()


def test_schedules_tried_per_stage_count() -> None:
    assert [s.name for s in configurations(1, 8, 4, ("gpipe", "1f1b", "interleaved"), (2,))] == ["1f1b"]
    found = configurations(4, 8, 8, ("gpipe", "1f1b", "interleaved"), (2, 4))
    assert [(s.name, s.chunks) for s in found] == [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]


def test_a_stage_gets_the_mesh_with_the_pipeline_axis_shrunk() -> None:
    assert stage_mesh(Mesh(8, 8), 0, 8) == Mesh(8)
    assert stage_mesh(Mesh(8, 8), 0, 4) == Mesh(2, 8)
    assert stage_mesh(Mesh(4), 0, 4) == Mesh(1)
    with pytest.raises(ValueError, match="do not divide"):
        stage_mesh(Mesh(8, 8), 0, 3)


class ResidualMLP:
    """A tiny layer: x + down(relu(up(x))), built lazily so the fast tests above need no torch."""

    @staticmethod
    def step(width: int = 8, batch: int = 4):  # noqa: ANN205
        import torch

        from tapestry.pipeline import layer_step

        class Layer(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.up = torch.nn.Linear(width, 2 * width, bias=False)
                self.down = torch.nn.Linear(2 * width, width, bias=False)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x + self.down(torch.relu(self.up(x)))

        return layer_step(Layer(), torch.zeros(batch, width))


@pytest.fixture(scope="module")
def mlp_step():  # noqa: ANN201
    return ResidualMLP.step()


def h100() -> object:
    from tapestry.cost import DefaultCostModel, load_profile

    return DefaultCostModel(load_profile("gpu-h100-cluster"))


@pytest.fixture(scope="module")
def free_pipeline(mlp_step):  # noqa: ANN001, ANN201
    """Four of the tiny layers on Mesh(2), no memory budget, one plan per stage count: read by two tests."""
    import tapestry

    return tapestry.plan_pipeline(mlp_step, 4, tapestry.Mesh(2), global_batch=16, cost_model=h100(),
                                  memory_budget=None, budget=tapestry.Budget(seconds=30), pareto_points=1)


def test_a_layer_step_computes_its_inputs_gradient_and_prices_as_its_plan(mlp_step) -> None:  # noqa: ANN001
    import tapestry
    from tapestry.cost import plan_cost
    from tapestry.pipeline import layer_cost

    model = h100()
    result = tapestry.optimize(mlp_step, 1, cost_model=model)
    layer = layer_cost(result.plan, model)
    weights = 8 * 16 + 16 * 8 + 8  # up, down and the input gate that asks for the input's gradient
    assert (layer.params, layer.state, layer.slots) == (weights, 2 * weights, 2)
    assert layer.boundary == 4 * 8 * 4  # the float32 input of one micro-batch
    assert layer.activations >= layer.boundary and layer.flops > 0
    twice = layer_cost(tapestry.optimize(ResidualMLP.step(batch=8), 1, cost_model=model).plan, model)
    assert twice.activations == 2 * layer.activations  # kept values scale with the micro-batch: no weights among them
    assert twice.params == layer.params
    assert layer.reduce == 0  # one device: nothing to reduce
    assert layer.forward + layer.backward + layer.update == pytest.approx(plan_cost(result.plan, model))


def test_a_layer_step_reads_its_input_and_the_incoming_gradient_as_two_inputs(mlp_step) -> None:  # noqa: ANN001
    activations = [n.name for n in mlp_step.inputs if n.shape == (4, 8) and n.name not in mlp_step.constants]
    readers = {name: [n for n in mlp_step.nodes if name in n.args] for name in activations}
    assert len(activations) == 2 and all(readers.values()), readers  # neither the layer's input nor dL/dy unused


def test_plan_pipeline_places_every_layer_and_prices_the_chosen_step(mlp_step, free_pipeline,  # noqa: ANN001
                                                                     tmp_path) -> None:
    import tapestry
    from tapestry.optimizer import MemoryBudgetError

    free = free_pipeline
    assert [c.stages for c in free.candidates] == [1, 2]
    plan = free.plan
    assert plan.cost == min(c.plan.cost for c in free.candidates)
    assert free.peak_memory == int(max(plan.memory))
    assert sorted(i for stage in plan.layers_by_stage for i in stage) == [0, 1, 2, 3]
    assert plan.schedule.micro_batches == 4 and plan.micro_batch == 4
    assert plan.stage_plan is not None and plan.stage_plan.plan.mesh == plan.stage_mesh
    assert f"{plan.stages} stages over mesh axis 0" in free.explain()
    assert plan.draw(tmp_path / "schedule.png").stat().st_size > 0
    one_stage = next(c.plan for c in free.candidates if c.stages == 1)
    assert one_stage is not None
    with pytest.raises(MemoryBudgetError, match="no pipeline configuration fits"):
        tapestry.plan_pipeline(mlp_step, 4, tapestry.Mesh(2), global_batch=16, cost_model=h100(), stages=(1,),
                               memory_budget=one_stage.layer.working, budget=tapestry.Budget(seconds=30),
                               pareto_points=1)


def test_a_pipeline_plans_mfu_is_against_the_spec_sheet_whichever_profile_priced_it(mlp_step) -> None:  # noqa: ANN001
    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile

    def planned(profile: str):  # noqa: ANN202
        return tapestry.plan_pipeline(mlp_step, 4, tapestry.Mesh(2), global_batch=16, stages=(1,),
                                      cost_model=DefaultCostModel(load_profile(profile)), memory_budget=None,
                                      budget=tapestry.Budget(seconds=30), pareto_points=1).plan

    measured = planned("gpu-h100-cluster-measured")  # float32 layers: 51.5 TFLOP/s measured, 66.9 on the sheet
    assert measured.spec_peak_flops == 66.9e12
    assert measured.mfu == pytest.approx(measured.flops / (measured.cost * 2 * 66.9e12))
    assert f"MFU {measured.mfu:.1%}" in measured.describe()
    unmeasured = planned("cpu-gloo")  # no spec sheet: no MFU, and the plan says so
    assert "MFU unknown" in unmeasured.describe()
    with pytest.raises(ValueError, match="no spec-sheet peak"):
        unmeasured.mfu  # noqa: B018


def test_plan_pipeline_says_what_is_wrong_with_its_arguments(mlp_step) -> None:  # noqa: ANN001
    import tapestry

    def plan(**kw: object) -> None:
        args = {"layer": mlp_step, "layers": 4, "mesh": tapestry.Mesh(2), "global_batch": 16, "cost_model": h100()}
        tapestry.plan_pipeline(**{**args, **kw})

    with pytest.raises(ValueError, match="pipeline axis 1 is not an axis"):
        plan(axis=1)
    with pytest.raises(ValueError, match="precision 'fp8' is not one of mixed, bf16"):
        plan(precision="fp8")
    with pytest.raises(ValueError, match="micro-batch size 4 does not divide the global batch 10"):
        plan(global_batch=10)
    with pytest.raises(ValueError, match="has no `profile`"):
        plan(cost_model=object())


def test_stages_that_recompute_more_get_fewer_layers() -> None:
    """1F1B's first stage holds the most micro-batches, so recomputes the most; moving layers off it is faster."""
    from tapestry.pipeline.planner import rebalanced

    light = replace(LAYER, params=1, state=2)  # activations, not resident state, fill the budget
    schedule = Schedule("1f1b", 8, 64)
    budget = 10 * MIXED.resident(light) + light.working + 2 * 10 * 300
    even = fit(light, 80, schedule, MIXED, 0.0, budget)
    assert even is not None and [len(chunk) for chunk in even[1]] == [10] * 8
    better = rebalanced(light, 80, schedule, MIXED, 0.0, budget, even)
    sizes = [len(chunk) for chunk in better[1]]
    assert better[0].step_time < even[0].step_time and max(better[0].memory) <= budget
    assert sum(sizes) == 80 and sizes[0] < 10



@pytest.mark.parametrize("seed", range(4))
def test_the_ideal_time_floors_every_configuration(seed: int) -> None:
    """No schedule, split or recomputation runs the layers faster than their forwards and backwards shared evenly."""
    from tapestry.pipeline.planner import ideal_time

    rng = random.Random(seed)
    layer = replace(LAYER, forward=rng.uniform(1, 5), backward=rng.uniform(1, 9), update=rng.uniform(0, 3),
                    reduce=rng.uniform(0, 2))
    ends = Ends(replace(layer, forward=rng.uniform(0, 2)), replace(layer, backward=rng.uniform(0, 20)))
    for stages, micro_batches in [(1, 8), (2, 8), (4, 16), (4, 6)]:
        budget = rng.choice([None, 40 * MIXED.resident(layer) + 16 * layer.activations])
        plan = best_configuration(layer, 16, Mesh(4), 0, stages, micro_batches, MIXED, Link(1e-6, 1e9), budget,
                                  ends=ends)
        floor = ideal_time(layer, 16, stages, micro_batches, MIXED, ends)
        assert plan is None or plan.cost >= floor > 0


def extract_budgets(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The memory budget of every `Explored.extract` call from now on, in order (None: unbudgeted)."""
    from tapestry.optimizer import Explored

    budgets: list[int | None] = []
    extract = Explored.extract

    def counted(self: Explored, *args: object, **kw: object) -> object:
        budgets.append(kw.get("memory_budget"))
        return extract(self, *args, **kw)

    monkeypatch.setattr(Explored, "extract", counted)
    return budgets


def test_leaner_layer_plans_are_extracted_only_where_their_floor_beats_the_best_step(mlp_step,  # noqa: ANN001
                                                                                     monkeypatch) -> None:
    """A stage count's leaner layer plans (each an extraction under a memory budget, the dearest calls of a plan)
    are skipped where even the ideal time of its fastest plan is slower than a step already found: the chosen plan
    is the one every front gives, for fewer extractions."""
    import tapestry
    from tapestry.pipeline import planner

    budgets = extract_budgets(monkeypatch)

    def plan() -> tuple[tuple[object, ...], int]:
        budgets.clear()
        p = tapestry.plan_pipeline(mlp_step, 4, tapestry.Mesh(2), global_batch=16, cost_model=h100(),
                                   memory_budget=None, budget=tapestry.Budget(seconds=30), pareto_points=3).plan
        return (p.cost, p.schedule, p.chunks, p.recompute, p.micro_batch, p.layer), sum(b is not None for b in budgets)

    pruned, leaner = plan()
    monkeypatch.setattr(planner, "ideal_time", lambda *args, **kw: 0.0)  # no floor: every stage count's front
    every, all_leaner = plan()
    assert pruned == every
    assert 0 < leaner < all_leaner


def test_a_leaner_layer_plan_is_extracted_only_while_the_last_ones_floor_beats_the_best_step(
        mlp_step, monkeypatch) -> None:  # noqa: ANN001
    """Each leaner layer plan is the fastest under less memory than the last, so the last one's floor floors the
    next: the sweep stops at the first plan whose floor cannot beat the best step, and the extractions under a
    memory budget after it (the dearest calls of a plan) are not made."""
    import tapestry
    from tapestry.pipeline import planner

    budgets = extract_budgets(monkeypatch)

    def plan(points: int) -> tapestry.pipeline.PipelineResult:
        budgets.clear()
        return tapestry.plan_pipeline(mlp_step, 4, tapestry.Mesh(2), global_batch=16, cost_model=h100(), stages=(1,),
                                      memory_budget=None, budget=tapestry.Budget(seconds=30), pareto_points=points)

    monkeypatch.setattr(planner, "ideal_time", lambda *args, **kw: 0.0)  # no floor: a front of three
    plan(3)
    front = list(budgets)
    assert len(front) == 3 and front[0] is None and all(b is not None for b in front[1:])
    floors: list[float] = []

    def the_fastest_only_may_win(*args: object, **kw: object) -> float:  # the first leaner plan's floor beats none
        floors.append(0.0 if not floors else math.inf)
        return floors[-1]

    monkeypatch.setattr(planner, "ideal_time", the_fastest_only_may_win)
    stopped = plan(3)
    assert budgets == front[:2]
    assert "layer plans leaner than the 1 extracted not extracted: their floor, inf ms a step, is above the best " \
           "step found" in stopped.candidates[0].why
    floors.clear()
    two = plan(2).plan
    assert (stopped.plan.cost, stopped.plan.layer) == (two.cost, two.layer)


def test_a_layers_extraction_under_a_memory_budget_does_not_solve_again_what_was_solved_without_one(
        mlp_step, monkeypatch) -> None:  # noqa: ANN001
    """Under a budget each objective's plan is first the one chosen without it (where that fits, the budget does not
    bind): what a layer's fastest extraction solved is taken as it was made by each leaner one, not solved again;
    a graph priced otherwise is solved."""
    import tapestry
    from tapestry import optimizer

    explored = optimizer.explore(mlp_step, tapestry.Mesh(2), budget=tapestry.Budget(seconds=30))
    fastest = explored.extract(h100(), micro_batches=8)
    budgets: list[object] = []
    extract = optimizer.extract

    def counted(egraph: object, extractor: str, time_limit: float, budget: object = None, *args: object,
                **kw: object) -> object:
        budgets.append(budget)
        return extract(egraph, extractor, time_limit, budget, *args, **kw)

    monkeypatch.setattr(optimizer, "extract", counted)
    lean = next(explored.leaner_plans(fastest, h100(), micro_batches=8))
    assert lean.peak_memory < fastest.peak_memory
    assert None not in budgets  # the budget's own solves only, if any
    budgets.clear()
    explored.extract(h100(), micro_batches=4)
    assert None in budgets


def test_layer_plans_are_ranked_by_what_the_pipeline_pays_per_step() -> None:
    """A stage runs 64 micro-batches' forward and backward per update: the layer plan that is fastest for one
    micro-batch with its update (weights split in two) is not the one whose pipelined step is fastest (weights
    whole, only the optimizer state split: each micro-batch faster, the update slower, paid once).
    `plan_pipeline` ranks layer plans as the pipeline pays them, and chooses the second."""
    import tapestry
    from tapestry.optimizer import explore
    from tapestry.pipeline import layer_cost
    from tapestry.pipeline.planner import best_configuration

    step, model, mesh = ResidualMLP.step(width=1024, batch=2), h100(), tapestry.Mesh(2)
    budget = tapestry.Budget(seconds=30)
    one_run = explore(step, mesh, budget=budget).extract(model)
    chosen = tapestry.plan_pipeline(step, 2, mesh, global_batch=128, cost_model=model, stages=(1,),
                                    memory_budget=None, budget=budget, pareto_points=1).plan
    assert chosen.schedule.micro_batches == 64 and chosen.layer_plan is not None
    link = model.profile.axis_links(mesh.shape)[0]
    by_one_run = best_configuration(layer_cost(one_run.plan, model), 2, mesh, 0, 1, 64, MIXED, link, None,
                                    spec_peak_flops=chosen.spec_peak_flops, micro_batch=2)
    assert by_one_run is not None
    assert chosen.layer_plan.cost > one_run.plan.cost  # dearer for one micro-batch and its update ...
    assert chosen.cost < 0.9 * by_one_run.cost  # ... and faster per step
    assert chosen.layer.params > 1.9 * layer_cost(one_run.plan, model).params  # the weights whole, not halved


def test_every_layer_extraction_gets_plan_pipelines_time_limit(mlp_step, monkeypatch) -> None:  # noqa: ANN001
    """The fastest layer plan and the leaner ones are extracted under `time_limit`, by default LAYER_TIME_LIMIT
    (half `optimize`'s: the same 7B configuration on 64 GPUs in two thirds of the CPU seconds, docs/benchmarks.md),
    and a limit given reaches every extraction."""
    import inspect

    import tapestry
    from tapestry.optimizer import Explored
    from tapestry.pipeline import planner

    limits: list[float] = []
    extract = Explored.extract

    def counted(self: Explored, *args: object, **kw: object) -> object:
        limits.append(inspect.signature(extract).bind(self, *args, **kw).arguments.get("time_limit"))
        return extract(self, *args, **kw)

    monkeypatch.setattr(Explored, "extract", counted)
    monkeypatch.setattr(planner, "ideal_time", lambda *args, **kw: 0.0)  # no floor: the leaner plans are extracted
    for given, expected in [({}, planner.LAYER_TIME_LIMIT), ({"time_limit": 7.0}, 7.0)]:
        limits.clear()
        tapestry.plan_pipeline(mlp_step, 4, tapestry.Mesh(2), global_batch=16, cost_model=h100(), stages=(1,),
                               memory_budget=None, budget=tapestry.Budget(seconds=30), pareto_points=2, **given)
        assert len(limits) == 2 and set(limits) == {expected}


def test_a_layers_extractions_share_one_pricing(mlp_step, monkeypatch) -> None:  # noqa: ANN001
    """A stage count's layer is extracted several times under one cost model (its fastest plan, then leaner ones
    under memory budgets): its e-nodes are priced once, for all of them."""
    import tapestry
    from tapestry.egraph.decode import Decoder
    from tapestry.optimizer import Explored
    from tapestry.pipeline import planner

    calls = {"priced": 0, "extract": 0}
    priced, extract = Decoder.priced, Explored.extract

    def counted_priced(self: Decoder, *args: object, **kw: object) -> object:
        calls["priced"] += 1
        return priced(self, *args, **kw)

    def counted_extract(self: Explored, *args: object, **kw: object) -> object:
        calls["extract"] += 1
        return extract(self, *args, **kw)

    monkeypatch.setattr(Decoder, "priced", counted_priced)
    monkeypatch.setattr(Explored, "extract", counted_extract)
    monkeypatch.setattr(planner, "ideal_time", lambda *args, **kw: 0.0)  # no floor: the leaner plans are extracted
    tapestry.plan_pipeline(mlp_step, 4, tapestry.Mesh(2), global_batch=16, cost_model=h100(), stages=(1,),
                           memory_budget=None, budget=tapestry.Budget(seconds=30), pareto_points=3)
    assert calls["extract"] > 1 and calls["priced"] == 1


def test_leaner_layer_plans_are_not_extracted_where_they_could_gain_less_than_the_slack(mlp_step,  # noqa: ANN001
                                                                                         monkeypatch) -> None:
    """Gradient accumulation on one stage has no bubble: its fastest layer plan's step is its floor, which floors
    every leaner plan too, so none can be faster by the slack and none is extracted (an extraction under a memory
    budget each); the whole front's plan is no faster by more than the slack."""
    import tapestry

    budgets = extract_budgets(monkeypatch)

    def plan(slack: float) -> tapestry.pipeline.PipelineResult:
        return tapestry.plan_pipeline(mlp_step, 4, tapestry.Mesh(2), global_batch=16, cost_model=h100(), stages=(1,),
                                      memory_budget=None, budget=tapestry.Budget(seconds=30), pareto_points=3,
                                      leaner_slack=slack)

    skipped = plan(0.02)
    assert budgets == [None]
    assert "leaner layer plans not extracted" in skipped.candidates[0].why
    budgets.clear()
    swept = plan(-1.0)  # the front whatever its floor
    assert any(b is not None for b in budgets)
    assert swept.plan.cost >= (1 - 0.02) * skipped.plan.cost  # the front gained no more than the slack


def test_a_sub_meshs_explored_e_graph_is_freed_before_the_next_is_explored(mlp_step,  # noqa: ANN001
                                                                            monkeypatch) -> None:
    """The e-graphs of a pipeline's stage sub-meshes are the planner's largest objects (8x8x8 for 70B): one at a
    time is held."""
    import gc
    import weakref

    import tapestry
    from tapestry.pipeline import planner

    made: list[weakref.ref] = []
    explore = planner.explore

    def watched(*args: object, **kw: object) -> object:
        gc.collect()
        assert all(ref() is None for ref in made), "an earlier sub-mesh's e-graph is still held"
        found = explore(*args, **kw)
        made.append(weakref.ref(found))
        return found

    monkeypatch.setattr(planner, "explore", watched)
    tapestry.plan_pipeline(mlp_step, 4, tapestry.Mesh(2), global_batch=16, cost_model=h100(), memory_budget=None,
                           budget=tapestry.Budget(seconds=30), pareto_points=1)
    assert len(made) == 2


def test_a_stage_count_says_its_fastest_layer_plan_did_not_fit_and_its_floor_ruled_out_the_rest(
        mlp_step, free_pipeline, monkeypatch) -> None:  # noqa: ANN001
    """Where nothing of a stage count fits because its leaner layer plans were never extracted (their floor was above
    the best step), the report says so rather than that nothing fits."""
    import tapestry
    from tapestry.pipeline import planner

    one, two = (next(c.plan for c in free_pipeline.candidates if c.stages == s) for s in (1, 2))
    assert one.peak_memory > two.peak_memory
    floor = planner.ideal_time
    monkeypatch.setattr(planner, "ideal_time", lambda layer, layers, stages, *rest: math.inf if stages == 1
                        else floor(layer, layers, stages, *rest))
    result = tapestry.plan_pipeline(mlp_step, 4, tapestry.Mesh(2), global_batch=16, cost_model=h100(),
                                    memory_budget=(one.peak_memory + two.peak_memory) // 2,
                                    budget=tapestry.Budget(seconds=30), pareto_points=3)
    why = next(c.why for c in result.candidates if c.stages == 1)
    assert "the fastest layer plan does not fit" in why
    assert "leaner layer plans not extracted: their floor, inf ms a step, is above the best step found" in why


def test_a_later_stage_counts_fusion_priced_refit_is_made_only_where_its_plain_floor_comes_near_the_best_step(
        mlp_step, monkeypatch) -> None:  # noqa: ANN001
    """A layer extraction on 8 devices or more fits twice, by plain and by fusion-priced node costs. Once a best step
    is known, a stage count's layer is extracted by the plain fit first, and refitted (the plain fit not solved again)
    only where that plan's floor is within FUSION_REFIT_MARGIN above it; the chosen configuration is the same either
    way on this case, and the report says where the refit was not made."""
    import tapestry
    from tapestry.optimizer import Explored
    from tapestry.pipeline import planner

    refits: list[tuple[int, bool]] = []
    extract = Explored.extract

    def recorded(self: Explored, *args: object, **kw: object) -> object:
        refits.append((self.mesh.size, kw.get("fusion_refit", True)))
        return extract(self, *args, **kw)

    monkeypatch.setattr(Explored, "extract", recorded)

    def plan(margin: float) -> tapestry.pipeline.PipelineResult:
        refits.clear()
        monkeypatch.setattr(planner, "FUSION_REFIT_MARGIN", margin)
        return tapestry.plan_pipeline(mlp_step, 4, tapestry.Mesh(8), global_batch=16, cost_model=h100(),
                                      stages=(4, 1), memory_budget=None, budget=tapestry.Budget(seconds=30),
                                      pareto_points=1)

    refitted = plan(math.inf)
    assert refits == [(2, True), (8, False), (8, True)]
    skipped = plan(-1.0)
    assert refits == [(2, True), (8, False)]
    assert "no fusion-priced refit of the layer" in next(c.why for c in skipped.candidates if c.stages == 1)
    chosen = [(r.plan.stages, r.plan.cost, r.plan.schedule, r.plan.chunks, r.plan.layer) for r in (refitted, skipped)]
    assert chosen[0] == chosen[1]


def test_smaller_stage_counts_are_not_tried_once_ones_floor_is_the_stop_margin_above_the_best_step(
        mlp_step, monkeypatch) -> None:  # noqa: ANN001
    """Stage counts go largest first; once one's fastest layer plan has a floor (`ideal_time`) `stop_margin` or more
    above the best step found, the smaller stage counts (larger sub-meshes, dearer to plan) are not explored at all
    (STAGE_STOP_MARGIN: not an exact bound). On this case S = 2's floor is that far above S = 8's step: S = 1 is
    not tried, the report says so, and the chosen configuration is the one trying every stage count finds."""
    import tapestry
    from tapestry.pipeline import planner

    explored: list[int] = []
    explore = planner.explore
    monkeypatch.setattr(planner, "explore", lambda graph, mesh, **kw: explored.append(mesh.size) or explore(
        graph, mesh, **kw))

    def plan(margin: float) -> tapestry.pipeline.PipelineResult:
        explored.clear()
        return tapestry.plan_pipeline(mlp_step, 8, tapestry.Mesh(8), global_batch=16, cost_model=h100(),
                                      stages=(8, 2, 1), memory_budget=None, budget=tapestry.Budget(seconds=30),
                                      pareto_points=1, stop_margin=margin)

    every = plan(math.inf)
    assert explored == [1, 4, 8]
    stopped = plan(0.25)
    assert explored == [1, 4]
    why = next(c.why for c in stopped.candidates if c.stages == 1)
    assert why.startswith("not tried: S=2's fastest layer plan has a floor of") and "25% or more above" in why
    assert next(c.plan for c in stopped.candidates if c.stages == 1) is None
    chosen = [(r.plan.stages, r.plan.cost, r.plan.schedule, r.plan.chunks, r.plan.layer) for r in (every, stopped)]
    assert chosen[0] == chosen[1]
