"""Scaled dot-product attention as one kernel: softmax(q·kᵀ·scale + mask)·v.

q[*B, L, E], k[*B, S, E], v[*B, S, Ev] -> [*B, L, Ev]. The index dims are the batch dims, the queries L
and v's features Ev: all parallel. A batch dim of k and v may be 1 where q's is not: grouped-query attention
imports q as [B, Hkv, G, L, E] and k, v as [B, Hkv, 1, S, E], so query head h = G·kv + g reads kv head kv
= h // G, and both the kv heads and the group split. Every block reads its keys S and q's features E whole, since the
softmax over keys is not additive. A causal mask (torch's top-left: query i sees keys j <= i) needs each
query's absolute position, which a block alone does not give: the impls take the block's start
(`needs_block_start`). A query that sees no key (a mask row all false or all -inf) gives zeros, as
torch's math backend does.

The keys may also split, over the same mesh axes as the queries (ring attention, kernels.ring): each device
computes its queries against one key block at a time (`SDPA_RING`: the block's output and log-sum-exp; a causal
block compares absolute query and key positions), and the blocks merge by log-sum-exp.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry import dtypes
from tapestry.kernels.kernel import Kernel, KernelError, ParamValue, Shape, SignatureSpec, follow, matching
from tapestry.kernels.registry import register
from tapestry.kernels.ring import Ring
from tapestry.zspace import IndexProjection


def _mask_projection(mask: Shape, full: Shape, index_ndim: int | None = None, rows_whole: bool = False
                     ) -> IndexProjection:
    """mask, broadcast to [*B, L, S]: its batch and query dims follow the index dims (or read one cell where
    they are 1), its key dim is read whole. `index_ndim`: the kernel's index dims (default: batch, query and
    feature); `rows_whole`: the queries are not an index dim, so the mask's rows are read whole too."""
    try:
        fits = tuple(np.broadcast_shapes(mask, full)) == full
    except ValueError:
        fits = False
    if not fits:
        raise KernelError(f"mask{list(mask)} does not broadcast to [*B, L, S] = {list(full)}")
    keys = len(full) - 1
    whole = range(keys - 1 if rows_whole else keys, keys + 1)
    lead = len(full) - len(mask)
    rows = [None if t in whole or (size == 1 and full[t] != 1) else t for t, size in enumerate(mask, start=lead)]
    return follow(keys + 1 if index_ndim is None else index_ndim, rows,
                  shape=[size if t in whole else 1 for t, size in enumerate(mask, start=lead)])


def _broadcasts(kv: Shape, q: Shape) -> bool:
    """kv's batch dims are q's, or 1 (one key/value head shared by a group of query heads)."""
    return all(b in (1, a) for a, b in zip(q[:-2], kv[:-2]))


def _batch_rows(kv: Shape, q: Shape) -> list[int | None]:
    """kv's batch dims follow q's, or read their one cell where broadcast."""
    return [None if b == 1 and a != 1 else i for i, (a, b) in enumerate(zip(q[:-2], kv[:-2]))]


def sdpa_signature(q: Shape, k: Shape, v: Shape, mask: Shape | None = None, **params: ParamValue) -> SignatureSpec:
    if len(q) < 2 or len(k) != len(q) or len(v) != len(q) or not (_broadcasts(k, q) and _broadcasts(v, q)):
        raise KernelError(f"sdpa needs q[*B, L, E], k[*B, S, E], v[*B, S, Ev] (k's and v's batch dims q's or 1); "
                          f"got q{list(q)}, k{list(k)}, v{list(v)}")
    if k[-1] != q[-1] or v[-2] != k[-2]:
        got = f"q{list(q)}, k{list(k)}, v{list(v)}"
        raise KernelError(f"sdpa: k must have q's E={q[-1]} and v k's S={k[-2]}; got {got}")
    batch, (length, features), (keys, out) = q[:-2], q[-2:], v[-2:]
    nb = len(batch)
    n = nb + 2
    ones = (1,) * nb
    inputs = [
        follow(n, [*range(nb), nb, None], shape=(*ones, 1, features)),
        follow(n, [*_batch_rows(k, q), None, None], shape=(*ones, keys, features)),
        follow(n, [*_batch_rows(v, q), None, nb + 1], shape=(*ones, keys, 1)),
    ]
    if mask is not None:
        inputs.append(_mask_projection(mask, (*batch, length, keys)))
    return SignatureSpec(
        dims=(*(f"batch{i}" for i in range(nb)), "query", "feature"),
        sizes=(*batch, length, out),
        inputs=tuple(inputs),
        output=follow(n, range(n)),
        # scores and softmax are per query row, shared by its Ev points; each point then sums S products
        flops_per_point=2 * keys + math.ceil((2 * features + 5) * keys / max(out, 1)),
    )


def _attention_lse(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, scale: float
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse): the attention over these keys and each row's log-sum-exp (-inf where it sees none)."""
    scores = q @ np.swapaxes(k, -1, -2) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    top = scores.max(axis=-1, keepdims=True, initial=-np.inf)  # no keys (an empty key block): no weight
    safe = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(scores - safe)
    total = e.sum(axis=-1, keepdims=True)
    out = np.divide(e, total, out=np.zeros_like(e), where=total > 0) @ v
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.log(np.where(total > 0, total, 1.0)) + safe, -np.inf)[..., 0]
    return out, lse


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, scale: float) -> np.ndarray:
    return _attention_lse(q, k, v, mask, scale)[0]


def _wide(t: Any) -> Any:
    return t.float() if t.is_floating_point() and t.element_size() < 4 else t


def _attention_lse_torch(q: Any, k: Any, v: Any, mask: Any, scale: float) -> tuple[Any, Any]:
    """`_attention_lse` in torch; half-precision inputs in float32 (the merge of many blocks accumulates there)."""
    q, k, v = (_wide(t) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask.to(scores.dtype)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]) @ v, lse


def _causal(queries: int, keys: int, start: int, key_start: int = 0) -> np.ndarray:
    return (start + np.arange(queries))[:, None] >= (key_start + np.arange(keys))[None, :]


def _sdpa_numpy(q, k, v, causal: bool, scale: float, block_start: tuple[int, ...]) -> np.ndarray:
    return _attention(q, k, v, _causal(q.shape[-2], k.shape[-2], block_start[-2]) if causal else None, scale)


def _sdpa(q, k, v, mask, scale: float) -> Any:
    """torch's attention; the mask is given q's rank (torch's fused CPU path rejects a 1-D mask on 4-D q)."""
    if mask is not None:
        mask = mask[(None,) * (q.dim() - mask.dim())]
    k, v = k.expand(*q.shape[:-2], *k.shape[-2:]), v.expand(*q.shape[:-2], *v.shape[-2:])  # shared kv heads
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale or None)


def _causal_torch(q: Any, keys: int, start: int, key_start: int = 0) -> Any:
    rows = torch.arange(q.shape[-2], device=q.device) + start
    return rows[:, None] >= torch.arange(key_start, key_start + keys, device=q.device)[None, :]


def _sdpa_torch(q, k, v, causal: bool, scale: float, block_start: tuple[int, ...]) -> Any:
    return _sdpa(q, k, v, _causal_torch(q, k.shape[-2], block_start[-2]) if causal else None, scale)


# -- ring attention: one key block's (out, lse); kernels.ring merges them ------------------------------------------
def _ring_sdpa_numpy(q, k, v, causal: bool, scale: float, block_start: tuple[int, ...], key_start: int):
    mask = _causal(q.shape[-2], k.shape[-2], block_start[-2], key_start) if causal else None
    return _attention_lse(q, k, v, mask, scale)


def _ring_sdpa_torch(q, k, v, causal: bool, scale: float, block_start: tuple[int, ...], key_start: int):
    """A causal block wholly after the queries is skipped: it adds nothing (lse -inf), and costs nothing."""
    if causal and key_start > block_start[-2] + q.shape[-2] - 1:
        shape = (*torch.broadcast_shapes(q.shape[:-2], v.shape[:-2]), q.shape[-2])
        wide = _wide(q).dtype
        return q.new_zeros((*shape, v.shape[-1]), dtype=wide), q.new_full(shape, -torch.inf, dtype=wide)
    mask = _causal_torch(q, k.shape[-2], block_start[-2], key_start) if causal else None
    return _attention_lse_torch(q, k, v, mask, scale)


def _sdpa_keyed(shapes: tuple[Shape, ...]) -> tuple[int | None, ...]:
    """k's and v's key dims; a mask's last dim where it is not broadcast over the keys."""
    q, k, v, *mask = shapes
    return (None, len(k) - 2, len(v) - 2, *(len(m) - 1 if m[-1] != 1 else None for m in mask))


SDPA_RING = Ring("query", _sdpa_keyed, _ring_sdpa_numpy, _ring_sdpa_torch)
SDPA_MASKED_RING = Ring(
    "query", _sdpa_keyed,
    lambda q, k, v, mask, scale, key_start: _attention_lse(q, k, v, mask, scale),
    lambda q, k, v, mask, scale, key_start: _attention_lse_torch(q, k, v, mask, scale),
)


def causal_share(queries: tuple[int, int], keys: int) -> float:
    """The share of query-key pairs a causal mask keeps for queries [start, end) against `keys` keys (query i sees
    keys j <= i): what a causal block computes, and so what it costs."""
    start, end = queries
    if end <= start or keys <= 0:
        return 0.0
    seen = min(end, keys)
    kept = max(0, seen * (seen + 1) // 2 - start * (start + 1) // 2) if start < seen else 0
    kept += (end - max(start, seen)) * keys
    return kept / ((end - start) * keys)


def _sdpa_work(sig: Any, block: Any) -> float:
    if not dict(sig.params).get("causal"):
        return 1.0
    query = sig.dims.index("query")
    return causal_share((block.start[query], block.end[query]), sig.input_shapes[1][-2])


def _attention_rule(inputs: tuple[str, ...]):
    """q, k and v share one float dtype (a float mask too, as torch requires); a mask may also be bool."""
    agree = matching(inputs)

    def rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
        for slot, d in zip(inputs, in_dtypes):
            if not (dtypes.is_float(d) or (slot == "mask" and d == "bool")):
                kind = "bool or float" if slot == "mask" else "float"
                raise KernelError(f"{slot} must be {kind}, got {d}")
        return agree(in_dtypes, params)

    return rule


def _sample_qkv(draw) -> tuple[Shape, Shape, Shape]:
    """Some batch dims of k and v may be 1 (grouped-query attention: kv heads shared by a group of q heads)."""
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    length, keys, features, out = (draw(st.integers(1, 6)) for _ in range(4))
    shared = tuple(1 if draw(st.booleans()) else s for s in batch)
    return (*batch, length, features), (*shared, keys, features), (*shared, keys, out)


def _sample_sdpa(draw):
    return _sample_qkv(draw), {"causal": draw(st.booleans()), "scale": draw(st.sampled_from([0.0, 0.5]))}


def _sample_sdpa_masked(draw):
    q, k, v = _sample_qkv(draw)
    full = (*q[:-1], k[-2])
    keep = draw(st.integers(1, len(full)))
    mask = tuple(s if draw(st.booleans()) else 1 for s in full[len(full) - keep :])
    kind = draw(st.sampled_from(["bool", "float"]))
    return (q, k, v, mask), {"scale": draw(st.sampled_from([0.0, 0.5]))}, ("float", "float", "float", kind)


register(
    Kernel(
        name="sdpa",
        inputs=("q", "k", "v"),
        signature=sdpa_signature,
        numpy=_sdpa_numpy,
        torch=_sdpa_torch,
        sample=_sample_sdpa,
        params={"causal": False, "scale": 0.0},
        needs_block_start=True,
        ring=SDPA_RING,
        work=_sdpa_work,
        dtype_rule=_attention_rule(("q", "k", "v")),
        doc="softmax(q·kᵀ·scale)·v; causal: query i sees keys j <= i; scale 0 means 1/√E",
    )
)

register(
    Kernel(
        name="sdpa_masked",
        inputs=("q", "k", "v", "mask"),
        signature=sdpa_signature,
        numpy=lambda q, k, v, mask, scale: _attention(q, k, v, mask, scale),
        torch=_sdpa,
        sample=_sample_sdpa_masked,
        params={"scale": 0.0},
        ring=SDPA_MASKED_RING,
        dtype_rule=_attention_rule(("q", "k", "v", "mask")),
        doc="softmax(q·kᵀ·scale + mask)·v; a bool mask is True where a query may attend, a float one is added",
    )
)
