"""Views: permute and reshape move no data in a kernel launch, only in a lowering's view.

reshape is affine only on the leading dims it keeps; those are its index dims,
and the rest of the tensor is one block. A reshape that keeps no leading dim
has a 0-dim index space: it runs whole.
"""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from tapestry.kernels.kernel import Kernel, KernelError, Shape, SignatureSpec, follow
from tapestry.kernels.registry import register


def _perm(x: Shape, perm: tuple[int, ...]) -> tuple[int, ...]:
    n = len(x)
    if not perm or n == 0:
        return (*range(n - 2), n - 1, n - 2) if n >= 2 else tuple(range(n))
    if len(perm) != n or sorted(p % n for p in perm) != list(range(n)):
        raise KernelError(f"perm {list(perm)} is not a permutation of the {n} dims of x{list(x)}")
    return tuple(p % n for p in perm)


def transpose_signature(x: Shape, perm: tuple[int, ...]) -> SignatureSpec:
    p = _perm(x, perm)
    n = len(x)
    out = tuple(x[d] for d in p)
    return SignatureSpec(tuple(f"d{j}" for j in range(n)), out, (follow(n, [p.index(r) for r in range(n)]),), follow(n, range(n)), 0)


def reshape_signature(x: Shape, shape: tuple[int, ...]) -> SignatureSpec:
    if math.prod(shape) != math.prod(x) or any(s < 0 for s in shape):
        raise KernelError(f"cannot reshape x{list(x)} ({math.prod(x)} elements) to {list(shape)}")
    keep = next((i for i, (a, b) in enumerate(zip(x, shape)) if a != b), min(len(x), len(shape)))
    return SignatureSpec(
        tuple(f"d{i}" for i in range(keep)),
        x[:keep],
        (follow(keep, [*range(keep), *[None] * (len(x) - keep)], shape=(*(1,) * keep, *x[keep:])),),
        follow(keep, [*range(keep), *[None] * (len(shape) - keep)], shape=(*(1,) * keep, *shape[keep:])),
        0,
    )


def _sample_transpose(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    perm = tuple(draw(st.permutations(range(len(shape))))) if draw(st.booleans()) else ()
    return (shape,), {"perm": perm}


def _sample_reshape(draw):
    lead = tuple(draw(st.lists(st.integers(1, 4), max_size=2)))
    a, b = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return ((*lead, a, b),), {"shape": (*lead, a * b)}


register(
    Kernel(
        name="transpose",
        inputs=("x",),
        signature=transpose_signature,
        numpy=lambda x, perm: np.transpose(x, _perm(x.shape, perm)),
        torch=lambda x, perm: x.permute(*_perm(tuple(x.shape), perm)),
        sample=_sample_transpose,
        params={"perm": ()},
        is_view=True,
        doc="permute dims (default: swap the last two)",
    )
)

register(
    Kernel(
        name="reshape",
        inputs=("x",),
        signature=reshape_signature,
        numpy=lambda x, shape, out_shape: x.reshape(out_shape),
        torch=lambda x, shape, out_shape: x.reshape(out_shape),
        sample=_sample_reshape,
        params={"shape": ()},
        is_view=True,
        needs_out_shape=True,
        doc="reshape to `shape` (same number of elements)",
    )
)
