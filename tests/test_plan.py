"""Plans: a valid plan, simulated device by device, computes exactly what its graph means."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sweeps import draws

from tapestry import dtypes
from tapestry.cli import main
from tapestry.evaluator import evaluate, random_inputs
from tapestry.graph import Graph
from tapestry.kernels import KERNELS
from tapestry.plan import Compute, Plan, Reshard, build_plan
from tapestry.plan.explain import explain
from tapestry.plan.render import plan_to_dot
from tapestry.plan.simulate import simulate
from tapestry.plan.validate import PlanError, _surely_held, _unheld_read, plan_problems, validate_plan
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.collectives import Collective, classify_reshard, reshard_groups
from tapestry.sharding.comm import CommError
from tapestry.sharding.layout import ValueNumbers
from tapestry.sharding.partition import candidate_partitions
from tapestry.testing.strategies import signatures
from tapestry.zspace import IndexProjection, ZAffineMap, ZRange

MESHES = [Mesh(1), Mesh(2), Mesh(3), Mesh(4), Mesh(2, 2)]


def assert_plan_computes_graph(plan: Plan, seed: int = 0) -> None:
    validate_plan(plan)
    inputs = random_inputs(plan.graph, seed)
    expected, got = evaluate(plan.graph, inputs), simulate(plan, inputs)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-5)


def collectives_of(plan: Plan) -> set[Collective]:
    return {classify_reshard(s.src_layout, s.layout, s.shape, plan.mesh) for s in plan.steps if isinstance(s, Reshard)}


# -- graphs ------------------------------------------------------------------------------------


def seeds_example(batch: int = 16, features: int = 8, out: int = 6) -> Graph:
    g = Graph()
    x, w, b = g.input("x", (batch, features), "float64"), g.input("w", (features, out), "float64"), g.input("b", (out,), "float64")
    g.output("y", g.relu(g.linear(x, w, b, name="lin"), name="act"))
    return g


def matmul_graph(m: int = 6, k: int = 12, n: int = 5) -> Graph:
    g = Graph()
    g.output("c", g.matmul(g.input("a", (m, k), "float64"), g.input("b", (k, n), "float64"), name="mm"))
    return g


def conv_graph(h: int = 11) -> Graph:
    """relu then conv: the relu's row split must be widened by halos for the conv's row split."""
    g = Graph()
    x = g.relu(g.input("x", (2, 3, h, 9), "float64"), name="pre")
    g.output("y", g.conv2d(x, g.input("w", (4, 3, 3, 3), "float64"), stride=1, padding=1, name="conv"))
    return g


def chain_graph() -> Graph:
    """Four ops that each want a different layout of the value between them."""
    g = Graph()
    x, w, b = g.input("x", (10, 7), "float64"), g.input("w", (7, 9), "float64"), g.input("b", (9,), "float64")
    h = g.relu(g.linear(x, w, b, name="lin"), name="act")
    s = g.softmax(h, axis=0, name="soft")
    g.output("y", g.sum(s, axis=1, name="total"))
    return g


# -- simulation equals evaluation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh", "axes"),
    [
        (Mesh(1), {}),
        (Mesh(2), {"lin": (0,), "act": (0,)}),
        (Mesh(4), {"lin": (1,), "act": (1,)}),
        (Mesh(4), {"lin": (0,), "act": (1,)}),
        (Mesh(2, 2), {"lin": (0, 1), "act": (0, 1)}),
        (Mesh(2, 2), {"lin": (0, 1), "act": (None, 0)}),
    ],
    ids=str,
)
def test_seeds_example_plans_compute_the_graph(mesh, axes):
    assert_plan_computes_graph(build_plan(seeds_example(), mesh, axes))


@pytest.mark.parametrize(("mesh", "axes"), [(Mesh(2), (2,)), (Mesh(4), (2,)), (Mesh(2, 2), (0, 2))], ids=str)
def test_matmul_split_on_k_is_partial_then_all_reduced(mesh, axes):
    plan = build_plan(matmul_graph(), mesh, {"mm": axes})
    compute = next(s for s in plan.steps if isinstance(s, Compute))
    assert compute.layout.partial
    assert collectives_of(plan) == {Collective.ALL_REDUCE}
    assert_plan_computes_graph(plan)


def test_partial_sums_feeding_a_split_op_are_reduce_scattered():
    g = matmul_graph()
    g.output("r", g.relu("mm", name="act"))
    plan = build_plan(g, Mesh(4), {"mm": (2,), "act": (0,)})
    assert Collective.REDUCE_SCATTER in collectives_of(plan)
    assert_plan_computes_graph(plan)


def test_a_value_read_in_halves_is_resharded_from_a_copy_that_holds_each_half():
    """Rotary embeddings read each head in halves: the copy made for the first half's reader holds only that half,
    so the second half is moved from the whole value, not from that copy."""
    g = Graph()
    g.input("x", (4, 8))
    g.relu("x", name="h")
    first = g.op("slice", "h", axis=1, start=0, stop=4, name="first")
    second = g.op("slice", "h", axis=1, start=4, stop=8, name="second")
    g.output("rotated", g.op("concat", second, first, axis=1, name="rotated"))
    plan = build_plan(g, Mesh(2), {op: (0,) for op in ("h", "first", "second", "rotated")})
    validate_plan(plan)
    assert_plan_computes_graph(plan)


def test_ops_running_the_same_step_each_keep_their_own_origin_and_arguments():
    """Repeated layers' ops run one step over the same partition (build_plan makes it once): each is its own."""
    g = Graph()
    g.input("x", (4, 8))
    g.output("y", g.relu(g.relu("x", name="first"), name="second"))
    plan = build_plan(g, Mesh(2), {"first": (0,), "second": (0,)})
    first, second = (s for s in plan.steps if isinstance(s, Compute))
    assert (first.origin, second.origin, second.args) == ("first", "second", (first.out,))
    bare = [dataclasses.replace(step, out="", args=(), origin="") for step in (first, second)]
    assert bare[0] == bare[1]
    assert_plan_computes_graph(plan)


def test_a_partial_layout_on_one_device_is_just_the_value():
    assert_plan_computes_graph(build_plan(matmul_graph(), Mesh(1), {"mm": (2,)}))


@pytest.mark.parametrize("mesh", [Mesh(2), Mesh(4)], ids=str)
def test_conv_split_on_output_rows_reads_halos_sent_by_neighbours(mesh):
    plan = build_plan(conv_graph(), mesh, {"pre": (2,), "conv": (2,)})
    assert collectives_of(plan) == {Collective.SEND_RECV}
    assert_plan_computes_graph(plan)


@pytest.mark.parametrize(("mesh", "axes"), [(Mesh(2), (0,)), (Mesh(4), (1,)), (Mesh(2, 2), (0, 1))], ids=str)
def test_softmax_split_on_the_dims_off_its_axis(mesh, axes):
    g = Graph()
    g.output("y", g.softmax(g.input("x", (3, 6, 10), "float64"), axis=1, name="soft"))
    assert_plan_computes_graph(build_plan(g, mesh, {"soft": axes}))


@pytest.mark.parametrize("mesh", [Mesh(2), Mesh(4)], ids=str)
def test_chain_with_a_different_split_per_op_reshards_between_them(mesh):
    plan = build_plan(chain_graph(), mesh, {"lin": (0,), "act": (1,), "soft": (0,)})
    assert {Collective.ALL_TO_ALL, Collective.ALL_GATHER} <= collectives_of(plan)
    assert_plan_computes_graph(plan)


@pytest.mark.parametrize("mesh", [Mesh(3), Mesh(4), Mesh(2, 2)], ids=str)
def test_sizes_not_divisible_by_the_device_count(mesh):
    axes = {"lin": (0,) * mesh.ndim if mesh.ndim == 1 else (0, 1), "act": (1,) * mesh.ndim}
    assert_plan_computes_graph(build_plan(seeds_example(batch=7, features=5, out=3), mesh, axes))
    assert_plan_computes_graph(build_plan(conv_graph(h=7), mesh, {"pre": (2,) * mesh.ndim, "conv": (2,) * mesh.ndim}))


@st.composite
def one_op_plans(draw) -> Plan:
    """A random kernel on random shapes, then relu; each op takes a random candidate partition."""
    kernel = KERNELS[draw(st.sampled_from(sorted(KERNELS)))]
    sig = draw(signatures(kernel))
    mesh = draw(st.sampled_from(MESHES))
    g = Graph()
    args = [g.input(f"in{i}", shape, dtype) for i, (shape, dtype) in enumerate(zip(sig.input_shapes, sig.input_dtypes))]
    out = getattr(g, kernel.name)(*args, name="op", **dict(sig.params))
    ops = ("op", "after") if dtypes.is_float(out.dtype) else ("op",)  # relu is for numbers
    g.output("y", g.relu(out, name="after") if len(ops) == 2 else out)
    partitions = {op: draw(st.sampled_from(candidate_partitions(g.signature(op), mesh))) for op in ops}
    return build_plan(g, mesh, partitions=partitions)


@draws(66, 200)
def test_any_candidate_partition_of_any_kernel_makes_a_valid_plan_that_computes_the_graph(examples: int) -> None:
    @settings(max_examples=examples, deadline=None)
    @given(plan=one_op_plans(), seed=st.integers(0, 2**16))
    def check(plan, seed):
        assert_plan_computes_graph(plan, seed)

    check()


# -- the validator rejects what devices could not run ---------------------------------------------


def replace_step(plan: Plan, out: str, **changes) -> Plan:
    steps = tuple(dataclasses.replace(s, **changes) if s.out == out else s for s in plan.steps)
    return dataclasses.replace(plan, steps=steps)


def split_plan() -> Plan:
    """x split by rows over 4 devices: v0..v2 placed, v3 = linear, v4 = relu."""
    return build_plan(seeds_example(), Mesh(4), {"lin": (0,), "act": (0,)})


def problems_mentioning(plan: Plan, text: str) -> list[str]:
    return [p for p in plan_problems(plan) if text in p]


def test_build_plan_names_an_unknown_op_or_a_split_that_does_not_fit_the_mesh():
    g = seeds_example(8, 4, 6)
    with pytest.raises(ValueError, match=r"'linear' is no op of the graph; its ops are lin, act"):
        build_plan(g, Mesh(2), {"linear": (0,)})
    with pytest.raises(ValueError, match=r"op 'lin': axes \(0, 1\) name 2 mesh axes; the mesh \(2,\) has 1"):
        build_plan(g, Mesh(2), {"lin": (0, 1)})
    with pytest.raises(ValueError, match=r"op 'lin': axes \(5,\): the index space \[8, 6\] has dims 0..1"):
        build_plan(g, Mesh(2), {"lin": (5,)})


def test_a_built_plan_has_no_problems():
    assert plan_problems(split_plan()) == []


def test_blocks_leaving_a_gap_are_rejected():
    plan = split_plan()
    blocks = plan.by_id["v3"].blocks
    problems = problems_mentioning(replace_step(plan, "v3", blocks=(*blocks[:3], None)), "gap")
    assert problems and all(p.startswith("step v3 (compute linear)") for p in problems)


def test_overlapping_blocks_are_rejected():
    plan = split_plan()
    b0, b1, *rest = plan.by_id["v3"].blocks
    wider = ZRange(b0.start, (b1.start[0] + 1, b0.end[1]))
    assert problems_mentioning(replace_step(plan, "v3", blocks=(wider, b1, *rest)), "overlap")


def test_an_arg_layout_that_does_not_hold_a_devices_reads_is_rejected():
    plan = split_plan()
    by_columns = Layout.split((16, 8), plan.mesh, (1,))
    plan = replace_step(replace_step(plan, "v0", layout=by_columns), "v3",
                        arg_layouts=(by_columns, *plan.by_id["v3"].arg_layouts[1:]))
    problems = problems_mentioning(plan, "reads")
    assert problems and all(p.startswith("step v3 (compute linear): device") for p in problems)
    with pytest.raises(PlanError, match="step v3"):
        simulate(plan, random_inputs(plan.graph))  # the simulator never invents cells either


@draws(50, 150)
def test_reads_passed_without_islpy_are_held_by_islpys_judgement(examples: int) -> None:
    """`_surely_held` (the box of the map at the block's corners) never passes a read islpy finds unheld, and
    passes the reads of plain row and halo splits."""
    @settings(max_examples=examples, deadline=None)
    @given(st.data())
    def check(data):
        in_dim, out_dim = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 3))
        matrix = [[data.draw(st.integers(-2, 2)) for _ in range(in_dim)] for _ in range(out_dim)]
        projection = IndexProjection(ZAffineMap(matrix, [data.draw(st.integers(-3, 3)) for _ in range(out_dim)],
                                                in_dim=in_dim), [data.draw(st.integers(0, 3)) for _ in range(out_dim)])
        shape = tuple(data.draw(st.integers(1, 9)) for _ in range(out_dim))
        pairs = []
        for _ in range(data.draw(st.integers(1, 6))):
            start = [data.draw(st.integers(0, 6)) for _ in range(in_dim)]
            held_start = [data.draw(st.integers(0, n)) for n in shape]
            pairs.append((ZRange(start, [s + data.draw(st.integers(0, 3)) for s in start]),
                          ZRange(held_start, [data.draw(st.integers(h, n)) for h, n in zip(held_start, shape)])))
        for block, held in _surely_held(projection, shape, pairs):
            assert _unheld_read(projection, shape, block, held) is None
        halo = IndexProjection(ZAffineMap([[1]], [-1]), [3])  # a 3-wide window centred on each row
        rows = ZRange((4,), (8,))
        assert _surely_held(halo, (16,), [(rows, ZRange((3,), (9,)))]) == {(rows, ZRange((3,), (9,)))}
        assert not _surely_held(halo, (16,), [(rows, ZRange((4,), (9,)))])

    check()


def test_arg_layouts_must_be_the_layouts_their_values_have():
    plan = split_plan()
    plan = replace_step(plan, "v3", arg_layouts=(Layout.replicated((16, 8), plan.mesh), *plan.by_id["v3"].arg_layouts[1:]))
    assert problems_mentioning(plan, "step v3 (compute linear): arg 0 (x) 'v0' is laid out")


def test_a_dangling_value_reference_is_rejected():
    plan = split_plan()
    assert problems_mentioning(replace_step(plan, "v4", args=("v99",)), "step v4 (compute relu): arg 0 (x) refers to 'v99'")


def test_a_value_defined_after_its_use_is_rejected():
    plan = split_plan()
    plan = dataclasses.replace(plan, steps=(plan.steps[1], plan.steps[0], *plan.steps[2:]))
    assert plan_problems(plan) == []  # order among places is free
    plan = dataclasses.replace(plan, steps=(*plan.steps[:3], plan.steps[4], plan.steps[3]))
    assert problems_mentioning(plan, "step v4 (compute relu): arg 0 (x) refers to 'v3', which no earlier step")


def test_a_partial_output_is_rejected():
    plan = build_plan(matmul_graph(), Mesh(2), {"mm": (2,)})
    partial = next(s.out for s in plan.steps if isinstance(s, Compute))
    plan = dataclasses.replace(plan, steps=plan.steps[:-1], outputs={"c": partial})
    assert problems_mentioning(plan, f"output 'c' (step {partial} (compute matmul)) is partial")
    with pytest.raises(PlanError, match="partial"):
        validate_plan(plan)


def test_splitting_a_reduction_while_replicating_is_rejected():
    plan = build_plan(matmul_graph(), Mesh(2, 2), {"mm": (2, None)})  # k over axis 0, axis 1 repeats it
    assert problems_mentioning(plan, "step v2 (compute matmul): blocks do not partition the index space: splits a reduction")


def test_a_reshard_into_cells_no_device_holds_is_rejected():
    plan = build_plan(seeds_example(), Mesh(2), {"lin": (0,), "act": (1,)})
    reshard = next(s for s in plan.steps if isinstance(s, Reshard))
    half = Layout((reshard.src_layout.blocks[0], None))
    plan = replace_step(plan, reshard.out, src_layout=half)
    assert problems_mentioning(plan, f"step {reshard.out} (reshard): source 'v3' is laid out")


# -- collectives ---------------------------------------------------------------------------------


SHAPE = (8, 6)


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        (lambda m: Layout.split(SHAPE, m, (0,)), lambda m: Layout.replicated(SHAPE, m), Collective.ALL_GATHER),
        (lambda m: Layout(Layout.replicated(SHAPE, m).blocks, True), lambda m: Layout.replicated(SHAPE, m), Collective.ALL_REDUCE),
        (lambda m: Layout(Layout.replicated(SHAPE, m).blocks, True), lambda m: Layout.split(SHAPE, m, (1,)), Collective.REDUCE_SCATTER),
        (lambda m: Layout.split(SHAPE, m, (0,)), lambda m: Layout.split(SHAPE, m, (1,)), Collective.ALL_TO_ALL),
        (lambda m: Layout.replicated(SHAPE, m), lambda m: Layout.split(SHAPE, m, (0,)), Collective.NOOP),
        (lambda m: Layout.split(SHAPE, m, (0,)), lambda m: Layout.split(SHAPE, m, (0,)), Collective.NOOP),
        (lambda m: Layout.split(SHAPE, m, (0,)), lambda m: Layout((ZRange((0, 0), (3, 6)), *Layout.split(SHAPE, m, (0,)).blocks[1:])), Collective.SEND_RECV),
    ],
    ids=["split->R", "P->R", "P->S", "S(0)->S(1)", "R->S", "same", "halo"],
)
def test_classify_reshard_on_a_line(src, dst, expected):
    mesh = Mesh(4)
    assert classify_reshard(src(mesh), dst(mesh), SHAPE, mesh) is expected


def test_gathering_along_one_axis_of_a_grid_is_one_all_gather_per_row_of_devices():
    mesh = Mesh(2, 2)
    rows_cols, rows = Layout.split(SHAPE, mesh, (0, 1)), Layout.split(SHAPE, mesh, (0, None))
    assert classify_reshard(rows_cols, rows, SHAPE, mesh) is Collective.ALL_GATHER
    groups = reshard_groups(rows_cols, rows, SHAPE, mesh)
    assert [(g.ranks, g.axes, g.kind) for g in groups] == [((0, 1), (1,), "all_gather"), ((2, 3), (1,), "all_gather")]


def test_a_reshard_that_needs_every_axis_is_one_group_of_the_whole_mesh():
    mesh = Mesh(2, 2)
    rows_cols = Layout.split(SHAPE, mesh, (0, 1))
    (group,) = reshard_groups(rows_cols, Layout.replicated(SHAPE, mesh), SHAPE, mesh)
    assert group.ranks == (0, 1, 2, 3) and group.kind is Collective.ALL_GATHER


def test_moving_rows_between_the_axes_of_a_grid_is_one_message_per_column_of_devices():
    """Rows split over axis 0 to rows split over axis 1: device 2 needs device 0's rows, device 1 device 3's."""
    mesh = Mesh(2, 2)
    groups = reshard_groups(Layout.split(SHAPE, mesh, (0, None)), Layout.split(SHAPE, mesh, (None, 0)), SHAPE, mesh)
    assert [(g.ranks, g.kind) for g in groups] == [((0, 2), "send_recv"), ((1, 3), "send_recv")]


def test_partial_sums_are_reduced_along_the_axis_that_split_the_contraction():
    mesh = Mesh(2, 2)
    partial = Layout(Layout.split(SHAPE, mesh, (0, None)).blocks, partial=True)  # rows on axis 0, k split on axis 1
    groups = reshard_groups(partial, Layout.split(SHAPE, mesh, (0, None)), SHAPE, mesh)
    assert [(g.ranks, g.kind) for g in groups] == [((0, 1), "all_reduce"), ((2, 3), "all_reduce")]


def test_classify_reshard_refuses_impossible_moves():
    mesh = Mesh(2)
    with pytest.raises(CommError):
        classify_reshard(Layout((ZRange.from_shape((4, 6)), None)), Layout.replicated(SHAPE, mesh), SHAPE, mesh)


# -- formats and commands -------------------------------------------------------------------------


def test_plans_round_trip_through_json():
    plan = build_plan(chain_graph(), Mesh(2, 2), {"lin": (0, 1), "act": (1, None), "soft": (0, None)})
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    assert_plan_computes_graph(again)


@pytest.mark.parametrize("name", ["../escaped", "/tmp/escaped", "sub/x"])
def test_a_plan_file_whose_output_name_is_a_path_is_refused_and_run_writes_nothing(tmp_path, capsys, name):
    data = build_plan(seeds_example(), Mesh(2), {"lin": (0,), "act": (0,)}).to_json()
    data["outputs"] = {name: data["outputs"]["y"]}
    with pytest.raises(ValueError, match="output .* is not an identifier"):
        Plan.from_json(data, "plan.json")
    data["graph"]["outputs"] = {name: data["graph"]["outputs"]["y"]}
    with pytest.raises(ValueError, match=r"plan\.json: .*output .* is not an identifier"):
        Plan.from_json(data, "plan.json")
    path, saved = tmp_path / "plan.json", tmp_path / "deep" / "out"
    path.write_text(json.dumps(data))
    assert main(["run", str(path), "--no-compile", "--save-outputs", str(saved)]) == 2
    assert "is not an identifier" in capsys.readouterr().err
    assert not any(p.suffix == ".npy" for p in tmp_path.rglob("*")) and not list(Path("/tmp").glob("escaped*"))


@pytest.mark.parametrize("edit", [
    {"kernel": "linear_gelu"},  # another kernel of the same signature
    {"params": {"value": 2.0}},  # another parameter
])
def test_a_plan_edited_to_compute_something_else_is_refused_naming_the_step_and_the_file(tmp_path, capsys, edit):
    g = Graph()
    x, w, b = g.input("x", (16, 8)), g.input("w", (8, 6)), g.input("b", (6,))
    made = g.linear_relu(x, w, b) if "kernel" in edit else g.add_scalar(g.linear(x, w, b), value=1.0)
    g.output("y", made)
    data = build_plan(g, Mesh(2), {}).to_json()
    step = data["steps"][-1]
    step.update(edit)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    for command in (["explain", str(path)], ["run", str(path), "--no-compile"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert f"{path}: the plan does not compute its graph" in err
        culprit = f"step {step['out']} (compute {step['kernel']})"
        assert f"the first step computing a value the graph does not: {culprit}" in err


@pytest.mark.parametrize("mesh", [[2.7], [2, 1.5], [2.0]])
def test_a_mesh_of_fractional_devices_is_refused_not_truncated(mesh):
    with pytest.raises(ValueError, match="a mesh's axes are whole numbers of devices"):
        Mesh(*mesh)
    data = build_plan(seeds_example(), Mesh(2), {}).to_json()
    data["mesh"] = mesh
    with pytest.raises(ValueError, match=r"plan.json: mesh: a mesh's axes are whole numbers of devices"):
        Plan.from_json(data, "plan.json")


def test_a_truncated_plan_file_is_an_error_naming_the_file_and_line(tmp_path, capsys):
    path = tmp_path / "plan.json"
    build_plan(seeds_example(), Mesh(2), {}).save(path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=rf"{path}:\d+:\d+: not valid JSON"):
        Plan.load(path)
    assert main(["explain", str(path)]) == 2
    assert f"{path}:" in capsys.readouterr().err


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda steps: steps[3].update(input_dtypes=["bfloat16"] * 3), r"arg 0 \(x\) 'v0' is float32, but the step reads"
                                                                     r" it as bfloat16"),
    (lambda steps: steps[4].update(dtype="float16"), r"says its source 'v3' is float16, but it is float32"),
    (lambda steps: steps[3].update(input_dtypes=["float8"] * 3), r"float8"),
])
def test_a_plan_edited_to_another_dtype_is_refused(edit, problem):
    g = Graph()
    x, w, b = g.input("x", (16, 8)), g.input("w", (8, 6)), g.input("b", (6,))
    g.output("y", g.relu(g.linear(x, w, b)))
    data = build_plan(g, Mesh(2), {"linear_0": (0,), "relu_0": (1,)}).to_json()
    assert [s["kind"] for s in data["steps"]][3:5] == ["compute", "reshard"]
    edit(data["steps"])
    with pytest.raises(PlanError, match=problem):
        validate_plan(Plan.from_json(data, "plan.json"))


def test_explain_lists_every_step_with_its_layouts_and_communication():
    plan = build_plan(seeds_example(), Mesh(4), {"lin": (0,), "act": (1,)})
    text = explain(plan)
    for step in plan.steps:
        assert any(line.startswith(step.out + " ") for line in text.splitlines())
    assert "compute  linear(x=v0, w=v1, b=v2) -> [16, 6] as S(0)" in text
    assert "reshard  v3 S(0) -> S(1): all_to_all, 72 elements moved (max 24 into one device)" in text
    assert "origin: lin" in text and "d3: computes=2 flops=400 received=12" in text


def test_plan_pictures_draw_one_cluster_per_device_and_label_communication():
    plan = build_plan(seeds_example(), Mesh(2, 2), {"lin": (0, 1), "act": (None, 0)})
    source = plan_to_dot(plan).source
    assert all(f"cluster_d{k}" in source for k in plan.mesh.devices)
    assert "linear zr[0:8, 0:3]" in source and "all_to_all" in source


def test_explain_command_prints_per_step_lines(tmp_path, capsys):
    path = tmp_path / "plan.json"
    build_plan(seeds_example(), Mesh(2), {"lin": (0,), "act": (0,)}).save(path)
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan on mesh 2 (2 devices)") and "\nv3  compute  linear(" in out


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_show_command_draws_a_plan_as_svg(tmp_path, capsys):
    path = tmp_path / "plan.json"
    build_plan(seeds_example(), Mesh(2), {"lin": (0,), "act": (1,)}).save(path)
    assert main(["show", str(path), "-o", str(tmp_path / "plan.svg")]) == 0
    assert (tmp_path / "plan.svg").read_text().lstrip().startswith(("<?xml", "<svg"))


def _matmul_relu(mesh: Mesh, matmul_axes: tuple) -> Plan:
    g = Graph()
    g.output("y", g.relu(g.matmul(g.input("a", (8, 6)), g.input("b", (6, 4)))))
    return build_plan(g, mesh, {"matmul_0": matmul_axes, "relu_0": (None,) * mesh.ndim})


@pytest.mark.parametrize(("matmul_axes", "dropped", "cause"), [
    ((0,), 0, r"cell \[\d+, \d+\] of zr\[0:8, 0:4\] never arrives"),  # rows gathered: one piece lost
    ((2,), -1, r"device \d's partial sums of zr\[0:8, 0:4\] never arrive"),  # partial sums: the last one lost
])
def test_the_simulator_fails_when_a_needed_cell_or_partial_sum_never_arrives(monkeypatch, matmul_axes, dropped, cause):
    """A lost transfer must not leave zeros that might pass for data: the simulator checks arrivals against the layouts."""
    import tapestry.plan.simulate as simulation

    plan = _matmul_relu(Mesh(4), matmul_axes)
    inputs = random_inputs(plan.graph)
    np.testing.assert_allclose(simulate(plan, inputs)["y"], evaluate(plan.graph, inputs)["y"], rtol=1e-5)
    moves = simulation.transfers
    monkeypatch.setattr(simulation, "transfers", lambda src, dst: [t for k, t in enumerate(moves(src, dst))
                                                                   if k != dropped % len(moves(src, dst))])
    with pytest.raises(PlanError, match=cause):
        simulate(plan, inputs)


def test_validation_computes_reads_itself_so_a_halo_a_row_short_is_caught(monkeypatch):
    """Plan generation's needed_layout is not trusted: if it drops a halo row, validate_plan still sees the read."""
    import tapestry.plan.plan as plans
    from tapestry.sharding.partition import needed_layout

    def short_halo(sig, arg, part):
        layout, rows = needed_layout(sig, arg, part), sig.input_shapes[arg][2] if arg == 0 else None
        return Layout(tuple(b if b is None or arg != 0 or b.end[2] == rows else
                            ZRange(b.start, (*b.end[:2], b.end[2] - 1, *b.end[3:])) for b in layout.blocks))

    g = Graph()
    g.output("y", g.conv2d(g.input("x", (1, 2, 8, 8)), g.input("w", (3, 2, 3, 3)), padding=1))
    validate_plan(build_plan(g, Mesh(2), {"conv2d_0": (2,)}))  # rows split: device 0 reads row 4 of device 1's
    monkeypatch.setattr(plans, "needed_layout", short_halo)
    with pytest.raises(PlanError, match=r"device 0 reads zr\[0:1, 0:2, 0:5, 0:8\] of arg 0 \(x\) 'v0' but holds only "
                                        r"zr\[0:1, 0:2, 0:4, 0:8\]"):
        validate_plan(build_plan(g, Mesh(2), {"conv2d_0": (2,)}))


def relu_chain_plan(depth: int = 3) -> Plan:
    """x split by rows over 4 devices through `depth` relus alike but for their names (as an expanded plan's layers)."""
    g = Graph()
    value = g.input("x", (16, 8), "float64")
    for k in range(depth):
        value = g.relu(value, name=f"act{k}")
    g.output("y", value)
    return build_plan(g, Mesh(4), {f"act{k}": (0,) for k in range(depth)})


def test_steps_alike_but_for_their_names_are_judged_once_and_their_sources_each_time(monkeypatch):
    """A Compute step whose blocks, layouts and binding were found valid is not judged again (an expanded plan runs
    copy 1's steps once per later copy), but what it reads still is, by name."""
    from tapestry.plan import validate

    plan = relu_chain_plan()
    judged = []
    whole = validate._compute_problems
    monkeypatch.setattr(validate, "_compute_problems", lambda *a: judged.append(a[1].out) or whole(*a))
    assert plan_problems(plan) == []
    relus = [s.out for s in plan.steps if isinstance(s, Compute)]
    assert judged == relus[:1]
    dangling = replace_step(plan, relus[2], args=("v99",))
    assert problems_mentioning(dangling, f"step {relus[2]} (compute relu): arg 0 (x) refers to 'v99', which no "
                                         f"earlier step defines")
    late = dataclasses.replace(plan, steps=tuple(s for s in plan.steps if s.out != relus[1]) + (plan.by_id[relus[1]],))
    assert problems_mentioning(late, f"step {relus[2]} (compute relu): arg 0 (x) refers to {relus[1]!r}")


def test_a_step_alike_to_a_valid_one_but_for_its_blocks_is_judged_again():
    plan = relu_chain_plan()
    last = [s for s in plan.steps if isinstance(s, Compute)][-1]
    problems = problems_mentioning(replace_step(plan, last.out, blocks=(*last.blocks[:3], None)), "gap")
    assert problems and all(p.startswith(f"step {last.out} (compute relu)") for p in problems)


def test_reshards_alike_but_for_their_names_are_judged_once_and_a_wrong_one_in_a_later_layer_is_caught(monkeypatch):
    """A Reshard whose shape and layouts were found valid is not judged again (an expanded plan's later copies move
    as copy 1 does: on 8x8x8 each move's 512 blocks were checked once per layer), but its source still is, by name;
    a later layer's reshard moving into another layout is judged, and a wrong one caught."""
    from tapestry.plan import validate

    g = Graph()
    value = g.input("x", (16, 8), "float64")
    for k in range(4):
        value = g.relu(value, name=f"act{k}")
    g.output("y", value)
    plan = build_plan(g, Mesh(4), {f"act{k}": (k % 2,) for k in range(4)})  # rows, columns, rows, columns
    moves = [s for s in plan.steps if isinstance(s, Reshard)]
    number = ValueNumbers()
    assert len(moves) == 3 and validate._moved(moves[0], number) == validate._moved(moves[2], number) \
        != validate._moved(moves[1], number)
    judged = []
    whole = validate.can_move
    monkeypatch.setattr(validate, "can_move", lambda src, dst: judged.append(dst) or whole(src, dst))
    assert plan_problems(plan) == []
    assert judged == [moves[0].layout, moves[1].layout]  # the third is the first but for its names
    last = moves[2]
    dangling = replace_step(plan, last.out, src="v99")
    assert problems_mentioning(dangling, f"step {last.out} (reshard): source refers to 'v99', which no earlier step "
                                         f"defines")
    past = Layout((*last.layout.blocks[:3], ZRange((0, 6), (16, 9))))
    assert problems_mentioning(replace_step(plan, last.out, layout=past),
                               f"step {last.out} (reshard): layout: device 3 holds zr[0:16, 6:9], outside the tensor")
    partial = Layout(last.layout.blocks, partial=True)
    assert problems_mentioning(replace_step(plan, last.out, layout=partial), f"step {last.out} (reshard): impossible "
                                                                             f"move")


def test_steps_sharing_their_blocks_are_judged_once_by_identity_and_their_sources_each_time(monkeypatch):
    """An expanded plan's copies share copy 1's blocks (one tuple object): a later copy is found alike by that object,
    without hashing every device's block again (hashing blocks was a third of validating a 4-layer 70B slice's plan
    on 8x8x8, docs/benchmarks.md), and what it reads is still checked by name."""
    from tapestry.plan import validate

    plan = relu_chain_plan()
    relus = [s for s in plan.steps if isinstance(s, Compute)]
    shared = dataclasses.replace(plan, steps=tuple(dataclasses.replace(s, blocks=relus[0].blocks)
                                                   if isinstance(s, Compute) else s for s in plan.steps))
    keyed = []
    whole = validate._computed
    monkeypatch.setattr(validate, "_computed", lambda step, binding: keyed.append(step.out) or whole(step, binding))
    assert plan_problems(shared) == []
    assert keyed == [relus[0].out]
    dangling = replace_step(shared, relus[2].out, args=("v99",))
    assert problems_mentioning(dangling, f"step {relus[2].out} (compute relu): arg 0 (x) refers to 'v99'")


def fresh_layouts(plan: Plan) -> Plan:
    """The plan with every layout of every step copied into an equal object of its own: no two steps share one."""
    def fresh(layout: Layout) -> Layout:
        return Layout(tuple(layout.blocks), layout.partial)

    def copied(step):  # noqa: ANN001, ANN202
        if isinstance(step, Compute):
            return dataclasses.replace(step, layout=fresh(step.layout), arg_layouts=tuple(map(fresh, step.arg_layouts)))
        if isinstance(step, Reshard):
            return dataclasses.replace(step, src_layout=fresh(step.src_layout), layout=fresh(step.layout))
        return dataclasses.replace(step, layout=fresh(step.layout))
    return dataclasses.replace(plan, steps=tuple(map(copied, plan.steps)))


def test_layouts_compared_by_number_judge_as_layouts_compared_by_value(monkeypatch):
    """validate numbers layouts once per object (`ValueNumbers`) and compares the numbers: a plan whose steps each
    hold their own equal copies of the layouts is valid, judges each step alike but for its names once as the
    plan sharing them does, and a step that says its argument is laid out otherwise is caught."""
    from tapestry.plan import validate

    g = Graph()
    value = g.input("x", (16, 8), "float64")
    for k in range(4):
        value = g.relu(value, name=f"act{k}")
    g.output("y", value)
    plan = fresh_layouts(build_plan(g, Mesh(4), {f"act{k}": (k % 2,) for k in range(4)}))
    judged = []
    whole = validate._compute_problems
    monkeypatch.setattr(validate, "_compute_problems", lambda *a: judged.append(a[1].out) or whole(*a))
    assert plan_problems(plan) == []
    relus = [s for s in plan.steps if isinstance(s, Compute)]
    assert judged == [relus[0].out, relus[1].out]  # rows, then columns; the later two are those but for names
    moves = [s for s in plan.steps if isinstance(s, Reshard)]
    number = ValueNumbers()
    assert validate._moved(moves[0], number) == validate._moved(moves[2], number)
    last = relus[-1]
    other = moves[0].src_layout  # rows, where the last relu reads columns
    assert other != last.arg_layouts[0]
    wrong = replace_step(plan, last.out, arg_layouts=(Layout(tuple(other.blocks)),))
    assert problems_mentioning(wrong, f"step {last.out} (compute relu): arg 0 (x) {last.args[0]!r} is laid out")
