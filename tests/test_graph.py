"""The block graph builder, its validation, JSON round trip and pictures."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

import tapestry
from tapestry import verify
from tapestry.graph import Graph, GraphError, graph_from_json, graph_to_json, load_graph, save_graph
from tapestry.graph.render import graph_to_dot


def seeds_example() -> Graph:
    g = Graph()
    x = g.input("x", (64, 128))
    w = g.input("w", (128, 32))
    b = g.input("b", (32,))
    g.output("z", g.relu(g.linear(x, w, b)))
    return g


def test_builder_has_one_method_per_kernel_and_infers_shapes():
    g = seeds_example()
    assert [n.op for n in g.ops] == ["linear", "relu"]
    assert g["relu_0"].shape == (64, 32)
    assert set(tapestry.KERNELS) <= set(dir(g))


def test_graph_prints_like_fx():
    assert str(seeds_example()).splitlines()[3] == "linear_0: float32[64, 32] = linear(x, w, b)"


def test_shape_mismatch_names_op_input_and_shapes():
    g = Graph()
    x, w, b = g.input("x", (4, 8)), g.input("w", (9, 2)), g.input("b", (2,))
    with pytest.raises(GraphError, match=r"op 'fc' \(linear\): .*x's last dim 8.*w=w\[9, 2\]"):
        g.linear(x, w, b, name="fc")


def test_unknown_kernel_is_an_attribute_error_and_a_graph_error():
    g = Graph()
    with pytest.raises(AttributeError, match="no attribute or kernel 'convolve'"):
        g.convolve
    with pytest.raises(GraphError, match="unknown kernel 'convolve'"):
        g.op("convolve", g.input("x", (2,)))


def test_a_parameter_passed_positionally_says_to_pass_it_by_keyword():
    g = Graph()
    b = g.input("b", (16,))
    with pytest.raises(GraphError, match=r"op 'r' \(reshape\) takes 1 tensor input\(s\) \(x\); got also "
                                         r"\(16, 1, 1\): parameters go by keyword \(shape=...\)"):
        g.reshape(b, (16, 1, 1), name="r")


def test_fresh_names_count_the_kernel_s_nodes_and_a_rollback_frees_its_names():
    g = Graph()
    x = g.input("x", (4, 4))
    g.relu(x)
    g.relu(x, name="relu_1")  # taken by hand: the next fresh relu skips it
    assert [g.relu(x).name, g.exp(x).name] == ["relu_2", "exp_0"]
    g.truncate(2)  # x and relu_0 are left
    assert [g.relu(x).name, g.relu(x).name] == ["relu_1", "relu_2"]


def test_repeated_ops_share_one_signature_but_params_equal_only_under_eq_bind_apart():
    g = Graph()
    x = g.input("x", (4, 4))
    a, b = g.relu(x), g.relu(x)
    assert g.signature(a.name) is g.signature(b.name)  # a model's repeated layers bind once
    zero, negative = g.mul_scalar(x, value=0.0), g.mul_scalar(x, value=-0.0)  # 0.0 == -0.0
    assert math.copysign(1, dict(g[negative.name].params)["value"]) == -1
    assert g.signature(zero.name) is not g.signature(negative.name)
    g.slice(x, axis=1, start=0, stop=2)
    with pytest.raises(GraphError, match="param 'axis' must be int, got True"):  # True == 1, and bind refuses it
        g.slice(x, axis=True, start=0, stop=2)


def test_a_kernel_registered_again_binds_anew_not_from_the_graph_s_earlier_signatures(monkeypatch):
    from dataclasses import replace

    from tapestry.kernels import KERNELS

    g = Graph()
    x = g.input("x", (4, 4))
    g.relu(x)
    monkeypatch.setitem(KERNELS, "relu", replace(KERNELS["relu"], doc="registered again"))
    assert g.signature(g.relu(x).name).kernel is KERNELS["relu"]


def test_added_after_is_what_a_builder_added_since_in_order():
    g = Graph()
    x = g.input("x", (4, 4))
    size = len(g)
    y = g.relu(g.constant("c", np.ones((4, 4), np.float32)))
    assert [n.name for n in g.added_after(size)] == ["c", y.name]
    assert g.added_after(len(g)) == () and g.added_after(0) == g.nodes


def test_duplicate_names_are_rejected():
    g = Graph()
    g.input("x", (2,))
    with pytest.raises(GraphError, match="'x' is defined twice"):
        g.input("x", (3,))


@pytest.mark.parametrize("name", ["../x", "/tmp/x", "a/b", ".hidden", "", "a b", "x\\y"])
def test_output_names_that_could_be_paths_are_refused_by_the_builder_and_in_json(name):
    g = seeds_example()
    with pytest.raises(GraphError, match="output .* is not an identifier"):
        g.output(name, "relu_0")
    data = graph_to_json(seeds_example())
    data["outputs"] = {name: "relu_0"}
    with pytest.raises(GraphError, match="output .* is not an identifier"):
        graph_from_json(data, "g.json")


def test_a_shape_of_fractions_is_refused_not_truncated():
    with pytest.raises(GraphError, match=r"input 'x': shape \[8.9, 6\] is not whole numbers"):
        Graph().input("x", [8.9, 6])
    data = {"inputs": [{"name": "x", "shape": [8.9, 6]}], "ops": [], "outputs": {"y": "x"}}
    with pytest.raises(GraphError, match=r"g.json: input 'x': shape \[8.9, 6\] is not whole numbers"):
        graph_from_json(data, "g.json")


def test_cells_counts_huge_shapes_exactly():
    g = Graph()
    g.output("y", g.relu(g.input("x", (2**40, 2**40))))
    assert verify.cells(g) == 2 * 2**80


def test_json_round_trip():
    g = seeds_example()
    assert graph_from_json(json.loads(json.dumps(graph_to_json(g)))) == g


def test_example_values_of_inputs_round_trip_through_json_and_feed_random_inputs():
    g = Graph()
    offsets = g.input("offsets", (3,), "int64")
    g.output("y", g.add_scalar(offsets, value=1))
    g.example("offsets", np.array([0, 2, 5]))
    again = graph_from_json(json.loads(json.dumps(graph_to_json(g))))
    assert again == g and again.examples["offsets"].dtype == np.int64
    np.testing.assert_array_equal(tapestry.random_inputs(again, seed=7)["offsets"], [0, 2, 5])
    with pytest.raises(GraphError, match=r"example: input 'offsets' has shape \[3\], the value \[2\]"):
        g.example("offsets", np.array([0, 1]))


def test_json_round_trip_keeps_the_order_of_the_ops():
    g = Graph()
    x = g.input("x", (4,))
    g.output("b", g.relu(g.relu(x, name="a"), name="b"))
    g.output("c", g.relu(x, name="c"))
    again = graph_from_json(json.loads(json.dumps(graph_to_json(g))))
    assert [n.name for n in again.ops] == [n.name for n in g.ops] == ["a", "b", "c"]


def test_json_ops_may_come_in_any_order():
    data = graph_to_json(seeds_example())
    data["ops"].reverse()
    assert graph_from_json(data) == seeds_example()


def _json_with_ops(ops):
    return {"inputs": [{"name": "x", "shape": [4]}], "ops": ops, "outputs": {}}


def test_json_dangling_reference_is_named():
    data = _json_with_ops([{"name": "r", "op": "relu", "args": ["nope"]}])
    with pytest.raises(GraphError, match="op 'r' \\(relu\\): input 'nope' is not defined anywhere"):
        graph_from_json(data)


def test_json_cycle_is_reported_as_a_path():
    data = _json_with_ops([{"name": "a", "op": "relu", "args": ["b"]}, {"name": "b", "op": "exp", "args": ["a"]}])
    with pytest.raises(GraphError, match="cycle: (a -> b -> a|b -> a -> b)"):
        graph_from_json(data)


def test_json_unknown_kernel_and_wrong_recorded_shape():
    with pytest.raises(GraphError, match="unknown kernel 'relux'"):
        graph_from_json(_json_with_ops([{"name": "r", "op": "relux", "args": ["x"]}]))
    with pytest.raises(GraphError, match="recorded shape \\[5\\] but inputs give \\[4\\]"):
        graph_from_json(_json_with_ops([{"name": "r", "op": "relu", "args": ["x"], "shape": [5]}]))


def test_bad_json_file_names_file_and_line(tmp_path):
    path = tmp_path / "g.json"
    path.write_text('{"inputs": [\n  oops]}')
    with pytest.raises(GraphError, match="g.json:2: not valid JSON"):
        load_graph(path)


def test_save_and_load(tmp_path):
    save_graph(seeds_example(), tmp_path / "g.json")
    assert load_graph(tmp_path / "g.json") == seeds_example()


def test_dot_has_inputs_ops_and_outputs():
    source = graph_to_dot(seeds_example()).source
    assert "linear" in source and "output_z" in source and "x -> linear_0" in source


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz dot not installed")
def test_show_command_writes_svg(tmp_path):
    save_graph(seeds_example(), tmp_path / "g.json")
    from tapestry.cli import main

    assert main(["show", str(tmp_path / "g.json"), "-o", str(tmp_path / "g.svg")]) == 0
    assert (tmp_path / "g.svg").read_text().lstrip().startswith("<?xml")


def test_evaluate_computes_the_seeds_example():
    g = seeds_example()
    inputs = tapestry.random_inputs(g, seed=1)
    expected = np.maximum(inputs["x"] @ inputs["w"] + inputs["b"], 0)
    np.testing.assert_allclose(tapestry.evaluate(g, inputs)["z"], expected, rtol=1e-5)


def test_evaluate_checks_supplied_inputs():
    g = seeds_example()
    inputs = tapestry.random_inputs(g)
    inputs["w"] = inputs["w"][:3]
    with pytest.raises(GraphError, match="input 'w': expected shape \\[128, 32\\], found \\[3, 32\\]"):
        tapestry.evaluate(g, inputs)
