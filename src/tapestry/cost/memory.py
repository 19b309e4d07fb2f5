"""Memory per device: the second objective next to time, and what a memory budget bounds.

The model is the runtime's (tapestry.runtime.execute): every rank places its
blocks of the program inputs before the first step and keeps them for the
whole program (weights stay resident), then runs its lowered steps, dropping
each buffer after its last reader (`RankProgram.dead_after`). A buffer holds
its block at its value's dtype size. A `Local` move whose block lies inside
the source block is a view of it, as the runtime makes it: it adds no bytes
and keeps its source alive. Not counted: kernel scratch space, collective
staging buffers and allocator slack; nor the gather of the outputs to rank 0
that `Plan.run` adds after the plan (the plan's outputs stay live to its end).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tapestry import dtypes
from tapestry.plan.plan import Place, Plan
from tapestry.sharding import Block, Layout

if TYPE_CHECKING:
    from tapestry.lower.program import RankProgram


def block_bytes(block: Block, dtype: str) -> int:
    return 0 if block is None else block.size * dtypes.itemsize(dtype)


def layout_bytes(layout: Layout, dtype: str) -> tuple[int, ...]:
    """Bytes each device holds of a value in `layout`."""
    return tuple(block_bytes(b, dtype) for b in layout.blocks)


def resident_bytes(plan: Plan) -> list[int]:
    """Per device, the bytes of program inputs it holds for the whole program."""
    total = [0] * plan.mesh.size
    for step in plan.steps:
        if isinstance(step, Place):
            total = [t + n for t, n in zip(total, layout_bytes(step.layout, plan.dtypes[step.out]))]
    return total


def _rank_peak(plan: Plan, program: RankProgram) -> int:
    """One rank's most bytes at once: its placed blocks throughout, plus the live buffers at each step."""
    from tapestry.lower.program import Local, PlaceBlock, RankProgram  # imports torch: only when asked

    steps = [s for s in program.steps if s.step < len(plan.steps)]  # the outputs' gather is not the plan's
    dead = RankProgram(program.rank, program.world, tuple(steps)).dead_after()
    owner: dict[str, str | None] = {}  # buffer -> the buffer whose storage it is (a view's source); None: resident
    users: dict[str, int] = {}  # storage -> how many live buffers share it
    size: dict[str, int] = {}
    resident, live, peak = 0, 0, 0
    for step, gone in zip(steps, dead):
        dtype = plan.dtypes[step.out]
        if isinstance(step, PlaceBlock):
            resident += block_bytes(step.block, dtype)
            owner[step.out] = None
            continue
        if isinstance(step, Local) and step.src_block is not None and step.src_block.contains(step.out_block):
            owner[step.out] = owner[step.src]
        else:
            owner[step.out] = step.out
            size[step.out] = block_bytes(step.out_block, dtype)
            live += size[step.out]
        base = owner[step.out]
        if base is not None:
            users[base] = users.get(base, 0) + 1
        peak = max(peak, live)
        for name in gone:
            base = owner.pop(name, None)
            if base is None:
                continue  # resident, or never made on this rank
            users[base] -= 1
            if users[base] == 0:
                live -= size.pop(base)
    return resident + peak


def peak_memory(plan: Plan) -> list[int]:
    """Per device, the most bytes it holds at once when the plan runs as lowered."""
    from tapestry.lower.program import lower

    return [_rank_peak(plan, program) for program in lower(plan).ranks]
