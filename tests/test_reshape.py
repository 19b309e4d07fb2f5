"""reshape keeps an index dim for every group of dims that merge or split, so heads and batches shard through it."""
from __future__ import annotations

import numpy as np
import pytest

from tapestry.evaluator import run_sharded
from tapestry.kernels import DimKind, get_kernel
from tapestry.zspace import ZRange


def bind(x, shape):
    return get_kernel("reshape").bind([x], {"shape": shape})


def test_head_split_keeps_batch_sequence_and_heads():
    sig = bind((2, 8, 64), (2, 8, 4, 16))
    assert sig.spec.sizes == (2, 8, 4)
    assert sig.dim_kinds == (DimKind.PARALLEL,) * 3
    # one head's block of the output reads exactly that head's 16 columns of the input
    head = ZRange((0, 0, 1), (2, 8, 2))
    assert sig.projections[0].apply(head) == ZRange((0, 0, 16), (2, 8, 32))
    assert sig.output.apply(head) == ZRange((0, 0, 1, 0), (2, 8, 2, 16))


def test_head_merge_is_the_inverse():
    sig = bind((2, 8, 4, 16), (2, 8, 64))
    assert sig.spec.sizes == (2, 8, 4)


def test_batch_sequence_merge_keeps_batch_and_hidden():
    sig = bind((4, 8, 32), (32, 32))
    assert sig.spec.sizes == (4, 32)
    assert sig.output.apply(ZRange((1, 0), (3, 32))) == ZRange((8, 0), (24, 32))


def test_regrouping_with_common_factor():
    # [4, 6] -> [6, 4]: two chunks of 12 elements each side
    assert bind((4, 6), (6, 4)).spec.sizes == (2,)


@pytest.mark.parametrize("x, shape", [((2, 8, 64), (2, 8, 4, 16)), ((4, 8, 32), (32, 32)), ((4, 6), (6, 4)),
                                      ((1, 6), (2, 3)), ((2, 3, 4), (24,)), ((24,), (2, 3, 4)), ((2, 1, 3), (6, 1))])
def test_every_split_of_the_index_space_reassembles_the_reshape(x, shape):
    sig = bind(x, shape)
    arg = np.random.default_rng(0).standard_normal(x).astype(np.float32)
    parts = [sig.index]
    for d, size in enumerate(sig.spec.sizes):  # split every index dim in two
        parts = [p for part in parts for p in part.split(d, max(1, (size + 1) // 2))]
    np.testing.assert_array_equal(run_sharded(sig, [arg], parts), arg.reshape(shape))
