"""Expert parallelism: grouped_mm's rows and experts split together over a mesh axis, rows moved to their
expert's device and back by all-to-all, with the data's exact row counts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tapestry
from tapestry.graph import Graph
from tapestry.plan import Compute, Plan, build_plan
from tapestry.plan.simulate import simulate
from tapestry.plan.validate import plan_problems
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.partition import candidate_partitions, make_partition

ROWS, DIM, OUT, EXPERTS = 12, 3, 5, 4
# Routings (each expert's end row): uneven, empty experts, rows no expert owns, every row to one expert.
ENDS = [[3, 6, 9, 12], [0, 1, 11, 11], [2, 2, 2, 7], [0, 0, 0, 12], [12, 12, 12, 12], [5, 5, 9, 9]]


def moe_graph(rows: int = ROWS) -> Graph:
    g = Graph()
    x, w = g.input("x", (rows, DIM)), g.input("w", (EXPERTS, DIM, OUT))
    ends = g.input("ends", (EXPERTS,), "int64")
    g.output("y", g.op("grouped_mm", x, w, ends, name="mm"))
    return g


def inputs(ends: list[int], rows: int = ROWS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(len(ends) + sum(ends))
    return {"x": rng.standard_normal((rows, DIM)).astype(np.float32),
            "w": rng.standard_normal((EXPERTS, DIM, OUT)).astype(np.float32), "ends": np.array(ends, np.int64)}


def ep_plan(mesh: Mesh, axis: int, others: tuple = (), rows: int = ROWS) -> Plan:
    g = moe_graph(rows)
    sig = g.signature("mm")
    axes = tuple(None if a == axis else (others[a] if a < len(others) else None) for a in range(mesh.ndim))
    return build_plan(g, mesh, partitions={"mm": make_partition(sig, mesh, axes, exchange=(axis,))})


@pytest.mark.parametrize("ends", ENDS)
@pytest.mark.parametrize("mesh, axis, others", [(Mesh(4), 0, ()), (Mesh(2), 0, ()), (Mesh(3), 0, ()),
                                                (Mesh(2, 2), 1, (1,)), (Mesh(2, 2), 0, (None, None)),
                                                (Mesh(2, 2), 1, (0,)), (Mesh(2, 2), 0, (None, 0))])
def test_an_expert_parallel_grouped_mm_equals_the_unsharded_one_for_any_routing(ends, mesh, axis, others):
    plan = ep_plan(mesh, axis, others)
    assert not plan_problems(plan)
    given = inputs(ends)
    want = tapestry.evaluate(plan.graph, given)["y"]
    np.testing.assert_allclose(simulate(plan, given)["y"], want, rtol=1e-5, atol=1e-5)


def test_the_expert_split_takes_rows_and_experts_together_and_its_output_is_whole_rows():
    sig = moe_graph().signature("mm")
    step = Compute.running(sig, make_partition(sig, Mesh(4), (None,), exchange=(0,)))
    assert step.exchange == (0,) and not step.layout.partial
    assert step.layout == Layout.split((ROWS, OUT), Mesh(4), (0,))  # each device its rows, every expert applied
    x, w, ends = step.arg_layouts
    assert x == Layout.split((ROWS, DIM), Mesh(4), (0,)) and w == Layout.split((EXPERTS, DIM, OUT), Mesh(4), (0,))
    assert ends == Layout.replicated((EXPERTS,), Mesh(4))


def test_candidates_include_expert_parallel_on_each_long_enough_axis_and_nothing_partial_with_it():
    sig = moe_graph().signature("mm")
    names = {p.name(sig) for p in candidate_partitions(sig, Mesh(2, 2)) if p.exchange}
    assert names == {"split(ep:row=expert,·)", "split(ep:row=expert,n)", "split(ep:row=expert,row)",
                     "split(·,ep:row=expert)", "split(n,ep:row=expert)", "split(row,ep:row=expert)"}
    assert not [p for p in candidate_partitions(sig, Mesh(8)) if p.exchange]  # 8 > 4 experts


def test_a_plan_keeps_its_exchange_through_json_and_a_forged_one_is_refused():
    plan = ep_plan(Mesh(4), 0)
    again = Plan.from_json(plan.to_json())
    assert [s.exchange for s in again.steps if isinstance(s, Compute)] == [(0,)]
    forged = [s for s in plan.steps if isinstance(s, Compute)][0]
    from dataclasses import replace
    bad = replace(plan, steps=tuple(replace(s, exchange=()) if s is forged else s for s in plan.steps))
    assert any("partial" in p or "partition" in p for p in plan_problems(bad))


# -- take_rows: the dispatch and combine ---------------------------------------------------------------------------
def gather_graph(rows: int = 10, count: int = 12) -> Graph:
    g = Graph()
    x, idx = g.input("x", (rows, DIM)), g.input("idx", (count,), "int64")
    g.output("y", g.op("take_rows", x, idx, rows=rows, name="gather"))
    return g


@pytest.mark.parametrize("idx", [[0, 9, 3, 3, -1, 5, 2, 8, -10, 4, 4, 7], [9] * 12, [1, 0] * 6])
@pytest.mark.parametrize("mesh, axes, exchange", [(Mesh(4), (None,), (0,)), (Mesh(3), (None,), (0,)),
                                                  (Mesh(2, 2), (None, 1), (0,)), (Mesh(4), ("source",), ()),
                                                  (Mesh(2, 2), ("row", "source"), ())])
def test_take_rows_split_by_table_rows_or_exchanged_equals_torch_indexing(idx, mesh, axes, exchange):
    g = gather_graph()
    sig = g.signature("gather")
    choice = tuple(a if a is None or isinstance(a, int) else sig.dims.index(a) for a in axes)
    plan = build_plan(g, mesh, partitions={"gather": make_partition(sig, mesh, choice, exchange=exchange)})
    assert not plan_problems(plan)
    given = {"x": np.arange(10 * DIM, dtype=np.float32).reshape(10, DIM), "idx": np.array(idx, np.int64)}
    want = torch.from_numpy(given["x"])[torch.tensor(idx)].numpy()
    np.testing.assert_array_equal(tapestry.evaluate(g, given)["y"], want)
    np.testing.assert_array_equal(simulate(plan, given)["y"], want)


def test_take_rows_refuses_an_index_outside_the_table():
    given = {"x": np.zeros((10, DIM), np.float32), "idx": np.array([0] * 11 + [10], np.int64)}
    with pytest.raises(IndexError, match="index 10 is out of bounds for a table of 10 rows"):
        tapestry.evaluate(gather_graph(), given)
