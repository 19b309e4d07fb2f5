"""Fast reshard pricing against its oracle: the box-by-box group search, classification and counting that
sharding.collectives, cost.comm and can_move did before they worked on block arrays (issue 12). Both must agree on every
group (ranks, blocks, axes, collective), every count and every refusal, on random layout pairs: even and uneven
splits, replicated axes, idle devices, empty blocks, partial sums, on 1-D to 3-D meshes."""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import replace
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tapestry.cost.comm import moves
from tapestry.sharding import Layout, Mesh, comm
from tapestry.sharding.collectives import Collective, Group, reshard_groups
from tapestry.sharding.collectives import _classify as collective_of
from tapestry.sharding.comm import CommError, box_difference, can_move, overlap, received_counts, transfers, within
from tapestry.zspace import ZRange

# -- the oracle: box arithmetic one block at a time ------------------------------------------------------------


def oracle_groups(src: Layout, dst: Layout, mesh: Mesh) -> tuple[Group, ...]:
    every = tuple(range(mesh.ndim))
    subsets = [a for n in range(mesh.ndim) for a in itertools.combinations(every, n)]
    for axes in sorted(subsets, key=lambda a: math.prod(mesh.shape[i] for i in a)):
        fibres = mesh.fibres(axes)
        if all(_self_sufficient(src, dst, ranks) for ranks in fibres):
            return tuple(_group(src, dst, mesh, axes, ranks) for ranks in fibres)
    return (_group(src, dst, mesh, every, tuple(mesh.devices)),)


def oracle_counts(src: Layout, dst: Layout, mesh: Mesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    received, messages = [0] * len(dst.blocks), [0] * len(dst.blocks)
    for group in oracle_groups(src, dst, mesh):
        local = _local(group.src, group.dst)
        if local is not None:
            for rank, cells, count in zip(group.ranks, *received_counts(*local[:2])):
                received[rank], messages[rank] = cells, count
    return tuple(received), tuple(messages)


def oracle_can_move(src: Layout, dst: Layout) -> bool:
    if dst.partial:
        return False
    if src.partial:
        return True
    held = [b for b in src.blocks if b is not None]
    return not any(_missing(need, held) for need in dst.blocks if need is not None)


def _missing(need: ZRange, held: list[ZRange]) -> list[ZRange]:
    """The boxes of `need` that no block of `held` holds."""
    missing = [need]
    for have in held:
        missing = [piece for m in missing for piece in box_difference(m, have)]
    return missing


def _self_sufficient(src: Layout, dst: Layout, ranks: tuple[int, ...]) -> bool:
    members = set(ranks)
    for rank in ranks:
        need = dst.blocks[rank]
        if need is None:
            continue
        if src.partial:
            if any(k not in members and overlap(held, need) is not None for k, held in enumerate(src.blocks)):
                return False
            continue
        held = [b for b in (src.blocks[k] for k in ranks) if b is not None]
        if not any(h.contains(need) for h in held) and _missing(need, held):
            return False
    return True


def _local(src: Layout, dst: Layout) -> tuple[Layout, Layout, tuple[int, ...]] | None:
    held = [b for layout in (src, dst) for b in layout.blocks if b is not None]
    if not held:
        return None
    box = ZRange.bounding(held)

    def shifted(b: ZRange | None) -> ZRange | None:
        return None if b is None else ZRange(tuple(map(operator.sub, b.start, box.start)),
                                             tuple(map(operator.sub, b.end, box.start)))

    return (Layout(tuple(map(shifted, src.blocks)), src.partial), Layout(tuple(map(shifted, dst.blocks))),
            box.shape)


def _group(src: Layout, dst: Layout, mesh: Mesh, axes: tuple[int, ...], ranks: tuple[int, ...]) -> Group:
    mine = Layout(tuple(src.blocks[r] for r in ranks), src.partial), Layout(tuple(dst.blocks[r] for r in ranks))
    local = _local(*mine)
    if local is None:
        return Group(ranks, *mine, axes, Collective.NOOP)
    return Group(ranks, *mine, axes, _classify(*local, Mesh(*(mesh.shape[a] for a in axes)) if axes else Mesh(1)))


def _classify(src: Layout, dst: Layout, shape: tuple[int, ...], mesh: Mesh) -> Collective:
    """As before the fast path: planned moves decide whether the group moves anything; naming the collective of
    one that does is the same code then and now (collectives._classify)."""
    return collective_of(src, dst, shape, mesh) if transfers(src, dst) else Collective.NOOP


# -- random layout pairs ---------------------------------------------------------------------------------------

MESHES = [Mesh(1), Mesh(3), Mesh(4), Mesh(2, 2), Mesh(2, 3), Mesh(2, 2, 2), Mesh(1, 2, 2)]


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[Layout, Layout, tuple[int, ...], Mesh]:
    mesh = draw(st.sampled_from(MESHES))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
    return draw(layouts(shape, mesh)), draw(layouts(shape, mesh)), shape, mesh


@st.composite
def layouts(draw: st.DrawFn, shape: tuple[int, ...], mesh: Mesh) -> Layout:
    """A split (even or not, some axes replicated), replicated or arbitrary layout; some devices may idle."""
    kind = draw(st.sampled_from(["split", "replicated", "boxes"]))
    if kind == "split":
        dims = tuple(draw(st.sampled_from([None, *range(len(shape))])) for _ in mesh.shape)
        blocks = Layout.split(shape, mesh, dims).blocks
    elif kind == "replicated":
        blocks = Layout.replicated(shape, mesh).blocks
    else:
        blocks = tuple(draw(boxes(shape)) for _ in mesh.devices)
    idle = draw(st.lists(st.booleans(), min_size=mesh.size, max_size=mesh.size))
    if draw(st.booleans()):
        blocks = tuple(None if off else b for b, off in zip(blocks, idle))
    return Layout(blocks, partial=draw(st.booleans()) and draw(st.booleans()))


@st.composite
def boxes(draw: st.DrawFn, shape: tuple[int, ...]) -> ZRange | None:
    if draw(st.integers(0, 5)) == 0:
        return None
    bounds = [sorted(draw(st.tuples(st.integers(0, n), st.integers(0, n)))) for n in shape]
    return ZRange(tuple(lo for lo, _ in bounds), tuple(hi for _, hi in bounds))


def _outcome(fn, *args):
    try:
        return fn(*args)
    except CommError:
        return CommError


@settings(max_examples=1500, deadline=None)
@given(pair=layout_pairs())
def test_groups_kinds_and_counts_match_the_box_by_box_oracle(pair):
    src, dst, shape, mesh = pair
    expected = _outcome(oracle_groups, src, dst, mesh)
    assert _outcome(reshard_groups, src, dst, shape, mesh) == expected
    if expected is CommError:
        return
    moved = moves(src, dst, shape, mesh)
    assert (moved.received, moved.messages) == oracle_counts(src, dst, mesh)
    assert moved.axes == expected[0].axes


@settings(max_examples=500, deadline=None)
@given(pair=layout_pairs())
def test_senders_found_block_by_block_on_few_devices_are_the_vectorized_tests(pair):
    """`_meeting` tries each block in turn on up to LOOPED_DEVICES devices (every mesh above), with numpy past
    them: the same devices in the same ring order either way."""
    src, dst, _, _ = pair
    needs = [(k, need) for k, need in enumerate(dst.blocks) if need is not None]
    looped = [comm._meeting(src, need, k) for k, need in needs]
    with mock.patch.object(comm, "LOOPED_DEVICES", 0):
        assert [comm._meeting(src, need, k) for k, need in needs] == looped


@settings(max_examples=1000, deadline=None)
@given(pair=layout_pairs())
def test_moves_within_the_destinations_box_are_the_moves_moved_there(pair):
    """`received_counts` plans the pair clipped to the box the destination's blocks span and moved to its origin:
    the same moves, each region moved by that origin, and the same refusals."""
    src, dst, _, _ = pair
    expected = _outcome(transfers, src, dst)
    clipped_src, moved_dst = within(src, dst)
    got = _outcome(transfers, clipped_src, moved_dst)
    if expected is CommError or moved_dst is dst:
        assert got == expected
        return
    origin = ZRange.bounding([b for b in dst.blocks if b is not None]).start
    assert got == tuple(replace(t, region=t.region.translate(tuple(-x for x in origin))) for t in expected)


@settings(max_examples=1000, deadline=None)
@given(pair=layout_pairs())
def test_can_move_matches_the_box_by_box_oracle(pair):
    src, dst, _, _ = pair
    assert can_move(src, dst) == oracle_can_move(src, dst)


@pytest.mark.parametrize("mesh", MESHES)
def test_named_layouts_match_the_oracle_on_every_pair(mesh):
    """Every split, replicated and partial layout of a tensor split evenly along one dim, unevenly along the
    other, each to each."""
    for shape in [(3, 4)]:
        named = [Layout.split(shape, mesh, dims) for dims in itertools.product([None, 0, 1], repeat=mesh.ndim)]
        named += [Layout(layout.blocks, partial=True) for layout in named]
        for src, dst in itertools.product(named, named):
            expected = _outcome(oracle_groups, src, dst, mesh)
            assert _outcome(reshard_groups, src, dst, shape, mesh) == expected, (src, dst)
            if expected is not CommError:
                moved = moves(src, dst, shape, mesh)
                assert (moved.received, moved.messages) == oracle_counts(src, dst, mesh), (src, dst)
