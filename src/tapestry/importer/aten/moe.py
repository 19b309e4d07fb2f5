"""Mixture-of-experts dispatch: grouped matmuls of rows sorted by expert (expert parallelism), and histc."""
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
    """Rows sorted by expert, `offs` each expert's end row: `grouped_mm`, whose expert dim shards (expert
    parallelism)."""
    value, weight = b.tensor(x), b.tensor(w)
    if offs is None or bias is not None or out_dtype is not None or value.ndim != 2 or weight.ndim != 3:
        raise Unsupported("a grouped mm other than x[R, D] by w[E, D, F] with offsets (no bias, no out_dtype)")
    return b.op("grouped_mm", value, weight, b.tensor(offs))
