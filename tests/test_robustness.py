"""Bad input gives a clear error or the right result (issue 14): bool arithmetic, zero-size dims, malformed files."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import tapestry
from tapestry.kernels import get_kernel


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
