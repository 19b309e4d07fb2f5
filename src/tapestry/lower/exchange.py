"""An expert-parallel step on one rank, in torch: rows out by all-to-all, the rank's experts on what arrives,
results back by all-to-all (plan.exchange says which rows go where; both runtimes call `run_experts`).

Each rank picks, from the values it holds, the rows of its block that each member's experts own. The counts
are the data's: a receiver counts its rows itself where every member holds the routing whole (grouped_mm's
`ends`), else they are traded first by an all-to-all of one count per member. Then one all-to-all per
travelling input (the rows), the kernel on each sender's rows with this rank's experts, and one all-to-all of
the results back, each landing on the rows it was computed for (where the output does not follow the rows,
grouped_mm_k's, the results are summed here instead, and nothing goes back). The sizes depend on the values, so
the step runs eagerly (a host read of the counts), as grouped_mm's own kernel does.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as fc

from tapestry.kernels import get_kernel
from tapestry.lower.program import ExpertCompute
from tapestry.plan.exchange import out_rows, routes_from, row_dim, travels


def run_experts(step: ExpertCompute, args: Sequence[torch.Tensor], group: Any) -> torch.Tensor:
    """This rank's output block of `step`, `args` its reads (blocks of every input for its own index block),
    `group` the process group of `step.group` (the whole mesh's when None)."""
    sig = get_kernel(step.kernel).bind(step.input_shapes, dict(step.params), step.input_dtypes)
    along, rows, back_rows = travels(sig), row_dim(sig), out_rows(sig)
    size = len(step.blocks)
    mine = {r.dst: r for r in routes_from(sig, step.member, step.blocks, args)}
    sent = [len(mine[q].positions) if q in mine else 0 for q in range(size)]
    if sig.kernel.exchange.counted:  # the routing is held whole by every member: count what arrives here
        theirs = {q: r for q in range(size) if q != step.member
                  for r in routes_from(sig, q, step.blocks, args) if r.dst == step.member}
        if step.member in mine:
            theirs[step.member] = mine[step.member]
        received = [len(theirs[q].positions) if q in theirs else 0 for q in range(size)]
    else:
        counts = fc.all_to_all_single(torch.tensor(sent, dtype=torch.int64), [1] * size, [1] * size, group)
        received = [int(c) for c in fc.wait_tensor(counts).tolist()]
    arrived: list[list[torch.Tensor] | None] = [None] * len(args)
    for k, (arg, dim) in enumerate(zip(args, along)):
        if dim is None:
            continue
        front = arg.movedim(dim, 0)
        parts = [front[list(mine[q].positions)] if q in mine else front[:0] for q in range(size)]
        moved = fc.wait_tensor(fc.all_to_all_single(torch.cat(parts).contiguous(), received, sent, group))
        arrived[k] = [piece.movedim(0, dim) for piece in torch.split(moved, received)]
    results, dtype = [], getattr(torch, sig.dtype)
    for q in range(size):
        if not received[q]:
            rest = list(step.out_block.shape)
            if back_rows is not None:
                rest[back_rows] = 0
                results.append(torch.zeros(rest, dtype=dtype, device=args[0].device).movedim(back_rows, 0))
            continue
        start, end = list(step.index.start), list(step.index.end)
        start[rows] = step.blocks[q].start[rows]  # a sender's rows computed as one block (plan.exchange)
        if sig.kernel.exchange.counted:
            start[rows] += theirs[q].positions[0]
        end[rows] = start[rows] + received[q]
        index = type(step.index)(tuple(start), tuple(end))
        call = [arrived[k][q] if arrived[k] is not None else arg for k, arg in enumerate(args)]
        out = get_kernel(step.kernel).torch(*call, **sig.call_kwargs(index))
        results.append(out if back_rows is None else out.movedim(back_rows, 0))
    if back_rows is None:  # the rows' sums stay with the experts
        return sum(results, torch.zeros(step.out_block.shape, dtype=dtype, device=args[0].device))
    back = fc.wait_tensor(fc.all_to_all_single(torch.cat(results).contiguous(), sent, received, group))
    out = torch.zeros(step.out_block.shape, dtype=dtype, device=args[0].device).movedim(back_rows, 0)
    for q, piece in enumerate(torch.split(back, sent)):
        if sent[q]:
            out[list(mine[q].positions)] += piece  # a row may meet several members' experts (plan.exchange)
    return out.movedim(0, back_rows)
