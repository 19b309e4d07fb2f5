"""Views: permute and reshape move no data in a kernel launch, only in a lowering's view.

reshape keeps one index dim per group of dims that merge or split (see
reshape_signature), so a split of the hidden dim into heads, or a merge of
batch and sequence, shards like the dims around it.
"""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from tapestry.kernels.kernel import Kernel, KernelError, Params, Shape, SignatureSpec, follow
from tapestry.kernels.registry import register


def _perm(x: Shape, perm: tuple[int, ...]) -> tuple[int, ...]:
    n = len(x)
    if not perm or n == 0:
        return (*range(n - 2), n - 1, n - 2) if n >= 2 else tuple(range(n))
    if len(perm) != n or sorted(p % n for p in perm) != list(range(n)):
        raise KernelError(f"perm {list(perm)} is not a permutation of the {n} dims of x{list(x)}")
    return tuple(p % n for p in perm)


def _canonical_transpose(shapes: tuple[Shape, ...], params: Params) -> Params:
    """A perm that spells out the default (swap the last two dims) is the default, (); any other, with dims
    counted from 0: the rules (Transpose x "") match every spelling of one transpose."""
    (x,), perm = shapes, dict(params)["perm"]
    return (("perm", () if _perm(x, perm) == _perm(x, ()) else _perm(x, perm)),)


def transpose_signature(x: Shape, perm: tuple[int, ...]) -> SignatureSpec:
    p = _perm(x, perm)
    n = len(x)
    out = tuple(x[d] for d in p)
    return SignatureSpec(tuple(f"d{j}" for j in range(n)), out, (follow(n, [p.index(r) for r in range(n)]),), follow(n, range(n)), 0)


def reshape_groups(x: Shape, shape: Shape) -> list[tuple[list[int], list[int]]]:
    """Pair x's dims with the target's in the smallest runs of equal element count (row-major)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(x) or j < len(shape):
        ins, outs, pa, pb = [], [], 1, 1
        if i < len(x):
            ins.append(i), (pa := pa * x[i])
            i += 1
        if j < len(shape):
            outs.append(j), (pb := pb * shape[j])
            j += 1
        while pa != pb:
            if pa < pb:
                ins.append(i), (pa := pa * x[i])
                i += 1
            else:
                outs.append(j), (pb := pb * shape[j])
                j += 1
        groups.append((ins, outs))
    return groups


def reshape_signature(x: Shape, shape: tuple[int, ...]) -> SignatureSpec:
    """One index dim per group of dims that merge or split: its k equal, contiguous chunks, where k is the gcd
    of the group's leading (non-1) sizes on both sides. A chunk is a row-range of each side's leading dim with
    the inner dims whole, so [B,S,D] -> [B,S,H,Dh] keeps B, S and H (a split of D into H blocks) and
    [B,S,D] -> [B*S,D] keeps B and D."""
    if math.prod(shape) != math.prod(x) or any(s < 0 for s in shape):
        raise KernelError(f"cannot reshape x{list(x)} ({math.prod(x)} elements) to {list(shape)}")
    if math.prod(x) == 0:
        return SignatureSpec((), (), (follow(0, [None] * len(x), shape=x),), follow(0, [None] * len(shape), shape=shape), 0)
    sizes: list[int] = []
    sides = {"in": (x, [None] * len(x), list(x), [1] * len(x)), "out": (shape, [None] * len(shape), list(shape), [1] * len(shape))}
    for ins, outs in reshape_groups(x, shape):
        leads = {side: next((d for d in dims if sides[side][0][d] > 1), None) for side, dims in (("in", ins), ("out", outs))}
        if leads["in"] is None or leads["out"] is None:
            continue
        k = math.gcd(x[leads["in"]], shape[leads["out"]])
        if k == 1:
            continue
        for side, lead in leads.items():
            dims, rows, block, scale = sides[side]
            rows[lead], block[lead], scale[lead] = len(sizes), dims[lead] // k, dims[lead] // k
        sizes.append(k)
    n = len(sizes)
    projection = {side: follow(n, rows, shape=block, scale=scale) for side, (_, rows, block, scale) in sides.items()}
    return SignatureSpec(tuple(f"d{i}" for i in range(n)), tuple(sizes), (projection["in"],), projection["out"], 0)


def _sample_transpose(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    perm = tuple(draw(st.permutations(range(len(shape))))) if draw(st.booleans()) else ()
    return (shape,), {"perm": perm}


def _sample_reshape(draw):
    """Random merges, splits and regroupings of random factors (size-1 dims included)."""
    factors = draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=5))

    def grouping() -> tuple[int, ...]:
        cuts = sorted(draw(st.sets(st.integers(1, len(factors) - 1), max_size=len(factors) - 1))) if len(factors) > 1 else []
        bounds = [0, *cuts, len(factors)]
        return tuple(math.prod(factors[lo:hi]) for lo, hi in zip(bounds, bounds[1:]))

    return (grouping(),), {"shape": grouping()}


register(
    Kernel(
        name="transpose",
        inputs=("x",),
        signature=transpose_signature,
        numpy=lambda x, perm: np.transpose(x, _perm(x.shape, perm)),
        torch=lambda x, perm: x.permute(*_perm(tuple(x.shape), perm)),
        sample=_sample_transpose,
        params={"perm": ()},
        canonical=_canonical_transpose,
        is_view=True,
        always_view=True,
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
