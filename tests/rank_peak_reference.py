"""The reference for `cost.memory.rank_peaks`: one rank's peak walked on its lowered program, copying the live set
at each new high (quadratic in a deep plan's steps, so a test's only), for tests to compare the shortcuts with."""
from __future__ import annotations

from tapestry.cost.memory import block_bytes
from tapestry.lower.program import PlaceBlock, RankProgram, viewed
from tapestry.plan import Plan


def snapshot_peak(plan: Plan, program: RankProgram) -> tuple[int, dict[int, int]]:
    """The peak and the bytes per plan step live then, by copying the live buffers at each new high."""
    steps = [s for s in program.steps if s.step < len(plan.steps)]
    dead = RankProgram(program.rank, program.world, tuple(steps)).dead_after()
    prepared = {k for k, s in enumerate(plan.steps) if s.out in plan.prepared}
    owner, users, size, made_by, placed = {}, {}, {}, {}, {}
    live, peak, at_peak = 0, 0, {}
    for step, gone in zip(steps, dead):
        dtype = plan.dtypes[step.out]
        source = viewed(step)
        view = source is not None
        if isinstance(step, PlaceBlock) or step.step in prepared:
            made = 0 if view else block_bytes(step.block if isinstance(step, PlaceBlock) else step.out_block, dtype)
            placed[step.step] = placed.get(step.step, 0) + made
            owner[step.out] = None
            continue
        if view:
            owner[step.out] = owner[source]
        else:
            owner[step.out], size[step.out], made_by[step.out] = step.out, block_bytes(step.out_block, dtype), step.step
            live += size[step.out]
        if owner[step.out] is not None:
            users[owner[step.out]] = users.get(owner[step.out], 0) + 1
        if live > peak:
            peak, at_peak = live, dict(size)
        for name in gone:
            base = owner.pop(name, None)
            if base is not None:
                users[base] -= 1
                if users[base] == 0:
                    live -= size.pop(base)
    held = dict(placed)
    for buffer, n in at_peak.items():
        held[made_by[buffer]] = held.get(made_by[buffer], 0) + n
    return sum(placed.values()) + peak, held
