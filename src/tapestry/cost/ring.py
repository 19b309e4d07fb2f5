"""The communication a ring-attention step leaves exposed (plan.ring): its key blocks' sends, less the compute
they hide behind.

A ring of p members runs p rounds; in each of the first p - 1, every member sends the travelling key blocks it
holds (k's, v's: the largest member's, in the values' dtypes) to the next member over the slowest link of the
ring's axes (alpha + bytes/beta) while it computes the round's block, 1/p of the step's roofline time (the slowest
member's, which under a causal mask is the last, meeting every key). A round takes the longer of the two, so the
step costs its compute (priced by the roofline) plus (p - 1) · max(0, send - compute/p) here. Long sequences hide
the sends entirely (compute grows with the keys squared, a send with the keys); short ones do not, which is where
all-gathering the keys (a Reshard before a query split) or another split wins.

The backward's ring (`Ring.gradients`) also passes the dk and dv sums of the key block it holds each round (in the
compute dtype: float32 for half precision, as lower.ring accumulates them), hidden by the next round's compute like
the key blocks, and once more after the last round, to the key block's owner: that pass is exposed whole. So a
training step's backward ring sends about three times the forward's bytes against about 2.5 times its compute.
"""
from __future__ import annotations

import math

from tapestry import dtypes
from tapestry.cost.profile import Link
from tapestry.cost.roofline import Roofline
from tapestry.kernels.ring import travels
from tapestry.plan.plan import Compute
from tapestry.sharding import Mesh


def ring_send_bytes(step: Compute) -> int:
    """Bytes a member sends per round: its blocks of the travelling inputs (the largest member's), and a gradient
    ring's dk and dv sums."""
    sig = step.signature
    return ring_sum_bytes(step) + sum(
        dtypes.itemsize(d) * max((b.size for b in layout.blocks if b is not None), default=0)
        for layout, d, moves in zip(step.arg_layouts, sig.input_dtypes, travels(sig)) if moves)


def ring_sum_bytes(step: Compute) -> int:
    """A gradient ring's dk and dv sums a member passes on per round: two thirds of its [dq | dk | dv] output rows
    (the largest member's), in the compute dtype; 0 for other rings."""
    sig = step.signature
    if not sig.kernel.ring.gradients:
        return 0
    rows = max((b.size for b in step.layout.blocks if b is not None), default=0)
    return rows * 2 // 3 * dtypes.compute_dtype(sig.dtype).itemsize


def ring_exposed_time(step: Compute, mesh: Mesh, link: Link, roofline: Roofline) -> float:
    """Seconds of the step's sends that its compute does not hide (see the module doc)."""
    p = math.prod(mesh.shape[a] for a in step.ring)
    send = link.alpha + ring_send_bytes(step) / link.beta
    home = ring_sum_bytes(step)  # a gradient ring's last pass of the sums, to their owners: nothing left to hide it
    last = link.alpha + home / link.beta if home else 0.0
    return (p - 1) * max(0.0, send - roofline.compute_time(step, mesh) / p) + last
