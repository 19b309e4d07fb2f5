"""Ring attention's pieces: a kernel whose key dim may be split across devices, and the log-sum-exp merge.

Attention's keys are a softmax reduction, not a sum: a block of keys gives its rows' output and their log-sum-exp
(lse, the log of the softmax's denominator over those keys), and two blocks' results merge as
    lse = log(exp(lse_a) + exp(lse_b)),  out = exp(lse_a - lse)·out_a + exp(lse_b - lse)·out_b
(flash attention's online softmax; ring attention's combine). A row that sees no key in a block has lse -inf and
adds nothing; a row that sees no key at all gives zeros, as the whole kernel does.

A kernel with a `Ring` (sdpa, sdpa_masked, and training's flash_attention[_masked], whose output keeps the merged
lse: `Ring.with_lse`) may run as a ring step (sharding.partition, plan.ring): mesh axes split
its queries (`rows`) and, in the same order, the key dim of its keyed inputs (k, v, a mask's key columns); each
device computes its queries against every member's key block in turn, merging as it goes.

The fused backward's ring (`Ring.gradients`, flash_attention[_masked]_backward) splits the same way, with the forward's
saved lse: each block gives dq, dk and dv parts; dq sums where the queries are, and each key block's dk and dv sum as
they travel round the ring with it, back to the key block's owner, whose output row i packs [dq_i | dk_i | dv_i]
(query block j and key block j are the same rows: self-attention, keys split evenly as the queries are).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tapestry import dtypes
from tapestry.zspace import ZRange

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Ring:
    """How a kernel's keys split: `rows` the index dim of its queries; `keyed(input shapes)` per input the tensor
    dim holding keys (None: not keyed); `numpy`/`torch` the block impls, taking the kernel's inputs (keyed ones
    narrowed to a key block), its call kwargs and `key_start` (the block's first key), returning (out, lse)."""

    rows: str
    keyed: Callable[[tuple[Shape, ...]], tuple[int | None, ...]]
    numpy: Callable[..., tuple[np.ndarray, np.ndarray]]
    torch: Callable[..., tuple[Any, Any]]
    with_lse: bool = False  # the kernel's output packs each row's lse after its out (flash_attention: [out | lse])
    # The backward's ring: the impls return (dq, dk, dv) parts, summed (dq at the queries, dk and dv at the keys'
    # owner) and packed per row; its rows split only in a ring (a row block's dk and dv need every query).
    gradients: bool = False


def finish_numpy(ring: Ring, out: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """The merged (out, lse) as the kernel's output: out, or [out | lse] per row with `with_lse` (a row that saw
    no key: lse 0, as torch's fused kernel gives)."""
    if not ring.with_lse:
        return out
    return np.concatenate([out, np.where(np.isfinite(lse), lse, 0.0)[..., None]], axis=-1)


def finish_torch(ring: Ring, out: Any, lse: Any) -> Any:
    """`finish_numpy` in torch."""
    import torch

    if not ring.with_lse:
        return out
    return torch.cat([out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None]], dim=-1)


def merge_numpy(out_a: np.ndarray, lse_a: np.ndarray, out_b: np.ndarray, lse_b: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Two key blocks' (out, lse) as one: lse [..., L], out [..., L, Ev]."""
    top = np.maximum(lse_a, lse_b)
    safe = np.where(np.isfinite(top), top, 0.0)
    wa, wb = np.exp(lse_a - safe), np.exp(lse_b - safe)
    total = wa + wb
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / np.where(total > 0, total, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return out, lse


def merge_torch(out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """`merge_numpy` in torch (differentiable: no in-place writes)."""
    import torch

    top = torch.maximum(lse_a, lse_b)
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    wa, wb = torch.exp(lse_a - safe), torch.exp(lse_b - safe)
    total = wa + wb
    seen = total > 0
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / torch.where(seen, total, torch.ones_like(total))[..., None]
    lse = torch.where(seen, safe + torch.log(torch.where(seen, total, torch.ones_like(total))),
                      torch.full_like(total, -torch.inf))
    return out, lse


def _computed(sig: Any, args: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Half-precision inputs in float32, as `Signature.compute` runs them."""
    return [b.astype(dtypes.compute_dtype(d), copy=False) if dtypes.is_float(d) else b
            for b, d in zip(args, sig.input_dtypes)]


def ring_numpy(sig: Any, blocks: Sequence[Sequence[np.ndarray]], key_starts: Sequence[int],
               kwargs: dict[str, Any]) -> np.ndarray:
    """One device's ring step in numpy: `blocks[t]` the kernel's inputs with keyed ones narrowed to key block t
    (starting at key `key_starts[t]`), merged in order; the result in the signature's dtype. Half-precision
    inputs are computed in float32, as `Signature.compute` does."""
    ring = sig.kernel.ring
    out = lse = None
    for args, start in zip(blocks, key_starts):
        o, s = ring.numpy(*_computed(sig, args), key_start=start, **kwargs)
        out, lse = (o, s) if out is None else merge_numpy(out, lse, o, s)
    if out is None:
        raise ValueError(f"{sig.kernel.name}: a ring step needs at least one key block")
    return dtypes.cast(finish_numpy(ring, out, lse), sig.dtype)


def gradient_parts_numpy(sig: Any, args: Sequence[np.ndarray], key_start: int, kwargs: dict[str, Any]
                         ) -> tuple[np.ndarray, ...]:
    """A gradient ring's one round in numpy: (dq, dk, dv) of a query block against the key block in `args`."""
    return tuple(sig.kernel.ring.numpy(*_computed(sig, args), key_start=key_start, **kwargs))


def pack_gradients(sig: Any, dq: Any, dk: Any, dv: Any) -> Any:
    """A gradient ring member's summed parts as its output rows [dq_i | dk_i | dv_i] (numpy or torch)."""
    if dq.shape[-2] != dk.shape[-2]:
        raise ValueError(f"{sig.kernel.name}: a gradient ring member's query block ({dq.shape[-2]} rows) and key "
                         f"block ({dk.shape[-2]} keys) must be the same rows")
    if isinstance(dq, np.ndarray):
        return dtypes.cast(np.concatenate([dq, dk, dv], axis=-1), sig.dtype)
    import torch

    return torch.cat([dq, dk, dv], dim=-1).to(getattr(torch, sig.dtype))


def key_region(sig: Any, arg: int, region: ZRange, keys: tuple[int, int]) -> ZRange:
    """`region` of input `arg` with its key dim (where the input is keyed) narrowed to keys [start, end)."""
    dim = sig.kernel.ring.keyed(sig.input_shapes)[arg]
    if dim is None:
        return region
    start, end = list(region.start), list(region.end)
    start[dim], end[dim] = keys
    return ZRange(tuple(start), tuple(end))


def key_extent(sig: Any) -> int:
    """How many keys the kernel's keyed inputs hold."""
    dims = sig.kernel.ring.keyed(sig.input_shapes)
    return next(sig.input_shapes[a][d] for a, d in enumerate(dims) if d is not None)


def travels(sig: Any) -> tuple[bool, ...]:
    """Per input: does it pass round the ring: keyed and not read by query (k, v; a mask's rows follow the
    queries, so each device holds its rows' mask for every key and reads a key block of it per round)."""
    rows = sig.dims.index(sig.kernel.ring.rows)
    return tuple(d is not None and not any(row[rows] for row in p.matrix)
                 for d, p in zip(sig.kernel.ring.keyed(sig.input_shapes), sig.projections))
