"""Cost models: the default model ranks known cases right, formulas match hand-computed numbers."""
from __future__ import annotations

import dataclasses
import math
import runpy
from pathlib import Path

import pytest

import tapestry
from tapestry import cli
from tapestry.cost import (
    AlphaBeta,
    CostModel,
    DefaultCostModel,
    DeviceProfile,
    Link,
    Profile,
    collective_time,
    load_profile,
    peak_memory,
    plan_cost,
    resident_bytes,
)
from tapestry.cost.comm import hierarchical_time, phases
from tapestry.graph import Graph
from tapestry.plan import Compute, Plan, Reshard, build_plan
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.collectives import classify_reshard
from tapestry.zspace import ZRange

ALPHA, BETA = 1e-5, 1e10
PROFILE = Profile(
    "test",
    DeviceProfile(peak_flops=1e12, mem_bandwidth=1e11, launch_overhead=1e-5),
    (Link(ALPHA, BETA),),
    {"source": "hand-made for tests"},
)
MODEL = DefaultCostModel(PROFILE)
ROOT = Path(__file__).resolve().parents[1]


def matmul_graph(n: int) -> Graph:
    g = Graph()
    a, b = g.input("a", (n, n)), g.input("b", (n, n))
    g.output("y", g.matmul(a, b, name="mm"))
    return g


def k_split_plan(n: int, mesh: Mesh) -> Plan:
    """matmul split on its reduction dim k: partial products, then the all-reduce build_plan adds."""
    return build_plan(matmul_graph(n), mesh, {"mm": (2,)})


def compute_bytes(plan: Plan) -> float:
    return sum(s.signature.cost(s.blocks[0])[1] for s in plan.steps if isinstance(s, Compute))


# -- ranking ------------------------------------------------------------------------------------
def test_sharding_a_large_matmul_beats_replicating_it_when_compute_dominates() -> None:
    mesh = Mesh(4)
    replicated = build_plan(matmul_graph(4096), mesh)
    sharded = k_split_plan(4096, mesh)
    assert any(isinstance(s, Reshard) for s in sharded.steps), "the sharded plan pays for its all-reduce"
    assert plan_cost(sharded, MODEL) < plan_cost(replicated, MODEL)


def test_replicating_a_tiny_matmul_beats_sharding_it_when_latency_dominates() -> None:
    mesh = Mesh(4)
    assert plan_cost(build_plan(matmul_graph(8), mesh), MODEL) < plan_cost(k_split_plan(8, mesh), MODEL)


def test_fusion_saves_the_intermediate_bytes() -> None:
    def plan(fused: bool) -> Plan:
        g = Graph()
        x, w, b = g.input("x", (256, 128)), g.input("w", (128, 64)), g.input("b", (64,))
        g.output("y", g.linear_relu(x, w, b) if fused else g.relu(g.linear(x, w, b)))
        return build_plan(g, Mesh(1))

    intermediate = 4 * 256 * 64  # float32 [256, 64]
    assert compute_bytes(plan(False)) - compute_bytes(plan(True)) == 2 * intermediate  # written once, read once
    assert plan_cost(plan(True), MODEL) < plan_cost(plan(False), MODEL)


def test_a_view_costs_far_less_than_a_launch_but_not_nothing() -> None:
    """Not zero, so that extraction breaks ties toward fewer views (tests/test_robustness.py)."""
    g = Graph()
    g.output("t", g.transpose(g.input("x", (64, 32))))
    (step,) = [s for s in build_plan(g, Mesh(2), {"transpose_0": (0,)}).steps if isinstance(s, Compute)]
    assert 0.0 < MODEL.step_cost(step, Mesh(2)) < MODEL.profile.device.launch_overhead / 100


def test_place_is_free_inputs_arrive_laid_out() -> None:
    plan = build_plan(matmul_graph(64), Mesh(4), {"mm": (0,)})
    assert all(MODEL.step_cost(s, plan.mesh) == 0.0 for s in plan.steps if not isinstance(s, Compute | Reshard))


def test_a_compute_step_takes_as_long_as_its_largest_shard() -> None:
    n, mesh = 4096, Mesh(4)
    (step,) = [s for s in build_plan(matmul_graph(n), mesh, {"mm": (0,)}).steps if isinstance(s, Compute)]
    flops = 2 * (n // 4) * n * n
    assert MODEL.step_cost(step, mesh) == pytest.approx(flops / 1e12 + 1e-5)


def test_more_ranks_than_cores_time_share_them() -> None:
    """4 ranks on 2 cores: each step, compute or reshard, takes twice as long as on 4 free devices."""
    n, mesh = 512, Mesh(4)
    shared = DefaultCostModel(Profile("2 cores", DeviceProfile(1e12, 1e11, 1e-5, cores=2), (Link(ALPHA, BETA),)))
    plan = k_split_plan(n, mesh)
    for step in plan.steps:
        assert shared.step_cost(step, mesh) == pytest.approx(2 * MODEL.step_cost(step, mesh))
    two = k_split_plan(n, Mesh(2))
    assert plan_cost(two, shared) == pytest.approx(plan_cost(two, MODEL))  # no more ranks than cores: unchanged
    assert DeviceProfile(1, 1, 0, cores=2).oversubscription(3) == 1.5 and PROFILE.device.oversubscription(64) == 1


# -- communication --------------------------------------------------------------------------------
def test_a_partial_output_is_all_reduced_with_the_ring_formula() -> None:
    n, mesh = 8, Mesh(4)
    (reshard,) = [s for s in k_split_plan(n, mesh).steps if isinstance(s, Reshard)]
    assert reshard.src_layout.partial and not reshard.layout.partial
    assert classify_reshard(reshard.src_layout, reshard.layout, reshard.shape, mesh) == "all_reduce"
    p, nbytes = 4, n * n * 4
    assert MODEL.step_cost(reshard, mesh) == pytest.approx(2 * (p - 1) / p * nbytes / BETA + 2 * (p - 1) * ALPHA)


def test_partial_sums_into_one_part_of_them_on_every_device_price_as_the_all_reduce_of_that_part() -> None:
    """Issue 24: Mixtral's tensor-parallel hand plan priced 38.5 s on 8x8x8, a grouped mm's partial output reduced
    into each half of a chunk as point-to-point moves (each device received the 511 others' addends of the half).
    Each device slices its addend of the half and they all-reduce it: the price of a half-width all-reduce, on the
    whole mesh (hierarchical on the cluster's nodes) as on a line."""
    for mesh, model in [(Mesh(4), MODEL), (Mesh(2, 8), AlphaBeta(load_profile("gpu-h100-cluster")))]:
        whole, half = (64, 256), (64, 128)
        partial = Layout(Layout.replicated(whole, mesh).blocks, partial=True)
        into_half = Reshard("h", "x", whole, partial, Layout((ZRange((0, 0), half),) * mesh.size))
        assert classify_reshard(into_half.src_layout, into_half.layout, whole, mesh) == "all_reduce"
        reduce_half = Reshard("h", "x", half, Layout(Layout.replicated(half, mesh).blocks, partial=True),
                              Layout.replicated(half, mesh))
        assert model.step_cost(into_half, mesh) == pytest.approx(model.step_cost(reduce_half, mesh), rel=1e-12)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("all_gather", 3 * 1e-6 + 0.75 * 4000 / 1e9),
        ("reduce_scatter", 3 * 1e-6 + 0.75 * 4000 / 1e9),
        ("all_reduce", 6 * 1e-6 + 1.5 * 4000 / 1e9),
        ("all_to_all", 3 * 1e-6 + 0.75 * 4000 / 1e9),
    ],
)
def test_collective_formulas_on_hand_computed_numbers(kind: str, expected: float) -> None:
    assert collective_time(kind, 4000, 4, Link(1e-6, 1e9)) == pytest.approx(expected)
    assert collective_time(kind, 4000, 1, Link(1e-6, 1e9)) == 0.0


def test_point_to_point_moves_use_exact_volumes() -> None:
    """A halo: each of 2 devices receives one element in one message from the other."""
    mesh, shape = Mesh(2), (4,)
    src = Layout.split(shape, mesh, (0,))
    dst = Layout((ZRange((1,), (3,)), ZRange((1,), (3,))))
    step = Reshard("h", "x", shape, src, dst)
    assert classify_reshard(src, dst, shape, mesh) == "send_recv"
    assert MODEL.step_cost(step, mesh) == pytest.approx(ALPHA + 4 / BETA)


def test_a_collective_on_one_mesh_axis_uses_that_axis_link_and_size() -> None:
    mesh, shape = Mesh(2, 4), (8, 8)
    slow, fast = Link(1e-3, 1e8), Link(1e-6, 1e11)
    model = AlphaBeta(Profile("two-level", PROFILE.device, (slow, fast)))
    gather_axis_1 = Reshard("g", "x", shape, Layout.split(shape, mesh, (None, 0)), Layout.replicated(shape, mesh))
    assert model.step_cost(gather_axis_1, mesh) == pytest.approx(collective_time("all_gather", 256, 4, fast))
    gather_both = Reshard("g", "x", shape, Layout.split(shape, mesh, (0, 1)), Layout.replicated(shape, mesh))
    hierarchical = collective_time("all_gather", 256, 4, fast) + collective_time("all_gather", 256 / 4, 2, slow)
    assert model.step_cost(gather_both, mesh) == pytest.approx(hierarchical)


# -- topology: links per level, hierarchical collectives ---------------------------------------------
CLUSTER = load_profile("gpu-h100-cluster")
NVLINK, INFINIBAND = (level.link for level in CLUSTER.levels)


def test_cluster_mesh_axes_map_to_nvlink_inside_a_node_and_infiniband_across() -> None:
    assert CLUSTER.axis_links((2, 8)) == (INFINIBAND, NVLINK)
    assert CLUSTER.axis_links((4, 8, 8)) == (INFINIBAND, INFINIBAND, NVLINK)
    assert CLUSTER.axis_links((2, 4)) == (NVLINK, NVLINK)  # 8 devices: one node
    assert CLUSTER.axis_links((16,)) == (INFINIBAND,)  # one ring over two nodes waits for the slower link
    with pytest.raises(ValueError, match="joins at most 8 devices"):
        load_profile("gpu-h100-node").axis_links((2, 8))


def test_the_same_collective_on_the_outer_axis_costs_the_infiniband_price() -> None:
    """An all-gather of a 64 MiB float32 tensor over the 8 devices of one axis of Mesh(8, 8): inside a node on
    NVLink, across nodes on InfiniBand: the bandwidth terms differ by the links' ratio."""
    mesh, shape, model = Mesh(8, 8), (4096, 4096), AlphaBeta(CLUSTER)
    inner = Reshard("g", "x", shape, Layout.split(shape, mesh, (None, 0)), Layout.replicated(shape, mesh))
    outer = Reshard("g", "x", shape, Layout.split(shape, mesh, (0, None)), Layout.replicated(shape, mesh))
    nbytes = 4 * 4096 * 4096
    assert model.step_cost(inner, mesh) == pytest.approx(collective_time("all_gather", nbytes, 8, NVLINK))
    assert model.step_cost(outer, mesh) == pytest.approx(collective_time("all_gather", nbytes, 8, INFINIBAND))
    bandwidth = [model.step_cost(step, mesh) - 7 * link.alpha for step, link in ((outer, INFINIBAND), (inner, NVLINK))]
    assert bandwidth[0] / bandwidth[1] == pytest.approx(NVLINK.beta / INFINIBAND.beta)  # 450 / 50 GB/s


def test_an_all_reduce_over_both_axes_is_priced_as_the_hierarchical_algorithm() -> None:
    """Mesh(2, 8) on the cluster: reduce-scatter inside the node, all-reduce the eighth across the two nodes,
    all-gather inside again; cheaper than one flat ring over the slower link."""
    mesh, shape, model = Mesh(2, 8), (1024, 1024), AlphaBeta(CLUSTER)
    partial = Layout(Layout.replicated(shape, mesh).blocks, partial=True)
    step = Reshard("r", "x", shape, partial, Layout.replicated(shape, mesh))
    assert classify_reshard(partial, step.layout, shape, mesh) == "all_reduce"
    n = 4 * 1024 * 1024
    expected = (collective_time("reduce_scatter", n, 8, NVLINK) + collective_time("all_reduce", n / 8, 2, INFINIBAND)
                + collective_time("all_gather", n, 8, NVLINK))
    assert model.step_cost(step, mesh) == pytest.approx(expected)
    assert model.step_cost(step, mesh) < collective_time("all_reduce", n, 16, INFINIBAND)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_a_hierarchy_of_equal_links_moves_what_one_ring_moves_in_fewer_steps(kind: str) -> None:
    link = Link(0.0, 1e9)
    flat = collective_time(kind, 4096, 16, link)
    assert hierarchical_time(kind, 4096, [(8, link), (2, Link(0.0, 1e9 * (1 - 1e-12)))]) == pytest.approx(flat)
    assert phases([(2, link), (8, link)]) == [(16, link)]  # axes of one link are one ring, as before


def test_a_profile_of_levels_round_trips_through_json(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    CLUSTER.save(path)
    assert load_profile(path) == CLUSTER


# -- memory ---------------------------------------------------------------------------------------
def diamond(mesh: Mesh, axes: tuple[int | None, ...]) -> Plan:
    """x -> a = relu(x) -> b = relu(a) -> c = a * b: `a` stays live until `c`."""
    g = Graph()
    x = g.input("x", (4, 4))
    a = g.relu(x, name="a")
    g.output("c", g.mul(a, g.relu(a, name="b"), name="c"))
    return build_plan(g, mesh, {op: axes for op in ("a", "b", "c")})


def test_peak_memory_by_hand() -> None:
    block = 4 * 16  # one float32 [4, 4]
    # x stays resident; live activations at each step: a | a b | a b c  -> x + 3 blocks
    assert peak_memory(diamond(Mesh(1), (None,))) == [4 * block]
    assert peak_memory(diamond(Mesh(2), (0,))) == [4 * block // 2] * 2


def test_a_one_device_plan_holds_every_weight_for_the_whole_program() -> None:
    from tapestry.models import mlp

    graph = mlp(depth=6, batch=4, width=32)
    plan = build_plan(graph, Mesh(1))
    weights = sum(4 * math.prod(n.shape) for n in graph.inputs)
    assert resident_bytes(plan) == [weights]
    # plus the widest moment of activations: one layer's linear output and its relu ([4, 32] float32 each)
    assert peak_memory(plan) == [weights + 2 * 4 * 4 * 32]
    assert peak_memory(build_plan(mlp(depth=12, batch=4, width=32), Mesh(1)))[0] > peak_memory(plan)[0]


def test_a_bfloat16_graph_needs_half_the_memory_of_its_float32_twin() -> None:
    from tapestry.models import transformer_block

    twins = [build_plan(transformer_block(2, 8, 16, 2, dtype), Mesh(2), {}) for dtype in ("float32", "bfloat16")]
    assert peak_memory(twins[1]) == [p // 2 for p in peak_memory(twins[0])]


def test_a_view_move_shares_its_source_and_a_weight_split_halves_its_bytes() -> None:
    g = Graph()
    x, w = g.input("x", (8, 8)), g.input("w", (8, 8))
    g.output("y", g.matmul(x, w, name="y"))
    replicated, split = (build_plan(g, Mesh(2), {"y": axes}) for axes in ((None,), (1,)))  # n: column split
    assert resident_bytes(replicated) == [2 * 256] * 2 and resident_bytes(split) == [256 + 128] * 2
    assert peak_memory(replicated) == [2 * 256 + 256] * 2 and peak_memory(split) == [256 + 128 + 128] * 2


def test_a_view_kernel_adds_no_bytes_and_keeps_its_source_alive_as_torch_does() -> None:
    """expand, slice, select and transpose make torch views: a fill broadcast from one row holds the row's bytes
    (issue 24: the 70B step's zero fills, counted at their full size, were 56 of the 89 GB on each device), and a
    transposed activation keeps the activation alive until the view's last reader; reshape may copy and counts."""
    block, resident = 4 * 64 * 64, 4 * 64 + 4 * 64 * 64  # one float32 [64, 64]; row and w held throughout
    g = Graph()
    row, w = g.input("row", (1, 64)), g.input("w", (64, 64))
    filled = g.op("expand", row, shape=(64, 64), name="filled")  # read first and last: live throughout
    a = g.op("relu", g.op("add", filled, w, name="s"), name="a")
    g.output("y", g.op("add", a, filled, name="y"))
    assert peak_memory(build_plan(g, Mesh(1))) == [resident + 2 * block]  # s and a (the fill a view of row)
    g = Graph()
    w = g.input("w", (64, 64))
    t = g.op("transpose", g.op("relu", w, name="a"), name="t")  # t keeps a alive to y
    c = g.op("relu", g.op("relu", w, name="b"), name="c")
    g.output("y", g.op("add", t, c, name="y"))
    assert peak_memory(build_plan(g, Mesh(1))) == [block + 3 * block]  # a (under t), b and c
    g = Graph()
    row, w = g.input("row", (1, 64)), g.input("w", (64, 64))
    g.output("y", g.op("add", g.op("reshape", g.op("expand", row, shape=(64, 64)), shape=(64, 64)), w, name="y"))
    assert peak_memory(build_plan(g, Mesh(1))) == [resident + 2 * block]  # the reshape's copy and y


# -- dtypes ---------------------------------------------------------------------------------------
def test_a_bfloat16_move_carries_half_the_bytes() -> None:
    mesh, shape = Mesh(4), (64, 64)
    src, dst = Layout.split(shape, mesh, (0,)), Layout.replicated(shape, mesh)
    link = PROFILE.link(0)
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        step = Reshard("g", "x", shape, src, dst, dtype)
        assert MODEL.step_cost(step, mesh) == pytest.approx(collective_time("all_gather", size * 64 * 64, 4, link))


def test_the_roofline_runs_each_dtype_at_its_own_peak() -> None:
    gpu = DefaultCostModel(load_profile("gpu-h100-nccl"))
    assert gpu.profile.device.peak("bfloat16") == 989.4e12 and gpu.profile.device.peak("float32") == 66.9e12
    assert gpu.profile.device.peak("int64") == gpu.profile.device.peak_flops  # not listed: the default peak
    times = {}
    for dtype in ("float32", "bfloat16"):
        g = Graph()
        g.output("y", g.matmul(g.input("a", (4096, 4096), dtype), g.input("b", (4096, 4096), dtype), name="y"))
        plan = build_plan(g, Mesh(1))
        times[dtype] = plan_cost(plan, gpu) - gpu.profile.device.launch_overhead
    assert times["float32"] == pytest.approx(2 * 4096**3 / 66.9e12)  # compute-bound either way
    assert times["bfloat16"] == pytest.approx(2 * 4096**3 / 989.4e12)


@pytest.mark.parametrize("field, key", [("peaks", "peak_flops_by_dtype"), ("spec_peaks", "spec_peak_flops_by_dtype")])
def test_profiles_without_per_dtype_peaks_still_load_and_peaks_round_trip(tmp_path: Path, field: str, key: str) -> None:
    assert getattr(load_profile("cpu-gloo").device, field) == ()  # calibrated float32 only: every dtype runs at it
    peaks = Profile("p", DeviceProfile(1.0, 2.0, 3.0, **{field: (("bfloat16", 8.0), ("tf32", 4.0))}), (Link(1, 2),))
    peaks.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == peaks
    data = peaks.to_json()
    data["device"][key] = {"bf16": 1.0}
    with pytest.raises(ValueError, match=f"{key} names bf16"):
        Profile.from_json(data)


def test_mfu_is_against_the_spec_sheets_peak_not_the_calibrated_rate_the_profile_prices_with() -> None:
    measured = load_profile("gpu-h100-cluster-measured").device
    assert measured.peak("bfloat16") < 0.8 * measured.spec_peak("bfloat16")  # 765 measured, 989.4 on the sheet
    assert measured.mfu(989.4e12, 2.0, 4, "bfloat16") == pytest.approx(1 / 8)
    spec = load_profile("gpu-h100-nccl").device  # a spec-sheet profile: both the same
    assert spec.spec_peak("bfloat16") == spec.peak("bfloat16") == 989.4e12
    assert spec.mfu(66.9e12, 1.0, 1, "float32") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no spec-sheet peak for it"):
        load_profile("cpu-gloo").device.mfu(1e9, 1.0, 1, "float32")  # a CPU measured: no sheet to divide by


# -- profiles, protocol, CLI ----------------------------------------------------------------------
def test_profile_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    PROFILE.save(path)
    assert load_profile(path) == PROFILE
    assert load_profile(path).provenance == PROFILE.provenance
    cores = Profile("cores", DeviceProfile(1, 2, 3, cores=1.5), (Link(1, 2),))
    cores.save(path)
    assert load_profile(path) == cores


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(tapestry.__file__).parent / "profiles").glob("*.json")))
def test_shipped_profiles_load_by_name_and_say_where_they_come_from(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name and profile.provenance
    assert profile.device.peak_flops > 0 and all(link.beta > 0 for link in profile.axis_links((2, 4)))


def test_one_link_serves_every_axis_several_links_one_each() -> None:
    one = Profile("one", PROFILE.device, (Link(1, 2),))
    two = Profile("two", PROFILE.device, (Link(1, 2), Link(3, 4)))
    assert one.link(5) == Link(1, 2)
    assert two.link(1) == Link(3, 4)
    with pytest.raises(ValueError, match="axis 2"):
        two.link(2)


def test_a_user_model_is_any_class_with_step_cost() -> None:
    class Steps:
        def step_cost(self, step: object, mesh: Mesh) -> float:
            return 1.0

    plan = k_split_plan(8, Mesh(4))
    assert isinstance(Steps(), CostModel)
    assert plan_cost(plan, Steps()) == len(plan.steps)


def test_the_custom_cost_model_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(ROOT / "examples" / "custom_cost_model.py"), run_name="__main__")
    assert "bytes moved" in capsys.readouterr().out


@pytest.fixture
def only_the_cost_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other subcommands are built elsewhere in parallel; this suite depends on none of them."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("tapestry.cost.command",))


def test_cost_symbolic_prints_the_formulas(only_the_cost_command: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["cost", "--symbolic", "linear", "--shapes", "64x128,128x32,32"]) == 0
    out = capsys.readouterr().out
    assert "flops = 256*batch0*out" in out
    assert "bytes = 4*batch0*out + 512*batch0 + 516*out" in out


def test_cost_on_a_mesh_prices_every_candidate_partition(
    only_the_cost_command: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "p.json"
    PROFILE.save(path)
    argv = ["cost", "--symbolic", "softmax", "--shapes", "64x128", "--param", "axis=1", "--mesh", "4"]
    assert cli.main([*argv, "--profile", str(path)]) == 0
    out = capsys.readouterr().out
    assert "replicate" in out and "split(d0)" in out


def test_cost_rejects_a_bad_shape(only_the_cost_command: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["cost", "--symbolic", "relu", "--shapes", "4xq"]) == 2
    assert "--shapes" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_quick_writes_a_loadable_profile(only_the_cost_command: None, tmp_path: Path) -> None:
    path = tmp_path / "cpu.json"
    assert cli.main(["calibrate", "-o", str(path), "--quick"]) == 0
    profile = load_profile(path)
    assert profile.device.peak_flops > 0 and profile.links[0].alpha >= 0
    assert "tapestry calibrate" in profile.provenance["command"]


def test_steps_alike_but_for_their_names_are_priced_once_and_as_each_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """An expanded plan's copies run copy 1's steps under other names, sharing their blocks: `plan_step_costs` prices
    each such step once, to what pricing every step alone gives; a step of other blocks or layouts is priced apart."""
    from tapestry.cost.fusion import fused_costs

    g = Graph()
    value = g.input("x", (16, 8))
    for k in range(4):
        value = g.relu(value, name=f"act{k}")
    g.output("y", value)
    mesh = Mesh(4)
    plan = build_plan(g, mesh, {"act0": (0,), "act1": (0,), "act2": (0,), "act3": ()})
    relus = [s for s in plan.steps if isinstance(s, Compute)]
    shared = {s.out: dataclasses.replace(s, blocks=relus[0].blocks) for s in relus[1:3]}
    plan = Plan(mesh, g, tuple(shared.get(s.out, s) for s in plan.steps), plan.outputs)
    alone = {s.out: MODEL.step_cost(s, mesh) for s in plan.steps}
    priced = []
    step_cost = DefaultCostModel.step_cost
    monkeypatch.setattr(DefaultCostModel, "step_cost", lambda self, s, m: priced.append(s.out) or step_cost(self, s, m))
    for model in (MODEL, DefaultCostModel(PROFILE, fuse=False)):
        priced.clear()
        costs = model.plan_step_costs(plan)
        assert costs == (fused_costs(plan, alone, PROFILE.device) if model.fuse else alone)
        assert relus[1].out not in priced and relus[2].out not in priced
        assert {relus[0].out, relus[3].out} <= set(priced)
