"""Specification of the islpy bridge, and agreement of the closed forms with islpy."""

import islpy as isl
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from sweeps import draws
from zspace_helpers import F, PROPERTY, R, projected_ranges, zr, zranges

from tapestry.zspace import (
    IndexProjection,
    ZAffineMap,
    ZRange,
    bounding_box,
    box_of,
    covers,
    difference,
    footprint,
    is_partition,
    partition_problems,
    set_size,
    to_isl_map,
    to_isl_set,
)

# --- conversions ---


def test_set_of_a_range_has_its_cells():
    assert to_isl_set(R) == isl.Set("{ [i, j] : 0 <= i < 2 and 0 <= j < 3 }")


def test_set_of_a_zero_dim_range_is_one_point():
    assert set_size(to_isl_set(ZRange((), ()))) == 1


def test_set_of_an_empty_range_is_empty():
    assert to_isl_set(zr("zr[2:2, 0:3]")).is_empty()


def test_map_relates_an_index_point_to_the_cells_of_its_box():
    cells = to_isl_map(F).intersect_domain(to_isl_set(zr("zr[5:6, 6:7]"))).range()
    assert box_of(cells) == F.apply((5, 6))


def test_footprint_of_a_range_is_the_union_of_its_points_boxes():
    r = zr("zr[5:7, 6:8]")
    union = isl.Set.empty(to_isl_set(F.apply(r)).get_space())
    for p in r.points():
        union = union.union(to_isl_set(F.apply(p)))
    assert footprint(F, r) == union


def test_footprint_rejects_range_of_wrong_ndim():
    with pytest.raises(ValueError, match="ndim mismatch"):
        footprint(F, zr("zr[0:1]"))


# --- boxes ---


def test_box_of_a_box_is_its_range():
    assert box_of(isl.Set("{ [i, j] : 1 <= i <= 3 and -2 <= j <= 0 }")) == zr("zr[1:4, -2:1]")


def test_box_of_a_box_split_into_pieces_is_its_range():
    assert box_of(to_isl_set(zr("zr[0:2]")).union(to_isl_set(zr("zr[2:5]")))) == zr("zr[0:5]")


def test_box_of_a_set_with_holes_is_none():
    assert box_of(isl.Set("{ [t] : t mod 2 = 0 and 0 <= t <= 4 }")) is None


def test_box_of_an_empty_set_is_none():
    assert box_of(to_isl_set(zr("zr[1:1]"))) is None


def test_bounding_box_of_a_set_with_holes_spans_it():
    assert bounding_box(isl.Set("{ [t] : t mod 2 = 0 and 0 <= t <= 4 }")) == zr("zr[0:5]")


def test_bounding_box_rejects_unbounded_sets():
    with pytest.raises(ValueError, match="unbounded set"):
        bounding_box(isl.Set("{ [t] : t >= 0 }"))


# --- partitions ---


def test_split_pieces_partition_the_range():
    assert is_partition(R.split(1, 2), R)


def test_partition_problems_names_a_gap():
    assert partition_problems([zr("zr[0:2]"), zr("zr[3:5]")], zr("zr[0:5]")) == ["gap: zr[2:3]"]


def test_partition_problems_names_an_overlap():
    problems = partition_problems([zr("zr[0:3]"), zr("zr[3:5]"), zr("zr[2:3]")], zr("zr[0:5]"))
    assert problems == ["overlap between part 0 zr[0:3] and part 2 zr[2:3]: zr[2:3]"]


def test_partition_problems_names_a_part_outside_the_whole():
    problems = partition_problems([zr("zr[0:5]"), zr("zr[5:6]")], zr("zr[0:5]"))
    assert problems == ["part 1 zr[5:6] lies outside zr[0:5]"]


def test_covering_with_overlaps_is_not_a_partition():
    parts = [zr("zr[0:3]"), zr("zr[2:5]")]
    assert covers(parts, zr("zr[0:5]")) and not is_partition(parts, zr("zr[0:5]"))


def test_partition_problems_rejects_parts_of_wrong_ndim():
    with pytest.raises(ValueError, match="ndim mismatch"):
        partition_problems([zr("zr[0:1]")], R)


# --- coverage and communication sets ---


def test_blocks_cover_a_target_spanning_them():
    assert covers([zr("zr[0:2, 0:3]"), zr("zr[2:4, 0:3]")], zr("zr[1:3, 1:2]"))


def test_blocks_do_not_cover_a_target_reaching_past_them():
    assert not covers([zr("zr[0:2, 0:3]"), zr("zr[2:4, 0:3]")], zr("zr[1:3, 1:4]"))


def test_difference_is_what_is_needed_but_not_held():
    needed, held = zr("zr[0:4, 0:4]"), zr("zr[1:3, 1:3]")
    assert set_size(difference(needed, held)) == 12


def test_difference_accepts_isl_sets():
    assert difference(to_isl_set(R), R).is_empty()


def test_set_size_rejects_unbounded_sets():
    with pytest.raises(ValueError, match="unbounded set"):
        set_size(isl.Set("{ [t] : t >= 0 }"))


# --- the closed forms agree with islpy ---


@draws(50, 150)
def test_projection_of_a_range_is_the_bounding_box_of_its_isl_footprint(examples: int) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(projected_ranges())
    def check(pr):
        p, r = pr
        cells = footprint(p, r)
        if cells.is_empty():  # a 0-dim range cannot be empty, so a scalar tensor still yields zr[]
            assert p.apply(r).is_empty or p.out_dim == 0
        else:
            assert p.apply(r) == bounding_box(cells)
            assert box_of(cells) in (None, p.apply(r))

    check()


def test_mixed_sign_footprint_is_the_exact_box():
    p = IndexProjection(ZAffineMap([[1, -1]]))
    assert box_of(footprint(p, zr("zr[0:2, 0:2]"))) == p.apply(zr("zr[0:2, 0:2]")) == zr("zr[-1:2]")


range_pairs = st.integers(0, 3).flatmap(lambda n: st.tuples(zranges(n), zranges(n)))


@draws(50, 150)
def test_intersection_agrees_with_isl(examples: int) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(range_pairs)
    def check(pair):
        a, b = pair
        result = a.intersection(b)
        shared = to_isl_set(a).intersect(to_isl_set(b))
        if not shared.is_empty():
            assert result == box_of(shared)
        # Boxes touch or overlap exactly when their closures [start, end] meet.
        closure = lambda r: to_isl_set(ZRange(r.start, [e + 1 for e in r.end]))  # noqa: E731
        assert (result is None) == closure(a).intersect(closure(b)).is_empty()

    check()


@draws(50, 150)
def test_containment_of_non_empty_ranges_agrees_with_isl(examples: int) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(range_pairs)
    def check(pair):
        a, b = pair
        assume(not b.is_empty)
        assert a.contains(b) == to_isl_set(b).is_subset(to_isl_set(a))

    check()


@draws(50, 150)
def test_point_containment_agrees_with_isl(examples: int) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(zranges(max_extent=3), st.data())
    def check(r, data):
        p = tuple(data.draw(st.lists(st.integers(-6, 9), min_size=r.ndim, max_size=r.ndim)))
        point = isl.Set("{ [%s] }" % ", ".join(map(str, p)))
        assert r.contains(p) == point.is_subset(to_isl_set(r))

    check()


@st.composite
def splits(draw):
    """A non-empty range and its pieces under split or split_even."""
    r = draw(zranges(ndim=draw(st.integers(1, 3))).filter(lambda r: not r.is_empty))
    dim = draw(st.integers(-r.ndim, r.ndim - 1))
    if draw(st.booleans()):
        return r, r.split(dim, draw(st.integers(1, 5)))
    return r, r.split_even(dim, draw(st.integers(1, 6)))


@draws(50, 150)
def test_split_pieces_always_partition_the_range(examples: int) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(splits())
    def check(split):
        r, pieces = split
        assert is_partition(pieces, r)

    check()


@draws(50, 150)
def test_removing_a_non_empty_piece_leaves_a_gap(examples: int) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(splits(), st.data())
    def check(split, data):
        r, pieces = split
        i = data.draw(st.sampled_from([i for i, p in enumerate(pieces) if not p.is_empty]))
        problems = partition_problems(pieces[:i] + pieces[i + 1 :], r)
        assert problems and problems[0].startswith("gap: ")

    check()


@draws(50, 150)
def test_enlarging_a_non_empty_piece_breaks_the_partition(examples: int) -> None:
    @settings(PROPERTY, max_examples=examples)
    @given(splits(), st.data())
    def check(split, data):
        r, pieces = split
        i = data.draw(st.sampled_from([i for i, p in enumerate(pieces) if not p.is_empty]))
        d = data.draw(st.integers(0, r.ndim - 1))
        grown = ZRange(pieces[i].start, [e + (k == d) for k, e in enumerate(pieces[i].end)])
        assert partition_problems(pieces[:i] + [grown] + pieces[i + 1 :], r)

    check()
