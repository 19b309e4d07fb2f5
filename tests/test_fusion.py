"""Chains of elementwise kernels on one device are priced as the one kernel inductor compiles them into
(cost.fusion): their external inputs read once, the values anything else reads written once, one launch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tapestry
from tapestry import optimizer
from tapestry.cost import DefaultCostModel, load_profile, plan_cost, step_costs
from tapestry.cost.breakdown import breakdown
from tapestry.cost.fusion import fusion_groups
from tapestry.graph import Graph
from tapestry.plan import Compute, Reshard, build_plan

GPU = DefaultCostModel(load_profile("gpu-h100-nccl"))
UNFUSED = DefaultCostModel(GPU.profile, fuse=False)
ROWS, COLS = 4096, 1024  # 16 MiB per float32 value: memory-bound by far


def chain() -> Graph:
    """y = sigmoid((x + r) * w), w broadcast over the rows; and z = (x + r) @ m, a matmul reading the sum."""
    g = Graph()
    x, r, w = g.input("x", (ROWS, COLS)), g.input("r", (ROWS, COLS)), g.input("w", (COLS,))
    h = g.op("add", x, r, name="h")
    g.output("y", g.op("sigmoid", g.op("mul", h, w, name="n"), name="s"))
    g.output("z", g.op("matmul", h, g.input("m", (COLS, 8)), name="mm"))
    return g


def test_a_chain_reads_its_inputs_and_writes_what_leaves_it_once_with_one_launch():
    plan = build_plan(chain(), tapestry.Mesh(1))
    [group] = fusion_groups(plan)
    assert [plan.by_id[v].kernel for v in group.members] == ["add", "mul", "sigmoid"]
    assert {plan.by_id[v].kernel for v in group.written} == {"add", "sigmoid"}  # h: the matmul reads it
    device = GPU.profile.device
    moved = 4 * (3 * ROWS * COLS + COLS + ROWS * COLS)  # x, r, w in; h, y out
    matmul = next(s for s in plan.steps if isinstance(s, Compute) and s.kernel == "matmul")
    expected = moved / device.mem_bandwidth + device.launch_overhead + GPU.step_cost(matmul, plan.mesh)
    assert plan_cost(plan, GPU) == pytest.approx(expected)
    assert plan_cost(plan, GPU) < plan_cost(plan, UNFUSED)


def test_a_reshard_between_two_elementwise_kernels_breaks_the_fusion():
    """Rows split all along fuse add, mul and sigmoid; the mul split by columns instead puts a reshard on each
    side of it: three groups of one, and the plan prices higher by more than the reshards alone."""
    mesh = tapestry.Mesh(2)
    along = build_plan(chain(), mesh, {"h": (0,), "n": (0,), "s": (0,), "mm": (0,)})
    across = build_plan(chain(), mesh, {"h": (0,), "n": (1,), "s": (0,), "mm": (0,)})
    assert not any(isinstance(s, Reshard) for s in along.steps if s.out not in along.prepared)
    moves = [s for s in across.steps if isinstance(s, Reshard)]
    assert moves
    assert len(fusion_groups(along)) == 1 and fusion_groups(across) == []
    assert plan_cost(across, UNFUSED) - plan_cost(along, UNFUSED) == pytest.approx(
        sum(GPU.step_cost(s, mesh) for s in moves), rel=1e-3)  # unfused, splitting the mul by columns is free
    assert plan_cost(across, GPU) - plan_cost(along, GPU) > 1.5 * sum(GPU.step_cost(s, mesh) for s in moves)


def test_a_chain_never_spans_a_matmul_that_one_member_waits_for_and_another_feeds():
    """u = sigmoid(x) feeds the matmul t, and y = u * t waits for it: u and y cannot be one kernel (u is written
    before the matmul, y made after it), as a forward value a backward op reads is written."""
    g = Graph()
    x, m = g.input("x", (ROWS, COLS)), g.input("m", (COLS, COLS))
    u = g.op("sigmoid", x, name="u")
    g.output("y", g.op("mul", u, g.op("matmul", u, m, name="t"), name="y"))
    plan = build_plan(g, tapestry.Mesh(1))
    assert fusion_groups(plan) == []
    assert plan_cost(plan, GPU) == plan_cost(plan, UNFUSED)


def test_fused_step_costs_sum_to_the_plan_cost_and_never_exceed_the_steps_alone():
    from training_helpers import adam_step

    plan = build_plan(adam_step(64, 256, 1024)[0].graph, tapestry.Mesh(1))
    fused, alone = step_costs(plan, GPU), step_costs(plan, UNFUSED)
    assert fused.keys() == alone.keys()
    assert all(fused[v] <= alone[v] for v in fused)
    assert sum(fused.values()) < sum(alone.values())
    assert breakdown(plan, GPU, GPU.profile.device).total == pytest.approx(plan_cost(plan, GPU))


def priced_adam_step() -> str:
    from training_helpers import adam_step

    plan = build_plan(adam_step(64, 256, 1024)[0].graph, tapestry.Mesh(1))
    return f"{step_costs(plan, GPU)!r} {fusion_groups(plan)!r}"


def test_fusion_pricing_does_not_depend_on_the_hash_seed():
    """This process (its hash seed random unless PYTHONHASHSEED is set) against one with hashing unseeded."""
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent / "src"), str(here)]), "PYTHONHASHSEED": "0"}
    script = "import test_fusion; print(test_fusion.priced_adam_step())"
    other = subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True).stdout
    assert other.strip() == priced_adam_step()


def exp_sigmoid_chain(length: int) -> Graph:
    """y = sigmoid(exp(...sigmoid(exp(x)))), `length` elementwise kernels of ROWS x COLS."""
    g = Graph()
    h = g.input("x", (ROWS, COLS))
    for i in range(length):
        h = g.op("sigmoid" if i % 2 else "exp", h, name=f"h{i}")
    g.output("y", h)
    return g


def test_extraction_chooses_by_the_fused_price_of_the_plan(monkeypatch):
    """Eight elementwise kernels on 2 devices (fused extraction let down to 2), the output wanted replicated.
    Priced step by step, halving each kernel's bytes outweighs gathering y at the end; fused, the chain is one
    kernel whatever its split, and the gather is the dearer part: extraction under fusion-aware node costs
    computes it whole on each device."""
    monkeypatch.setattr(optimizer, "FUSED_EXTRACTION_DEVICES", 2)
    explored = tapestry.explore(exp_sigmoid_chain(8), tapestry.Mesh(2))
    unfused = explored.extract(UNFUSED, outputs="replicated").plan
    fused = explored.extract(GPU, outputs="replicated")
    assert any(isinstance(s, Reshard) for s in unfused.steps)  # split, then gathered
    assert not any(isinstance(s, Reshard) for s in fused.plan.steps)
    device = GPU.profile.device
    alone = 2 * 4 * ROWS * COLS / device.mem_bandwidth + device.launch_overhead  # x read, y written, one launch
    assert fused.plan.cost == pytest.approx(alone)
    assert fused.plan.cost < plan_cost(unfused, GPU)
    assert fused.status == "feasible" and fused.plan.notes["node_costs"] == "fused"
    # its fused node costs (x read and the launch by the first kernel, y's write by the Deliver) are its price
    # but for the other kernels' FLOPs, which the group's time hides behind its bytes and the node costs add
    flops = sum(s.signature.cost(s.blocks[0])[0] / device.peak("float32") for s in fused.plan.steps[2:])
    assert fused.plan.cost < fused.selection.dag_cost == pytest.approx(fused.plan.cost + flops)


def test_meshes_below_fused_extraction_devices_extract_once_under_unfused_node_costs():
    """The same chain on 2 devices with the default gate: no second extraction, the unfused costs' plan."""
    assert optimizer.FUSED_EXTRACTION_DEVICES > 2
    explored = tapestry.explore(exp_sigmoid_chain(8), tapestry.Mesh(2))
    once = explored.extract(GPU, outputs="replicated")
    assert once.plan.steps == explored.extract(UNFUSED, outputs="replicated").plan.steps
    assert "node_costs" not in once.plan.notes


def test_extraction_keeps_the_unfused_choice_where_fused_node_costs_find_nothing_cheaper(monkeypatch):
    """Four kernels: splitting them does not pay for the gather either way; the plan is the one the unfused
    costs chose, proven as before."""
    monkeypatch.setattr(optimizer, "FUSED_EXTRACTION_DEVICES", 2)
    explored = tapestry.explore(exp_sigmoid_chain(4), tapestry.Mesh(2))
    fused = explored.extract(GPU, outputs="replicated")
    assert fused.plan.steps == explored.extract(UNFUSED, outputs="replicated").plan.steps
    assert fused.status == "optimal" and "node_costs" not in fused.plan.notes


def _group_time_per_device(plan, group, device) -> float:  # noqa: ANN001
    """`fusion.group_time` as first written: every device priced, each value read from outside once."""
    from tapestry import dtypes
    from tapestry.cost.fusion import _add_reads, footprint
    from tapestry.cost.roofline import compute_dtype

    inside, written, slowest = set(group.members), set(group.written), 0.0
    for d in range(plan.mesh.size):
        seconds, nbytes, reads = 0.0, 0, {}
        for v in group.members:
            step = plan.by_id[v]
            block = step.blocks[d]
            if block is None or block.is_empty:
                continue
            if not step.signature.kernel.is_view:
                seconds += step.signature.cost(block)[0] / device.peak(compute_dtype(step.signature))
            _add_reads(step, block, [a not in inside for a in step.args], reads)
            if v in written:
                nbytes += footprint(step.signature.output, block) * dtypes.itemsize(step.signature.dtype)
        nbytes += sum(reads.values())
        if seconds or nbytes:
            slowest = max(slowest, max(seconds, nbytes / device.mem_bandwidth) + device.launch_overhead)
    return slowest * device.oversubscription(plan.mesh.size)


def reads_twice_or_two(shared: bool) -> Graph:
    """a = x + r; y = a * x (x read by both members: once from memory) or a * q (q like x: read too)."""
    g = Graph()
    x, r = g.input("x", (ROWS, COLS)), g.input("r", (ROWS, COLS))
    other = x if shared else g.input("q", (ROWS, COLS))
    g.output("y", g.op("mul", g.op("add", x, r, name="a"), other, name="y"))
    return g


def test_groups_of_one_key_take_one_time_and_the_memoised_prices_are_the_per_device_ones():
    """`fusion.group_key` is exact: over the groups of a training step's hand plans on 2x2 (and each group with all
    or none of its values written) and two chains that differ only in reading one outside value twice, groups of
    one key price alike; `group_time` (devices whose blocks cost alike priced once) and `fused_costs` (each
    distinct group once) give the prices of pricing every group on every device."""
    from training_helpers import adam_step

    from tapestry.cost import fused_costs
    from tapestry.cost.fusion import Group, group_key, group_time
    from tapestry.sharding.layout import ValueNumbers
    from tapestry.training.plans import baselines

    device = GPU.profile.device
    number = ValueNumbers()  # one for every plan: blocks equal in value, one number (the keys compare across plans)
    hands = sorted(baselines(adam_step(64, 256, 1024)[0].graph, tapestry.Mesh(2, 2)).items())
    assert all(any(len(set(s.blocks)) > 1 for s in hand.steps if isinstance(s, Compute)) for _, hand in hands)
    plans = [*(hand for _, hand in hands),
             *(build_plan(reads_twice_or_two(shared), tapestry.Mesh(1)) for shared in (True, False))]
    times: dict[tuple, float] = {}
    for plan in plans:
        groups = fusion_groups(plan)
        assert groups
        for group in groups:
            for variant in (group, Group(group.members, ()), Group(group.members, group.members)):
                expected = _group_time_per_device(plan, variant, device)
                assert group_time(plan, variant, device) == expected
                assert times.setdefault(group_key(plan, variant, number), expected) == expected
        costs = step_costs(plan, UNFUSED)
        unmemoised = dict(costs)
        for group in groups:
            unfused = sum(costs[v] for v in group.members)
            scale = min(_group_time_per_device(plan, group, device), unfused) / unfused
            unmemoised.update({v: costs[v] * scale for v in group.members})
        assert fused_costs(plan, costs, device) == unmemoised
    twice, two = (group_key(p, g, number) for p in plans[-2:] for g in fusion_groups(p))
    assert twice != two


def test_alike_groups_whose_blocks_are_equal_objects_apart_are_priced_once_as_those_sharing_them(monkeypatch):
    """`fused_costs` numbers each member's blocks by value, once per blocks object (`ValueNumbers`): a plan whose
    steps each hold their own copy of the blocks prices each distinct group once and costs what the plan sharing
    them costs (numbering blocks by identity would price every layer's group again and fail)."""
    import dataclasses

    from tapestry.cost import fusion
    from tapestry.cost.fusion import fused_costs

    g = Graph()
    value = g.input("x", (ROWS, COLS))
    for k in range(4):
        value = g.op("sigmoid", g.op("add", g.op("matmul", value, g.input(f"w{k}", (COLS, COLS))), value,
                                    name=f"a{k}"), name=f"s{k}")
    g.output("y", value)
    plan = build_plan(g, tapestry.Mesh(2, 2), {})
    first: dict[tuple, tuple] = {}  # the later layers share the first's blocks, as an expanded plan's copies do
    shared = dataclasses.replace(plan, steps=tuple(
        dataclasses.replace(s, blocks=first.setdefault(s.binding, s.blocks)) if isinstance(s, Compute) else s
        for s in plan.steps))
    apart = dataclasses.replace(plan, steps=tuple(
        dataclasses.replace(s, blocks=tuple(list(s.blocks))) if isinstance(s, Compute) else s for s in shared.steps))
    assert len(fusion_groups(shared)) == 4
    priced = []
    group_time = fusion.group_time
    monkeypatch.setattr(fusion, "group_time", lambda *a: priced.append(a[1]) or group_time(*a))
    costs = step_costs(shared, UNFUSED)
    once = fused_costs(shared, costs, GPU.profile.device)
    assert len(priced) == 1
    assert fused_costs(apart, costs, GPU.profile.device) == once
    assert len(priced) == 2
