"""Batched matmul a[*batch, m, k] @ b[*batch, k, n] (b may also be 2-D).

k is an index dim, so splitting it gives partial products: matmul is additive in k.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry.kernels.kernel import Kernel, KernelError, Shape, SignatureSpec, follow, numeric
from tapestry.kernels.registry import register


def matmul_signature(a: Shape, b: Shape) -> SignatureSpec:
    if len(a) < 2 or len(b) < 2:
        raise KernelError(f"matmul needs a[*batch, m, k] and b[*batch, k, n]; got a{list(a)}, b{list(b)}")
    batch = a[:-2]
    if len(b) != 2 and b[:-2] != batch:
        raise KernelError(f"b's batch dims {list(b[:-2])} must equal a's {list(batch)} (or b must be 2-D)")
    if b[-2] != a[-1]:
        raise KernelError(f"contraction sizes differ: a{list(a)} has k={a[-1]}, b{list(b)} has k={b[-2]}")
    nb = len(batch)
    n = nb + 3
    m, nn, k = nb, nb + 1, nb + 2
    b_rows = [*range(nb), k, nn] if len(b) > 2 else [k, nn]
    return SignatureSpec(
        dims=(*(f"batch{i}" for i in range(nb)), "m", "n", "k"),
        sizes=(*batch, a[-2], b[-1], a[-1]),
        inputs=(follow(n, [*range(nb), m, k]), follow(n, b_rows)),
        output=follow(n, [*range(nb), m, nn]),
        flops_per_point=2,
    )


def _sample(draw):
    batch = tuple(draw(st.lists(st.integers(1, 4), max_size=1)))
    m, k, n = (draw(st.integers(1, 6)) for _ in range(3))
    b = (*batch, k, n) if draw(st.booleans()) else (k, n)
    return ((*batch, m, k), b), {}


register(
    Kernel(
        name="matmul",
        inputs=("a", "b"),
        signature=matmul_signature,
        numpy=np.matmul,
        torch=torch.matmul,
        sample=_sample,
        additive=frozenset({"k"}),
        dtype_rule=numeric("matmul", ("a", "b")),
        doc="a @ b, batched",
    )
)
