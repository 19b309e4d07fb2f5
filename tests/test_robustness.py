"""Bad input gives a clear error or the right result (issue 14): bool arithmetic, zero-size dims, malformed files."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tapestry
from tapestry import cli, dtypes
from tapestry.demo import seeds_example
from tapestry.egraph.rules import BUILTIN_DIR
from tapestry.evaluator import read_block, run_sharded
from tapestry.kernels import KernelError, get_kernel
from tapestry.plan import build_plan
from tapestry.plan.plan import Compute
from tapestry.sharding import Mesh
from tapestry.testing.graphs import GENERATED
from tapestry.testing.strategies import arrays_for


@pytest.mark.parametrize(("op", "arity"), [("sub", 2), ("neg", 1), ("pow", 2), ("relu", 1), ("abs", 1)])
def test_ops_that_numpy_and_torch_refuse_on_bool_are_refused_when_the_graph_is_built(op: str, arity: int) -> None:
    g = tapestry.Graph()
    operands = [g.input(f"x{i}", (3,), dtype="bool") for i in range(arity)]
    with pytest.raises(tapestry.GraphError, match=rf"\({op}\): {op}: bool operands are not supported"):
        getattr(g, op)(*operands)


def test_bool_with_a_number_still_subtracts() -> None:
    """Only bool - bool is refused: bool and float promote to float, as in numpy and torch."""
    g = tapestry.Graph()
    y = g.sub(g.input("a", (3,), dtype="bool"), g.input("b", (3,), dtype="float32"))
    g.output("y", y)
    out = tapestry.evaluate(g, {"a": np.array([True, False, True]), "b": np.ones(3, np.float32)})["y"]
    assert out.dtype == np.float32 and out.tolist() == [0.0, -1.0, 0.0]


def test_batch_norm_of_a_negative_variance_is_nan_without_a_warning() -> None:
    kernel = get_kernel("batch_norm")
    x = np.ones((1, 2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = kernel.numpy(x, np.zeros(2), np.array([-1.0, 1.0]), np.ones(2), np.zeros(2), eps=1e-5)
    assert np.isnan(out[0, 0]).all() and np.isfinite(out[0, 1]).all()


def test_zero_size_dims_keep_their_shapes() -> None:
    """relu of a (4, 0) tensor is (4, 0) (it was (0, 0)); reductions over an empty dim give the identity."""
    g = tapestry.Graph()
    x, w = g.input("x", (4, 0)), g.input("w", (0, 3))
    for name, value in {"relu": g.relu(x), "sum": g.sum(x, axis=1), "matmul": g.matmul(x, w),
                        "reshape": g.reshape(x, shape=(2, 0, 3)), "transpose": g.transpose(x, perm=(1, 0))}.items():
        g.output(name, value)
    got = tapestry.evaluate(g, tapestry.random_inputs(g, seed=0))
    assert {k: v.shape for k, v in got.items()} == {
        "relu": (4, 0), "sum": (4,), "matmul": (4, 3), "reshape": (2, 0, 3), "transpose": (0, 4)}
    assert not got["sum"].any() and not got["matmul"].any()


@pytest.mark.parametrize("name", GENERATED)
@settings(max_examples=4, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_kernel_gives_torchs_shape_for_a_zero_size_input_or_refuses_it(name: str, data) -> None:
    """Each input dim in turn set to 0: the kernel refuses at bind time, or its shape and values are torch's."""
    kernel = get_kernel(name)
    shapes, params, *kinds = kernel.sample(data.draw)
    in_dtypes = ["float64" if d == "float" else d for d in (kinds[0] if kinds else ("float",) * len(shapes))]
    for slot, shape in enumerate(shapes):
        for dim in range(len(shape)):
            zeroed = [tuple(s) for s in shapes]
            zeroed[slot] = tuple(0 if d == dim else size for d, size in enumerate(shape))
            try:
                sig = kernel.bind(zeroed, params, in_dtypes)
            except KernelError:
                continue
            args = arrays_for(sig, 0)
            want = kernel.torch(*[dtypes.to_tensor(a) for a in args], **sig.call_kwargs(sig.index)).numpy()
            assert sig.output_shape == want.shape, f"{name}{zeroed}: {sig.output_shape}, torch {want.shape}"
            got = run_sharded(sig, args, [sig.index])
            np.testing.assert_allclose(got, want, err_msg=f"{name}{zeroed}")


def test_plans_refuse_zero_size_tensors_and_graphs_without_outputs() -> None:
    g = tapestry.Graph()
    g.output("y", g.relu(g.input("x", (4, 0))))
    with pytest.raises(tapestry.GraphError, match=r"input 'x' has shape \[4, 0\]: plans cannot place zero-size"):
        build_plan(g, Mesh(2))
    empty = tapestry.Graph()
    empty.relu(empty.input("x", (4, 3)))
    with pytest.raises(tapestry.GraphError, match="the graph has no outputs"):
        tapestry.optimize(empty, 2)


@pytest.fixture
def saved_plan(tmp_path: Path) -> dict:
    plan = build_plan(seeds_example(8, 4, 6), Mesh(2), {"linear_0": (0,), "relu_0": (0,)})
    plan.save(tmp_path / "plan.json")
    return json.loads((tmp_path / "plan.json").read_text())


def cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line error (and its listed problems) of a command that must fail with exit status 2."""
    assert cli.main(argv) == 2
    return capsys.readouterr().err


def test_a_corrupt_or_wrong_input_file_names_the_input_and_file(tmp_path, saved_plan, capsys) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x.npy").write_bytes(b"\x93NUMPY garbage")
    err = cli_error(["run", str(tmp_path / "plan.json"), "--no-compile", "--inputs", str(tmp_path / "in")], capsys)
    assert f"input 'x': {tmp_path / 'in' / 'x.npy'} is not a readable .npy file" in err
    (tmp_path / "in" / "x.npy").unlink()
    torch.save({"x": torch.zeros(8, 4)}, tmp_path / "in" / "x.pt")
    err = cli_error(["run", str(tmp_path / "plan.json"), "--no-compile", "--inputs", str(tmp_path / "in")], capsys)
    assert "x.pt holds a dict, not one array" in err


@pytest.mark.parametrize("command", ["explain", "run", "optimize", "show"])
def test_a_top_level_json_list_is_refused_by_name(command: str, tmp_path, saved_plan, capsys) -> None:
    path = tmp_path / "list.json"
    path.write_text(json.dumps([saved_plan if command in ("explain", "run") else saved_plan["graph"]]))
    extra = {"optimize": ["--out", str(tmp_path / "o.json")], "run": ["--no-compile"]}.get(command, [])
    err = cli_error([command, str(path), *extra], capsys)
    assert f"{path}: " in err and "the top level is a JSON list" in err


EDITS = {
    "a step removed": (lambda d: d["steps"].pop(1), "step v3 (compute linear): arg 1 (w) refers to 'v1', which no "
                       "earlier step defines"),
    "an output renamed": (lambda d: d["outputs"].update(y="nope"), "output 'y' refers to 'nope', which no step"),
    "a layout cut short": (lambda d: d["steps"][-1]["layout"].update(blocks=d["steps"][-1]["layout"]["blocks"][:1]),
                           "step v4 (compute relu): layout"),
    "an unknown kernel": (lambda d: d["steps"][3].update(kernel="nokernel"), "unknown kernel 'nokernel'"),
    "a step that is not an object": (lambda d: d["steps"].__setitem__(0, "place"), "steps[0]: "),
    "no steps": (lambda d: d.pop("steps"), "steps: missing key 'steps'"),
}


@pytest.mark.parametrize("command", ["explain", "run"])
@pytest.mark.parametrize("edit", EDITS)
def test_explain_and_run_validate_an_edited_plan_first(command: str, edit: str, tmp_path, saved_plan, capsys) -> None:
    change, expected = EDITS[edit]
    change(saved_plan)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(saved_plan))
    err = cli_error([command, str(path), *(["--no-compile"] if command == "run" else [])], capsys)
    assert f"{path}: " in err and expected in err, err


def test_a_graph_without_outputs_cannot_be_optimized(tmp_path, saved_plan, capsys) -> None:
    path = tmp_path / "graph.json"
    path.write_text(json.dumps({**saved_plan["graph"], "outputs": {}}))
    assert "the graph has no outputs" in cli_error(["optimize", str(path), "--out", str(tmp_path / "o.json")], capsys)


def test_extraction_picks_no_useless_views_after_a_rule_that_grows_them(tmp_path: Path) -> None:
    """At zero cost per view the ILP picked transpose(relu(transpose(x))) for relu(x) on one device."""
    (tmp_path / "grow.egg").write_text('(rewrite (Relu x) (Transpose (Relu (Transpose x "")) ""))\n')
    g = tapestry.Graph()
    g.output("y", g.relu(g.input("x", (64, 32))))
    for mesh in (1, 2):
        plan = tapestry.optimize(g, mesh, rules=[BUILTIN_DIR, tmp_path], time_limit=10).plan
        assert [s.kernel for s in plan.steps if isinstance(s, Compute)] == ["relu"], mesh


@pytest.mark.parametrize("name", GENERATED)
@settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_what_the_graph_accepts_at_a_dtype_torch_computes_at_the_promised_dtype(name: str, data) -> None:
    """Every operand at bool, int64 and float16 in turn (one draw of shapes and params for the three): the kernel
    refuses at bind time, or torch runs it and gives the graph's dtype (softmax, the norms, add_relu and matmul took
    bool or integers torch has no kernel for)."""
    kernel = get_kernel(name)
    shapes, drawn, *_ = kernel.sample(data.draw)
    for dtype in ("bool", "int64", "float16"):
        # torch raises on an integer // 0 (a precondition)
        divides = name.startswith("floor_divide") and dtype != "float16"
        params = {**drawn, "value": 1.0} if divides and drawn.get("value") == 0 else drawn
        try:
            sig = kernel.bind(shapes, params, [dtype] * len(shapes))
        except KernelError:
            continue
        blocks = [read_block(a, p.apply(sig.index)) for a, p in zip(arrays_for(sig, 0), sig.projections)]
        if divides:
            blocks = [np.where(b == 0, np.ones_like(b), b) for b in blocks]
        got = kernel.torch(*[dtypes.to_tensor(b) for b in blocks], **sig.call_kwargs(sig.index))
        assert dtypes.name_of(got) == sig.dtype, f"{name} at {dtype}: graph says {sig.dtype}, torch gives {got.dtype}"
