"""Shape and vision kernels: their dim kinds, torch's semantics (padding, groups, eval batch norm), and
sharded runs, including blocks that lie wholly outside one input of a concat."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tapestry
from tapestry.evaluator import read_block, run_sharded
from tapestry.graph import Graph
from tapestry.kernels import DimKind, KernelError, Signature, get_kernel
from tapestry.plan import build_plan
from tapestry.sharding import Mesh
from tapestry.sharding.partition import candidate_partitions, needed_layout, partition_issues
from tapestry.zspace import ZRange

P, W, R = DimKind.PARALLEL, DimKind.WINDOWED, DimKind.REDUCTION
RNG = np.random.default_rng(0)


def bind(name: str, *shapes: tuple[int, ...], dtypes: tuple[str, ...] | None = None, **params) -> Signature:
    return get_kernel(name).bind(shapes, params, dtypes or ("float64",) * len(shapes))


def kinds(sig: Signature) -> dict[str, DimKind]:
    return dict(zip(sig.dims, sig.dim_kinds))


def grid(sig: Signature, **chunks: int) -> list[ZRange]:
    """The index space cut into chunks of the given size along the named dims."""
    parts = [sig.index]
    for dim, size in chunks.items():
        parts = [piece for part in parts for piece in part.split(sig.dims.index(dim), size)]
    return parts


def run_every_way(sig: Signature, args: list[np.ndarray], **chunks: int) -> np.ndarray:
    """The kernel run whole, after checking that every grid of the named dims gives the same result."""
    whole = run_sharded(sig, args, [sig.index])
    for k in range(1, len(chunks) + 1):
        for names in itertools.combinations(chunks, k):
            np.testing.assert_allclose(run_sharded(sig, args, grid(sig, **{n: chunks[n] for n in names})), whole,
                                       rtol=1e-12, atol=1e-12)
    return whole


def whole_in_torch(sig: Signature, x: np.ndarray) -> torch.Tensor:
    """The torch impl on the whole (zero-padded) read of x."""
    block = read_block(x, sig.projections[0].apply(sig.index))
    return sig.kernel.torch(torch.from_numpy(block), **sig.call_kwargs(sig.index))


def normal(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


# -- dim kinds ----------------------------------------------------------------------------------


def test_concat_axis_is_a_parallel_dim_so_every_dim_splits():
    sig = bind("concat", (2, 3), (2, 5), axis=-1)
    assert sig.output_shape == (2, 8)
    assert sig.dim_kinds == (P, P) and sig.splittable == (0, 1)


def test_conv_rows_are_windowed_groups_parallel_and_channels_a_reduction_additive_only_without_bias():
    conv = bind("conv2d", (1, 4, 8, 8), (6, 2, 3, 3), groups=2, padding=1)
    assert kinds(conv) == {"n": P, "kg": P, "oh": W, "ow": W, "c": R, "g": P}
    assert conv.output_shape == (1, 6, 8, 8)
    assert "c" in (conv.dims[d] for d in conv.splittable)
    biased = bind("conv2d_bias", (1, 4, 8, 8), (6, 4, 3, 3), (6,), padding=1)
    assert kinds(biased)["c"] is R and "c" not in (biased.dims[d] for d in biased.splittable)


def test_grouped_conv_blocks_hold_whole_groups():
    """With groups > 1, kg and c have one point each (a box of channels is exact only for whole groups)."""
    sig = bind("conv2d", (1, 6, 5, 5), (4, 3, 3, 3), groups=2)
    assert dict(zip(sig.dims, sig.index.shape)) == {"n": 1, "kg": 1, "oh": 3, "ow": 3, "c": 1, "g": 2}
    second = ZRange((0, 0, 0, 0, 0, 1), (1, 1, 3, 3, 1, 2))
    assert sig.projections[0].apply(second) == ZRange((0, 3, 0, 0), (1, 6, 5, 5))
    assert sig.output.apply(second) == ZRange((0, 2, 0, 0), (1, 4, 3, 3))


def test_pool_rows_are_windowed_when_windows_overlap():
    assert kinds(bind("max_pool2d", (1, 2, 7, 7), kernel=3, stride=2, padding=1)) == {"n": P, "c": P, "oh": W, "ow": W}
    assert kinds(bind("avg_pool2d", (1, 2, 8, 8), kernel=2)) == {"n": P, "c": P, "oh": P, "ow": P}  # stride 0: 2


def test_views_move_no_data_and_keep_the_dtype():
    for sig in (bind("slice", (5, 4), dtypes=("int64",), axis=0, start=1, stop=5, step=2),
                bind("select", (5, 4), dtypes=("bool",), axis=1, index=-1),
                bind("expand", (4, 1), dtypes=("int32",), shape=(3, -1, 6))):
        assert sig.kernel.is_view and sig.cost(sig.index) == (0.0, 0.0)
        assert sig.dtype == sig.input_dtypes[0]
    assert bind("expand", (4, 1), shape=(3, -1, 6)).output_shape == (3, 4, 6)


@pytest.mark.parametrize(
    "name, shapes, params, message",
    [
        ("concat", [(2, 3), (3, 3)], {"axis": 1}, "equal shapes off that axis"),
        ("slice", [(4,)], {"stop": 3, "step": 0}, "step >= 1"),
        ("select", [(4, 2)], {"axis": 1, "index": 2}, "out of range"),
        ("expand", [(3, 2)], {"shape": (3, 4)}, "cannot expand"),
        ("conv2d", [(1, 4, 5, 5), (4, 3, 3, 3)], {"groups": 2}, "groups=2 dividing C and K"),
        ("max_pool2d", [(1, 1, 5, 5)], {"kernel": 2, "padding": 2}, "padding <= kernel // 2"),
        ("batch_norm", [(2, 3, 4), (3,), (3,), (4,), (3,)], {}, "of shape \\[C\\]"),
    ],
)
def test_bad_shapes_and_params_say_what_was_expected(name, shapes, params, message):
    with pytest.raises(KernelError, match=message):
        get_kernel(name).bind(shapes, params)


def test_pools_reject_integer_inputs():
    with pytest.raises(KernelError, match="float x"):
        bind("max_pool2d", (1, 1, 4, 4), dtypes=("int64",), kernel=2)


# -- values -------------------------------------------------------------------------------------


def test_concat_of_bool_is_bool_and_blocks_across_or_beside_the_seam_agree():
    a, b = RNG.random((3, 4)) < 0.5, RNG.random((3, 2)) < 0.5
    sig = bind("concat", a.shape, b.shape, dtypes=("bool", "bool"), axis=1)
    assert sig.dtype == "bool"
    got = run_every_way(sig, [a, b], d0=2, d1=1)  # d1 chunks of 1: blocks wholly inside a or inside b
    assert got.dtype == np.bool_ and (got == np.concatenate([a, b], axis=1)).all()
    np.testing.assert_array_equal(run_sharded(sig, [a, b], grid(sig, d1=3)), got)  # a block straddling the seam


def test_concat_promotes_like_torch_cat():
    sig = bind("concat", (2,), (3,), dtypes=("int32", "float16"))
    assert sig.dtype == str(torch.cat([torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.float16)]).dtype
                            ).removeprefix("torch.")


@pytest.mark.parametrize("start, stop, step", [(1, 7, 2), (-5, 100, 3), (0, 6, 1), (6, 7, 4)])
def test_slice_with_step_is_python_slicing(start, stop, step):
    x = normal(3, 7)
    sig = bind("slice", x.shape, axis=-1, start=start, stop=stop, step=step)
    np.testing.assert_array_equal(run_every_way(sig, [x], d0=2, d1=1), x[:, start:stop:step])


def test_select_drops_its_axis():
    x = normal(3, 4, 5)
    sig = bind("select", x.shape, axis=1, index=-2)
    np.testing.assert_array_equal(run_every_way(sig, [x], d0=1, d1=2), x[:, -2])


def test_expand_reads_one_cell_of_size_one_dims():
    x = np.arange(4).reshape(4, 1)
    sig = bind("expand", x.shape, dtypes=("int64",), shape=(2, 4, 3))
    np.testing.assert_array_equal(run_every_way(sig, [x], d0=1, d1=3, d2=2), np.broadcast_to(x, (2, 4, 3)))


@pytest.mark.parametrize("groups, stride, padding", [(1, 1, 1), (2, 2, 1), (3, 1, 0), (6, 1, 2)])
def test_grouped_conv_matches_torch(groups, stride, padding):
    x, w, b = normal(2, 6, 7, 6), normal(6 * (1 + (groups < 6)), 6 // groups, 3, 2), normal(6 * (1 + (groups < 6)))
    params = {"stride": stride, "padding": padding, "groups": groups}
    want = F.conv2d(*map(torch.from_numpy, (x, w, b)), **params).numpy()
    conv = bind("conv2d", x.shape, w.shape, **params)
    got = run_every_way(conv, [x, w], g=1, kg=2, oh=2, c=2) + b[:, None, None]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    biased = bind("conv2d_bias", x.shape, w.shape, b.shape, **params)
    np.testing.assert_allclose(run_every_way(biased, [x, w, b], g=1, kg=2, ow=3), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel, stride, padding", [(3, 2, 1), (2, 1, 1), (3, 1, 1), (2, 2, 0)])
def test_max_pool_pads_with_minus_infinity_like_torch(kernel, stride, padding):
    x = -np.abs(normal(2, 3, 7, 6)) - 1  # all negative: a zero from padding would win every edge window
    sig = bind("max_pool2d", x.shape, kernel=kernel, stride=stride, padding=padding)
    want = F.max_pool2d(torch.from_numpy(x), kernel, stride, padding).numpy()
    np.testing.assert_array_equal(run_every_way(sig, [x], oh=1, ow=2), want)
    torch_block = whole_in_torch(sig, x)
    np.testing.assert_array_equal(torch_block.numpy(), want)


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("kernel, stride, padding", [(3, 2, 1), (2, 1, 1), (3, 3, 1)])
def test_avg_pool_counts_padding_or_not_like_torch(kernel, stride, padding, count_include_pad):
    x = normal(2, 3, 7, 8)
    params = {"kernel": kernel, "stride": stride, "padding": padding, "count_include_pad": count_include_pad}
    sig = bind("avg_pool2d", x.shape, **params)
    want = F.avg_pool2d(torch.from_numpy(x), kernel, stride, padding, count_include_pad=count_include_pad).numpy()
    np.testing.assert_allclose(run_every_way(sig, [x], oh=1, ow=2), want, rtol=1e-12, atol=1e-12)
    torch_block = whole_in_torch(sig, x)
    np.testing.assert_allclose(torch_block.numpy(), want, rtol=1e-12, atol=1e-12)


def test_batch_norm_is_torch_eval_mode():
    x = normal(2, 3, 4, 5)
    bn = torch.nn.BatchNorm2d(3, eps=1e-3, dtype=torch.float64)
    with torch.no_grad():
        for p in (bn.running_mean, bn.weight, bn.bias):
            p.copy_(torch.from_numpy(normal(3)))
        bn.running_var.copy_(torch.from_numpy(np.abs(normal(3)) + 0.1))
    want = bn.eval()(torch.from_numpy(x)).detach().numpy()
    stats = [t.detach().numpy() for t in (bn.running_mean, bn.running_var, bn.weight, bn.bias)]
    sig = bind("batch_norm", x.shape, *[(3,)] * 4, eps=1e-3)
    np.testing.assert_allclose(run_every_way(sig, [x, *stats], c=1, s1=2), want, rtol=1e-12, atol=1e-12)


# -- graphs, plans and the runtime -----------------------------------------------------------------


def vision_graph() -> Graph:
    """Grouped conv, padded max pool, concat, batch norm, avg pool without padding counts, and the shape views."""
    g = Graph()
    x = g.input("x", (2, 4, 7, 7), "float64")
    conv = g.conv2d(x, g.input("w", (6, 2, 3, 3), "float64"), padding=1, groups=2)
    pool = g.max_pool2d(conv, kernel=3, stride=2, padding=1)
    cat = g.concat(pool, g.input("y", (2, 3, 4, 4), "float64"), axis=1)
    bn = g.batch_norm(cat, *(g.input(n, (9,), "float64") for n in ("mean", "var", "bw", "bb")))
    avg = g.avg_pool2d(bn, kernel=2, stride=1, padding=1, count_include_pad=False)
    picked = g.select(g.slice(avg, axis=2, start=1, stop=5, step=2), axis=0, index=1)
    g.output("out", g.add(picked, g.expand(g.input("z", (2, 1), "float64"), shape=(9, 2, 5))))
    return g


# per op: the index dim each of a 2-device mesh's axis splits (the concat's axis 1 straddles its seam: 9 -> 5 + 4)
SPLITS = {"conv2d_0": (5,), "max_pool2d_0": (2,), "concat_0": (1,), "batch_norm_0": (1,), "avg_pool2d_0": (3,),
          "slice_0": (2,), "select_0": (0,), "expand_0": (0,)}


def vision_inputs(graph: Graph) -> dict[str, np.ndarray]:
    inputs = tapestry.random_inputs(graph, seed=1)
    inputs["var"] = np.abs(inputs["var"]) + 0.1
    return inputs


def test_sharded_evaluation_of_a_vision_graph_equals_the_whole():
    g = vision_graph()
    inputs = vision_inputs(g)
    want = tapestry.evaluate(g, inputs)["out"]
    assert np.isfinite(want).all()
    parts = {
        "conv2d_0": grid(g.signature("conv2d_0"), g=1, oh=3),
        "max_pool2d_0": grid(g.signature("max_pool2d_0"), oh=1, ow=3),
        "concat_0": grid(g.signature("concat_0"), d1=2),  # blocks in a alone, across the seam, in b alone
        "batch_norm_0": grid(g.signature("batch_norm_0"), c=4),
        "avg_pool2d_0": grid(g.signature("avg_pool2d_0"), oh=2, ow=2),
        "slice_0": grid(g.signature("slice_0"), d2=1),
        "select_0": grid(g.signature("select_0"), d0=4),
        "expand_0": grid(g.signature("expand_0"), d0=2, d2=3),
    }
    np.testing.assert_allclose(tapestry.evaluate_sharded(g, inputs, parts)["out"], want, rtol=1e-12, atol=1e-12)


def test_a_concat_split_on_its_axis_is_a_candidate_and_a_device_beside_the_seam_needs_nothing_of_b():
    sig = bind("concat", (2, 6), (2, 2), axis=1)
    part = next(p for p in candidate_partitions(sig, Mesh(2)) if p.name(sig) == "split(d1)")
    assert partition_issues(sig, part.blocks) == []
    assert needed_layout(sig, 0, part).blocks == (ZRange((0, 0), (2, 4)), ZRange((0, 4), (2, 6)))
    assert needed_layout(sig, 1, part).blocks == (None, ZRange((0, 0), (2, 2)))


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_two_gloo_ranks_run_a_vision_graph_split_everywhere(compile):
    from tapestry.runtime import run_plan

    g = vision_graph()
    inputs = vision_inputs(g)
    result = run_plan(build_plan(g, Mesh(2), SPLITS), inputs, compile=compile, timeout=300)
    np.testing.assert_allclose(result.outputs["out"], tapestry.evaluate(g, inputs)["out"], rtol=1e-12, atol=1e-12)
