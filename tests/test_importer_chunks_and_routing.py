"""The ops Switch Transformers' router (max.dim, one_hot) and Longformer's chunked attention (as_strided of
overlapping chunks) ran opaque: they import as kernels (amax and argmax, one_hot, windows), compute what eager
torch computes, and shard in a plan on four devices."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import tapestry
from tapestry.evaluator import evaluate
from tapestry.importer import from_torch
from tapestry.kernels import DimKind, KernelError, get_kernel

from test_importer_kernels import assert_same, eager, imported_and_planned_on_four


def chunk(x: torch.Tensor, w: int) -> torch.Tensor:
    """Longformer's `_chunk`: x[B, S, D] as overlapping chunks [B, 2S/2w - 1, 2w, D], each w rows after the last."""
    x = x.view(x.size(0), x.size(1) // (2 * w), 2 * w, x.size(2))
    size, stride = list(x.size()), list(x.stride())
    size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
    return x.as_strided(size=size, stride=stride)


class Chunked(torch.nn.Module):
    """Longformer's chunkings: the query's chunks of 2w rows every w; chunks of a transposed view (as_strided reads
    memory, whose order is not the dims'); the value's chunks of 3w rows every w of a padded tensor."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.w = w
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h, w = self.proj(x), self.w  # [B, S, D]
        (b, s, d), t = h.shape, h.transpose(0, 1).contiguous().transpose(0, 1)  # memory order [S, B, D]
        across = t.as_strided(size=(b, s // w - 1, 2 * w, d), stride=(d, w * b * d, b * d, 1))  # Longformer's
        padded = torch.nn.functional.pad(h, (0, 0, w, w), value=-1.0)
        p = padded.stride()
        values = padded.as_strided(size=(b, s // w, 3 * w, d), stride=(p[0], w * p[1], p[1], p[2]))
        return chunk(h, w) * 2, across + 1, values * 2


def test_overlapping_chunks_import_as_windows_and_split_with_halos():
    torch.manual_seed(0)
    module, args = Chunked(2).eval(), (torch.randn(2, 8, 4),)
    imp = imported_and_planned_on_four(module, args, "windows")
    assert set(imp.coverage["aten.as_strided.default"]) == {"reshape, windows", "transpose, windows", "windows"}


def test_a_bool_mask_put_of_one_value_is_a_masked_fill():
    """Longformer's `extended_attention_mask[attention_mask == 2] = max`, and over the dims after the first."""

    class Put(torch.nn.Module):
        def forward(self, x, mask):
            y = x.clone()
            y[mask == 2] = torch.finfo(x.dtype).max
            z = x.clone()
            z[:, mask[0] > 0] = -1.0
            return y, z

    x, mask = torch.randn(3, 4), torch.tensor([[1, 2, 0, 2], [2, 1, 1, 0], [0, 0, 2, 1]])
    imp = from_torch(Put(), (x, mask), verbose=False)
    assert not imp.opaque and all("masked_fill" in made for made in imp.coverage["aten.index_put.default"])
    assert_same(imp.outputs(evaluate(imp.graph, imp.inputs(x, mask))), eager(Put(), (x, mask)))


def test_an_as_strided_that_is_no_window_pattern_stays_opaque_and_matches():
    class Diagonal(torch.nn.Module):
        def forward(self, x):
            return x.as_strided((3,), (4,)) * 1.0, x.as_strided((2, 3), (0, 1)) + 1.0

    x = torch.randn(3, 3)
    imp = from_torch(Diagonal(), (x,), verbose=False)
    assert imp.opaque == {"aten.as_strided.default": 2}
    assert_same(imp.outputs(evaluate(imp.graph, imp.inputs(x))), eager(Diagonal(), (x,)))


class Router(torch.nn.Module):
    """Switch Transformers' top-1 router: the expert by argmax, one_hot over the experts, the gate by max.dim."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        probs = self.classifier(x).softmax(-1)
        gate, expert = torch.max(probs, dim=-1)
        kept = torch.max((probs > 0.25).float(), dim=1, keepdim=True)[1]  # ties: the first position, as torch
        mask = torch.nn.functional.one_hot(expert, num_classes=4)
        return gate, expert, kept, mask, mask.cumsum(-2)


def test_max_dim_and_one_hot_import_as_kernels_and_split():
    torch.manual_seed(0)
    module, args = Router().eval(), (torch.randn(2, 6, 8),)
    imp = imported_and_planned_on_four(module, args, "one_hot")
    assert dict(imp.coverage["aten.max.dim"]) == {"amax, argmax": 1, "argmax": 1}  # `kept` reads positions only
    assert set(imp.coverage["aten.one_hot.default"]) == {"one_hot"}


def test_one_hot_without_a_class_count_is_refused():
    """torch.export cannot trace one_hot without num_classes (its shape is the data's); a graph cannot ask it."""
    with pytest.raises(KernelError, match="classes >= 1"):
        get_kernel("one_hot").bind([(3,)], {"classes": -1}, ["int64"])


def test_one_hot_raises_on_a_class_out_of_range_as_torch_does():
    sig = get_kernel("one_hot").bind([(3,)], {"classes": 2}, ["int64"])
    for impl, ids in ((sig.kernel.numpy, np.array([0, 2, 1])), (sig.kernel.torch, torch.tensor([0, -1, 1]))):
        with pytest.raises((ValueError, RuntimeError), match=r"\[0, 2\)"):
            impl(ids, **sig.call_kwargs(sig.index))


@pytest.mark.parametrize("size, step, kind", [(4, 2, DimKind.WINDOWED), (2, 2, DimKind.PARALLEL),
                                               (2, 3, DimKind.PARALLEL)])
def test_overlapping_windows_are_a_windowed_dim_and_disjoint_ones_parallel(size, step, kind):
    sig = get_kernel("windows").bind([(3, 12, 5)], {"axis": 1, "size": size, "step": step})
    assert sig.output_shape == (3, (12 - size) // step + 1, size, 5)
    assert sig.dim_kinds == (DimKind.PARALLEL, kind, DimKind.PARALLEL)


def test_one_hot_splits_over_its_classes():
    sig = get_kernel("one_hot").bind([(3, 4)], {"classes": 5}, ["int64"])
    assert sig.output_shape == (3, 4, 5) and sig.dims[-1] == "class" and len(sig.splittable) == 3


def trained_as_torch(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tapestry.TorchImport:
    """One SGD step of `module` (loss: the mean square of its float outputs) imported, its loss and updated weights
    checked against torch's own step."""
    def loss(m: torch.nn.Module, *xs: torch.Tensor) -> torch.Tensor:
        return sum(o.float().pow(2).mean() for o in m(*xs) if o.is_floating_point())

    imp = from_torch(module, args, training=tapestry.Training(loss=loss, lr=0.1), verbose=False)
    ours = imp.outputs(evaluate(imp.graph, imp.inputs(*args)))
    reference = copy.deepcopy(module)
    want = loss(reference, *args)
    want.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    np.testing.assert_allclose(float(ours["loss"]), want.item(), rtol=1e-5)
    for path, value in reference.named_parameters():
        np.testing.assert_allclose(ours["parameters"][path], value.detach().numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=path)
    return imp


def test_the_backward_of_overlapping_chunks_imports_as_kernels_and_equals_torchs_gradients():
    """as_strided's backward adds each chunk's gradient into a buffer of the input's storage (index_put of the
    windows of an arange) and reads it back in the chunked tensor's layout: an as_strided that is a permutation
    of row-major (a reshape and a transpose), beside new_empty_strided buffers copied into (a fill). No opaque op."""
    torch.manual_seed(0)
    imp = trained_as_torch(Chunked(2).eval(), (torch.randn(2, 8, 4),))
    assert not imp.opaque, imp.translation.declined
    assert {"reshape, transpose", "reshape"} & set(imp.coverage["aten.as_strided.default"])


def test_the_routers_training_step_differentiates_around_one_hot_and_equals_torch():
    """one_hot's integer mask has no gradient (the router's weights learn through the gate, max.dim's values),
    and a training step's trace decomposes it into a comparison with an arange (eq): no backward to import."""
    torch.manual_seed(0)
    imp = trained_as_torch(Router().eval(), (torch.randn(2, 6, 8),))
    assert not imp.opaque, imp.translation.declined
    ops = {node.op for node in imp.graph.ops}
    assert "eq" in ops and "one_hot" not in ops
