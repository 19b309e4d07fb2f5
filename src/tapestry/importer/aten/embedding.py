"""Embeddings: lookups of table rows, and bags of rows summed or averaged (`embedding_bag`)."""
from __future__ import annotations

from typing import Any

import torch

from tapestry.graph import Value
from tapestry.importer.translate import Builder, Unsupported, converts


@converts("aten.embedding.default")
def _embedding(b: Builder, weight: Any, ids: Any, *rest: Any) -> Value:
    return b.op("embedding", b.tensor(ids), b.tensor(weight))


@converts("aten.embedding_bag.padding_idx", "aten._embedding_bag.default", "aten.embedding_bag.default")
def _embedding_bag(b: Builder, weight: Any, ids: Any, offsets: Any, scale_grad_by_freq: bool = False,
                   mode: int = 0, sparse: bool = False, per_sample_weights: Any = None,
                   include_last_offset: bool = False, padding_idx: int | None = None) -> tuple[Any, ...]:
    """Bags of rows, summed (mode 0) or averaged (mode 1): the rows are an `embedding`, each id's bag is the
    number of offsets at or before its position, less one (`ge`, `sum`), and the bags are a `scatter_add` into
    zeros; a mean divides by the bag sizes (an empty bag gives zeros, as torch). Only the bags are converted
    (the other three outputs serve the backward)."""
    table, index = b.tensor(weight), b.tensor(ids)
    if mode not in (0, 1) or (padding_idx is not None and padding_idx >= 0):
        raise Unsupported(f"mode {mode} (0: sum and 1: mean are taken) or a padding_idx")
    if per_sample_weights is not None and mode != 0:
        raise Unsupported("per_sample_weights with a mean")
    rows = b.op("embedding", index, table)
    if index.ndim == 2:  # [B, L]: fixed-size bags, no offsets
        if per_sample_weights is not None:
            rows = b.op("mul", rows, b.op("reshape", b.tensor(per_sample_weights), shape=(*index.shape, 1)))
        return (b.op("sum" if mode == 0 else "mean", rows, axis=1, keepdim=False), None, None, None)
    starts = b.tensor(offsets)
    if include_last_offset:
        starts = b.op("slice", starts, axis=0, start=0, stop=starts.shape[0] - 1, step=1)
    count, dim = index.shape[0], table.shape[1]
    bags = starts.shape[0]
    positions = b.constant(torch.arange(count, dtype=getattr(torch, starts.dtype)).reshape(count, 1))
    started = b.op("ge", positions, b.op("reshape", starts, shape=(1, bags)))  # [T, B]: bag b began at or before t
    bag = b.op("sub_scalar", b.op("sum", started, axis=1, keepdim=False), value=1.0)  # [T]
    if per_sample_weights is not None:
        rows = b.op("mul", rows, b.op("reshape", b.tensor(per_sample_weights), shape=(count, 1)))
    column = b.op("expand", b.op("reshape", bag, shape=(count, 1)), shape=(count, dim))
    zeros = b.constant(torch.zeros(bags, dim, dtype=getattr(torch, table.dtype)))
    total = b.op("scatter_add", zeros, column, rows, axis=0)
    if mode == 1:
        ones = b.constant(torch.ones(count, 1, dtype=getattr(torch, table.dtype)))
        sizes = b.op("scatter_add", b.constant(torch.zeros(bags, 1, dtype=getattr(torch, table.dtype))),
                     b.op("reshape", bag, shape=(count, 1)), ones, axis=0)
        total = b.op("div", total, b.op("maximum_scalar", sizes, value=1.0))
    return (total, None, None, None)
