"""Every kernel, run sharded over any legal partition, equals the kernel run whole."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import sympy
import torch
from hypothesis import HealthCheck, Phase, assume, find, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from tapestry import dtypes
from tapestry.evaluator import check_partition, read_block, run_sharded
from tapestry.graph import GraphError
from tapestry.kernels import KERNELS, DimKind, KernelError, get_kernel
from tapestry.kernels.opaque import MAX_ARITY, opaque_name
from tapestry.testing.strategies import arrays_for, partitions, signatures
from tapestry.zspace import ZRange
from sweeps import draws

ALL = sorted(KERNELS)
SPLITTABLE = [name for name in ALL if name not in {opaque_name(n) for n in range(MAX_ARITY + 1)}]  # opaque: a point
# find's first match, unshrunk and the same each run: these tests need a signature that exists, not the smallest
# (shrinking was most of their CPU time: docs/benchmarks.md, "Test suite time"); no deadline (200 ms failed at load)
FIRST_MATCH = settings(database=None, derandomize=True, phases=[Phase.generate], deadline=None)


def check_sharded_equals_unsharded(name: str, examples: int, cut: bool) -> None:
    """`examples` random signatures and partitions of kernel `name`; `cut`: only signatures with a splittable dim
    of two or more, cut into two or more nonempty blocks (the whole index as one block, a common draw otherwise,
    runs the kernel as the reference does)."""

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
    @given(data=st.data(), seed=st.integers(0, 2**16))
    def check(data, seed):
        sig = data.draw(signatures(KERNELS[name]))
        assume(not cut or any(sig.index.shape[d] >= 2 for d in sig.splittable))
        parts = data.draw(partitions(sig.index, sig.splittable, cut))
        assert not cut or sum(not p.is_empty for p in parts) >= 2, parts
        args = arrays_for(sig, seed)
        whole = run_sharded(sig, args, [sig.index])
        np.testing.assert_allclose(run_sharded(sig, args, parts), whole, rtol=1e-9, atol=1e-9)

    check()


@pytest.mark.parametrize("name", ALL)
def test_sharded_equals_unsharded(name):
    """Every kernel on 5 real cuts (the opaque ones, points with nothing to split, on 5 draws)."""
    check_sharded_equals_unsharded(name, 5, cut=name in SPLITTABLE)


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_sharded_equals_unsharded_exhaustive(name):
    check_sharded_equals_unsharded(name, 100, cut=False)


@pytest.mark.parametrize("name", SPLITTABLE)
def test_the_sampler_draws_a_splittable_dim_of_two_or_more(name):
    """test_sharded_equals_unsharded only means something when a partition can cut a dim."""
    find(signatures(KERNELS[name]), lambda sig: any(sig.index.shape[d] >= 2 for d in sig.splittable),
         settings=settings(FIRST_MATCH, max_examples=300))


@pytest.mark.parametrize("name", SPLITTABLE)
def test_the_torch_impl_traces_with_make_fx(name):
    """The persistent runtime traces every rank's program with make_fx: each kernel's torch impl must trace."""
    sig = find(signatures(KERNELS[name]), lambda sig: len(sig.dims) >= 1, settings=FIRST_MATCH)
    args = [dtypes.to_tensor(a) for a in arrays_for(sig, 0)]
    fn = functools.partial(sig.kernel.torch, **sig.call_kwargs(sig.index))
    torch.testing.assert_close(make_fx(fn)(*args)(*args), fn(*args), equal_nan=True)


@draws(5, 10)
@pytest.mark.parametrize("name", ALL)
def test_torch_impl_matches_numpy(name, examples):

    @settings(max_examples=examples, deadline=None)
    @given(data=st.data(), seed=st.integers(0, 2**16))
    def check(data, seed):
        sig = data.draw(signatures(KERNELS[name]))
        blocks = [read_block(a, p.apply(sig.index)) for a, p in zip(arrays_for(sig, seed), sig.projections)]
        kwargs = sig.call_kwargs(sig.index)
        expected = sig.kernel.numpy(*blocks, **kwargs)
        got = sig.kernel.torch(*[dtypes.to_tensor(b) for b in blocks], **kwargs)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-7, atol=1e-9)

    check()


@pytest.mark.parametrize("name", sorted(n for n, k in KERNELS.items() if k.always_view))
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_an_always_view_kernel_returns_a_view_of_its_argument(name, data):
    """cost.memory counts no bytes for an `always_view` kernel's result (it shares its argument's storage, as
    lower.program.viewed says): its torch impl must never copy, on any block it is given."""
    sig = data.draw(signatures(KERNELS[name]))
    assert sig.kernel.is_view
    x = dtypes.to_tensor(read_block(arrays_for(sig, 0)[0], sig.projections[0].apply(sig.index)))
    got = sig.kernel.torch(x, **sig.call_kwargs(sig.index))
    assert got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


@draws(5, 10)
@pytest.mark.parametrize("name", ALL)
def test_declared_additivity_is_only_on_reduction_dims(name, examples):
    """Every dim of every kernel: a declared additive dim is a reduction the kernel has; only reductions not
    declared additive are unsplittable; and splitting any splittable dim in halves, summed, gives the whole."""

    @settings(max_examples=examples, deadline=None)
    @given(data=st.data())
    def check(data):
        sig = data.draw(signatures(KERNELS[name]))
        assert set(sig.kernel.additive) <= set(sig.dims), f"{name} declares additive dims it does not have"
        args = arrays_for(sig, 0)
        whole = run_sharded(sig, args, [sig.index])
        for d, (dim, kind) in enumerate(zip(sig.dims, sig.dim_kinds)):
            if dim in sig.kernel.additive:
                assert kind is DimKind.REDUCTION, f"{name}: {dim} is declared additive but is {kind.value}"
            splits = (kind is not DimKind.REDUCTION or dim in sig.kernel.additive) \
                and dim not in sig.kernel.ring_only
            assert (d in sig.splittable) == splits, dim
            if d in sig.splittable and sig.index.shape[d] >= 2:
                halves = run_sharded(sig, args, sig.index.split_even(d, 2))
                np.testing.assert_allclose(halves, whole, rtol=1e-9, atol=1e-9, err_msg=f"{name} split on {dim}")

    check()


def bind(name, *shapes, **params):
    return get_kernel(name).bind(shapes, params)


def test_linear_dims_are_parallel_and_contraction_is_inside_the_block():
    sig = bind("linear", (64, 128), (128, 32), (32,))
    assert sig.dims == ("batch0", "out")
    assert sig.dim_kinds == (DimKind.PARALLEL, DimKind.PARALLEL)
    assert sig.output_shape == (64, 32)


def test_matmul_k_is_an_additive_reduction():
    sig = bind("matmul", (8, 4), (4, 6))
    assert sig.dim_kinds == (DimKind.PARALLEL, DimKind.PARALLEL, DimKind.REDUCTION)
    assert 2 in sig.splittable


def test_conv_output_rows_are_windowed_when_the_kernel_overlaps():
    sig = bind("conv2d", (1, 2, 8, 8), (3, 2, 3, 3))
    assert dict(zip(sig.dims, sig.dim_kinds)) == {
        "n": DimKind.PARALLEL, "kg": DimKind.PARALLEL, "oh": DimKind.WINDOWED,
        "ow": DimKind.WINDOWED, "c": DimKind.REDUCTION, "g": DimKind.PARALLEL,
    }


def test_conv_with_stride_equal_to_kernel_has_no_halo():
    sig = bind("conv2d", (1, 1, 8, 8), (1, 1, 2, 2), stride=2)
    assert sig.dim_kinds[2] is DimKind.PARALLEL


def test_softmax_reads_its_axis_whole_so_it_is_not_an_index_dim():
    sig = bind("softmax", (4, 10), axis=1)
    assert sig.dims == ("d0",)
    assert sig.projections[0].apply(ZRange((1,), (3,))) == ZRange((1, 0), (3, 10))


def test_splitting_a_non_additive_reduction_is_rejected():
    fake = bind("sum", (4, 6), axis=1)
    check_partition(fake, fake.index.split(1, 2))  # sum is additive in its axis
    not_additive = type(fake)(fake.kernel.__class__(**{**fake.kernel.__dict__, "additive": frozenset()}),
                              fake.input_shapes, fake.params, fake.spec)
    assert not_additive.splittable == (0,)
    with pytest.raises(GraphError, match="not additive"):
        check_partition(not_additive, not_additive.index.split(1, 2))


def test_partition_with_a_gap_or_overlap_is_rejected():
    sig = bind("relu", (10,))
    with pytest.raises(GraphError, match="not a partition"):
        check_partition(sig, [ZRange((0,), (4,)), ZRange((5,), (10,))])
    with pytest.raises(GraphError, match="not a partition"):
        check_partition(sig, [ZRange((0,), (6,)), ZRange((5,), (10,))])


def test_cost_formulas_are_sympy_over_named_index_dims():
    sig = bind("linear", (64, 128), (128, 32), (32,))
    batch0, out = sig.symbols
    assert sympy.simplify(sig.flops_expr - 256 * batch0 * out) == 0
    assert sig.cost(sig.index) == (256 * 64 * 32, 4 * (64 * 128 + 128 * 32 + 32 + 64 * 32))


def test_fused_kernel_does_not_pay_for_the_intermediate():
    linear = bind("linear", (64, 128), (128, 32), (32,))
    relu = bind("relu", (64, 32))
    fused = bind("linear_relu", (64, 128), (128, 32), (32,))
    assert fused.cost(fused.index)[1] < linear.cost(linear.index)[1] + relu.cost(relu.index)[1]


@pytest.mark.parametrize(
    "name, shapes, params, message",
    [
        ("linear", [(4, 8), (9, 2), (2,)], {}, "first dim must equal x's last dim 8"),
        ("matmul", [(4, 8), (7, 2)], {}, "contraction sizes differ"),
        ("add", [(3, 4), (5,)], {}, "do not broadcast"),
        ("sum", [(3, 4)], {"axis": 2}, "axis 2 is out of range"),
        ("reshape", [(3, 4)], {"shape": (5, 2)}, "cannot reshape"),
        ("relu", [(3,), (3,)], {}, "expected 1 inputs"),
        ("relu", [(3,)], {"axis": 0}, "unknown param"),
    ],
)
def test_bad_shapes_and_params_say_what_was_expected(name, shapes, params, message):
    with pytest.raises(KernelError, match=message):
        get_kernel(name).bind(shapes, params)


def test_unknown_kernel_suggests_a_close_name():
    with pytest.raises(KernelError, match="did you mean 'relu'"):
        get_kernel("rellu")
