"""Expert-parallel steps: which rows of an exchange Compute go where, and what comes back.

An exchange step (`Compute.exchange`, a kernel with `Kernel.exchange`: grouped_mm, take_rows) splits rows and
experts together over mesh axes: member j of a group along those axes holds row block j of the travelling inputs
(those that follow the rows: grouped_mm's x, take_rows' idx) and expert block j of the others (the weights, the
table; grouped_mm's `ends` whole). Each member sends the rows of its block that member q's experts own to q
(exactly those: `Exchange.select` reads the values), q computes them with what it holds, and sends the results
back, where they are added into the member's output rows (a row whose experts sit on several members, as
grouped_mm's overlapping spans of falling `ends` make, sums their results, as the kernel does); rows no expert
owns stay zero. A kernel whose output does not follow its rows (grouped_mm_k: the rows summed per expert) keeps
the results where they were computed: q's output block is the sum over the rows every member sent it.
One all-to-all of the counts, one of the rows, one of the results; the counts are the data's, never an
even-routing guess. Simulation (plan.simulate) and the rank programs (spmd.trace) both follow `routes`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tapestry.kernels import Signature
from tapestry.plan.plan import Compute
from tapestry.sharding import Mesh
from tapestry.sharding.partition import exchange_groups
from tapestry.zspace import ZRange


@dataclass(frozen=True)
class Route:
    """The rows at `positions` (from the start of member `src`'s row block) go to member `dst`, which computes
    them as `index` (dst's block, its rows the run from the first of them)."""

    src: int
    dst: int
    positions: tuple[int, ...]
    index: ZRange


def members(step: Compute, mesh: Mesh) -> list[tuple[int, ...]]:
    """The groups of devices that trade rows: the fibres along the step's exchange axes, or runs of its
    `exchange_group` devices along its one axis (sharding.partition.exchange_groups)."""
    return exchange_groups(mesh, step.exchange, step.exchange_group)


def row_dim(sig: Signature) -> int:
    return sig.dims.index(sig.kernel.exchange.rows)


def out_rows(sig: Signature) -> int | None:
    """The output dim that follows the rows (results go back to the rows' members), or None (they stay)."""
    rows = row_dim(sig)
    return next((r for r, row in enumerate(sig.output.matrix) if row[rows]), None)


def travels(sig: Signature) -> tuple[int | None, ...]:
    """Per input: the tensor dim that follows the rows (sent with them), or None (it stays with the experts)."""
    rows = row_dim(sig)
    return tuple(next((r for r, row in enumerate(p.matrix) if row[rows]), None) for p in sig.projections)


def routes_from(sig: Signature, src: int, blocks: Sequence[ZRange], held: Sequence[Any]) -> list[Route]:
    """The routes out of member `src` (in dst order, itself included) given its held input blocks `held`."""
    rows = row_dim(sig)
    found = []
    for dst, theirs in enumerate(blocks):
        positions = tuple(sig.kernel.exchange.select(sig, held, blocks[src], theirs))
        if not positions:
            continue
        first = blocks[src].start[rows] + positions[0]
        start, end = list(theirs.start), list(theirs.end)
        start[rows], end[rows] = first, first + len(positions)
        found.append(Route(src, dst, positions, ZRange(tuple(start), tuple(end))))
    return found
