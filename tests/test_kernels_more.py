"""The importer's kernels (elementwise families, reductions, attention, embedding): dim kinds, torch's
dtype rules, causal attention over query shards, half precision against torch."""
from __future__ import annotations

import itertools
import operator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tapestry import dtypes
from tapestry.evaluator import run_sharded
from tapestry.graph import Graph, GraphError
from tapestry.kernels import DimKind, KernelError, get_kernel
from tapestry.kernels.elementwise import BINARY, UNARY
from tapestry.testing.strategies import arrays_for
from tapestry.zspace import ZRange

P, R = DimKind.PARALLEL, DimKind.REDUCTION
TWINS = [f"{op.name}_scalar" for op in BINARY if op.twin]


def bind(name, shapes, params=None, in_dtypes=None):
    return get_kernel(name).bind(shapes, params or {}, in_dtypes)


def kinds(sig):
    return dict(zip(sig.dims, sig.dim_kinds))


# -- dim kinds ---------------------------------------------------------------------------------

def test_sum_keepdim_keeps_a_size_one_axis_and_stays_additive():
    sig = bind("sum", [(4, 6)], {"axis": 0, "keepdim": True})
    assert sig.output_shape == (1, 6)
    assert kinds(sig) == {"reduce": R, "d1": P} and 0 in sig.splittable
    assert bind("sum", [(4, 6)], {"axis": -1}).output_shape == (4,)


@pytest.mark.parametrize("name", ["mean", "amax"])
def test_mean_and_amax_read_their_axis_whole(name):
    sig = bind(name, [(3, 5, 7)], {"axis": 1})
    assert kinds(sig) == {"d0": P, "d2": P} and sig.output_shape == (3, 7)
    assert sig.projections[0].apply(ZRange((1, 2), (2, 4))) == ZRange((1, 0, 2), (2, 5, 4))
    assert bind(name, [(3, 5, 7)], {"axis": 1, "keepdim": True}).output_shape == (3, 1, 7)


@pytest.mark.parametrize("name, shapes", [("log_softmax", [(4, 9)]), ("rms_norm", [(4, 9), (9,)]),
                                          ("layer_norm", [(4, 9), (9,), (9,)])])
def test_normalisations_read_the_last_axis_whole(name, shapes):
    sig = bind(name, shapes)
    assert kinds(sig) == {"d0": P}
    assert sig.projections[0].apply(ZRange((1,), (3,))) == ZRange((1, 0), (3, 9))


def test_sdpa_splits_batch_queries_and_value_features_and_reads_keys_whole():
    sig = bind("sdpa", [(2, 3, 8, 4), (2, 3, 10, 4), (2, 3, 10, 5)], {"causal": True})
    assert kinds(sig) == {"batch0": P, "batch1": P, "query": P, "feature": P}
    assert sig.output_shape == (2, 3, 8, 5)
    block = ZRange((1, 0, 2, 1), (2, 3, 5, 3))
    q, k, v = (p.apply(block) for p in sig.projections)
    assert q == ZRange((1, 0, 2, 0), (2, 3, 5, 4))
    assert k == ZRange((1, 0, 0, 0), (2, 3, 10, 4))
    assert v == ZRange((1, 0, 0, 1), (2, 3, 10, 3))


def test_sdpa_masked_follows_the_mask_along_batch_and_queries_where_it_is_not_broadcast():
    sig = bind("sdpa_masked", [(2, 3, 8, 4), (2, 3, 10, 4), (2, 3, 10, 5), (2, 1, 1, 10)], {},
               ["float32", "float32", "float32", "bool"])
    assert sig.projections[3].apply(ZRange((1, 1, 2, 0), (2, 3, 5, 5))) == ZRange((1, 0, 0, 0), (2, 1, 1, 10))
    with pytest.raises(KernelError, match=r"mask\[3, 10\] does not broadcast to \[\*B, L, S\] = \[2, 3, 8, 10\]"):
        bind("sdpa_masked", [(2, 3, 8, 4), (2, 3, 10, 4), (2, 3, 10, 5), (3, 10)])


def test_embedding_splits_ids_and_features_and_reads_the_table_whole():
    sig = bind("embedding", [(2, 5), (100, 16)], {}, ["int64", "float32"])
    assert kinds(sig) == {"d0": P, "d1": P, "feature": P} and sig.output_shape == (2, 5, 16)
    assert sig.projections[1].apply(ZRange((0, 1, 4), (1, 3, 8))) == ZRange((0, 4), (100, 8))
    assert sig.index_bound(0) == 100 and sig.index_bound(1) is None


def test_a_broadcast_operand_reads_one_cell_along_its_size_one_dims():
    sig = bind("where", [(4, 1), (1, 6), (4, 6)], {}, ["bool", "float32", "float32"])
    assert kinds(sig) == {"d0": P, "d1": P}
    block = ZRange((1, 2), (3, 5))
    assert [p.apply(block) for p in sig.projections] == [ZRange((1, 0), (3, 1)), ZRange((0, 2), (1, 5)), block]


# -- dtype rules: torch's -----------------------------------------------------------------------


def tensor(dtype: str, shape=(2, 3)) -> torch.Tensor:
    return torch.ones(shape, dtype=dtypes.to_torch(dtype))


def torch_dtype(fn, *args) -> str | None:
    """The dtype torch gives, or None where torch refuses these operands."""
    try:
        return dtypes.name_of(fn(*args))
    except RuntimeError:
        return None


@pytest.mark.parametrize("op", BINARY, ids=lambda op: op.name)
def test_binary_dtypes_are_torchs_for_every_pair(op):
    for a, b in itertools.product(dtypes.DTYPES, repeat=2):
        expected = torch_dtype(op.torch, tensor(a), tensor(b))
        if expected is None:  # e.g. bool - bool
            continue
        sig = bind(op.name, [(2, 3), (2, 3)], {}, [a, b])
        assert sig.dtype == expected, (a, b)
        # 0-dim b: torch would let it give way; the kernel's impl still gives the dtype the rule promised
        assert dtypes.name_of(sig.kernel.torch(tensor(a), tensor(b, ()))) == sig.dtype


def test_promotion_matches_torch_result_type():
    for a, b in itertools.product(dtypes.DTYPES, repeat=2):
        assert bind("add", [(3,), (3,)], {}, [a, b]).dtype == dtypes.name_of(torch.result_type(tensor(a), tensor(b)))


PYTHON_OPS = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv, "pow": operator.pow,
    "floor_divide": operator.floordiv,
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "maximum": lambda a, b: torch.clamp_min(*((a, b) if isinstance(a, torch.Tensor) else (b, a))),
    "minimum": lambda a, b: torch.clamp_max(*((a, b) if isinstance(a, torch.Tensor) else (b, a))),
}


@pytest.mark.parametrize("name", TWINS)
def test_scalar_twins_give_torchs_dtype_for_a_python_number(name):
    python_op = PYTHON_OPS[name.removesuffix("_scalar")]
    for x, value, reverse in itertools.product(dtypes.DTYPES, [2.0, 2.5], [False, True]):
        number = int(value) if value.is_integer() else value
        expected = torch_dtype(lambda t: python_op(number, t) if reverse else python_op(t, number), tensor(x))
        if expected is None:  # e.g. bool - 2
            continue
        sig = bind(name, [(2, 3)], {"value": value, "reverse": reverse}, [x])
        assert sig.dtype == expected, (x, value, reverse)
        assert dtypes.name_of(sig.kernel.torch(tensor(x), value=value, reverse=reverse)) == expected


def test_comparisons_and_logical_ops_give_bool():
    for name in ["eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or"]:
        assert bind(name, [(3,), (3,)], {}, ["float16", "int64"]).dtype == "bool"
    assert bind("logical_not", [(3,)], {}, ["float32"]).dtype == "bool"
    assert bind("lt_scalar", [(3,)], {"value": 0.5}, ["int32"]).dtype == "bool"


@pytest.mark.parametrize("name", [op.name for op in UNARY])
def test_unary_dtypes_are_torchs(name):
    for d in ("int64", "float16", "bfloat16", "float64"):
        sig = bind(name, [(3,)], {}, [d])
        assert sig.dtype == dtypes.name_of(sig.kernel.torch(tensor(d, (3,)), **sig.call_kwargs(sig.index))), d
    if name in ("sqrt", "exp", "tanh", "sigmoid", "log"):
        expected = dtypes.name_of(getattr(torch, name)(tensor("int64")))
        assert bind(name, [(3,)], {}, ["int64"]).dtype == expected == "float32"


def test_reduction_dtypes():
    assert bind("sum", [(3, 4)], {}, ["int32"]).dtype == dtypes.name_of(tensor("int32").sum(-1)) == "int64"
    assert bind("sum", [(3, 4)], {}, ["bool"]).dtype == "int64"
    assert bind("amax", [(3, 4)], {}, ["int32"]).dtype == "int32"
    assert bind("mean", [(3, 4)], {}, ["bfloat16"]).dtype == "bfloat16"
    with pytest.raises(KernelError, match="mean needs a float x, got int64"):
        bind("mean", [(3, 4)], {}, ["int64"])


def test_embedding_gives_the_tables_dtype_and_needs_integer_ids():
    assert bind("embedding", [(4,), (10, 3)], {}, ["int32", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(KernelError, match="ids must be int32 or int64, got float32"):
        bind("embedding", [(4,), (10, 3)], {}, ["float32", "float32"])


def test_cast_gives_its_param_and_rounds_like_torch():
    x = np.array([-1.7, -0.5, 0.0, 0.4, 2.9, 1e-3], dtype=np.float32)
    for target in dtypes.DTYPES:
        sig = bind("cast", [x.shape], {"dtype": target}, ["float32"])
        assert sig.dtype == target
        got = sig.compute([x], sig.index)
        want = dtypes.from_tensor(sig.kernel.torch(torch.from_numpy(x), dtype=target))
        assert got.dtype == want.dtype and np.array_equal(got.astype(np.float64), want.astype(np.float64)), target
    with pytest.raises(KernelError, match="cast: dtype 'float8' is not one of"):
        bind("cast", [(3,)], {"dtype": "float8"})


def test_where_and_masked_fill_need_bool_conditions():
    assert bind("where", [(3,), (3,), (3,)], {}, ["bool", "int32", "float16"]).dtype == "float16"
    assert bind("masked_fill", [(3,), (3,)], {"value": -1.5}, ["bfloat16", "bool"]).dtype == "bfloat16"
    with pytest.raises(KernelError, match="where: cond must be bool, got float32"):
        bind("where", [(3,), (3,), (3,)], {}, ["float32", "float32", "float32"])
    with pytest.raises(KernelError, match="masked_fill: mask must be bool, got int64"):
        bind("masked_fill", [(3,), (3,)], {}, ["float32", "int64"])


def test_mixed_float_operands_are_named_in_the_error():
    with pytest.raises(KernelError, match=r"different float dtypes \(q: float32, k: float16, v: float32\)"):
        bind("sdpa", [(2, 4), (3, 4), (3, 4)], {}, ["float32", "float16", "float32"])
    with pytest.raises(KernelError, match=r"\(x: bfloat16, w: float32\)"):
        bind("rms_norm", [(2, 4), (4,)], {}, ["bfloat16", "float32"])
    with pytest.raises(KernelError, match="mask must be bool or float, got int64"):
        bind("sdpa_masked", [(2, 4), (3, 4), (3, 4), (2, 3)], {}, ["float32"] * 3 + ["int64"])
    g = Graph()
    q = g.input("query", (2, 4), dtype="float32")
    k = g.input("keys", (3, 4), dtype="bfloat16")
    with pytest.raises(GraphError, match=r"q=query\[2, 4\] float32, k=keys\[3, 4\] bfloat16"):
        g.sdpa(q, k, k)


# -- semantics --------------------------------------------------------------------------------


def attention_inputs(L: int, S: int, seed: int = 0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in [(2, L, 4), (2, S, 4), (2, S, 3)]]


@pytest.mark.parametrize("L, S", [(7, 7), (5, 9), (9, 4)])
def test_causal_sdpa_sharded_over_queries_equals_whole_and_torch(L, S):
    sig = bind("sdpa", [(2, L, 4), (2, S, 4), (2, S, 3)], {"causal": True}, ["float64"] * 3)
    args = attention_inputs(L, S)
    whole = run_sharded(sig, args, [sig.index])
    parts = [ZRange((0, lo, 0), (2, hi, 3)) for lo, hi in [(0, 2), (2, 3), (3, L)]]
    np.testing.assert_allclose(run_sharded(sig, args, parts), whole, rtol=1e-12, atol=1e-12)
    reference = F.scaled_dot_product_attention(*map(torch.from_numpy, args), is_causal=True).numpy()
    np.testing.assert_allclose(whole, reference, rtol=1e-10, atol=1e-12)
    # the torch impl, block by block, with each block's start
    q, k, v = map(torch.from_numpy, args)
    blocks = [sig.kernel.torch(q[:, p.start[1]:p.end[1]], k, v, **sig.call_kwargs(p)) for p in parts]
    np.testing.assert_allclose(torch.cat(blocks, dim=1).numpy(), reference, rtol=1e-10, atol=1e-12)


def test_sdpa_masked_bool_mask_and_a_row_that_sees_nothing():
    q, k, v = map(torch.from_numpy, attention_inputs(3, 5))
    mask = torch.tensor([[True, False, True, True, False], [False] * 5, [True] * 5])
    sig = bind("sdpa_masked", [(2, 3, 4), (2, 5, 4), (2, 5, 3), (3, 5)], {"scale": 0.25}, ["float64"] * 3 + ["bool"])
    got = run_sharded(sig, [q.numpy(), k.numpy(), v.numpy(), mask.numpy()], [sig.index])
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25).numpy()
    np.testing.assert_allclose(got, reference, rtol=1e-10, atol=1e-12)
    assert np.all(got[:, 1] == 0)


@pytest.mark.parametrize("eps", [1e-12, 1e-5])
def test_layer_norm_uses_its_eps(eps):
    """BERT's 1e-12 matters where a row's variance is tiny: there 1e-5 would flatten it."""
    rng = np.random.default_rng(0)
    x = 3.0 + 1e-5 * rng.standard_normal((4, 8))
    w, b = rng.standard_normal(8), rng.standard_normal(8)
    sig = bind("layer_norm", [(4, 8), (8,), (8,)], {"eps": eps}, ["float64"] * 3)
    got = run_sharded(sig, [x, w, b], [sig.index])
    reference = F.layer_norm(torch.from_numpy(x), (8,), torch.from_numpy(w), torch.from_numpy(b), eps)
    np.testing.assert_allclose(got, reference.numpy(), rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(sig.kernel.torch(*map(torch.from_numpy, (x, w, b)), eps=eps), reference)
    assert sig.params == (("eps", eps),)
    if eps == 1e-12:
        assert np.abs(got - b).max() > 0.5  # not flattened to the shift


@pytest.mark.parametrize("name, value, forward, backward", [
    ("sub_scalar", 1.0, lambda x: x - 1.0, lambda x: 1.0 - x),
    ("div_scalar", 2.0, lambda x: x / 2.0, lambda x: 2.0 / x),
    ("pow_scalar", 2.0, lambda x: x**2.0, lambda x: 2.0**x),
    ("lt_scalar", 0.5, lambda x: x < 0.5, lambda x: 0.5 < x),
])
def test_reverse_scalar_ops_put_the_value_first(name, value, forward, backward):
    x = np.array([-2.0, -0.5, 0.25, 1.0, 3.0])
    for reverse, want in ((False, forward(x)), (True, backward(x))):
        sig = bind(name, [x.shape], {"value": value, "reverse": reverse}, ["float64"])
        np.testing.assert_array_equal(sig.compute([x], sig.index), want)
        np.testing.assert_array_equal(sig.kernel.torch(torch.from_numpy(x), value=value, reverse=reverse).numpy(), want)


def test_integer_scalar_ops_keep_integers_or_round_to_float32_like_torch():
    x = np.array([0, 1, 2, 3], dtype=np.int32)
    for name, value, reverse in [("add_scalar", 1.5, False), ("div_scalar", 3.0, True), ("pow_scalar", 0.5, False),
                                 ("mul_scalar", 2.0, False), ("pow_scalar", 2.0, True)]:
        sig = bind(name, [x.shape], {"value": value, "reverse": reverse}, ["int32"])
        got = sig.compute([x], sig.index)
        want = sig.kernel.torch(torch.from_numpy(x), value=value, reverse=reverse).numpy()
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=2e-7)


def test_gelu_tanh_approximation_matches_torch_and_rejects_other_names():
    x = np.linspace(-4, 4, 33)
    for approximate in ("none", "tanh"):
        sig = bind("gelu", [x.shape], {"approximate": approximate}, ["float64"])
        want = F.gelu(torch.from_numpy(x), approximate=approximate).numpy()
        np.testing.assert_allclose(sig.compute([x], sig.index), want, rtol=1e-12, atol=1e-14)
    with pytest.raises(KernelError, match="approximate must be 'none' or 'tanh', got 'erf'"):
        bind("gelu", [(3,)], {"approximate": "erf"})


# -- half precision: the reference computes in float32 and rounds; torch computes in the half type ----

HALF_CASES = [
    ("add", [(4, 8), (8,)], {}),
    ("div", [(4, 8), (4, 8)], {}),
    ("gelu", [(4, 8)], {"approximate": "tanh"}),
    ("silu", [(4, 8)], {}),
    ("mean", [(4, 8)], {"axis": 1}),
    ("log_softmax", [(4, 8)], {}),
    ("layer_norm", [(4, 8), (8,), (8,)], {"eps": 1e-12}),
    ("rms_norm", [(4, 8), (8,)], {}),
    ("sdpa", [(2, 6, 8), (2, 6, 8), (2, 6, 4)], {"causal": True}),
    ("mul_scalar", [(4, 8)], {"value": 0.125}),
]
TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2}  # a few ulps of each


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name, shapes, params", HALF_CASES, ids=[c[0] for c in HALF_CASES])
def test_half_precision_reference_matches_torch(name, shapes, params, dtype):
    sig = bind(name, shapes, params, [dtype] * len(shapes))
    assert sig.dtype == dtype
    args = arrays_for(sig, 1)
    got = run_sharded(sig, args, [sig.index])
    want = sig.kernel.torch(*map(dtypes.to_tensor, args), **sig.call_kwargs(sig.index))
    assert dtypes.name_of(want) == dtype
    tol = TOLERANCE[dtype] * (4 if name in ("sdpa", "log_softmax", "layer_norm", "rms_norm") else 1)
    np.testing.assert_allclose(got.astype(np.float32), want.float().numpy(), rtol=tol, atol=tol)


def test_cast_to_bfloat16_rounds_like_torch():
    x = np.random.default_rng(0).standard_normal(64)
    sig = bind("cast", [x.shape], {"dtype": "bfloat16"}, ["float64"])
    got = sig.compute([x], sig.index)
    want = dtypes.from_tensor(torch.from_numpy(x).to(torch.bfloat16))
    assert got.dtype == want.dtype and np.array_equal(got.astype(np.float32), want.astype(np.float32))
