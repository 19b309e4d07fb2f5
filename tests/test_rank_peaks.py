"""`cost.memory.rank_peaks` finds the buffers live at a rank's peak from when each was made and freed, not by
copying the live set at every new high (quadratic in a deep plan's steps), lowers each step alike but for its
names once, and walks one rank per group of ranks alike in every step: the same peak and the same steps holding it
as that snapshot of every rank's lowered program (tests/rank_peak_reference.py), on training plans with views,
reshards and prepared steps, and on plans whose ranks hold unequal shards."""
from __future__ import annotations

import dataclasses
import random

import pytest
from rank_peak_reference import snapshot_peak
from test_plan import fresh_layouts
from training_helpers import adam_step

import tapestry
from tapestry.cost import rank_peaks
from tapestry.cost.memory import Lowerings, _alike_ranks, _parts, layout_bytes, most_elements
from tapestry.graph import Graph
from tapestry.lower import program
from tapestry.lower.program import lower
from tapestry.models import mlp
from tapestry.plan import Compute, Place, Plan, build_plan
from tapestry.sharding import Layout
from tapestry.training.plans import baselines
from tapestry.zspace import ZRange

CUBE = tapestry.Mesh(2, 2, 2)


def uneven(axes: dict[str, tuple[int | None, ...]]) -> Plan:
    """Four matmul -> relu layers on 2x2x2, 5 rows split over axis 0 (3 and 2): two kinds of rank, by row count.
    build_plan makes each layer's steps once, so the later layers share the first's blocks, as copies do."""
    g = Graph()
    value = g.input("x", (5, 12))
    for k in range(4):
        value = g.relu(g.matmul(value, g.input(f"w{k}", (12, 12)), name=f"mm{k}"), name=f"act{k}")
    g.output("y", value)
    return build_plan(g, CUBE, {f"{op}{k}": split for op, split in axes.items() for k in range(4)})


UNEVEN = {  # where the unequal shards are reshared: all-gathers, reduce-scatters, views (Local)
    "gathered": {"mm": (0, None, 1), "act": (0, 1, None)},
    "summed": {"mm": (0, 2, None), "act": (0, 1, None)},
    "viewed": {"mm": (0, None, None)},
}


def plans() -> list[Plan]:
    graph = adam_step(16, 32, 8)[0].graph
    mesh = tapestry.Mesh(2, 2)
    return [build_plan(mlp(depth=4, batch=4, width=32), tapestry.Mesh(2)), build_plan(graph, mesh),
            *baselines(graph, mesh).values(), *baselines(graph, CUBE).values(), *map(uneven, UNEVEN.values())]


@pytest.mark.parametrize("plan", plans(), ids=lambda p: f"{len(p.steps)} steps on {p.mesh}")
def test_each_ranks_peak_and_what_holds_it_are_the_live_set_at_its_first_highest_moment(plan: Plan) -> None:
    found = rank_peaks(plan)
    expected = [snapshot_peak(plan, program) for program in lower(plan, pieces=False).ranks]
    assert [(p.bytes, dict(p.live)) for p in found] == expected
    places = sum(isinstance(s, Place) for s in plan.steps)
    assert any(len(live) > places for _, live in expected)  # activations live at the peak, not only inputs


@pytest.mark.parametrize("name", UNEVEN)
def test_ranks_holding_unequal_shards_are_walked_apart_and_each_peaks_as_its_own_program(name: str) -> None:
    plan = uneven(UNEVEN[name])
    assert _alike_ranks(_parts(plan), CUBE.size) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 3 rows, then 2
    expected = [snapshot_peak(plan, program)[0] for program in lower(plan).ranks]
    assert [p.bytes for p in rank_peaks(plan)] == expected
    assert expected[0] > expected[4]


def test_the_ranks_of_an_even_data_parallel_step_are_one_group() -> None:
    plan = baselines(adam_step(16, 32, 8)[0].graph, CUBE)["data parallel"]
    assert _alike_ranks(_parts(plan), CUBE.size) == [list(range(CUBE.size))]


def test_steps_alike_but_for_their_names_are_lowered_once_and_peak_as_the_plan_sharing_nothing(monkeypatch):
    """build_plan's later layers share the first's blocks, as an expanded plan's copies do: each such step is
    lowered once, and the peaks are those of the same plan whose steps share nothing (each lowered alone)."""
    shared = uneven(UNEVEN["gathered"])
    alone = dataclasses.replace(shared, steps=tuple(
        dataclasses.replace(s, blocks=tuple(list(s.blocks))) if isinstance(s, Compute) else s for s in shared.steps))
    lowered: list[int] = []  # the Compute steps lowered
    lower_step = program.lower_step

    def counted(index, step, *args, **kwargs):
        lowered.extend([index] if isinstance(step, Compute) else [])
        return lower_step(index, step, *args, **kwargs)

    monkeypatch.setattr(program, "lower_step", counted)
    once = rank_peaks(shared)
    shared_calls = len(lowered)
    lowered.clear()
    assert rank_peaks(alone) == once
    assert len(lowered) == sum(isinstance(s, Compute) for s in alone.steps) == 4 * shared_calls


def alike_ranks_by_refinement(parts: list[tuple], size: int) -> list[list[int]]:
    """`_alike_ranks` as it was before it compared numbered columns: each distinct row refines the groups by the
    identity of each rank's part, groups numbered in the order of their first rank."""
    group = [0] * size
    for row in {id(row): row for row in parts}.values():
        found: dict[tuple[int, int], int] = {}
        group = [found.setdefault((g, id(part)), len(found)) for g, part in zip(group, row)]
    ranks: dict[int, list[int]] = {}
    for rank, g in enumerate(group):
        ranks.setdefault(g, []).append(rank)
    return list(ranks.values())


@pytest.mark.parametrize("seed", range(40))
def test_ranks_compared_as_numbered_columns_group_as_refining_row_by_row(seed: int) -> None:
    """Random rows of a few part objects (and None), some rows repeated as one object: the same groups in the same
    order as refining by each row; a Lowerings' row numbers reused across calls change nothing."""
    rng = random.Random(seed)
    size = rng.choice([1, 2, 8, 64, 512])
    pool = [None, *(object() for _ in range(rng.randint(1, 4)))]
    rows = [tuple(rng.choice(pool[:rng.randint(1, len(pool))]) for _ in range(size)) for _ in range(rng.randint(0, 6))]
    parts = [rng.choice(rows) for _ in range(rng.randint(0, 12))] if rows else []
    lowerings = Lowerings()
    expected = alike_ranks_by_refinement(parts, size)
    assert _alike_ranks(parts, size) == expected
    assert _alike_ranks(parts, size, lowerings) == expected == _alike_ranks(parts, size, lowerings)


def test_steps_naming_equal_layout_objects_are_lowered_once_and_peak_as_those_sharing_them(monkeypatch):
    """Every layout of a plan copied into an equal object of its own (no two steps share one): each step alike but
    for its names is still lowered once (the key numbers layouts by value), and every rank's peak is the same."""
    shared = uneven(UNEVEN["summed"])
    apart = fresh_layouts(shared)
    lowered: list[int] = []
    lower_step = program.lower_step

    def counted(index, step, *args, **kwargs):
        lowered.append(index)
        return lower_step(index, step, *args, **kwargs)

    monkeypatch.setattr(program, "lower_step", counted)
    once = rank_peaks(shared)
    shared_calls = len(lowered)
    lowered.clear()
    assert rank_peaks(apart) == once
    assert len(lowered) == shared_calls < len(shared.steps)
    lowered.clear()
    lowerings = Lowerings()
    rank_peaks(shared, lowerings)
    assert rank_peaks(apart, lowerings) == once  # the second plan's steps: all lowered by the first's keys
    assert len(lowered) == shared_calls


def test_a_layouts_most_elements_are_the_largest_of_its_blocks_bytes_per_itemsize() -> None:
    mesh = tapestry.Mesh(2, 2, 2)
    layouts = [Layout.split((5, 12), mesh, (0, 1, None)), Layout.replicated((3,), mesh), Layout.replicated((), mesh),
               Layout((ZRange((0, 0), (3, 4)), None, *[ZRange((1, 2), (2, 9))] * 6)), Layout((None,) * 8),
               *(layout for plan in plans() for step in plan.steps for layout in [step.layout])]
    for layout in layouts:
        assert most_elements(layout) * 2 == max(layout_bytes(layout, "bfloat16"), default=0)
