"""linear(x, w, b) = x @ w + b, and its fusions with an activation.

The contraction dim `in` is not an index dim: every block reads whole rows of x
and whole columns of w. Splitting `in` needs the substitution
linear -> add(matmul(x, w), b), since the bias must be added once, not per shard.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry.kernels.elementwise import _gelu
from tapestry.kernels.kernel import Kernel, KernelError, Shape, SignatureSpec, follow, numeric
from tapestry.kernels.registry import register


def linear_signature(x: Shape, w: Shape, b: Shape) -> SignatureSpec:
    if len(x) < 1 or len(w) != 2 or len(b) != 1:
        raise KernelError(f"expected x[*batch, in], w[in, out], b[out]; got x{list(x)}, w{list(w)}, b{list(b)}")
    batch, n_in = x[:-1], x[-1]
    if w[0] != n_in:
        raise KernelError(f"w's first dim must equal x's last dim {n_in}: got w{list(w)}")
    if b[0] != w[1]:
        raise KernelError(f"b must have w's out size {w[1]}: got b{list(b)}")
    n = len(batch) + 1
    out_dim = n - 1
    return SignatureSpec(
        dims=(*(f"batch{i}" for i in range(len(batch))), "out"),
        sizes=(*batch, w[1]),
        inputs=(
            follow(n, [*range(len(batch)), None], shape=(*(1,) * len(batch), n_in)),
            follow(n, [None, out_dim], shape=(n_in, 1)),
            follow(n, [out_dim]),
        ),
        output=follow(n, range(n)),
        flops_per_point=2 * n_in,
    )


def _sample(draw):
    batch = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=2)))
    n_in, n_out = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    return ((*batch, n_in), (n_in, n_out), (n_out,)), {}


def _linear(name: str, np_act, torch_act, doc: str) -> Kernel:
    return register(
        Kernel(
            name=name,
            inputs=("x", "w", "b"),
            signature=linear_signature,
            numpy=lambda x, w, b: np_act(x @ w + b),
            torch=lambda x, w, b: torch_act(torch.addmm(b, x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])),
            sample=_sample,
            dtype_rule=numeric(name, ("x", "w", "b"), floats_only=name == "linear_gelu"),
            doc=doc,
        )
    )


linear = _linear("linear", lambda y: y, lambda y: y, "x @ w + b")
linear_relu = _linear("linear_relu", lambda y: np.maximum(y, 0), torch.relu, "relu(x @ w + b), fused")
linear_gelu = _linear("linear_gelu", _gelu, torch.nn.functional.gelu, "gelu(x @ w + b), fused")
