"""tapestry.equivalent proves two graphs equal by saturating them together, and proves nothing false."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tapestry
from tapestry.cli import main
from tapestry.egraph.rules import EmptyRulesWarning
from tapestry.graph import Graph, GraphError, save_graph


def linear_relu() -> Graph:
    g = Graph()
    x, w, b = g.input("x", (8, 4)), g.input("w", (4, 6)), g.input("b", (6,))
    g.output("y", g.relu(g.linear(x, w, b)))
    return g


def matmul_add_relu() -> Graph:
    g = Graph()
    x, w, b = g.input("x", (8, 4)), g.input("w", (4, 6)), g.input("b", (6,))
    g.output("y", g.relu(g.add(g.matmul(x, w), b)))
    return g


def reassociated(left: bool) -> Graph:
    g = Graph()
    a, b, c = g.input("a", (4, 5)), g.input("b", (5, 6)), g.input("c", (6, 3))
    g.output("y", g.matmul(g.matmul(a, b), c) if left else g.matmul(a, g.matmul(b, c)))
    return g


def test_a_fusion_and_a_substitution_prove_linear_relu_equal_to_its_parts():
    result = tapestry.equivalent(linear_relu(), matmul_add_relu())
    assert result and result.outputs == {"y": True}
    assert any("fusion.egg" in rule for round_ in result.rules for rule in round_)


def test_matmul_associativity_is_derived():
    assert tapestry.equivalent(reassociated(True), reassociated(False)).proven


def test_different_programs_are_not_proven_equal():
    g = Graph()
    x, w, b = g.input("x", (8, 4)), g.input("w", (4, 6)), g.input("b", (6,))
    g.output("y", g.gelu(g.linear(x, w, b)))  # gelu, not relu
    result = tapestry.equivalent(linear_relu(), g)
    assert not result and result.outputs == {"y": False}


@pytest.mark.filterwarnings("ignore:.*no rules in this file")
def test_without_rules_only_identical_programs_are_proven(tmp_path: Path):
    (tmp_path / "empty.egg").write_text("; no rules\n")
    assert tapestry.equivalent(linear_relu(), linear_relu(), rules=[tmp_path / "empty.egg"]).proven
    assert not tapestry.equivalent(linear_relu(), matmul_add_relu(), rules=[tmp_path / "empty.egg"]).proven


def test_graphs_with_other_inputs_or_outputs_are_refused():
    other = Graph()
    other.output("z", other.relu(other.input("x", (8, 4))))
    with pytest.raises(GraphError, match="inputs differ"):
        tapestry.equivalent(linear_relu(), other)


def test_prove_command_exits_0_when_proven_and_1_when_not(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """In this process (`python -m tapestry.cli` is run by test_runtime): a fresh interpreter cost more than the
    proof."""
    save_graph(linear_relu(), tmp_path / "a.json")
    save_graph(matmul_add_relu(), tmp_path / "b.json")
    assert main(["prove", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["proven"] is True
    empty = tmp_path / "empty.egg"
    empty.write_text("; no rules\n")
    with pytest.warns(EmptyRulesWarning, match="no rules in this file"):
        assert main(["prove", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--rules", str(empty)]) == 1
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["proven"] is False


def _plus_constant(values: list[float], name: str = "c") -> Graph:
    g = Graph()
    g.output("y", g.add(g.input("x", (3,)), g.constant(name, np.array(values, np.float32))))
    return g


def test_constants_are_part_of_what_is_proven():
    assert not tapestry.equivalent(_plus_constant([1, 2, 3]), _plus_constant([100, 200, 300]))
    assert not tapestry.equivalent(_plus_constant([1, 2, 3]), _plus_constant([1, 2, 4]))
    assert tapestry.equivalent(_plus_constant([1, 2, 3]), _plus_constant([1, 2, 3]))


def test_a_constant_is_not_proven_equal_to_a_free_input_of_the_same_name():
    free = Graph()
    free.output("y", free.add(free.input("x", (3,)), free.input("c", (3,))))
    assert not tapestry.equivalent(_plus_constant([1, 2, 3]), free)
