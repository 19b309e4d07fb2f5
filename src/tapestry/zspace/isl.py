"""islpy bridge: islpy is the oracle for set questions the closed forms answer fast."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import islpy as isl

from tapestry.zspace.affine import IndexProjection
from tapestry.zspace.zrange import ZRange, check_ndim, covered, tiles

_CTX = isl.DEFAULT_CONTEXT
_SET, _IN, _OUT = isl.dim_type.set, isl.dim_type.in_, isl.dim_type.out


def _ineq(
    space: isl.Space, coefficients: Sequence[tuple[isl.dim_type, int, int]], constant: int
) -> isl.Constraint:
    """The constraint Σ coef·var + constant >= 0."""
    c = isl.Constraint.inequality_alloc(space)
    for kind, pos, coef in coefficients:
        c = c.set_coefficient_val(kind, pos, coef)
    return c.set_constant_val(constant)


@lru_cache(maxsize=4096)  # the same ranges recur across partition and coverage checks
def to_isl_set(r: ZRange) -> isl.Set:
    """The cells of r; a 0-dim range is the one-point set { [] }."""
    space = isl.Space.set_alloc(_CTX, 0, r.ndim)
    s = isl.BasicSet.universe(space)
    for d, (lo, hi) in enumerate(zip(r.start, r.end)):
        s = s.add_constraint(_ineq(space, [(_SET, d, 1)], -lo))
        s = s.add_constraint(_ineq(space, [(_SET, d, -1)], hi - 1))
    return isl.Set.from_basic_set(s)


@lru_cache(maxsize=1024)
def to_isl_map(p: IndexProjection) -> isl.Map:
    """Index point i -> every cell t with A·i + b <= t < A·i + b + shape."""
    space = isl.Space.alloc(_CTX, 0, p.in_dim, p.out_dim)
    m = isl.BasicMap.universe(space)
    for r, (row, b, n) in enumerate(zip(p.matrix, p.offset, p.shape)):
        terms = [(_IN, c, a) for c, a in enumerate(row) if a]
        negated = [(k, c, -a) for k, c, a in terms]
        m = m.add_constraint(_ineq(space, [(_OUT, r, 1)] + negated, -b))
        m = m.add_constraint(_ineq(space, [(_OUT, r, -1)] + terms, b + n - 1))
    return isl.Map.from_basic_map(m)


def footprint(p: IndexProjection, r: ZRange) -> isl.Set:
    """Every tensor cell some index point of r selects."""
    check_ndim(r, r.ndim, p.in_dim)
    return to_isl_map(p).intersect_domain(to_isl_set(r)).range()


def bounding_box(s: isl.Set) -> ZRange | None:
    """The smallest ZRange holding s; None when s is empty."""
    if s.is_empty():
        return None
    if not s.is_bounded():
        raise ValueError(f"unbounded set {s}")
    n = s.dim(_SET)
    return ZRange(
        [s.dim_min_val(d).to_python() for d in range(n)],
        [s.dim_max_val(d).to_python() + 1 for d in range(n)],
    )


def box_of(s: isl.Set) -> ZRange | None:
    """s as a ZRange when it is exactly a non-empty box, else None."""
    return bounding_box(s) if s.coalesce().is_box() else None


def _union(ranges: Sequence[ZRange], ndim: int) -> isl.Set:
    result = isl.Set.empty(isl.Space.set_alloc(_CTX, 0, ndim))
    for r in ranges:
        check_ndim(r, r.ndim, ndim)
        result = result.union(to_isl_set(r))
    return result


def _describe(s: isl.Set) -> str:
    """Boxes read better than constraints, so print them when the pieces are boxes."""
    boxes = [box_of(isl.Set.from_basic_set(b)) for b in s.coalesce().get_basic_sets()]
    return ", ".join(map(str, boxes)) if all(boxes) else str(s)


def partition_problems(parts: Sequence[ZRange], whole: ZRange) -> list[str]:
    """Why parts fail to partition whole (gaps, strays, overlaps); empty when they do. Boxes that tile it are
    answered by the closed form (`tiles`); islpy names what is wrong otherwise."""
    if tiles(parts, whole):
        return []
    whole_set = to_isl_set(whole)
    sets = [to_isl_set(p) for p in parts]
    problems = []
    gap = whole_set.subtract(_union(parts, whole.ndim))
    if not gap.is_empty():
        problems.append(f"gap: {_describe(gap)}")
    for i, (part, s) in enumerate(zip(parts, sets)):
        if not s.is_subset(whole_set):
            problems.append(f"part {i} {part} lies outside {whole}")
    for i in range(len(parts)):
        for j in range(i + 1, len(parts)):
            shared = sets[i].intersect(sets[j])
            if not shared.is_empty():
                pair = f"part {i} {parts[i]} and part {j} {parts[j]}"
                problems.append(f"overlap between {pair}: {_describe(shared)}")
    return problems


def is_partition(parts: Sequence[ZRange], whole: ZRange) -> bool:
    """Coverage and pairwise disjointness; coverage alone is not a partition."""
    return not partition_problems(parts, whole)


def covers(blocks: Sequence[ZRange], target: ZRange) -> bool:
    """Whether target lies inside the union of blocks (by `covered`'s grid where it is not too fine)."""
    for b in blocks:
        check_ndim(b, b.ndim, target.ndim)
    found = covered(blocks, target)
    return to_isl_set(target).is_subset(_union(blocks, target.ndim)) if found is None else found


def difference(a: isl.Set | ZRange, b: isl.Set | ZRange) -> isl.Set:
    """a minus b: e.g. what a device needs minus what it holds."""
    return _as_set(a).subtract(_as_set(b))


def set_size(s: isl.Set) -> int:
    """The number of integer points in a bounded set."""
    if not s.is_bounded():
        raise ValueError(f"unbounded set {s}")
    return s.count_val().to_python()


def _as_set(x: isl.Set | ZRange) -> isl.Set:
    return to_isl_set(x) if isinstance(x, ZRange) else x
