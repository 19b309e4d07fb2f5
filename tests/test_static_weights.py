"""Static inputs (inference weights): what is computed from them alone is prepared once, so its per-run cost is 0
(TASO and Tensat price weight-only subgraphs so). That makes the merged QKV GEMM of rules/taso/merge.egg pay off:
its weight concat is prepared, and only the launches it saves remain (tests/test_merge_cost.py)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from tapestry import optimize
from tapestry.cost import DefaultCostModel, load_profile, plan_cost
from tapestry.egraph.rules import BUILTIN_DIR, builtin_rule_paths
from tapestry.graph import Graph, graph_from_json, graph_to_json
from tapestry.plan.explain import explain
from tapestry.plan.plan import Compute, Place
from tapestry.sharding import Mesh
from tapestry.verify import check_meaning

GPU = DefaultCostModel(load_profile("gpu-h100-nccl"))
MERGE_RULES = [*builtin_rule_paths(), BUILTIN_DIR / "taso" / "merge.egg"]
TOKENS, DIM, HEADS = 8, 1024, 4  # decode-sized: one launch is a large share of a GEMM's time


def attention_block(static: bool, dim: int = DIM, n_heads: int = HEADS) -> Graph:
    """Multi-head attention with q, k, v = x @ Wq, x @ Wk, x @ Wv, then an output projection."""
    g = Graph()
    x = g.input("x", (TOKENS, dim))

    def heads(t, perm):
        return g.transpose(g.reshape(t, shape=(TOKENS, n_heads, dim // n_heads)), perm=perm)

    q, k, v = (g.matmul(x, g.input(f"w{n}", (dim, dim), static=static)) for n in "qkv")
    scores = g.softmax(g.matmul(heads(q, (1, 0, 2)), heads(k, (1, 2, 0))), axis=2)
    mixed = g.reshape(g.transpose(g.matmul(scores, heads(v, (1, 0, 2))), perm=(1, 0, 2)), shape=(TOKENS, dim))
    g.output("y", g.relu(g.matmul(mixed, g.input("wo", (dim, dim), static=static))))
    return g


@functools.cache
def plan_of(static: bool, dim: int = DIM, n_heads: int = HEADS):
    return optimize(attention_block(static, dim, n_heads), Mesh(4), rules=MERGE_RULES, cost_model=GPU).plan


def matmuls_reading_x(plan) -> list[Compute]:
    x = next(s.out for s in plan.steps if isinstance(s, Place) and s.input == "x")
    return [s for s in plan.steps if isinstance(s, Compute) and s.kernel == "matmul" and s.args[0] == x]


def test_with_static_weights_one_merged_gemm_computes_q_k_and_v():
    plan = plan_of(static=True)
    [qkv] = matmuls_reading_x(plan)
    assert qkv.shape == (TOKENS, 3 * DIM)
    merged_weight = plan.by_id[qkv.args[1]]
    assert merged_weight.out in plan.prepared and merged_weight.kernel == "concat"
    assert "prepared once from static inputs" in explain(plan)
    check_meaning(plan)


def test_a_wide_merged_qkv_gemm_is_column_split_over_4_devices_when_the_heads_are_not():
    """Three heads do not split over 4 devices, so attention runs whole on each; at 3072 wide, reading a quarter
    of [Wq Wk Wv] on each device (Megatron's column split) and gathering q, k and v in one collective beats
    reading all of it (1536 wide: the whole merged GEMM on each device is cheaper)."""
    plan = plan_of(static=True, dim=3072, n_heads=3)
    [qkv] = matmuls_reading_x(plan)
    assert qkv.shape == (TOKENS, 3 * 3072)
    assert qkv.layout.name(qkv.shape, plan.mesh) == "S(1)"
    check_meaning(plan)


def test_prepared_steps_cost_nothing_per_run():
    plan = plan_of(static=True)
    assert plan.prepared and plan.notes["prepared"] == len(plan.prepared)
    per_run = sum(GPU.step_cost(s, plan.mesh) for s in plan.steps if s.out not in plan.prepared)
    assert plan_cost(plan, GPU) == pytest.approx(per_run) == pytest.approx(plan.cost)


@pytest.mark.parametrize("dim, n_heads", [(DIM, HEADS), (3072, 3)])
def test_without_static_weights_the_merge_does_not_pay(dim: int, n_heads: int):
    plan = plan_of(False, dim, n_heads)
    assert len(matmuls_reading_x(plan)) == 3
    assert not plan.prepared
    assert not any(isinstance(s, Compute) and s.kernel == "concat" for s in plan.steps)


def weight_prepared_with_a_constant() -> Graph:
    g = Graph()
    x, w = g.input("x", (256, 8)), g.input("w", (8, 8), static=True)
    c = g.constant("c", np.ones((8, 8), np.float32))
    g.output("y", g.relu(g.matmul(x, g.add(g.relu(w), c))))  # the peak: the two activations, after add
    return g


def test_prepared_is_transitive_and_stops_at_a_run_time_input():
    plan = optimize(weight_prepared_with_a_constant(), 1, rules=[], cost_model=GPU).plan
    kernels = {s.kernel for s in plan.steps if s.out in plan.prepared}
    assert kernels == {"relu", "add"}


def test_two_gloo_ranks_run_the_prepared_steps_once_before_the_iterations_and_compute_what_the_evaluator_does():
    pytest.importorskip("torch")
    import tapestry
    from tapestry.runtime import run_plan

    graph = weight_prepared_with_a_constant()
    plan = optimize(graph, 2, rules=[], cost_model=GPU).plan
    inputs = tapestry.random_inputs(graph, seed=1)
    result = run_plan(plan, inputs, compile=False, backend="gloo", repeat=2)
    np.testing.assert_allclose(result.outputs["y"], tapestry.evaluate(graph, inputs)["y"], rtol=1e-5, atol=1e-5)
    prepared = {k for k, s in enumerate(plan.steps) if s.out in plan.prepared}
    reported = [{t.step for t in rank.steps if t.kind == "prepare"} for rank in result.ranks]
    assert prepared and set().union(*reported) == prepared


def test_static_inputs_survive_json():
    g = Graph()
    g.output("y", g.relu(g.input("w", (2,), static=True)))
    assert graph_from_json(graph_to_json(g)).static == {"w"}


def test_static_in_json_must_name_an_input():
    data = graph_to_json(attention_block(static=False)) | {"static": ["nope"]}
    with pytest.raises(ValueError, match="static 'nope' is not an input"):
        graph_from_json(data)


def test_an_inference_import_marks_parameters_and_float_buffers_static_and_a_training_import_does_not():
    torch = pytest.importorskip("torch")
    import tapestry

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()
    x = torch.randn(3, 4)
    inference = tapestry.from_torch(model, (x,), verbose=False)
    assert inference.graph.static == set(inference.translation.state) >= {"0.weight", "1.running_mean"}
    loss = tapestry.Training(loss=lambda m, x: m(x).square().mean(), optimizer="sgd", lr=0.1)
    assert not tapestry.from_torch(torch.nn.Linear(4, 4), (x,), training=loss, verbose=False).graph.static


def test_prepared_results_stay_resident_in_the_memory_model_as_the_runtime_keeps_them():
    from tapestry.cost import rank_peaks

    plan = optimize(weight_prepared_with_a_constant(), 2, rules=[], cost_model=GPU).plan
    relu = next(k for k, s in enumerate(plan.steps) if s.out in plan.prepared and s.kernel == "relu")
    assert all(relu in peak.live for peak in rank_peaks(plan))  # the add read it last, before the peak



def test_a_model_that_rescales_its_weight_on_its_first_call_imports_that_work_as_prepared_and_is_left_as_it_was():
    """HF's RWKV divides weights in place on its first eval call, then sets a flag (docs/importing.md, Known traps):
    imported fresh, the division is traced and prepared (it reads a weight alone); after an eager call it is gone.
    Both plans compute what eager does, and the import changes neither the weight nor the flag."""
    torch = pytest.importorskip("torch")
    import copy

    import tapestry
    from tapestry.plan.simulate import simulate

    class RescalesOnce(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.rescaled = torch.nn.Linear(4, 4), False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.rescaled:
                with torch.no_grad():
                    self.linear.weight.div_(2.0)
                self.rescaled = True
            return self.linear(x) * 3.0

    def divisions(model: torch.nn.Module) -> list[Compute]:
        imported = tapestry.from_torch(model, (x,), verbose=False)
        plan = optimize(imported.graph, Mesh(2), extractor="greedy-dag").plan
        with torch.no_grad():
            want = copy.deepcopy(model)(x).numpy()
        np.testing.assert_allclose(imported.outputs(simulate(plan, imported.inputs(x)))[0], want, rtol=1e-6)
        return [s for s in plan.steps if isinstance(s, Compute) and s.kernel.startswith("div")
                and s.out in plan.prepared]

    torch.manual_seed(0)
    x, fresh = torch.randn(3, 4), RescalesOnce().eval()
    weight = fresh.linear.weight.detach().clone()
    assert len(divisions(fresh)) == 1
    assert not fresh.rescaled and torch.equal(fresh.linear.weight, weight)
    with torch.no_grad():
        fresh(x)
    assert divisions(fresh) == []
