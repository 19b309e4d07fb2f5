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
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from layout_helpers import boxes, layouts, pairs
from sweeps import draws, strided

from tapestry.cost.comm import moves
from tapestry.sharding import Layout, Mesh, comm
from tapestry.sharding.collectives import Collective, Group, classify_reshard, local_layouts, reshard_groups
from tapestry.sharding.collectives import _classify as collective_of
from tapestry.sharding.comm import CommError, box_difference, can_move, overlap, received_counts, transfers, within
from tapestry.sharding.grid import cells
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


def _outcome(fn, *args):
    try:
        return fn(*args)
    except CommError:
        return CommError


@draws(300, 1500)
def test_groups_kinds_and_counts_match_the_box_by_box_oracle(examples: int) -> None:
    @settings(max_examples=examples, deadline=None)
    @given(pair=layout_pairs())
    def check(pair):
        src, dst, shape, mesh = pair
        expected = _outcome(oracle_groups, src, dst, mesh)
        assert _outcome(reshard_groups, src, dst, shape, mesh) == expected
        if expected is CommError:
            return
        moved = moves(src, dst, shape, mesh)
        assert (moved.received, moved.messages) == oracle_counts(src, dst, mesh)
        assert moved.axes == expected[0].axes
        assert moved.kind == classify_reshard(src, dst, shape, mesh)

    check()


def test_a_move_into_part_of_the_value_keeps_its_collective_when_priced_on_the_part():
    """Pricing clips the source to the box the destination's blocks span (`cost.comm.moves`). Gathering the first
    half of a split vector onto both devices is a send/recv: device 1's block lies outside that half. Clipped, the
    pair would read as an all-gather of the half (device 1's block an empty piece of it); its price must not."""
    mesh, shape = Mesh(2), (4,)
    src = Layout.split(shape, mesh, (0,))
    half = Layout((ZRange((0,), (2,)),) * 2)
    assert classify_reshard(src, half, shape, mesh) == Collective.SEND_RECV
    assert moves(src, half, shape, mesh).kind == Collective.SEND_RECV


@draws(100, 500)
def test_a_pair_moved_to_the_box_its_blocks_span_is_each_block_moved_by_its_corner(examples: int) -> None:
    """`local_layouts` (made from each layout's span and shifted copy) against `_local` (every held block's
    bounding box, each block moved by its start): the same blocks, partial flags and shape, and None for a pair
    holding nothing. The local blocks touch 0 and the box's far side on every dim, and the pair moved anywhere
    has the same local layouts: groups that are translations of one another are one collective."""
    @settings(max_examples=examples, deadline=None)
    @given(pair=layout_pairs(), offset=st.lists(st.integers(0, 5), min_size=3, max_size=3))
    def check(pair, offset):
        src, dst, shape, _ = pair
        expected = _local(src, dst)
        got = local_layouts(src, dst)
        offset = tuple(offset[:len(shape)])
        moved = [Layout(tuple(None if b is None else b.translate(offset) for b in layout.blocks), layout.partial)
                 for layout in (src, dst)]
        assert local_layouts(*moved) == got
        if expected is None:
            assert got is None
            return
        assert got == (expected[0], replace(expected[1], partial=dst.partial), expected[2])
        held = [b for layout in got[:2] for b in layout.blocks if b is not None]
        assert [min(b.start[d] for b in held) for d in range(len(shape))] == [0] * len(shape)
        assert [max(b.end[d] for b in held) for d in range(len(shape))] == list(got[2])

    check()


@draws(100, 500)
def test_senders_found_block_by_block_on_few_devices_are_the_vectorized_tests(examples: int) -> None:
    """`_meeting` tries each block in turn on up to LOOPED_DEVICES devices (every mesh above), with numpy past
    them: the same devices in the same ring order either way."""
    @settings(max_examples=examples, deadline=None)
    @given(pair=layout_pairs())
    def check(pair):
        src, dst, _, _ = pair
        needs = [(k, need) for k, need in enumerate(dst.blocks) if need is not None]
        looped = [comm._meeting(src, need, k) for k, need in needs]
        with mock.patch.object(comm, "LOOPED_DEVICES", 0):
            assert [comm._meeting(src, need, k) for k, need in needs] == looped

    check()


@draws(200, 1000)
def test_moves_within_the_destinations_box_are_the_moves_moved_there(examples: int) -> None:
    """`received_counts` plans the pair clipped to the box the destination's blocks span and moved to its origin:
    the same moves, each region moved by that origin, and the same refusals."""
    @settings(max_examples=examples, deadline=None)
    @given(pair=layout_pairs())
    def check(pair):
        src, dst, _, _ = pair
        expected = _outcome(transfers, src, dst)
        clipped_src, moved_dst = within(src, dst)
        got = _outcome(transfers, clipped_src, moved_dst)
        if expected is CommError or moved_dst is dst:
            assert got == expected
            return
        origin = ZRange.bounding([b for b in dst.blocks if b is not None]).start
        assert got == tuple(replace(t, region=t.region.translate(tuple(-x for x in origin))) for t in expected)

    check()


@draws(100, 500)
def test_blocks_inside_a_box_tested_as_arrays_past_few_devices_are_the_block_by_block_test(examples: int) -> None:
    """`can_move` tests a destination's blocks against the source's filled box block by block on up to
    LOOPED_DEVICES devices (every mesh above), as one array test past them: the same answer either way."""
    @settings(max_examples=examples, deadline=None)
    @given(data=st.data())
    def check(data):
        _, dst, shape, _ = data.draw(layout_pairs())
        box = data.draw(boxes(shape))
        assume(box is not None)
        looped = comm._within(dst, box)
        assert looped == all(b is None or b.is_empty or box.contains(b) for b in dst.blocks)
        with mock.patch.object(comm, "LOOPED_DEVICES", 0):
            assert comm._within(dst, box) == looped

    check()


@draws(200, 1000)
def test_a_few_boxes_cover_a_box_as_the_box_by_box_oracle_says_counting_their_union(examples: int) -> None:
    """`union_covers` answers for up to UNION_BOXES distinct parts meeting the box (inclusion-exclusion), and
    says so where it does not answer; `filled_box` agrees with the cell grid either way."""
    @settings(max_examples=examples, deadline=None)
    @given(data=st.data())
    def check(data):
        shape = tuple(data.draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
        held = [b for b in data.draw(st.lists(boxes(shape), min_size=1, max_size=6)) if b is not None]
        box = data.draw(boxes(shape))
        assume(held and box is not None)
        found = comm.union_covers(held, box)
        parts = {overlap(b, box) for b in held} - {None}
        assert found is not None or len({p for p in parts if not p.is_empty}) > comm.UNION_BOXES
        assert found in (None, not _missing(box, held))
        has, _ = cells(Layout(tuple(held)), Layout(tuple(held)))
        assert (comm.filled_box(Layout(tuple(held))) is not None) == bool(has.any(axis=0).all())

    check()


@draws(200, 1000)
def test_can_move_matches_the_box_by_box_oracle(examples: int) -> None:
    @settings(max_examples=examples, deadline=None)
    @given(pair=layout_pairs())
    def check(pair):
        src, dst, _, _ = pair
        assert can_move(src, dst) == oracle_can_move(src, dst)

    check()


@pytest.mark.parametrize(("mesh", "every"), strided([(mesh,) for mesh in MESHES], {"2x2x2": 5, "1x2x2": 5}))
def test_named_layouts_match_the_oracle_on_every_pair(mesh, every):
    """Every split, replicated and partial layout of a tensor split evenly along one dim, unevenly along the
    other, each to each (or each every-th pair)."""
    for shape in [(3, 4)]:
        named = [Layout.split(shape, mesh, dims) for dims in itertools.product([None, 0, 1], repeat=mesh.ndim)]
        named += [Layout(layout.blocks, partial=True) for layout in named]
        for src, dst in pairs(named, named, every):
            expected = _outcome(oracle_groups, src, dst, mesh)
            assert _outcome(reshard_groups, src, dst, shape, mesh) == expected, (src, dst)
            if expected is not CommError:
                moved = moves(src, dst, shape, mesh)
                assert (moved.received, moved.messages) == oracle_counts(src, dst, mesh), (src, dst)


def _planned_counts(src: Layout, dst: Layout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per device the cells and messages of the block moves `transfers` plans for the pair within the
    destination's box (what `received_counts` counted before it counted grids without planning)."""
    cells, messages = [0] * len(dst.blocks), [0] * len(dst.blocks)
    for t in transfers(*within(src, dst)):
        cells[t.dst] += t.region.size
        messages[t.dst] += 1
    return tuple(cells), tuple(messages)


@draws(200, 1000)
def test_received_counts_are_the_planned_moves_counts(examples: int) -> None:
    """Grids counted without planning, box by box on up to LOOPED_DEVICES devices (every mesh here) and as arrays
    past them, other pairs by their planned moves: the same cells, messages and refusals either way."""
    @settings(max_examples=examples, deadline=None)
    @given(pair=layout_pairs())
    def check(pair):
        src, dst, _, _ = pair
        planned = _outcome(_planned_counts, src, dst)
        received_counts.cache_clear()
        assert _outcome(received_counts, src, dst) == planned
        received_counts.cache_clear()
        with mock.patch.object(comm, "LOOPED_DEVICES", 0):
            assert _outcome(received_counts, src, dst) == planned

    check()


def test_splits_on_a_few_devices_are_counted_without_planning_moves():
    """Every pair of splits of a tensor on 2x2, counted box by box (`_looped_grid_counts`): no move planned."""
    mesh, shape = Mesh(2, 2), (4, 6)
    splits = [Layout.split(shape, mesh, dims) for dims in itertools.product([None, 0, 1], repeat=mesh.ndim)]
    expected = {(src, dst): _planned_counts(src, dst) for src, dst in itertools.product(splits, splits)}
    received_counts.cache_clear()
    with mock.patch.object(comm, "transfers", side_effect=AssertionError("planned the moves")):
        assert {pair: received_counts(*pair) for pair in expected} == expected


def _footprints(shape: tuple[int, ...], mesh: Mesh) -> list[Layout]:
    """What readers of a packed value need: its first third along the last dim, whole on every device or split over
    the mesh's axes, as a fused backward's dq slice is read."""
    third = ZRange.from_shape(shape[:-1] + (shape[-1] // 3,))
    split = [Layout.split(third.shape, mesh, dims) for dims in itertools.product([None, 0, len(shape) - 1],
                                                                                 repeat=mesh.ndim)]
    return [Layout.replicated(third.shape, mesh), *split]


@pytest.mark.parametrize(("mesh", "every"), strided([(Mesh(4, 8),), (Mesh(2, 2, 4),)], {"2x2x4": 5}))
def test_splits_into_footprints_count_as_their_planned_moves(mesh, every):
    """Even and uneven splits (some axes replicated) into slices of the tensor on 32 and 16 devices (each to each,
    or each every-th pair): the grid counts are `transfers`' counts."""
    shape = (4, 10, 9)
    splits = [Layout.split(shape, mesh, dims) for dims in itertools.product([None, 0, 1, 2], repeat=mesh.ndim)]
    for src, dst in pairs(splits, _footprints(shape, mesh) + splits[::7], every):
        assert received_counts(src, dst) == _planned_counts(src, dst), (src, dst)


def test_a_split_gathered_into_a_slice_on_512_devices_is_counted_without_planning_moves():
    """A 512-way split gathered into a slice on every device: 511 messages each, counted on the grid its blocks
    form (planning its 261,632 block moves took seconds, most of pricing a 7B-wide step on 8x8x8)."""
    mesh = Mesh(8, 8, 8)
    shape = (8, 32, 2048, 384)
    src = Layout.split(shape, mesh, (1, 2, 2))
    dst = _footprints(shape, mesh)[0]
    with mock.patch.object(comm, "transfers", side_effect=AssertionError("planned the moves")):
        cells, messages = received_counts(src, dst)
    own = 8 * 4 * 32 * 128
    assert set(messages) == {511} and set(cells) == {8 * 32 * 2048 * 128 - own}
