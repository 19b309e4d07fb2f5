"""A ring-attention step on one rank, in torch (plan.ring says who meets whose keys; both runtimes call
`run_ring`).

Round t: the rank computes its queries against the key block it has (its own at t = 0, then member j - t's),
while that block's travelling tensors (k's, v's) go on to member j + 1 and member j - t - 1's arrive from member
j - 1: one functional all-to-all per travelling input per round, issued before the round's compute and waited
after it, so the transfer overlaps the compute. A stationary keyed input (a mask, which follows the queries) is
held for every key and sliced to the round's key block. The rounds' (out, lse) merge by log-sum-exp
(kernels.ring). Every size is the plan's, so the step traces (make_fx) and compiles like any other.

The backward's ring (`Ring.gradients`) moves k and v the same way; dq sums on the rank, and the dk and dv sums of
the key block it holds go on to member j + 1 with one more all-to-all per round, each round adding its part: after
p rounds each key block's sums come home to its owner (the last pass is the one that no compute hides).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as fc

from tapestry.kernels import get_kernel
from tapestry.kernels.ring import finish_torch, merge_torch, pack_gradients, travels
from tapestry.lower.program import RingCompute
from tapestry.plan.ring import rounds


def run_ring(step: RingCompute, args: Sequence[torch.Tensor], group: Any) -> torch.Tensor:
    """This rank's output block of `step`, `args` its reads, `group` the process group of `step.group`."""
    sig = get_kernel(step.kernel).bind(step.input_shapes, dict(step.params), step.input_dtypes)
    keyed, moving = sig.kernel.ring.keyed(step.input_shapes), travels(sig)
    size, me = len(step.keys), step.member
    after, before = (me + 1) % size, (me - 1) % size
    kwargs = sig.call_kwargs(step.index)
    gradients = sig.kernel.ring.gradients
    have = list(args)  # the travelling inputs as of this round: member src's key block
    out = lse = dq = sums = None  # sums: the dk, dv of the key block held, arriving from member j - 1
    for t, src in enumerate(rounds(size, me)):
        coming = None
        if t < size - 1:  # pass this round's block on while computing it
            arrives = (me - t - 1) % size
            coming = [_pass(have[a], keyed[a], step.keys[arrives], after, before, size, group)
                      if moving[a] else None for a in range(len(args))]
        start, end = step.keys[src]
        call = [have[a] if moving[a] or keyed[a] is None else have[a].narrow(keyed[a], start, end - start)
                for a in range(len(args))]
        if gradients:
            part_q, *part_kv = sig.kernel.ring.torch(*call, key_start=start, **kwargs)
            dq = part_q if dq is None else dq + part_q
            if sums is not None:  # member j - 1's sums for this key block, sent last round
                part_kv = [fc.wait_tensor(c).reshape(p.shape) + p for c, p in zip(sums, part_kv)]
            sums = [_pass(p, p.dim() - 2, step.keys[(src - 1) % size], after, before, size, group) for p in part_kv]
        else:
            o, s = sig.kernel.ring.torch(*call, key_start=start, **kwargs)
            out, lse = (o, s) if out is None else merge_torch(out, lse, o, s)
        if coming is not None:
            have = [fc.wait_tensor(c).reshape(_shaped(have[a], keyed[a], step.keys[arrives]))
                    if c is not None else have[a] for a, c in enumerate(coming)]
    if gradients:  # after p rounds the sums that arrive are this rank's own key block's
        assert dq is not None and sums is not None
        shape = _shaped(dq, dq.dim() - 2, step.keys[me])
        return pack_gradients(sig, dq, *(fc.wait_tensor(c).reshape(shape) for c in sums))
    assert out is not None
    return finish_torch(sig.kernel.ring, out, lse).to(getattr(torch, sig.dtype))


def _shaped(held: torch.Tensor, dim: int, keys: tuple[int, int]) -> tuple[int, ...]:
    shape = list(held.shape)
    shape[dim] = keys[1] - keys[0]
    return tuple(shape)


def _pass(held: torch.Tensor, dim: int, coming_keys: tuple[int, int], after: int, before: int, size: int,
          group: Any) -> torch.Tensor:
    """Send `held` (a key block along tensor dim `dim`) to member `after` and receive from member `before` the block
    of keys `coming_keys`, flat."""
    sent, received = [0] * size, [0] * size
    sent[after] = held.numel()
    received[before] = held.numel() // max(held.shape[dim], 1) * (coming_keys[1] - coming_keys[0])
    return fc.all_to_all_single(held.contiguous().reshape(-1), received, sent, group)
