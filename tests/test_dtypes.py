"""Dtypes follow torch: names, promotion, numpy and torch forms; half-precision plans run on ranks."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import tapestry
from tapestry import dtypes
from tapestry.graph import Graph, GraphError
from tapestry.plan import build_plan
from tapestry.runtime import run_plans
from tapestry.sharding import Mesh


@pytest.mark.parametrize("a, b", list(itertools.product(dtypes.DTYPES, repeat=2)))
def test_promotion_is_torchs(a, b):
    assert dtypes.promote(a, b) == str(torch.promote_types(getattr(torch, a), getattr(torch, b))).removeprefix("torch.")


@pytest.mark.parametrize("name", dtypes.DTYPES)
def test_numpy_and_torch_forms_round_trip(name, tmp_path):
    array = dtypes.cast(np.arange(6).reshape(2, 3) % 2, name)
    assert dtypes.name_of(array) == name
    back = dtypes.from_tensor(dtypes.to_tensor(array))
    np.testing.assert_array_equal(back.astype(np.float64), array.astype(np.float64))
    np.save(tmp_path / "a.npy", array)  # bfloat16 saves as raw 2-byte records
    np.testing.assert_array_equal(dtypes.cast(np.load(tmp_path / "a.npy"), name).astype(np.float64),
                                  array.astype(np.float64))


def test_unknown_dtype_and_mixed_matmul_are_graph_errors():
    g = Graph()
    with pytest.raises(GraphError, match="dtype 'float8' is not one of"):
        g.input("x", (2, 2), "float8")
    a, b = g.input("a", (2, 3), "float16"), g.input("b", (3, 4), "float32")
    with pytest.raises(GraphError, match=r"a: float16, b: float32"):
        g.matmul(a, b)


def test_a_bfloat16_linear_moves_half_the_bytes_of_its_float32_twin():
    def cost(dtype: str) -> tuple[float, float]:
        g = Graph()
        y = g.linear(g.input("x", (8, 16), dtype), g.input("w", (16, 4), dtype), g.input("b", (4,), dtype))
        sig = g.signature(y.name)
        return sig.cost(sig.index)

    (flops, nbytes), (half_flops, half_bytes) = cost("float32"), cost("bfloat16")
    assert (half_flops, half_bytes) == (flops, nbytes / 2)


def half_plans() -> list:
    """Column-split linear then a gather: a reshard moves half-precision blocks between ranks."""
    plans = []
    for dtype in ("bfloat16", "float16"):
        g = Graph()
        x, w, b = g.input("x", (8, 16), dtype), g.input("w", (16, 6), dtype), g.input("b", (6,), dtype)
        y = g.linear(x, w, b, name="fc")
        g.output("y", g.softmax(y, axis=-1, name="soft"))
        plans.append(build_plan(g, Mesh(2), {"fc": (1,), "soft": (0,)}))
    return plans


def test_half_precision_plans_run_on_two_ranks():
    plans = half_plans()
    for plan, run in zip(plans, run_plans(plans, nproc=2, compile=False, timeout=120)):
        want = tapestry.evaluate(plan.graph, tapestry.random_inputs(plan.graph))["y"]
        got = run.outputs["y"]
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=1e-2)
