"""Scaled dot-product attention, with grouped and multi-query heads."""
from __future__ import annotations

from typing import Any

from tapestry.graph import Value
from tapestry.importer.translate import Builder, Unsupported, converts


@converts("aten.scaled_dot_product_attention.default")
def _sdpa(b: Builder, q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Value:
    qv, kv, vv = b.tensor(q), b.tensor(k), b.tensor(v)
    if dropout_p:
        raise Unsupported("attention dropout")
    if is_causal and attn_mask is not None:
        raise Unsupported("a mask together with is_causal")
    mask = b.tensor(attn_mask) if attn_mask is not None else None
    grouped = qv.ndim >= 3 and kv.ndim == qv.ndim and qv.shape[-3] != kv.shape[-3]
    if grouped:  # enable_gqa: query head h reads kv head h // G
        qv, kv, vv, mask = _grouped(b, qv, kv, vv, mask)
    elif qv.shape[:-2] != kv.shape[:-2]:
        raise Unsupported(f"q{list(qv.shape)} and k{list(kv.shape)} differ in batch dims")
    scale = 0.0 if scale is None else float(scale)
    if mask is None:
        out = b.op("sdpa", qv, kv, vv, causal=bool(is_causal), scale=scale)
    else:
        out = b.op("sdpa_masked", qv, kv, vv, mask, scale=scale)
    return b.op("reshape", out, shape=b.shape) if grouped else out


def _grouped(b: Builder, q: Value, k: Value, v: Value, mask: Value | None) -> tuple[Any, ...]:
    """Grouped-query attention as sdpa with shared kv heads: the head dim of q (H = Hkv·G) split into [Hkv, G],
    k's and v's into [Hkv, 1] (broadcast over the group), a mask's into [Hkv, G] or [1, 1]. Both Hkv and G are
    then index dims of sdpa, so heads shard consistently: q head h = G·kv + g and its kv head h // G together."""
    heads, shared = q.shape[-3], k.shape[-3]
    if shared == 0 or heads % shared or v.shape[-3] != shared:
        raise Unsupported(f"{heads} query heads over {shared} key and {v.shape[-3]} value heads")
    group = heads // shared

    def split(x: Value, into: tuple[int, int]) -> Value:
        return b.op("reshape", x, shape=(*x.shape[:-3], *into, *x.shape[-2:]))

    if mask is not None:
        mask = mask if mask.ndim >= 3 else b.op("reshape", mask, shape=(*(1,) * (3 - mask.ndim), *mask.shape))
        mask = split(mask, (shared, group) if mask.shape[-3] == heads else (1, 1))
    return split(q, (shared, group)), split(k, (shared, 1)), split(v, (shared, 1)), mask
