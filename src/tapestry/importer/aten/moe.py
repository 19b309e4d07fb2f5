"""Mixture-of-experts dispatch: grouped matmuls of rows sorted by expert (expert parallelism) or sorted block by
block (grouped_mm_blocks and its weight gradient, grouped_mm_blocks_k), and histc."""
from __future__ import annotations

import math
from typing import Any

from tapestry.graph import Value
from tapestry.importer.translate import Builder, Unsupported, converts
from tapestry.kernels.reductions import HISTC_DTYPES


@converts("aten.histc.default")
def _histc(b: Builder, x: Any, bins: int = 100, min: float = 0, max: float = 0) -> Value:
    """Counts per bin (MoE routers: tokens per expert) over the flattened x: `histc`, whose elements shard as a
    reduction (each device counts its own, the counts sum)."""
    value = b.tensor(x)
    if min == max:
        raise Unsupported("histc's bins depend on the values' min and max over the whole tensor (min = max); "
                          "it runs whole")
    if value.dtype not in HISTC_DTYPES:
        raise Unsupported(f"histc of {value.dtype} (torch bins half precision in its own arithmetic)")
    flat = b.op("reshape", value, shape=(math.prod(value.shape),)) if value.ndim != 1 else value
    return b.op("histc", flat, bins=int(bins), min=float(min), max=float(max))


@converts("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")
def _grouped_mm(b: Builder, x: Any, w: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Value:
    """Rows sorted by expert, `offs` each expert's end row: x[R, D] by w[E, D, F] is `grouped_mm`, whose expert
    dim shards (expert parallelism); a[M, R] by b[R, N] (groups along the contraction: grouped_mm's weight
    gradient, as its backward makes it) is `grouped_mm_k`, whose experts shard likewise."""
    value, weight = b.tensor(x), b.tensor(w)
    if offs is None or bias is not None or out_dtype is not None:
        raise Unsupported("a grouped mm with a bias, an out_dtype or no offsets")
    if (value.ndim, weight.ndim) == (2, 3):
        return b.op("grouped_mm", value, weight, b.tensor(offs))
    if (value.ndim, weight.ndim) == (2, 2):
        return b.op("grouped_mm_k", value, weight, b.tensor(offs))
    raise Unsupported(f"a grouped mm of a {value.ndim}-D by a {weight.ndim}-D operand (2-D by 3-D and 2-D by 2-D, "
                      "with offsets, are taken)")


@converts("transformers.grouped_mm_fallback_backward.default")
def _grouped_mm_backward(b: Builder, x: Any, w: Any, offs: Any, grad: Any) -> tuple[Value, Value]:
    """transformers' fallback grouped mm's backward (non-bfloat16 weights): the input's gradient, a grouped_mm of
    the output's by the experts transposed, and the weights', a grouped_mm_k of x.T by it."""
    value, weight, ends, out = b.tensor(x), b.tensor(w), b.tensor(offs), b.tensor(grad)
    if value.ndim != 2 or weight.ndim != 3:
        raise Unsupported("a grouped mm other than x[R, D] by w[E, D, F]")
    grad_x = b.op("grouped_mm", out, b.op("transpose", weight, perm=(0, 2, 1)), ends)
    return grad_x, b.op("grouped_mm_k", b.op("transpose", value, perm=(1, 0)), out, ends)


@converts("tapestry.grouped_mm_blocks.default")
def _grouped_mm_blocks(b: Builder, x: Any, w: Any, ends: Any) -> Value:
    """Each block of rows through its own grouped mm (importer/block_routing.py's custom op): grouped_mm_blocks."""
    return b.op("grouped_mm_blocks", b.tensor(x), b.tensor(w), b.tensor(ends))


@converts("tapestry.grouped_mm_blocks_k.default")
def _grouped_mm_blocks_k(b: Builder, x: Any, g: Any, ends: Any, experts: int) -> Value:
    """grouped_mm_blocks' weight gradient (its custom op's backward): grouped_mm_blocks_k, whose experts are
    `ends`' columns."""
    counts = b.tensor(ends)
    if counts.ndim != 2 or counts.shape[1] != experts:
        raise Unsupported(f"grouped_mm_blocks_k of {experts} experts with ends of shape {list(counts.shape)}")
    return b.op("grouped_mm_blocks_k", b.tensor(x), b.tensor(g), counts)
