"""`movable` decides every pair of a value's layouts at once, exactly as `can_move` does pair by pair."""
from __future__ import annotations

import random

import numpy as np
import pytest

from unittest import mock

from tapestry.kernels import get_kernel
from tapestry.sharding import Layout, Mesh, comm
from tapestry.sharding.comm import box_difference, can_move, movable
from tapestry.sharding.partition import candidate_partitions, needed_layout, output_layout
from tapestry.zspace import ZRange


def random_block(rng: random.Random, shape: tuple[int, ...]) -> ZRange | None:
    if rng.random() < 0.15:
        return None
    starts = [rng.randint(0, s) for s in shape]
    return ZRange(starts, [rng.randint(a, s) for a, s in zip(starts, shape)])


def oracle_can_move(src: Layout, dst: Layout) -> bool:
    """Box by box: every cell a destination block needs is left over by no source block."""
    if dst.partial or src.partial:
        return src.partial and not dst.partial
    held = [b for b in src.blocks if b is not None]
    if not held:
        return all(b is None for b in dst.blocks)
    for need in (b for b in dst.blocks if b is not None):
        missing = [need]
        for have in held:
            missing = [piece for m in missing for piece in box_difference(m, have)]
        if any(not piece.is_empty for piece in missing):
            return False
    return True


def layouts(rng: random.Random, shape: tuple[int, ...], mesh: Mesh) -> list[Layout]:
    found = [Layout.replicated(shape, mesh), Layout((None,) * mesh.size)]
    found += [Layout.split(shape, mesh, dims) for dims in [(0, None), (None, len(shape) - 1), (0, len(shape) - 1)]]
    found += [Layout(tuple(random_block(rng, shape) for _ in range(mesh.size)), rng.random() < 0.2)
              for _ in range(14)]
    return found


@pytest.mark.parametrize("shape", [(8,), (6, 4), (4, 6, 2), (2, 3, 4, 5)])
@pytest.mark.parametrize("seed", range(4))
def test_movable_agrees_with_can_move_on_every_pair(shape, seed):
    mesh = Mesh(2, 2)
    found = layouts(random.Random(seed), shape, mesh)
    want = np.array([[can_move(a, b) for b in found] for a in found])
    np.testing.assert_array_equal(movable(found), want)


def test_a_layout_holding_one_row_moves_only_to_layouts_inside_that_row():
    mesh = Mesh(4)
    whole, row = Layout.replicated((4, 8), mesh), Layout((ZRange((0, 0), (1, 8)),) * 4)
    assert movable([whole, row]).tolist() == [[True, True], [False, True]]


def kernel_layouts(mesh: Mesh) -> list[list[Layout]]:
    """Each value's layouts as generation makes them: the output and argument layouts of every candidate partition
    of a matmul, a slice (arguments that hold a box inside the tensor) and a transpose, and the replicated
    layout, grouped by shape."""
    by_shape: dict[tuple[int, ...], dict[Layout, None]] = {}
    for sig in [get_kernel("matmul").bind([(4, 6), (6, 8)]),
                get_kernel("slice").bind([(8, 6)], {"axis": 0, "start": 1, "stop": 7}),
                get_kernel("transpose").bind([(4, 8)], {"perm": (1, 0)})]:
        for part in candidate_partitions(sig, mesh):
            by_shape.setdefault(sig.output_shape, {})[output_layout(sig, part)] = None
            for i, shape in enumerate(sig.input_shapes):
                by_shape.setdefault(shape, {})[needed_layout(sig, i, part)] = None
    return [[Layout.replicated(shape, mesh), *found] for shape, found in by_shape.items()]


@pytest.mark.parametrize("mesh", [Mesh(4), Mesh(2, 2), Mesh(2, 4)])
def test_sources_that_fill_a_box_are_decided_by_it_without_the_cell_grid(mesh):
    """Generation's layouts fill boxes (the whole tensor, or the part a slice reads), so `movable` and `can_move`
    decide them by the box alone: the same answers as the box-by-box oracle, and neither the cell grid nor
    `covers` is asked (before, every pair outside a source's box went on to `covers`, and a value too large for
    the grid was asked pair by pair, as the 7B step's largest values on 8x8 were)."""
    groups = kernel_layouts(mesh)
    want = [np.array([[oracle_can_move(a, b) for b in found] for a in found]) for found in groups]
    plain = [(a, b) for found in groups for a in found for b in found if not a.partial and not b.partial]
    assert not all(oracle_can_move(a, b) for a, b in plain)  # some destinations lie outside their source's box
    assert all(comm.filled_box(a) is not None for a, _ in plain if any(a.blocks))
    comm.can_move.cache_clear()

    def refuse(*args):
        raise AssertionError("the cell grid was asked about sources that fill a box")

    with mock.patch.object(comm, "covers", refuse), mock.patch.object(comm, "_grid_moves", refuse, create=True), \
            mock.patch.object(comm, "MOVABLE_CELLS", 0):
        for found, expected in zip(groups, want):
            np.testing.assert_array_equal(movable(found), expected)
            assert [[can_move(a, b) for b in found] for a in found] == expected.tolist()
    assert sum(len(found) for found in groups) > 20
