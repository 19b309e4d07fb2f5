"""What a merged QKV GEMM costs under the roofline (gpu-h100-nccl): one launch and one read of x instead of three
make the merged GEMM cheaper than its parts, decode-sized and prefill-sized alike; concatenating the weights at
run time, as the plan must when they arrive as three inputs, costs more than that saving (docs/rules.md)."""
from __future__ import annotations

import functools

import pytest

from tapestry import optimize
from tapestry.cost import DefaultCostModel, load_profile
from tapestry.egraph.driver import Budget
from tapestry.egraph.rules import BUILTIN_DIR
from tapestry.graph import Graph
from tapestry.plan.plan import Compute

GPU = DefaultCostModel(load_profile("gpu-h100-nccl"))
DIM = 1024


def qkv(tokens: int, merged: bool) -> Graph:
    g = Graph()
    x = g.input("x", (tokens, DIM))
    ws = [g.input(f"w{n}", (DIM, DIM)) for n in "qkv"]
    if merged:
        y = g.matmul(x, g.concat(g.concat(ws[0], ws[1], axis=1), ws[2], axis=1))
        for n, name in enumerate("qkv"):
            g.output(name, g.slice(y, axis=1, start=n * DIM, stop=(n + 1) * DIM))
    else:
        for name, w in zip("qkv", ws):
            g.output(name, g.matmul(x, w))
    return g


@functools.cache
def seconds_by_kernel(tokens: int, merged: bool) -> dict[str, float]:
    """The one-device plan's compute time per kernel, with no rule to change the program."""
    plan = optimize(qkv(tokens, merged), 1, rules=[BUILTIN_DIR / "fusion.egg"], cost_model=GPU, budget=Budget(iterations=1)).plan
    found: dict[str, float] = {}
    for step in plan.steps:
        if isinstance(step, Compute):
            name = step.signature.kernel.name
            found[name] = found.get(name, 0.0) + GPU.step_cost(step, plan.mesh)
    return found


@pytest.mark.parametrize("tokens", [8, 4096])
def test_one_merged_gemm_is_cheaper_than_three_by_at_least_two_launches(tokens: int):
    separate = seconds_by_kernel(tokens, merged=False)["matmul"]
    merged = seconds_by_kernel(tokens, merged=True)["matmul"]
    assert separate - merged >= 2 * GPU.profile.device.launch_overhead * 0.999


def test_concatenating_the_weights_at_run_time_costs_more_than_the_merge_saves():
    separate, merged = seconds_by_kernel(8, merged=False), seconds_by_kernel(8, merged=True)
    saved = separate["matmul"] - merged["matmul"]
    assert merged["concat"] > saved
    assert sum(merged.values()) > sum(separate.values())
