"""Scans, indexing and orderings (issue 25): which dims split, and that sharded runs equal torch's ops.

test_kernels.py already checks every kernel sharded against whole on random cases; here each kernel's
distinctive cases: a scan split along its scanned axis, an index with repeats or negatives, ties and NaN."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tapestry.evaluator import run_sharded
from tapestry.kernels import DimKind, KernelError, get_kernel
from tapestry.zspace import ZRange

P, R = DimKind.PARALLEL, DimKind.REDUCTION


def bind(name, shapes, params=None, in_dtypes=None):
    return get_kernel(name).bind(shapes, params or {}, in_dtypes)


def kinds(sig):
    return dict(zip(sig.dims, sig.dim_kinds))


def pieces(sig, dim: int, bounds: list[int]) -> list[ZRange]:
    """The index space cut along `dim` at `bounds`."""
    start, end = sig.index.start, sig.index.end
    return [ZRange(tuple(lo if d == dim else s for d, s in enumerate(start)),
                   tuple(hi if d == dim else e for d, e in enumerate(end))) for lo, hi in zip(bounds, bounds[1:])]


# -- cumsum ------------------------------------------------------------------------------------------------------
def test_cumsum_positions_are_parallel_and_the_source_an_additive_reduction():
    sig = bind("cumsum", [(3, 7)], {"axis": 1})
    assert kinds(sig) == {"d0": P, "d1": P, "source": R}
    assert sig.splittable == (0, 1, 2) and sig.output_shape == (3, 7)
    # positions 2..5 read every source position the block is given: the source dim's box, not a prefix
    assert sig.projections[0].apply(ZRange((0, 2, 1), (3, 5, 4))) == ZRange((0, 1), (3, 4))


@pytest.mark.parametrize("dim, bounds", [(1, [0, 3, 4, 7]), (2, [0, 2, 7]), (2, [0, 1, 5, 6, 7])])
def test_cumsum_split_along_its_axis_or_its_source_equals_torch(dim, bounds):
    sig = bind("cumsum", [(3, 7)], {"axis": 1}, ["float64"])
    x = np.random.default_rng(0).standard_normal((3, 7))
    np.testing.assert_allclose(run_sharded(sig, [x], pieces(sig, dim, bounds)),
                               torch.cumsum(torch.from_numpy(x), 1).numpy(), rtol=1e-12)


def test_cumsum_of_integers_and_bools_is_int64():
    assert bind("cumsum", [(4,)], {}, ["int32"]).dtype == "int64"
    assert bind("cumsum", [(4,)], {}, ["bool"]).dtype == "int64"
    assert bind("cumsum", [(4,)], {}, ["bfloat16"]).dtype == "bfloat16"


# -- dft_real ------------------------------------------------------------------------------------------------------
def test_dft_real_positions_are_parallel_and_its_sources_additive_reductions():
    sig = bind("dft2_real", [(2, 6, 4)], {"axes": (1, 2), "lengths": (6, 4), "norm": "backward"})
    assert kinds(sig) == {"d0": P, "d1": P, "d2": P, "source0": R, "source1": R}
    assert sig.splittable == (0, 1, 2, 3, 4) and sig.output_shape == (2, 6, 4)
    # output rows 1..3 of axis 1 read the source block of that axis, whatever rows they are
    assert sig.projections[0].apply(ZRange((0, 1, 0, 4, 0), (2, 3, 4, 6, 4))) == ZRange((0, 4, 0), (2, 6, 4))


@pytest.mark.parametrize("shape, axes, norm, dim, bounds", [
    ((2, 6, 4), (1, 2), "backward", 1, [0, 2, 5, 6]),  # output rows
    ((2, 6, 4), (1, 2), "ortho", 3, [0, 1, 4, 6]),  # the first axis's sources: partial sums
    ((2, 6, 4), (1, 2), "forward", 4, [0, 3, 4]),
    ((5, 7), (1,), "backward", 2, [0, 2, 7]),
    ((3, 4, 5), (0, 1, 2), "ortho", 5, [0, 2, 5]),
])
def test_dft_real_split_anywhere_equals_torch_fft_real_part(shape, axes, norm, dim, bounds):
    name = f"dft{len(axes)}_real"
    sig = bind(name, [shape], {"axes": axes, "lengths": tuple(shape[a] for a in axes), "norm": norm}, ["float64"])
    x = np.random.default_rng(0).standard_normal(shape)
    expected = torch.fft.fftn(torch.from_numpy(x), dim=axes, norm=norm).real.numpy()
    np.testing.assert_allclose(run_sharded(sig, [x], [sig.index]), expected, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(run_sharded(sig, [x], pieces(sig, dim, bounds)), expected, rtol=1e-9, atol=1e-9)


def test_dft_real_refuses_integers_and_lengths_that_are_not_the_axes_sizes():
    with pytest.raises(KernelError, match="float tensor"):
        bind("dft1_real", [(4, 6)], {"axes": (1,), "lengths": (6,), "norm": "backward"}, ["int64"])
    with pytest.raises(KernelError, match="lengths"):
        bind("dft1_real", [(4, 6)], {"axes": (1,), "lengths": (4,), "norm": "backward"})
    with pytest.raises(KernelError, match="transforms 2 axes"):
        bind("dft2_real", [(4, 6)], {"axes": (1,), "lengths": (6,), "norm": "backward"})


# -- argmax / argmin -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_argmax_reads_its_axis_whole_and_picks_the_first_of_ties_like_torch(name):
    sig = bind(name, [(4, 3)], {"axis": 0, "keepdim": True}, ["int64"])
    assert sig.dims == ("d1",) and sig.dtype == "int64" and sig.output_shape == (1, 3)
    x = np.array([[1, 5, 2], [5, 5, 0], [1, 0, 0], [5, 2, 2]])
    got = run_sharded(sig, [x], pieces(sig, 0, [0, 1, 3]))
    np.testing.assert_array_equal(got, getattr(torch, name)(torch.from_numpy(x), 0, keepdim=True).numpy())
    with pytest.raises(KernelError, match="bool"):
        bind(name, [(4,)], {}, ["bool"])


# -- take / gather / scatter_add -----------------------------------------------------------------------------------
def test_take_replaces_its_axis_by_the_index_dims_and_reads_that_axis_whole():
    sig = bind("take", [(2, 9, 3), (4, 5)], {"axis": 1}, ["float32", "int64"])
    assert sig.dims == ("d0", "i0", "i1", "d2") and sig.output_shape == (2, 4, 5, 3)
    assert set(sig.dim_kinds) == {P} and sig.splittable == (0, 1, 2, 3)
    assert sig.projections[0].apply(ZRange((0, 1, 0, 1), (1, 3, 5, 2))) == ZRange((0, 0, 1), (1, 9, 2))
    assert sig.index_bound(1) == 9 and sig.index_bound(0) is None


def test_take_with_negative_and_repeated_indices_split_along_them_equals_torch():
    sig = bind("take", [(3, 6), (5,)], {"axis": 1}, ["float64", "int64"])
    x, idx = np.random.default_rng(1).standard_normal((3, 6)), np.array([5, -1, 0, 0, -6])
    want = torch.from_numpy(x)[:, torch.from_numpy(idx)].numpy()
    np.testing.assert_array_equal(run_sharded(sig, [x, idx], pieces(sig, 1, [0, 2, 3, 5])), want)


def test_gather_along_a_split_axis_reads_x_whole_there_and_equals_torch():
    sig = bind("gather", [(3, 6), (2, 4)], {"axis": 1}, ["float64", "int32"])
    assert set(sig.dim_kinds) == {P} and sig.output_shape == (2, 4)
    assert sig.projections[0].apply(ZRange((1, 2), (2, 3))) == ZRange((1, 0), (2, 6))
    x, index = np.random.default_rng(2).standard_normal((3, 6)), np.array([[5, 0, 0, 3], [1, 1, 4, 2]], np.int32)
    want = torch.gather(torch.from_numpy(x), 1, torch.from_numpy(index).long()).numpy()
    np.testing.assert_array_equal(run_sharded(sig, [x, index], pieces(sig, 1, [0, 1, 4])), want)


@pytest.mark.parametrize("bounds", [[0, 6], [0, 1, 4, 6], [0, 3, 3, 6]])
def test_scatter_add_split_along_its_axis_adds_each_source_to_the_block_holding_its_row(bounds):
    sig = bind("scatter_add", [(6, 2), (5, 2), (5, 2)], {"axis": 0}, ["float64", "int64", "float64"])
    assert set(sig.dim_kinds) == {P} and sig.output_shape == (6, 2)
    rng = np.random.default_rng(3)
    x, src, index = rng.standard_normal((6, 2)), rng.standard_normal((5, 2)), np.array([[0, 5], [3, 3]] * 2 + [[0, 0]])
    want = torch.from_numpy(x).scatter_add(0, torch.from_numpy(index), torch.from_numpy(src)).numpy()
    np.testing.assert_allclose(run_sharded(sig, [x, index, src], pieces(sig, 0, bounds)), want, rtol=1e-12)


@pytest.mark.parametrize("name", ["scatter_add", "scatter"])
def test_a_scatter_costs_one_op_per_source_cell_not_per_output_cell_and_source_cell(name):
    """The embedding's backward: 16384 token rows added into a 32000-row table costs 16384 adds per column (it
    was priced 16384 per table cell, 32000 times too many)."""
    sig = bind(name, [(32000, 8), (16384, 8), (16384, 8)], {"axis": 0}, ["float32", "int64", "float32"])
    assert sig.cost(sig.index)[0] == pytest.approx(16384 * 8)
    columns = ZRange((0, 0), (32000, 4))
    assert sig.cost(columns)[0] == pytest.approx(16384 * 4)


@pytest.mark.parametrize("dim, bounds", [(1, [0, 4]), (1, [0, 1, 3, 4]), (0, [0, 2, 3])])
def test_scatter_split_on_any_dim_writes_topks_gradients_back_as_torch_does(dim, bounds):
    """A router's topk backward: each row's k values written at their columns of zeros. Split along the written
    axis, a block writes the columns it holds; split by rows, its rows."""
    sig = bind("scatter", [(3, 4), (3, 2), (3, 2)], {"axis": 1}, ["float32", "int64", "float32"])
    assert set(sig.dim_kinds) == {P} and sig.splittable == (0, 1)
    x, src, index = np.zeros((3, 4), np.float32), np.arange(1, 7, dtype=np.float32).reshape(3, 2), np.array(
        [[3, 0], [1, 2], [0, 3]])
    want = torch.from_numpy(x).scatter(1, torch.from_numpy(index), torch.from_numpy(src)).numpy()
    np.testing.assert_array_equal(run_sharded(sig, [x, index, src], pieces(sig, dim, bounds)), want)


@pytest.mark.parametrize("bounds", [[0, 6], [0, 1, 4, 6], [0, 3, 3, 6]])
def test_scatter_writes_a_repeated_cell_once_with_the_last_value_on_every_split(bounds):
    """torch leaves repeated writes unspecified (its CPU kernel writes in order: the last stays); every block
    takes the last too, so a split equals the whole run."""
    sig = bind("scatter", [(6, 2), (5, 2), (5, 2)], {"axis": 0}, ["float64", "int64", "float64"])
    rng = np.random.default_rng(3)
    x, src, index = rng.standard_normal((6, 2)), rng.standard_normal((5, 2)), np.array([[0, 5], [3, 3]] * 2 + [[0, 0]])
    want = x.copy()
    for i in range(5):
        for j in range(2):
            want[index[i, j], j] = src[i, j]
    np.testing.assert_array_equal(run_sharded(sig, [x, index, src], pieces(sig, 0, bounds)), want)
    np.testing.assert_array_equal(sig.kernel.torch(*map(torch.from_numpy, (x, index, src)), axis=0,
                                                   block_start=(0, 0)).numpy(), want)


@pytest.mark.parametrize("name, shapes, dtype_list, message", [
    ("take", [(3,), (2,)], ["float32", "float32"], "idx must be int32 or int64"),
    ("gather", [(3, 4), (2, 5)], ["float32", "int64"], "index no larger than x"),
    ("scatter_add", [(3,), (2,), (3,)], ["float32", "int64", "float32"], "index and src of one shape"),
    ("scatter_add", [(3,), (2,), (2,)], ["float32", "int64", "float64"], "x and src of one numeric dtype"),
])
def test_bad_index_inputs_say_what_was_expected(name, shapes, dtype_list, message):
    with pytest.raises(KernelError, match=message):
        bind(name, shapes, {"axis": 0}, dtype_list)


# -- topk / sort ---------------------------------------------------------------------------------------------------
def test_topk_axis_is_inside_the_block_and_the_other_dims_split():
    sig = bind("topk", [(4, 9, 2)], {"axis": 1, "k": 3})
    assert sig.dims == ("d0", "d2") and sig.output_shape == (4, 3, 2) and sig.splittable == (0, 1)
    with pytest.raises(KernelError, match="k=10 is out of range"):
        bind("topk", [(4, 9)], {"axis": 1, "k": 10})


@pytest.mark.parametrize("largest", [True, False])
def test_topk_keeps_ties_in_order_puts_nan_first_when_largest_and_equals_a_stable_torch_sort(largest):
    x = np.array([[1.0, 3.0, 3.0, np.nan, 1.0, 2.0], [0.0, -1.0, 0.0, 0.0, 5.0, -1.0]])
    order = torch.sort(torch.from_numpy(x), dim=1, descending=largest, stable=True)
    for indices, want in ((False, order.values), (True, order.indices)):
        sig = bind("topk", [x.shape], {"axis": 1, "k": 4, "largest": largest, "indices": indices})
        got = run_sharded(sig, [x], pieces(sig, 0, [0, 1, 2]))
        np.testing.assert_array_equal(got, want[:, :4].numpy())
    topk = torch.topk(torch.from_numpy(x[:1]), 1, largest=largest)
    assert np.isnan(topk.values.item()) == largest


# -- grouped-query attention: sdpa with kv heads shared by a group of query heads ----------------------------------
@pytest.mark.parametrize("dim, bounds", [(1, [0, 1, 2]), (2, [0, 1, 4]), (2, [0, 3, 4])])
def test_sdpa_with_shared_kv_heads_split_on_kv_heads_or_the_group_equals_torch_gqa(dim, bounds):
    """q[B, Hkv, G, L, E] with k, v[B, Hkv, 1, S, E]: q head h = G·kv + g reads kv head h // G."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s) for s in ((2, 2, 4, 5, 3), (2, 2, 1, 6, 3), (2, 2, 1, 6, 7)))
    sig = bind("sdpa", [q.shape, k.shape, v.shape], {"causal": True}, ["float64"] * 3)
    assert sig.dims == ("batch0", "batch1", "batch2", "query", "feature") and set(sig.dim_kinds) == {P}
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a.reshape(2, -1, *a.shape[-2:])) for a in (q, k, v)), is_causal=True, enable_gqa=True)
    got = run_sharded(sig, [q, k, v], pieces(sig, dim, bounds))
    np.testing.assert_allclose(got.reshape(want.shape), want.numpy(), rtol=1e-10)


# -- pad, floor_divide ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pad, bounds", [((1, 2, 0, 1), [0, 1, 3, 6]), ((-1, 2), [0, 2, 3]),
                                         ((2, -2, 1, 0), [0, 1, 4])])
def test_pad_split_anywhere_fills_value_only_outside_x_like_torch(pad, bounds):
    x = np.random.default_rng(5).standard_normal((2, 3, 4))
    sig = bind("pad", [x.shape], {"pad": pad, "value": 0.5}, ["float64"])
    want = torch.nn.functional.pad(torch.from_numpy(x), pad, value=0.5).numpy()
    assert sig.output_shape == want.shape and set(sig.dim_kinds) == {P}
    for dim in range(3):
        cuts = [min(b, sig.index.shape[dim]) for b in bounds[:-1]] + [sig.index.shape[dim]]
        np.testing.assert_array_equal(run_sharded(sig, [x], pieces(sig, dim, sorted(cuts))), want)


def test_floor_divide_rounds_toward_minus_infinity_like_torch():
    a, b = np.array([7.0, -7.0, 7.5, -0.5, 3.0]), np.array([2.0, 2.0, -2.0, 0.3, 0.0])
    sig = bind("floor_divide", [a.shape, b.shape], {}, ["float64", "float64"])
    np.testing.assert_array_equal(run_sharded(sig, [a, b], pieces(sig, 0, [0, 2, 5])),
                                  torch.floor_divide(torch.from_numpy(a), torch.from_numpy(b)).numpy())
    assert bind("floor_divide_scalar", [(3,)], {"value": 2.0}, ["int64"]).dtype == "int64"


# -- grouped_mm: MoE expert dispatch ---------------------------------------------------------------------------------
def _fallback(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """transformers' grouped_mm_fallback: expert e's rows [ends[e-1], ends[e]) by w[e]."""
    out, start = x.new_zeros(x.shape[0], w.shape[2]), 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def test_grouped_mm_experts_are_an_additive_reduction_so_they_shard():
    sig = bind("grouped_mm", [(6, 4), (3, 4, 5), (3,)], {}, ["float32", "float32", "int64"])
    assert kinds(sig) == {"row": P, "n": P, "k": R, "expert": R} and sig.splittable == (0, 1, 2, 3)
    assert sig.cost(sig.index)[0] == 2 * 6 * 4 * 5  # each row meets one expert


@pytest.mark.parametrize("dim, bounds", [(3, [0, 1, 4]), (3, [0, 2, 3, 4]), (0, [0, 3, 5, 7]), (1, [0, 2, 5]),
                                         (2, [0, 1, 3])])
def test_grouped_mm_split_over_experts_rows_features_or_k_equals_the_per_expert_loop(dim, bounds):
    rng = np.random.default_rng(6)
    x, w, ends = rng.standard_normal((7, 3)), rng.standard_normal((4, 3, 5)), np.array([2, 2, 6, 7])  # one empty
    sig = bind("grouped_mm", [x.shape, w.shape, ends.shape], {}, ["float64", "float64", "int64"])
    want = _fallback(*(torch.from_numpy(a) for a in (x, w, ends))).numpy()
    np.testing.assert_allclose(run_sharded(sig, [x, w, ends], pieces(sig, dim, bounds)), want, rtol=1e-12)


def test_grouped_mm_k_sums_each_experts_rows_with_rows_an_additive_reduction_and_experts_an_output_dim():
    sig = bind("grouped_mm_k", [(4, 6), (6, 5), (3,)], {}, ["float32", "float32", "int64"])
    assert kinds(sig) == {"expert": P, "m": P, "n": P, "row": R} and sig.splittable == (0, 1, 2, 3)
    assert sig.output_shape == (3, 4, 5) and sig.cost(sig.index)[0] == 2 * 6 * 4 * 5  # each row meets one expert


@pytest.mark.parametrize("dim, bounds", [(0, [0, 1, 4]), (0, [0, 2, 3, 4]), (3, [0, 3, 5, 7]), (1, [0, 2, 3]),
                                         (2, [0, 1, 5])])
def test_grouped_mm_k_split_over_experts_rows_or_features_equals_torchs_weight_gradient(dim, bounds):
    """grouped_mm's weight gradient as torch's backward computes it: x[rows of e].T @ g[rows of e] per expert."""
    rng = np.random.default_rng(7)
    x, g, ends = rng.standard_normal((7, 3)), rng.standard_normal((7, 5)), np.array([2, 2, 6, 7])  # one empty
    sig = bind("grouped_mm_k", [(3, 7), g.shape, ends.shape], {}, ["float64", "float64", "int64"])
    w = torch.zeros(4, 3, 5, dtype=torch.float64, requires_grad=True)
    _fallback(torch.from_numpy(x), w, torch.from_numpy(ends)).backward(torch.from_numpy(g))
    np.testing.assert_allclose(run_sharded(sig, [x.T.copy(), g, ends], pieces(sig, dim, bounds)), w.grad.numpy(),
                               rtol=1e-12)


# -- histc: MoE routers count tokens per expert ----------------------------------------------------------------------
@pytest.mark.parametrize("bounds", [[0, 9], [0, 4, 9], [0, 1, 2, 6, 9]])
def test_histc_counts_are_an_additive_reduction_over_the_elements_so_split_counts_sum_to_torchs(bounds):
    x = np.array([np.nan, -1.0, 0.0, 3.0, 3.5, np.inf, 1.0, 2.9999, 0.75], np.float32)  # edges, outside, NaN
    sig = bind("histc", [x.shape], {"bins": 4, "min": 0.0, "max": 3.0}, ["float32"])
    assert kinds(sig) == {"elements": R} and sig.splittable == (0,) and sig.output_shape == (4,)
    want = torch.histc(torch.from_numpy(x), 4, 0, 3).numpy()
    np.testing.assert_array_equal(run_sharded(sig, [x], pieces(sig, 0, bounds)), want)


@pytest.mark.parametrize("shapes, params, dtype, message", [
    ([(2, 3)], {"bins": 4, "min": 0.0, "max": 3.0}, "float32", "counts a flat x"),
    ([(6,)], {"bins": 4, "min": 1.0, "max": 1.0}, "float32", "max > min"),
    ([(6,)], {"bins": 0, "min": 0.0, "max": 1.0}, "float32", "bins >= 1"),
    ([(6,)], {"bins": 4, "min": 0.0, "max": 3.0}, "bfloat16", "float32 or float64 x"),
])
def test_bad_histc_inputs_say_what_was_expected(shapes, params, dtype, message):
    with pytest.raises(KernelError, match=message):
        bind("histc", shapes, params, [dtype])
