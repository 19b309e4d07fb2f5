"""`cost.memory.rank_peaks` finds the buffers live at a rank's peak from when each was made and freed, not by
copying the live set at every new high (quadratic in a deep plan's steps): the same peak and the same steps
holding it as that snapshot (the reference below), on training plans with views, reshards and prepared steps."""
from __future__ import annotations

import pytest
from training_helpers import adam_step

import tapestry
from tapestry.cost import rank_peaks
from tapestry.cost.memory import block_bytes
from tapestry.lower.program import Local, PlaceBlock, RankProgram, lower
from tapestry.models import mlp
from tapestry.plan import Place, Plan, build_plan
from tapestry.training.plans import baselines


def snapshot_peak(plan: Plan, program: RankProgram) -> tuple[int, dict[int, int]]:
    """The peak and the bytes per plan step live then, by copying the live buffers at each new high."""
    steps = [s for s in program.steps if s.step < len(plan.steps)]
    dead = RankProgram(program.rank, program.world, tuple(steps)).dead_after()
    prepared = {k for k, s in enumerate(plan.steps) if s.out in plan.prepared}
    owner, users, size, made_by, placed = {}, {}, {}, {}, {}
    live, peak, at_peak = 0, 0, {}
    for step, gone in zip(steps, dead):
        dtype = plan.dtypes[step.out]
        view = isinstance(step, Local) and step.src_block is not None and step.src_block.contains(step.out_block)
        if isinstance(step, PlaceBlock) or step.step in prepared:
            made = 0 if view else block_bytes(step.block if isinstance(step, PlaceBlock) else step.out_block, dtype)
            placed[step.step] = placed.get(step.step, 0) + made
            owner[step.out] = None
            continue
        if view:
            owner[step.out] = owner[step.src]
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


def plans() -> list[Plan]:
    graph = adam_step(16, 32, 8)[0].graph
    mesh = tapestry.Mesh(2, 2)
    return [build_plan(mlp(depth=4, batch=4, width=32), tapestry.Mesh(2)), build_plan(graph, mesh),
            *baselines(graph, mesh).values()]


@pytest.mark.parametrize("plan", plans(), ids=lambda p: f"{len(p.steps)} steps on {p.mesh}")
def test_each_ranks_peak_and_what_holds_it_are_the_live_set_at_its_first_highest_moment(plan: Plan) -> None:
    found = rank_peaks(plan)
    expected = [snapshot_peak(plan, program) for program in lower(plan, pieces=False).ranks]
    assert [(p.bytes, dict(p.live)) for p in found] == expected
    places = sum(isinstance(s, Place) for s in plan.steps)
    assert any(len(live) > places for _, live in expected)  # activations live at the peak, not only inputs
