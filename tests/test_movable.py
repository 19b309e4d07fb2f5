"""`movable` decides every pair of a value's layouts at once, exactly as `can_move` does pair by pair."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tapestry.sharding import Layout, Mesh
from tapestry.sharding.comm import can_move, movable
from tapestry.zspace import ZRange


def random_block(rng: random.Random, shape: tuple[int, ...]) -> ZRange | None:
    if rng.random() < 0.15:
        return None
    starts = [rng.randint(0, s) for s in shape]
    return ZRange(starts, [rng.randint(a, s) for a, s in zip(starts, shape)])


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
