"""Scaled dot-product attention, with grouped and multi-query heads; in training, torch's fused CPU kernels (the
forward with its log-sum-exp, and the backward) as the packed flash kernels of kernels/flash.py."""
from __future__ import annotations

from typing import Any

from tapestry import dtypes
from tapestry.graph import Value
from tapestry.importer.translate import Builder, Unsupported, converts
from tapestry.kernels.flash import by_rows, unpacked


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


@converts("aten._scaled_dot_product_flash_attention_for_cpu.default")
def _flash(b: Builder, q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False,
           attn_mask: Any = None, scale: float | None = None) -> tuple[Value, Value]:
    """(out, lse): one `flash_attention` kernel, its packed [out | lse] rows taken apart by views."""
    qv, kv, vv, mask, params = _fused_operands(b, q, k, v, dropout_p, is_causal, attn_mask, scale)
    grouped, (full, wide) = qv.shape[-3] != kv.shape[-3], b.node.meta["val"]
    if grouped:
        qv, kv, vv, mask = _grouped(b, qv, kv, vv, mask)
    name = "flash_attention" if mask is None else "flash_attention_masked"
    packed = b.op(name, qv, kv, vv, *([] if mask is None else [mask]), **params)
    features, last = qv.shape[-1], packed.ndim - 1
    out = b.op("slice", packed, axis=last, start=0, stop=features, step=1)
    lse = b.op("slice", packed, axis=last, start=features, stop=features + 1, step=1)
    return (_as(b, out, tuple(full.shape), full.dtype), _as(b, lse, tuple(wide.shape), wide.dtype))


@converts("aten._scaled_dot_product_flash_attention_for_cpu_backward.default")
def _flash_backward(b: Builder, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dropout_p: float,
                    is_causal: bool, attn_mask: Any = None, scale: float | None = None) -> tuple[Value, ...]:
    """(dq, dk, dv): one `flash_attention_backward` kernel, its packed [dq | dk | dv] rows (or points, where L != S)
    taken apart by views; with grouped heads each query head's dk and dv share, summed over its group."""
    qv, kv, vv, mask, params = _fused_operands(b, q, k, v, dropout_p, is_causal, attn_mask, scale)
    dv_, ov, lv = b.tensor(dout), b.tensor(out), b.tensor(lse)
    grouped, shapes = qv.shape[-3] != kv.shape[-3], tuple(b.node.meta["val"])
    if grouped:
        split = (kv.shape[-3], qv.shape[-3] // kv.shape[-3])
        dv_, ov = (b.op("reshape", t, shape=(*t.shape[:-3], *split, *t.shape[-2:])) for t in (dv_, ov))
        lv = b.op("reshape", lv, shape=(*lv.shape[:-2], *split, lv.shape[-1]))
        qv, kv, vv, mask = _grouped(b, qv, kv, vv, mask)
    name = "flash_attention_backward" if mask is None else "flash_attention_masked_backward"
    packed = b.op(name, dv_, qv, kv, vv, ov, lv, *([] if mask is None else [mask]), **params)
    grads, last = [], packed.ndim - 1
    group = last - (2 if by_rows(qv.shape, kv.shape) else 1)  # the query heads' group dim in the packed output
    for (start, stop), torch_value in zip(unpacked(qv.shape, kv.shape), shapes):
        piece = b.op("slice", packed, axis=last, start=start, stop=stop, step=1)
        if grouped and len(grads):  # a query head's share of its kv head's gradient: summed over the group
            piece = b.op("sum", piece, axis=group, keepdim=False)
        grads.append(_as(b, piece, tuple(torch_value.shape), torch_value.dtype))
    return tuple(grads)


def _fused_operands(b: Builder, q: Any, k: Any, v: Any, dropout_p: float, is_causal: bool, attn_mask: Any,
                    scale: float | None) -> tuple[Any, ...]:
    if dropout_p:  # torch's CPU kernel draws inside itself; training captures pick the math path for dropout
        raise Unsupported("fused attention with dropout")
    if is_causal and attn_mask is not None:
        raise Unsupported("a mask together with is_causal")
    qv, kv, vv = b.tensor(q), b.tensor(k), b.tensor(v)
    if qv.shape[:-3] != kv.shape[:-3]:
        raise Unsupported(f"q{list(qv.shape)} and k{list(kv.shape)} differ in batch dims")
    mask = b.tensor(attn_mask) if attn_mask is not None else None
    params = {"scale": 0.0 if scale is None else float(scale)}
    return qv, kv, vv, mask, params if mask is not None else {**params, "causal": bool(is_causal)}


def _as(b: Builder, value: Value, shape: tuple[int, ...], dtype: Any) -> Value:
    """A packed piece in torch's shape (a view) and dtype (a cast where the pack is wider)."""
    value = b.op("reshape", value, shape=shape) if value.shape != shape else value
    name = dtypes.name_of(dtype)
    return b.op("cast", value, dtype=name) if value.dtype != name else value
