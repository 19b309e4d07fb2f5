"""Attention in training as flash kernels run it: the forward's output with its log-sum-exp, and the backward's
three gradients, each one kernel, with no [L, S] intermediate in memory or in the price.

The graph's ops have one output each; torch's fused ops have two (out, lse) and three (dq, dk, dv). Each fused op
is one kernel whose output packs its results along the last dim, and the importer takes each result out as a view
(slice, reshape: they move no data and cost nothing):

- `flash_attention` q[*B, L, E], k[*B, S, E], v[*B, S, E] -> [*B, L, E + 1]: per query row its output and, in the
  last column, its log-sum-exp (lse, what the backward needs to rebuild the softmax). The output is in the
  compute dtype (float32 for half-precision inputs: lse must not round to bfloat16; the importer casts the output
  columns back, exactly). Index dims: the batch dims and the queries, all parallel.
- `flash_attention_backward` dout, q, k, v, out, lse -> [*B, L, 3·E] for self-attention (L = S, `by_rows`): row
  i packs [dq_i | dk_i | dv_i], query i's gradient beside key i's. Index dims: the batch dims and the rows, which
  split only in a ring (`Kernel.ring_only`; kernels.ring, `Ring.gradients`: a row block's dk and dv need every
  query; a plan splitting them otherwise is refused). Where L != S: [*B, L·E + S·E + S·E], per batch point dq,
  dk and dv flattened, index dims the batch dims only (`unpacked` says where each lies). With grouped-query
  attention (k's and v's batch dims 1 where q's are not) dk and dv are each query head's share; the importer sums
  the group.
- `flash_attention_masked`, `flash_attention_masked_backward`: the same with an additive float (or bool) mask
  broadcastable to [*B, L, S] as the last input.

Why packed rather than one kernel per result: separate kernels would each compute (and be priced for) the whole
attention, and fusing them back would need a multi-output step in lowering and in every runtime; one kernel per
fused op keeps the plan, its price and its lowering one call. What they cost: the forward 2·S·(E + Ev) + 5·S
FLOPs per query row, the backward L·S·(6·E + 4·Ev + 4) per batch point (S·(...) per row, by rows; recomputing
the scores, then dV, dP, dS, dQ and dK: about 2.5x the forward), both scaled by the causal share of kept
query-key pairs (`Kernel.work`), and bytes only of their inputs and outputs: a flash kernel keeps scores in
on-chip tiles.

On the CPU the impls call torch's fused kernels (`aten._scaled_dot_product_flash_attention_for_cpu` and its
backward); elsewhere they run the same arithmetic in torch's own ops (`forward_math`, `backward_math`: correct, with
the scores materialized; torch's CUDA flash kernels take other arguments, not wired here).
A row that sees no key gives zeros and lse 0, as torch's CPU kernel does. Torch's flash kernels need E = Ev.

Both have rings (context parallelism, kernels.ring): the forward keeps its merged lse (`Ring.with_lse`); the
backward, from the forward's lse, sums dq at the queries and sends dk and dv round with their keys back to the key
block's owner (`Ring.gradients`). In the runtime the lse view keeps the whole packed forward output (float32)
alive until the backward.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry import dtypes
from tapestry.kernels.attention import (
    _attention_lse, _attention_lse_torch, _batch_rows, _broadcasts, _causal, _causal_torch, _mask_projection,
    _ring_sdpa_numpy, _ring_sdpa_torch, _sdpa_keyed, _wide, causal_share,
)
from tapestry.kernels.kernel import Kernel, KernelError, ParamValue, Shape, SignatureSpec, follow
from tapestry.kernels.registry import register
from tapestry.kernels.ring import Ring

_ATEN = torch.ops.aten


def _check(q: Shape, k: Shape, v: Shape) -> tuple[Shape, int, int, int]:
    if len(q) < 3 or len(k) != len(q) or len(v) != len(q) or not (_broadcasts(k, q) and _broadcasts(v, q)):
        raise KernelError(f"flash attention needs q[*B, L, E], k[*B, S, E], v[*B, S, E] with at least one batch "
                          f"dim (k's and v's batch dims q's or 1); got q{list(q)}, k{list(k)}, v{list(v)}")
    if k[-1] != q[-1] or v[-1] != q[-1] or v[-2] != k[-2]:
        raise KernelError(f"flash attention: k and v must have q's E={q[-1]} and v k's S={k[-2]}; "
                          f"got q{list(q)}, k{list(k)}, v{list(v)}")
    return q[:-2], q[-2], k[-2], q[-1]


def forward_signature(q: Shape, k: Shape, v: Shape, mask: Shape | None = None, **params: ParamValue
                      ) -> SignatureSpec:
    features = _check(q, k, v)[3]
    return _per_query_row(q, k, v, mask, ("row", "k", "v"), width=features + 1,
                          flops_per_point=(4 * features + 5) * k[-2])


def _per_query_row(q: Shape, k: Shape, v: Shape, mask: Shape | None, args: tuple[str, ...], width: int,
                   flops_per_point: int) -> SignatureSpec:
    """A signature over batch and query rows whose output is `width` elements per row; `args` name each input's
    projection: "row" (a query row of q's shape), "k" and "v" (all keys, their batch broadcast), "lse" (a number
    per row); a mask is read last."""
    batch, length, keys, features = _check(q, k, v)
    nb = len(batch)
    n, ones = nb + 1, (1,) * nb
    projections = {
        "row": follow(n, [*range(nb), nb, None], shape=(*ones, 1, features)),
        "k": follow(n, [*_batch_rows(k, q), None, None], shape=(*ones, keys, features)),
        "v": follow(n, [*_batch_rows(v, q), None, None], shape=(*ones, keys, features)),
        "lse": follow(n, [*range(nb), nb], shape=(*ones, 1)),
    }
    inputs = [projections[arg] for arg in args]
    if mask is not None:
        inputs.append(_mask_projection(mask, (*batch, length, keys), index_ndim=n))
    return SignatureSpec(
        dims=(*(f"batch{i}" for i in range(nb)), "query"),
        sizes=(*batch, length),
        inputs=tuple(inputs),
        output=follow(n, [*range(nb), nb, None], shape=(*ones, 1, width)),
        flops_per_point=flops_per_point,
    )


def backward_signature(dout: Shape, q: Shape, k: Shape, v: Shape, out: Shape, lse: Shape,
                       mask: Shape | None = None, **params: ParamValue) -> SignatureSpec:
    batch, length, keys, features = _check(q, k, v)
    if dout != q or out != q or lse != q[:-1]:
        raise KernelError(f"flash attention backward: dout and out must be q{list(q)} and lse {list(q[:-1])}; "
                          f"got dout{list(dout)}, out{list(out)}, lse{list(lse)}")
    nb = len(batch)
    ones = (1,) * nb
    if not by_rows(q, k):
        rows = follow(nb, [*range(nb), None, None], shape=(*ones, length, features))
        inputs = [
            rows, rows,
            follow(nb, [*_batch_rows(k, q), None, None], shape=(*ones, keys, features)),
            follow(nb, [*_batch_rows(v, q), None, None], shape=(*ones, keys, features)),
            rows,
            follow(nb, [*range(nb), None], shape=(*ones, length)),
        ]
        if mask is not None:
            inputs.append(_mask_projection(mask, (*batch, length, keys), index_ndim=nb, rows_whole=True))
        return SignatureSpec(
            dims=tuple(f"batch{i}" for i in range(nb)),
            sizes=batch,
            inputs=tuple(inputs),
            output=follow(nb, [*range(nb), None], shape=(*ones, (length + 2 * keys) * features)),
            flops_per_point=length * keys * (10 * features + 4),
        )
    return _per_query_row(q, k, v, mask, ("row", "row", "k", "v", "row", "lse"), width=3 * features,
                          flops_per_point=keys * (10 * features + 4))


def by_rows(q: Shape, k: Shape) -> bool:
    """Does the backward pack its gradients per row ([dq_i | dk_i | dv_i] for query and key i, self-attention's
    L = S), which a ring splits with its queries, rather than per batch point (L != S)?"""
    return q[-2] == k[-2]


def unpacked(q: Shape, k: Shape) -> tuple[tuple[int, int], ...]:
    """Where dq, dk and dv lie along the last dim of the backward's packed output: [start, stop) each."""
    e = q[-1]
    if by_rows(q, k):
        return (0, e), (e, 2 * e), (2 * e, 3 * e)
    dq, dkv = q[-2] * e, k[-2] * e
    return (0, dq), (dq, dq + dkv), (dq + dkv, dq + 2 * dkv)


def _scale(q: Any, scale: float) -> float:
    return scale or 1.0 / math.sqrt(q.shape[-1])


# -- numpy: the reference ------------------------------------------------------------------------------------------
def _forward_numpy(q, k, v, mask, causal: bool, scale: float, block_start: tuple[int, ...]) -> np.ndarray:
    if causal:
        mask = _causal(q.shape[-2], k.shape[-2], block_start[-1])
    out, lse = _attention_lse(q, k, v, mask, scale)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], () if mask is None else mask.shape[:-2])
    lse = np.broadcast_to(np.where(np.isfinite(lse), lse, 0.0), (*batch, q.shape[-2]))
    return np.concatenate([np.broadcast_to(out, (*batch, *out.shape[-2:])), lse[..., None]], axis=-1)


def gradients_numpy(dout, q, k, v, out, lse, mask, scale: float) -> tuple[np.ndarray, ...]:
    """(dq, dk, dv) over these queries and keys, each with the batch dims of all operands.
    dS = P∘(dP − rowsum(dO∘O)) with P = exp(scores − lse) rebuilt from the given lse (the whole row's, in a ring),
    as flash kernels do."""
    s = _scale(q, scale)
    scores = q @ np.swapaxes(k, -1, -2) * s
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    p = np.exp(scores - lse[..., None])
    dv = np.swapaxes(p, -1, -2) @ dout
    ds = p * (dout @ np.swapaxes(v, -1, -2) - (dout * out).sum(axis=-1, keepdims=True))
    dq, dk = ds @ k * s, np.swapaxes(ds, -1, -2) @ q * s
    batch = dq.shape[:-2]
    return tuple(np.broadcast_to(g, (*batch, *g.shape[-2:])) for g in (dq, dk, dv))


def pack_numpy(dq: np.ndarray, dk: np.ndarray, dv: np.ndarray) -> np.ndarray:
    """The backward's packed output: per row where dq and dk have as many rows (`by_rows`), else per batch point."""
    if dq.shape[-2] == dk.shape[-2]:
        return np.concatenate([dq, dk, dv], axis=-1)
    return np.concatenate([g.reshape(*g.shape[:-2], -1) for g in (dq, dk, dv)], axis=-1)


def _backward_numpy(dout, q, k, v, out, lse, mask, causal: bool, scale: float) -> np.ndarray:
    if causal:
        mask = _causal(q.shape[-2], k.shape[-2], 0)
    return pack_numpy(*gradients_numpy(dout, q, k, v, out, lse, mask, scale))


# -- torch: torch's fused CPU kernels ------------------------------------------------------------------------------
def _rows(t: Any, batch: tuple[int, ...]) -> Any:
    """[*b, r, c] broadcast to [*batch, r, c] as torch's 4-D [N, 1, r, c]."""
    return t.expand(*batch, *t.shape[-2:]).reshape(-1, 1, *t.shape[-2:])


def _additive(mask: Any, q: Any, batch: tuple[int, ...], length: int, keys: int) -> Any:
    """A mask as the fused kernels take it: additive, q's dtype, [N, 1, L, S]."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -torch.inf)
    mask = mask[(None,) * (len(batch) + 2 - mask.dim())]
    return _rows(mask.expand(*batch, length, keys), batch)


def _forward_torch(q, k, v, mask, causal: bool, scale: float, block_start: tuple[int, ...]) -> Any:
    batch, length, keys = tuple(q.shape[:-2]), q.shape[-2], k.shape[-2]
    if causal and block_start[-1]:  # torch's causal mask starts at query 0: a later block's is explicit
        mask, causal = _causal_torch(q, keys, block_start[-1]), False
    if q.device.type != "cpu":
        return forward_math(q, k, v, _causal_torch(q, keys, 0) if causal else mask, scale)
    out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(
        _rows(q, batch), _rows(k, batch), _rows(v, batch), 0.0, causal,
        attn_mask=_additive(mask, q, batch, length, keys), scale=scale or None)
    return torch.cat([out.to(lse.dtype).reshape(*batch, length, -1), lse.reshape(*batch, length, 1)], dim=-1)


def _backward_torch(dout, q, k, v, out, lse, mask, causal: bool, scale: float) -> Any:
    batch, length, keys = tuple(q.shape[:-2]), q.shape[-2], k.shape[-2]
    if q.device.type != "cpu":
        return backward_math(dout, q, k, v, out, lse, _causal_torch(q, keys, 0) if causal else mask, scale)
    grads = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
        _rows(dout, batch), _rows(q, batch), _rows(k, batch), _rows(v, batch), _rows(out, batch),
        lse.to(torch.promote_types(q.dtype, torch.float32)).reshape(-1, 1, length),  # the lse dtype it makes
        0.0, causal, attn_mask=_additive(mask, q, batch, length, keys),
        scale=scale or None)
    return pack_torch(*(g.reshape(*batch, *g.shape[-2:]) for g in grads))


def pack_torch(dq: Any, dk: Any, dv: Any) -> Any:
    """`pack_numpy` in torch."""
    if dq.shape[-2] == dk.shape[-2]:
        return torch.cat([dq, dk, dv], dim=-1)
    return torch.cat([g.reshape(*g.shape[:-2], -1) for g in (dq, dk, dv)], dim=-1)


def forward_math(q, k, v, mask, scale: float) -> Any:
    """The packed forward in torch's own ops, where torch has no fused kernel returning the lse (off the CPU):
    the scores are materialized, in float32 for half-precision inputs."""
    out, lse = _attention_lse_torch(q, k, v, mask, scale)
    batch, length = tuple(q.shape[:-2]), q.shape[-2]
    lse = torch.where(torch.isfinite(lse), lse, 0.0).expand(*batch, length)
    return torch.cat([out.expand(*batch, length, -1), lse[..., None]], dim=-1)


def backward_math(dout, q, k, v, out, lse, mask, scale: float) -> Any:
    """The packed backward in torch's own ops (off the CPU), in float32 for half-precision inputs."""
    return pack_torch(*gradients_math(dout, q, k, v, out, lse, mask, scale)).to(q.dtype)


def gradients_math(dout, q, k, v, out, lse, mask, scale: float) -> tuple[Any, ...]:
    """`gradients_numpy` in torch's own ops, in float32 for half-precision inputs (and left so)."""
    dout, q, k, v, out = (_wide(t) for t in (dout, q, k, v, out))
    s = _scale(q, scale)
    scores = q @ k.transpose(-1, -2) * s
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask.to(scores.dtype)
    p = torch.exp(scores - lse.to(scores.dtype)[..., None])
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(dim=-1, keepdim=True))
    dq, dk = ds @ k * s, ds.transpose(-1, -2) @ q * s
    batch = tuple(dq.shape[:-2])
    return tuple(g.expand(*batch, *g.shape[-2:]) for g in (dq, dk, dv))


# -- ring attention (context parallelism): one key block's (out, lse); kernels.ring merges and packs them --------
def _sdpa_start(block_start: tuple[int, ...]) -> tuple[int, int]:
    """The query block's start where sdpa's ring impls read it (sdpa's queries are its second-to-last index dim)."""
    return (block_start[-1], 0)


FLASH_RING = Ring(
    "query", _sdpa_keyed,
    lambda q, k, v, causal, scale, block_start, key_start:
        _ring_sdpa_numpy(q, k, v, causal, scale, _sdpa_start(block_start), key_start),
    lambda q, k, v, causal, scale, block_start, key_start:
        _ring_sdpa_torch(q, k, v, causal, scale, _sdpa_start(block_start), key_start),
    with_lse=True,
)
FLASH_MASKED_RING = Ring(
    "query", _sdpa_keyed,
    lambda q, k, v, mask, scale, block_start, key_start: _attention_lse(q, k, v, mask, scale),
    lambda q, k, v, mask, scale, block_start, key_start: _attention_lse_torch(q, k, v, mask, scale),
    with_lse=True,
)


# The backward's ring: one query block against one key block gives (dq, dk, dv) parts; kernels.ring sums dq where the
# queries are and sends dk and dv back to the key block's owner. A causal key block wholly after the queries adds
# nothing and is skipped (the torch impl: zeros, no arithmetic).
def _ring_backward_numpy(dout, q, k, v, out, lse, *mask, scale, block_start, key_start, causal=False):
    if causal:
        mask = (_causal(q.shape[-2], k.shape[-2], block_start[-1], key_start),)
    return gradients_numpy(dout, q, k, v, out, lse, mask[0] if mask else None, scale)


def _ring_backward_torch(dout, q, k, v, out, lse, *mask, scale, block_start, key_start, causal=False):
    if causal and key_start > block_start[-1] + q.shape[-2] - 1:
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        wide = _wide(q).dtype
        return (q.new_zeros((*batch, *q.shape[-2:]), dtype=wide), q.new_zeros((*batch, *k.shape[-2:]), dtype=wide),
                q.new_zeros((*batch, *v.shape[-2:]), dtype=wide))
    if causal:
        mask = (_causal_torch(q, k.shape[-2], block_start[-1], key_start),)
    return gradients_math(dout, q, k, v, out, lse, mask[0] if mask else None, scale)


def _backward_keyed(shapes: tuple[Shape, ...]) -> tuple[int | None, ...]:
    """k's and v's key dims, and a mask's (where not broadcast over the keys)."""
    dout, q, k, v, out, lse, *mask = shapes
    _, keys, values, *masked = _sdpa_keyed((q, k, v, *mask))
    return (None, None, keys, values, None, None, *masked)


FLASH_BACKWARD_RING = Ring("query", _backward_keyed, _ring_backward_numpy, _ring_backward_torch, gradients=True)


# -- pricing, dtypes, samples --------------------------------------------------------------------------------------
def _forward_work(sig: Any, block: Any) -> float:
    """A causal block computes only the query-key pairs its mask keeps."""
    if not dict(sig.params).get("causal"):
        return 1.0
    return causal_share((block.start[-1], block.end[-1]), sig.input_shapes[1][-2])


def _backward_work(sig: Any, block: Any) -> float:
    if not dict(sig.params).get("causal"):
        return 1.0
    rows = (block.start[-1], block.end[-1]) if "query" in sig.dims else (0, sig.input_shapes[1][-2])
    return causal_share(rows, sig.input_shapes[2][-2])


def _rule(inputs: tuple[str, ...], packed: bool):
    """q, k, v (dout and out too) share one float dtype; a mask is bool or that dtype; lse any float. The forward
    gives the compute dtype (out and lse packed: float32 for half precision), the backward q's."""
    def rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
        named = dict(zip(inputs, in_dtypes))
        for slot, d in named.items():
            if not (dtypes.is_float(d) or (slot == "mask" and d == "bool")):
                raise KernelError(f"{slot} must be {'bool or float' if slot == 'mask' else 'float'}, got {d}")
        agree = {d for slot, d in named.items() if slot != "lse" and d != "bool"}
        if len(agree) > 1:
            listed = ", ".join(f"{slot}: {d}" for slot, d in named.items())
            raise KernelError(f"operands have different float dtypes ({listed}); cast them to one dtype first")
        (common,) = agree
        return str(dtypes.compute_dtype(common)) if packed else common
    return rule


def _sample_qkv(draw) -> tuple[Shape, Shape, Shape]:
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    length, keys, features = (draw(st.integers(1, 5)) for _ in range(3))
    shared = tuple(1 if draw(st.booleans()) else s for s in batch)
    return (*batch, length, features), (*shared, keys, features), (*shared, keys, features)


def _sample_mask(draw, q: Shape, k: Shape) -> tuple[Shape, str]:
    full = (*q[:-1], k[-2])
    keep = draw(st.integers(1, len(full)))
    return tuple(s if draw(st.booleans()) else 1 for s in full[len(full) - keep:]), draw(st.sampled_from(["bool",
                                                                                                         "float"]))


def _params(draw, masked: bool) -> dict[str, ParamValue]:
    causal = {} if masked else {"causal": draw(st.booleans())}
    return {**causal, "scale": draw(st.sampled_from([0.0, 0.5]))}


def _sample_forward(draw, masked: bool):
    q, k, v = _sample_qkv(draw)
    if not masked:
        return (q, k, v), _params(draw, False)
    mask, kind = _sample_mask(draw, q, k)
    return (q, k, v, mask), _params(draw, True), ("float", "float", "float", kind)


def _sample_backward(draw, masked: bool):
    q, k, v = _sample_qkv(draw)
    if draw(st.booleans()):  # self-attention (L = S): gradients packed per row, the rows an index dim
        k, v = (*k[:-2], q[-2], k[-1]), (*v[:-2], q[-2], v[-1])
    shapes = (q, q, k, v, q, q[:-1])
    if not masked:
        return shapes, _params(draw, False)
    mask, kind = _sample_mask(draw, q, k)
    return (*shapes, mask), _params(draw, True), ("float",) * 6 + (kind,)


QKV = ("q", "k", "v")
GRAD = ("dout", "q", "k", "v", "out", "lse")
for masked in (False, True):
    suffix, mask_slot = ("_masked", ("mask",)) if masked else ("", ())
    register(Kernel(
        name=f"flash_attention{suffix}",
        inputs=(*QKV, *mask_slot),
        signature=forward_signature,
        numpy=(lambda q, k, v, mask, scale, block_start: _forward_numpy(q, k, v, mask, False, scale, block_start))
        if masked else (lambda q, k, v, causal, scale, block_start:
                        _forward_numpy(q, k, v, None, causal, scale, block_start)),
        torch=(lambda q, k, v, mask, scale, block_start: _forward_torch(q, k, v, mask, False, scale, block_start))
        if masked else (lambda q, k, v, causal, scale, block_start:
                        _forward_torch(q, k, v, None, causal, scale, block_start)),
        sample=lambda draw, masked=masked: _sample_forward(draw, masked),
        params={"scale": 0.0} if masked else {"causal": False, "scale": 0.0},
        needs_block_start=True,
        takes_zero_size=False,
        ring=FLASH_MASKED_RING if masked else FLASH_RING,
        work=None if masked else _forward_work,
        dtype_rule=_rule((*QKV, *mask_slot), packed=True),
        doc="attention's output and log-sum-exp packed per query row as [out | lse], in the compute dtype"
            + ("; mask: bool (True attends) or float (added)" if masked else "; causal: query i sees keys j <= i"),
    ))
    register(Kernel(
        name=f"flash_attention{suffix}_backward",
        inputs=(*GRAD, *mask_slot),
        signature=backward_signature,
        numpy=(lambda *a, scale, block_start: _backward_numpy(*a, False, scale)) if masked
        else (lambda *a, causal, scale, block_start: _backward_numpy(*a, None, causal, scale)),
        torch=(lambda *a, scale, block_start: _backward_torch(*a, False, scale)) if masked
        else (lambda *a, causal, scale, block_start: _backward_torch(*a, None, causal, scale)),
        sample=lambda draw, masked=masked: _sample_backward(draw, masked),
        params={"scale": 0.0} if masked else {"causal": False, "scale": 0.0},
        needs_block_start=True,
        takes_zero_size=False,
        ring=FLASH_BACKWARD_RING,
        ring_only=frozenset({"query"}),
        work=None if masked else _backward_work,
        dtype_rule=_rule((*GRAD, *mask_slot), packed=False),
        accumulators=frozenset({"lse"}),
        doc="attention's gradients packed per batch point as [dq | dk | dv] from dout, q, k, v, out and lse",
    ))
