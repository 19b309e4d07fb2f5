"""tapestry.optimize: the seeds' example end to end, budgets, stats, provenance and the CLI."""
from __future__ import annotations

import gc
import json
import math
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tapestry
from tapestry.cli import main
from tapestry.cost import DefaultCostModel, load_profile, peak_memory
from tapestry.cost.memory import layout_bytes
from tapestry.egraph.driver import Budget
from tapestry.graph import Graph, save_graph
from tapestry.kernels import KERNELS
from tapestry.models import mlp, seeds_example
from tapestry.optimizer import optimize
from tapestry.plan import Compute, Place, Plan, Reshard, build_plan
from tapestry.plan.simulate import simulate
from tapestry.plan.validate import validate_plan
from tapestry.sharding import Mesh
from tapestry.testing.strategies import signatures
from tapestry import verify
from tapestry.verify import PlanMeaningError, error
from tapestry.zspace import ZRange


@pytest.fixture(scope="module")
def seeds_graph():
    return seeds_example(4096, 1024, 1024)


def computes(plan: Plan) -> list[Compute]:
    return [s for s in plan.steps if isinstance(s, Compute)]


def test_seeds_example_on_four_devices_runs_one_fused_kernel_per_device(seeds_graph):
    plan = optimize(seeds_graph, Mesh(4)).plan
    (step,) = computes(plan)
    assert step.kernel == "linear_relu"
    blocks = step.blocks
    assert len(blocks) == 4 and all(b is not None for b in blocks) and len(set(blocks)) == 4


def test_seeds_example_on_one_device_is_the_single_fused_kernel(seeds_graph):
    plan = optimize(seeds_graph, Mesh(1)).plan
    assert [s.kernel for s in computes(plan)] == ["linear_relu"]


@pytest.mark.parametrize("devices", [1, 4])
def test_seeds_example_plans_evaluate_equal_to_the_program(devices):
    graph = seeds_example(256, 128, 64)
    plan = optimize(graph, Mesh(devices)).plan
    validate_plan(plan)
    inputs = tapestry.random_inputs(graph, seed=3)
    np.testing.assert_allclose(simulate(plan, inputs)["y"], tapestry.evaluate(graph, inputs)["y"], rtol=1e-5, atol=1e-5)


def test_saturation_reaches_a_fixpoint_and_reports_per_iteration_stats():
    result = optimize(mlp(3, 64, 32), Mesh(2))
    stats = result.stats
    assert stats.stopped_by == "fixpoint"
    assert [it.iteration for it in stats.iterations] == list(range(len(stats.iterations)))
    assert stats.iterations[0].matches, "the first round fires the fusion rules"
    assert json.loads(stats.dumps())["stopped_by"] == "fixpoint"


def test_planning_collects_no_garbage_while_it_runs_and_turns_the_callers_collector_back_on(monkeypatch):
    seen = []
    extract = tapestry.optimizer.extract

    def watched(*args, **kwargs):
        seen.append(gc.isenabled())
        return extract(*args, **kwargs)

    monkeypatch.setattr(tapestry.optimizer, "extract", watched)
    assert gc.isenabled()
    optimize(mlp(2, 16, 8), Mesh(2), progress=lambda _: seen.append(gc.isenabled()))
    assert gc.isenabled()
    assert len(seen) >= 2 and set(seen) == {False}  # in saturation and in extraction


def test_planning_keeps_the_collector_off_between_saturation_and_extraction(monkeypatch):
    seen = []
    explore = tapestry.optimizer.explore

    def watched(*args, **kwargs):
        explored = explore(*args, **kwargs)
        seen.append(gc.isenabled())  # a sweep here went over everything saturation made
        return explored

    monkeypatch.setattr(tapestry.optimizer, "explore", watched)
    optimize(mlp(2, 16, 8), Mesh(2))
    assert seen == [False] and gc.isenabled()


def test_planning_leaves_what_it_made_to_the_oldest_generation_without_a_sweep():
    sweeps = []

    def seen(phase, info):
        if phase == "start":
            sweeps.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        optimize(mlp(2, 16, 8), Mesh(2))
    finally:
        gc.callbacks.remove(seen)
    assert sweeps == [] and gc.isenabled()


def test_planning_keeps_what_the_caller_froze_frozen():
    kept = [[]]
    gc.freeze()
    try:
        optimize(mlp(2, 16, 8), Mesh(2))
        assert gc.get_freeze_count() and not any(o is kept for o in gc.get_objects())  # frozen: in no generation
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())


def test_planning_leaves_a_disabled_collector_disabled():
    gc.disable()
    try:
        optimize(mlp(2, 16, 8), Mesh(2))
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "budget, reason",
    [(Budget(nodes=10), "nodes"), (Budget(iterations=0), "iterations"), (Budget(seconds=0.0), "rule nodes")],
)
def test_budgets_stop_saturation_and_say_which(budget, reason):
    graph = mlp(3, 64, 32)
    result = optimize(graph, Mesh(2), budget=budget)
    assert result.stats.stopped_by == reason
    validate_plan(result.plan)  # the program itself is always in the e-graph, so a plan exists


@pytest.mark.parametrize("bias", [False, True])
def test_a_relu_after_a_conv_runs_inside_the_conv_kernel_on_every_device(bias):
    g = Graph()
    x, w = g.input("x", (4, 8, 10, 10)), g.input("w", (16, 8, 3, 3))
    conv = g.op("conv2d_bias", x, w, g.input("b", (16,)), padding=1) if bias else g.op("conv2d", x, w, padding=1)
    g.output("y", g.relu(conv))
    plan = optimize(g, Mesh(2)).plan  # extract checks the plan against the evaluator
    assert [s.kernel for s in computes(plan)] == ["conv2d_bias_relu" if bias else "conv2d_relu"]


@pytest.mark.parametrize("bias_shape, bias_first", [((16, 1, 1), False), ((1, 16, 1, 1), False), ((16, 1, 1), True)])
def test_a_bias_added_to_a_conv_and_its_relu_run_inside_the_conv_kernel_on_every_device(bias_shape, bias_first):
    """conv + add(b reshaped to broadcast per channel) + relu, as a model written with the Graph API has it."""
    g = Graph()
    x, w, b = g.input("x", (4, 8, 10, 10)), g.input("w", (16, 8, 3, 3)), g.input("b", (16,))
    conv, bias = g.conv2d(x, w, padding=1), g.reshape(b, shape=bias_shape)
    g.output("y", g.relu(g.add(bias, conv) if bias_first else g.add(conv, bias)))
    plan = optimize(g, Mesh(2)).plan
    assert [s.kernel for s in computes(plan)] == ["conv2d_bias_relu"]
    inputs = tapestry.random_inputs(g, seed=5)
    np.testing.assert_allclose(simulate(plan, inputs)["y"], tapestry.evaluate(g, inputs)["y"], rtol=1e-5, atol=1e-5)


def test_explain_names_the_rule_that_made_a_fused_kernel():
    text = optimize(seeds_example(64, 32, 16), Mesh(2)).explain()
    assert "linear_relu made by fusion.egg:4" in text


def test_egraph_renders_as_svg_when_small(tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("graphviz dot not installed")
    result = optimize(seeds_example(64, 32, 16), Mesh(2))
    assert result.render_egraph(tmp_path / "e.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(ValueError, match="pictures are limited"):
        result.render_egraph(tmp_path / "big.svg", max_nodes=5)


def test_cli_optimize_writes_a_plan_that_explain_and_show_read(tmp_path, capsys):
    save_graph(seeds_example(64, 32, 16), tmp_path / "g.json")
    plan_path = tmp_path / "plan.json"
    assert main(["optimize", str(tmp_path / "g.json"), "--mesh", "4", "--out", str(plan_path),
                 "--stats", str(tmp_path / "stats.json")]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["stopped_by"] == "fixpoint" and last["plan"] == str(plan_path)
    validate_plan(Plan.load(plan_path))
    assert main(["explain", str(plan_path)]) == 0
    assert "linear_relu" in capsys.readouterr().out
    if shutil.which("dot"):
        assert main(["show", str(plan_path), "-o", str(tmp_path / "plan.svg")]) == 0


def test_cli_optimize_accepts_a_script_defining_graph(tmp_path, capsys):
    script = tmp_path / "model.py"
    script.write_text("from tapestry.models import mlp\ngraph = mlp(2, 16, 8)\n")
    assert main(["optimize", str(script), "--mesh", "2x2", "--out", str(tmp_path / "p.json")]) == 0
    assert Plan.load(tmp_path / "p.json").mesh == Mesh(2, 2)


def test_cli_reports_a_script_without_a_graph(tmp_path, capsys):
    script = tmp_path / "empty.py"
    script.write_text("x = 1\n")
    assert main(["optimize", str(script)]) == 2
    assert "must define `graph`" in capsys.readouterr().err


def test_pareto_front_trades_time_for_memory_and_the_budget_picks_from_it():
    from tapestry.models import transformer_block
    from tapestry.optimizer import MemoryBudgetError, explore

    # The fastest plan is proven in well under a second; the leaner ones run to their limit, unproven (5 s and 6
    # points: 45 CPU s), and need only fit: 1 s and 3 points sweep the front twice.
    # One exploration for the front and both budgets (`optimize` is `explore(...).extract(...)`; its budget is
    # passed through in test_memory_cuts and below). A small block on Mesh(2) trades time for memory alike, at a
    # fraction of the cost of a wider one on Mesh(4) (docs/benchmarks.md "Test suite time", branch maketest3).
    graph = transformer_block(batch=2, seq=4, dim=16, heads=2)
    explored = explore(graph, Mesh(2))
    front = explored.pareto(time_limit=1, points=3)
    times = [r.plan.cost for r in front]
    memories = [r.peak_memory for r in front]
    assert len(front) >= 2 and times[0] < times[-1] and memories[0] > memories[-1]  # a real trade, not one plan
    budget = memories[0] - 1  # the fastest plan does not fit
    lean = explored.extract(memory_budget=budget, time_limit=1)
    assert max(peak_memory(lean.plan)) <= budget < max(peak_memory(front[0].plan))
    assert lean.plan.cost > times[0]
    with pytest.raises(MemoryBudgetError, match="no plan fits 1 bytes per device"):
        explored.extract(memory_budget=1)


def test_a_memory_budget_is_a_hard_limit_that_changes_the_plan_and_beats_megatron_within_it():
    from tapestry.optimizer import explore
    from tapestry.plan import build_plan

    graph = Graph()
    x, w0, b0, w1, b1 = (graph.input(n, s) for n, s in
                         (("x", (8, 64)), ("w0", (64, 64)), ("b0", (64,)), ("w1", (64, 64)), ("b1", (64,))))
    h = graph.relu(graph.add(graph.matmul(x, w0, name="mm0"), b0, name="add0"), name="act0")
    graph.output("y", graph.add(graph.matmul(h, w1, name="mm1"), b1, name="add1"))
    explored = explore(graph, Mesh(4))
    fastest = explored.extract(time_limit=5)
    megatron = build_plan(graph, Mesh(4), {"mm0": ("n",), "add0": (1,), "act0": (1,), "mm1": ("k",)})
    budget = max(peak_memory(megatron))
    lean = explored.extract(time_limit=5, memory_budget=budget)
    assert max(peak_memory(lean.plan)) <= budget < max(peak_memory(fastest.plan))
    assert lean.plan.steps != fastest.plan.steps and lean.plan.cost >= fastest.plan.cost
    assert lean.plan.cost <= tapestry.cost.plan_cost(megatron, tapestry.optimizer.default_cost_model()) + 1e-12


def test_outputs_ask_for_a_layout():
    from tapestry.sharding import Layout

    graph = mlp(depth=1, batch=8, width=16)
    replicated = optimize(graph, Mesh(2), outputs="replicated").plan
    assert replicated.layout_of(replicated.outputs["y"]) == Layout.replicated((8, 16), Mesh(2))
    rows = Layout.split((8, 16), Mesh(2), (0,))
    split = optimize(graph, Mesh(2), outputs={"y": rows}).plan
    assert split.layout_of(split.outputs["y"]) == rows


def test_cli_pareto_prints_the_front_and_plots_it(tmp_path, capsys):
    save_graph(seeds_example(64, 32, 16), tmp_path / "g.json")
    out = tmp_path / "plan.json"
    assert main(["optimize", str(tmp_path / "g.json"), "--mesh", "2", "--out", str(out),
                 "--pareto-plot", str(tmp_path / "front.png")]) == 0
    assert "Pareto front" in capsys.readouterr().out
    assert (tmp_path / "front.png").stat().st_size > 0 and (tmp_path / "plan.pareto0.json").exists()


def test_the_costed_egraph_is_egraph_serialize_json_that_tapestry_extract_reads(tmp_path, capsys):
    save_graph(mlp(2, 32, 16), tmp_path / "g.json")
    egraph = tmp_path / "egraph.json"
    assert main(["optimize", str(tmp_path / "g.json"), "--mesh", "2", "--out", str(tmp_path / "p.json"),
                 "--egraph-json", str(egraph)]) == 0
    planned = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cost"]
    assert main(["extract", str(egraph), "--extractor", "ilp"]) == 0
    extracted = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert extracted["acyclic"] and extracted["dag_cost"] == pytest.approx(planned)


def chain(ops: int) -> tapestry.Graph:
    g = tapestry.Graph()
    value = g.input("x", (4, 4))
    for k in range(ops):
        value = g.relu(value) if k % 2 else g.exp(value)
    g.output("y", value)
    return g


def test_a_chain_deeper_than_pythons_stack_is_planned_checked_and_run():
    """Decoding, extraction, validation and simulation walk without recursion (1,000 frames is Python's limit)."""
    graph = chain(1500)
    plan = optimize(graph, 1, rules=[], budget=Budget(iterations=1), time_limit=30).plan
    assert len(plan.steps) == 1501
    inputs = tapestry.random_inputs(graph)
    np.testing.assert_allclose(simulate(plan, inputs)["y"], tapestry.evaluate(graph, inputs)["y"])


@pytest.mark.slow
def test_a_1500_op_chain_optimizes_on_two_devices_with_the_shipped_rules():
    """Generation, pricing and extraction of a sharded, rewritten chain walk without recursion too."""
    graph = chain(1500)
    result = optimize(graph, Mesh(2), extractor="greedy-dag")
    assert result.stats.stopped_by == "fixpoint" and len(result.plan.steps) >= 1501
    validate_plan(result.plan)


@pytest.mark.slow
@pytest.mark.parametrize("extractor", ["bottom-up", "greedy-dag", "ilp"])
def test_a_ten_thousand_op_chain_is_planned(extractor: str):
    plan = optimize(chain(10_000), 1, rules=[], budget=Budget(iterations=1, seconds=300), extractor=extractor,
                    time_limit=120).plan
    assert len(plan.steps) == 10_001


def test_optimize_refuses_a_plan_that_computes_something_else(tmp_path):
    """A wrong rule that check-rules did not draw where it is wrong still cannot make a wrong plan: optimize
    simulates the plan it chose on random inputs against the reference evaluator."""
    (tmp_path / "cheap.egg").write_text("(rewrite (Relu (Exp x)) (Relu x) :when ((>= (Rank x) 4)))\n")
    g = tapestry.Graph()
    g.output("y", g.relu(g.exp(g.input("x", (3, 3, 2, 2)))))
    with pytest.raises(PlanMeaningError, match=r"output 'y': max abs err .* \(tolerance 0.001\)"):
        optimize(g, 2, rules=[tmp_path])


def test_a_wrong_rule_is_caught_on_a_graph_too_large_to_simulate_whole(tmp_path):
    """Above verify.CHECK_CELLS the plan's ops and the graph's compute sampled lines of the output from only the
    cells those need: a rule that drops a relu still fails."""
    (tmp_path / "wrong.egg").write_text("(rewrite (Relu (Relu x)) x)\n")
    g = tapestry.Graph()
    g.output("y", g.relu(g.relu(g.input("x", (1100, 1000)))))
    assert verify.cells(g) > verify.CHECK_CELLS
    with pytest.raises(PlanMeaningError, match=r"at 4 sampled line\(s\) or cell\(s\) of each output.*output 'y': "):
        optimize(g, 2, rules=[tmp_path])
    result = optimize(g, 2)
    assert result.meaning_check.startswith("sampled: 4 line(s)") and "meaning: sampled" in result.explain()


def test_a_sampled_line_too_costly_shrinks_to_one_cell():
    """One output line of x @ w needs all of w; one cell, one column of it."""
    g = Graph()
    g.output("y", g.matmul(g.input("x", (4, 64)), g.input("w", (64, 32))))
    plan = build_plan(g, Mesh(2), {"matmul_0": (0,)})
    assert verify.check_sampled(plan, work=100_000) == verify.check_sampled(plan, work=1000) == 4
    assert verify.check_sampled(plan, work=10) == 0


def test_a_sampled_cell_too_costly_is_told_as_the_whole_walk_tells_it_and_sooner(monkeypatch):
    """`_needs` answers None exactly where the programs' whole `_backward` answers need more than `work`, and
    stops walking once the index points alone pass it."""
    g = Graph()
    g.output("y", g.relu(g.matmul(g.relu(g.input("x", (4, 64))), g.input("w", (64, 32)))))
    plan = build_plan(g, Mesh(2), {"matmul_0": (0,)})
    programs = (verify._Program.of_plan(plan), verify._Program.of_graph(g))
    for cell in (ZRange((0, 0), (1, 32)), ZRange((3, 5), (4, 6))):
        whole = verify._work([verify._backward(p, {"y": cell}) for p in programs])
        for work in (0, 1, whole // 3, whole // 2, whole - 1, whole, whole + 1, 10 * whole):
            found = verify._needs(programs, {"y": cell}, work)
            assert (found is None) == (whole > work)
            assert found is None or verify._work(found) == whole
    walked = []
    preimage = verify._preimage
    monkeypatch.setattr(verify, "_preimage", lambda sig, box: walked.append(sig) or preimage(sig, box))
    assert verify._needs(programs, {"y": ZRange((0, 0), (1, 32))}, 0) is None
    assert len(walked) == 1


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(sig=st.sampled_from(sorted(k for k in KERNELS if not k.startswith("opaque"))).flatmap(
    lambda k: signatures(KERNELS[k])), data=st.data())
def test_the_sampled_checks_index_blocks_are_islpys_preimages(sig, data):
    """Which index points write a box of the output: read off the projection's rows, equal to islpy's answer."""
    shape = sig.output_shape
    assume(0 not in shape)
    start = [data.draw(st.integers(0, n - 1)) for n in shape]
    box = ZRange(start, [data.draw(st.integers(a + 1, n)) for a, n in zip(start, shape)])
    assert verify._preimage(sig, box) == verify._preimage_isl(sig, box)


def test_a_plan_too_large_to_check_even_by_samples_says_so_loudly(monkeypatch):
    monkeypatch.setattr(verify, "CHECK_CELLS", 0)
    monkeypatch.setattr(verify, "SAMPLE_WORK", 1)
    with pytest.warns(UserWarning, match="the plan's meaning was NOT CHECKED"):
        result = optimize(seeds_example(8, 4, 6), 2)
    assert result.meaning_check.startswith("NOT CHECKED") and "meaning: NOT CHECKED" in result.explain()


def test_a_float32_output_computed_through_bfloat16_is_judged_at_bfloat16s_tolerance():
    """Split-K partial sums of a bfloat16 matmul, cast to float32: bfloat16's rounding, not float32's."""
    g = Graph()
    x, w = g.input("x", (4, 8192), "bfloat16"), g.input("w", (8192, 4), "bfloat16")
    g.output("y", g.cast(g.matmul(x, w), dtype="float32"))
    result = optimize(g, Mesh(4), memory_budget=40000)
    assert verify.compare(simulate(result.plan, tapestry.random_inputs(g)), tapestry.evaluate(
        g, tapestry.random_inputs(g)), g, result.plan)["y"].tolerance == verify.TOLERANCE["bfloat16"]


@pytest.mark.parametrize(("shape", "perm"), [((8, 6), (1, 0)), ((4, 8, 6), (0, 2, 1)), ((4, 8, 6), (-3, -1, -2))])
def test_a_transpose_spelled_with_its_default_perm_cancels_with_another(shape, perm):
    """Parameters reach the e-graph in one form, so the shipped (Transpose (Transpose x "") "") rule fires."""
    g = Graph()
    once = g.transpose(g.input("x", shape), perm=perm)
    assert g[once.name].params == (("perm", ()),)
    g.output("y", g.relu(g.transpose(once, perm=perm)))
    assert [s.kernel for s in computes(optimize(g, Mesh(2)).plan)] == ["relu"]


def test_a_transpose_other_than_the_default_keeps_its_perm():
    g = Graph()
    assert g[g.transpose(g.input("x", (2, 3, 4)), perm=(-2, 0, 2)).name].params == (("perm", (1, 0, 2)),)


@pytest.mark.parametrize(("got", "want", "ok"), [
    ([1.0, np.nan, np.inf], [1.0, np.nan, np.inf], True),  # shared NaNs and equal infinities agree
    ([1.0, np.nan], [1.0, 2.0], False),
    ([1.0, 2.0], [1.0, np.nan], False),
    ([np.inf], [-np.inf], False),
    ([1.0, 2.0005], [1.0, 2.0], True),
    ([1.0, 2.01], [1.0, 2.0], False),
])
def test_output_errors_treat_nan_as_a_value(got, want, ok):
    assert error(np.array(got), np.array(want), "float32").ok is ok


class ShardedStorage:
    """The default model, but weights (inputs named w...) live split over the devices, as ZeRO-3 and FSDP keep
    them: placing one with more than its share on a device costs a second."""

    def __init__(self) -> None:
        self.base = DefaultCostModel(load_profile("gpu-h100-nccl"))

    def step_cost(self, step, mesh):
        if isinstance(step, Place) and step.input.startswith("w"):
            share = math.prod(step.shape) * 4 / mesh.size
            return 1.0 if max(layout_bytes(step.layout, "float32")) > share else 0.0
        return self.base.step_cost(step, mesh)


def test_an_input_may_be_placed_split_and_gathered_before_use():
    g = Graph()
    x, w = g.input("x", (4096, 128)), g.input("w", (128, 128))
    g.output("y", g.softmax(g.matmul(x, w), axis=-1))  # moving w costs less than moving x's products
    result = tapestry.optimize(g, mesh=Mesh(4), cost_model=ShardedStorage())
    by = result.plan.by_id
    gathered = [s for s in result.plan.steps if isinstance(s, Reshard) and isinstance(by[s.src], Place)]
    assert any(by[s.src].input == "w" for s in gathered), result.explain()
    inputs = tapestry.random_inputs(g)
    np.testing.assert_allclose(simulate(result.plan, inputs)["y"], tapestry.evaluate(g, inputs)["y"], atol=1e-5)
