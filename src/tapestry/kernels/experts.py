"""grouped_mm(x[R, D], w[E, D, F], ends[E]) -> [R, F]: the rows of each expert by its weight (MoE dispatch).

Rows are sorted by expert: expert e owns rows [ends[e-1], ends[e]) (ends[-1] read as 0), the layout
transformers' `grouped_mm_fallback` and `torch._grouped_mm` take. Which rows an expert owns depends on the
values of `ends`, so the signature makes the expert an index dim that is an additive reduction: a block of
experts computes its experts' rows and leaves the others zero, and blocks over experts sum to the whole. So
experts shard over devices (expert parallelism, with weights split by expert), as do rows, output features and
the contraction. The combine of an expert split is priced as the reduction of a Partial output (an all-reduce
of [R, F]), not as the all-to-all of a token dispatch: sound, and an overestimate of its bytes.
"""
from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry import dtypes
from tapestry.kernels.kernel import Kernel, KernelError, ParamValue, Shape, SignatureSpec, follow, matching
from tapestry.kernels.registry import register


def grouped_mm_signature(x: Shape, w: Shape, ends: Shape) -> SignatureSpec:
    if len(x) != 2 or len(w) != 3 or ends != w[:1] or x[1] != w[1]:
        raise KernelError(f"grouped_mm needs x[R, D], w[E, D, F], ends[E]; got x{list(x)}, w{list(w)}, "
                          f"ends{list(ends)}")
    (rows, inner), (experts, _, out) = x, w
    return SignatureSpec(
        dims=("row", "n", "k", "expert"),
        sizes=(rows, out, inner, experts),
        inputs=(follow(4, [0, 2]), follow(4, [3, 2, 1]), follow(4, [None], shape=(experts,))),
        output=follow(4, [0, 1]),
        flops_per_point=Fraction(2, max(1, experts)),  # each row meets one expert: 2·R·F·D in all
    )


def _spans(ends, block_start: tuple[int, ...], rows: int, experts: int) -> list[tuple[int, int, int]]:
    """(expert in the block, first row, end row) of the block's rows each expert owns, in block coordinates."""
    ends = [int(e) for e in ends]
    row0, expert0 = block_start[0], block_start[3]
    spans = []
    for j in range(experts):
        e = expert0 + j
        lo, hi = (ends[e - 1] if e else 0) - row0, ends[e] - row0
        lo, hi = max(lo, 0), min(hi, rows)
        if hi > lo:
            spans.append((j, lo, hi))
    return spans


def _grouped_mm_numpy(x, w, ends, block_start: tuple[int, ...]) -> np.ndarray:
    out = np.zeros((x.shape[0], w.shape[2]), dtype=np.result_type(x, w))
    for j, lo, hi in _spans(ends.tolist(), block_start, x.shape[0], w.shape[0]):
        out[lo:hi] += x[lo:hi] @ w[j]
    return out


def _grouped_mm_torch(x, w, ends, block_start: tuple[int, ...]):
    out = x.new_zeros((x.shape[0], w.shape[2]))
    for j, lo, hi in _spans(ends.tolist(), block_start, x.shape[0], w.shape[0]):
        out[lo:hi] += x[lo:hi] @ w[j]
    return out


def _rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    if in_dtypes[2] not in ("int32", "int64"):
        raise KernelError(f"grouped_mm: ends must be int32 or int64, got {in_dtypes[2]}")
    if not all(dtypes.is_float(d) for d in in_dtypes[:2]):
        raise KernelError(f"grouped_mm needs float x and w; got {in_dtypes[0]}, {in_dtypes[1]}")
    return matching(("x", "w"))(in_dtypes[:2], params)


def _sample(draw):
    rows, inner, out, experts = (draw(st.integers(1, 5)) for _ in range(4))
    return ((rows, inner), (experts, inner, out), (experts,)), {}, ("float", "float", "int64")


register(
    Kernel(
        name="grouped_mm",
        inputs=("x", "w", "ends"),
        signature=grouped_mm_signature,
        numpy=_grouped_mm_numpy,
        torch=_grouped_mm_torch,
        sample=_sample,
        additive=frozenset({"k", "expert"}),
        needs_block_start=True,
        dtype_rule=_rule,
        index_bound=lambda shapes, slot, params: shapes[0][0] + 1 if slot == 2 else None,
        takes_zero_size=False,
        doc="rows [ends[e-1], ends[e]) of x by w[e], for every expert e (a MoE's expert dispatch)",
    )
)
