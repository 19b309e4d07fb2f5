"""Attention in a training step stays fused (kernels/flash.py): the forward with its log-sum-exp and the backward
are one kernel each, equal to torch's attention and its autograd, priced with no [L, S] traffic, and a training
step using them equals torch on one device and on two gloo ranks."""
from __future__ import annotations

import collections
import copy

import numpy as np
import pytest
import torch

import tapestry
from tapestry.evaluator import evaluate, run_sharded
from tapestry.importer.zoo import LlamaBlock
from tapestry.kernels import DimKind, get_kernel
from tapestry.spmd.launch import launch
from tapestry.testing.reference import torch_losses
from tapestry.training.plans import megatron
from tapestry.zspace import ZRange

F = torch.nn.functional


def bind(name, shapes, params=None, in_dtypes=None):
    return get_kernel(name).bind(shapes, params or {}, in_dtypes or ["float64"] * len(shapes))


def test_the_forward_splits_batch_heads_and_query_rows_and_reads_keys_whole():
    sig = bind("flash_attention", [(2, 2, 3, 8, 4), (2, 2, 1, 10, 4), (2, 2, 1, 10, 4)], {"causal": True})
    assert sig.dims == ("batch0", "batch1", "batch2", "query")
    assert sig.dim_kinds == (DimKind.PARALLEL,) * 4
    assert sig.output_shape == (2, 2, 3, 8, 5)  # [out | lse] per query row
    block = ZRange((1, 0, 2, 3), (2, 1, 3, 6))
    assert sig.projections[1].apply(block) == ZRange((1, 0, 0, 0, 0), (2, 1, 1, 10, 4))  # its kv head, every key


def test_the_backward_splits_batch_and_heads_and_packs_dq_dk_dv_per_point():
    q, k = (2, 4, 8, 6), (2, 4, 10, 6)
    sig = bind("flash_attention_backward", [q, q, k, k, q, q[:-1]], {"causal": True})
    assert sig.dims == ("batch0", "batch1") and sig.dim_kinds == (DimKind.PARALLEL,) * 2
    assert sig.output_shape == (2, 4, 8 * 6 + 2 * 10 * 6)
    assert sig.input_dtypes[5] == "float64"
    with pytest.raises(ValueError, match="lse"):
        bind("flash_attention_backward", [q, q, k, k, q, q])


def test_self_attentions_backward_packs_dq_dk_dv_per_row_and_splits_its_rows_only_in_a_ring():
    q, k = (2, 4, 8, 6), (2, 1, 8, 6)
    sig = bind("flash_attention_backward", [q, q, k, k, q, q[:-1]], {"causal": True})
    assert sig.dims == ("batch0", "batch1", "query") and sig.output_shape == (2, 4, 8, 3 * 6)
    block = ZRange((1, 2, 3), (2, 3, 5))
    assert sig.projections[1].apply(block) == ZRange((1, 2, 3, 0), (2, 3, 5, 6))  # its query rows
    assert sig.projections[2].apply(block) == ZRange((1, 0, 0, 0), (2, 1, 8, 6))  # its kv head, every key
    assert sig.kernel.ring.gradients


def _grouped(seed=0):
    """q with 4 heads over k, v with 2 (grouped-query), as torch takes them and as the kernels do."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, 7, 8, dtype=torch.float64, generator=g) for _ in range(2))
    dout = torch.randn(2, 4, 6, 8, dtype=torch.float64, generator=g)
    return q, k, v, dout


def _split(t, heads=2):
    return t.reshape(*t.shape[:1], heads, -1, *t.shape[2:])


@pytest.mark.parametrize("case", ["plain", "causal", "bool mask", "float mask"])
def test_forward_and_backward_equal_torch_attention_and_autograd_sharded_by_batch_and_heads(case):
    q, k, v, dout = _grouped()
    g = torch.Generator().manual_seed(3)
    mask = {"bool mask": torch.rand(6, 7, generator=g) > 0.3, "float mask": torch.randn(1, 1, 6, 7, generator=g,
                                                                                         dtype=torch.float64)}.get(case)
    causal = case == "causal"
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    suffix, extra, params = ("", [], {"causal": causal}) if mask is None else ("_masked", [mask.numpy()], {})
    arrays = [_split(t).detach().numpy() for t in (q,)] + [t.detach().numpy()[:, :, None] for t in (k, v)]
    mask_dtype = [] if mask is None else [str(mask.dtype).removeprefix("torch.")]
    forward = get_kernel(f"flash_attention{suffix}").bind(
        [a.shape for a in arrays + extra], params, ["float64"] * 3 + mask_dtype)
    halves = [ZRange((0, h, 0, 0), (2, h + 1, 2, 6)) for h in range(2)]  # by kv head
    packed = run_sharded(forward, arrays + extra, halves)
    out, lse = packed[..., :-1], packed[..., -1]
    np.testing.assert_allclose(out.reshape(want.shape), want.detach().numpy(), atol=1e-12)
    backward = get_kernel(f"flash_attention{suffix}_backward").bind(
        [arrays[0].shape, *(a.shape for a in arrays), out.shape, lse.shape, *(a.shape for a in extra)], params,
        ["float64"] * 6 + mask_dtype)
    grads = run_sharded(backward, [_split(dout).numpy(), *arrays, out, lse, *extra],
                        [ZRange((b, 0, 0), (b + 1, 2, 2)) for b in range(2)])  # by batch
    dq, dk, dv = np.split(grads, [6 * 8, 6 * 8 + 7 * 8], axis=-1)
    np.testing.assert_allclose(dq.reshape(q.shape), want_grads[0].numpy(), atol=1e-12)
    for got, ref in ((dk, want_grads[1]), (dv, want_grads[2])):  # each query head's share, summed over its group
        np.testing.assert_allclose(got.sum(axis=2).reshape(ref.shape), ref.numpy(), atol=1e-12)


def test_the_fused_torch_impls_equal_the_reference_on_a_later_causal_query_block():
    q, k, v, _ = _grouped()
    q, k, v = _split(q), k[:, :, None], v[:, :, None]
    sig = bind("flash_attention", [q.shape, k.shape, v.shape], {"causal": True})
    block = ZRange((0, 0, 0, 3), (2, 2, 2, 6))
    whole = run_sharded(sig, [t.numpy() for t in (q, k, v)], [sig.index])
    got = sig.kernel.torch(q[..., 3:, :], k, v, **sig.call_kwargs(block))
    np.testing.assert_allclose(got.numpy(), whole[..., 3:, :], atol=1e-12)


@pytest.mark.parametrize("masked", [False, True])
def test_the_off_cpu_math_path_equals_torchs_fused_cpu_kernels(masked):
    """Off the CPU the impls run the arithmetic in torch's ops: checked here against the fused CPU kernels, rows
    that see no key included (zeros, lse 0)."""
    from tapestry.kernels.flash import backward_math, forward_math

    q, k, v, dout = _grouped()
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
    mask = torch.rand(6, 7, generator=torch.Generator().manual_seed(2)) > 0.4 if masked else None
    if masked:
        mask[1] = False
    causal = torch.ones(6, 7, dtype=torch.bool).tril()
    name, params = ("flash_attention_masked", {"scale": 0.0}) if masked else ("flash_attention", {"causal": True,
                                                                                           "scale": 0.0})
    fused = get_kernel(name).torch(q, k, v, *([mask] if masked else []), block_start=(0, 0, 0), **params)
    math = forward_math(q, k, v, mask if masked else causal, 0.0)
    torch.testing.assert_close(math, fused)
    out, lse = fused[..., :-1], fused[..., -1]
    grads = get_kernel(f"{name}_backward").torch(dout, q, k, v, out, lse, *([mask] if masked else []),
                                                  block_start=(0, 0, 0), **params)
    torch.testing.assert_close(backward_math(dout, q, k, v, out, lse, mask if masked else causal, 0.0), grads)


def test_pricing_is_a_flash_kernels_no_score_traffic_and_the_backward_about_two_and_a_half_forwards():
    b, h, s, e = 1, 32, 4096, 128
    q = (b, h, s, e)
    params = {"causal": True}
    forward = bind("flash_attention", [q, q, q], params, ["bfloat16"] * 3)
    backward = bind("flash_attention_backward", [q, q, q, q, q, q[:-1]], params, ["bfloat16"] * 5 + ["float32"])
    (f_flops, f_bytes), (b_flops, b_bytes) = forward.cost(forward.index), backward.cost(backward.index)
    assert f_flops == pytest.approx(4 * b * h * s * s * e * causal_kept(s), rel=0.02)  # the kept pairs only
    assert b_flops / f_flops == pytest.approx(2.5, rel=0.03)
    cells = b * h * s * e
    assert f_bytes == 2 * 3 * cells + 4 * b * h * s * (e + 1)  # q, k, v in, [out | lse] out: no s x s
    assert b_bytes == 2 * 5 * cells + 4 * b * h * s + 2 * b * h * s * 3 * e
    from tapestry.cost.roofline import compute_dtype

    assert compute_dtype(backward) == "bfloat16"  # the float32 lse does not price it at float32's peak


def causal_kept(s: int) -> float:
    return (s + 1) / (2 * s)


def _ops(imported: tapestry.TorchImport) -> collections.Counter:
    return collections.Counter(n.op for n in imported.graph.ops)


def _mse(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(module(x), y)


def _one_step_matches(model, args, loss, tol=1e-5) -> tapestry.TorchImport:
    training = tapestry.Training(loss=loss, optimizer="sgd", lr=0.1)
    imported = tapestry.from_torch(model, args, training=training, verbose=False)
    ours = imported.outputs(evaluate(imported.graph, imported.inputs(*args)))
    reference = copy.deepcopy(model)
    value = loss(reference, *args)
    value.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert abs(float(ours["loss"]) - value.item()) <= tol * max(1.0, abs(value.item()))
    for path, p in reference.named_parameters():
        np.testing.assert_allclose(ours["parameters"][path], p.detach().numpy(), rtol=tol, atol=tol, err_msg=path)
    return imported


def test_a_llama_block_step_keeps_attention_fused_and_equals_torch():
    torch.manual_seed(0)
    x, y = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    ops = _ops(_one_step_matches(LlamaBlock(32, 4, 64), (x, y), _mse))
    assert ops["flash_attention"] == 1 and ops["flash_attention_backward"] == 1
    assert ops["softmax"] == 0 and ops["sdpa"] == 0  # no math attention beside them


def test_a_grouped_query_llama_block_step_equals_torch():
    """LlamaBlock with fewer key/value heads than query heads (LLaMA-2 70B's grouping): its k and v project to
    the shared heads only, and one training step equals torch's."""
    torch.manual_seed(0)
    x, y = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    block = LlamaBlock(32, 4, 64, kv_heads=2)
    assert block.k.weight.shape == block.v.weight.shape == (16, 32)
    ops = _ops(_one_step_matches(block, (x, y), _mse))
    assert ops["flash_attention"] == 1 and ops["flash_attention_backward"] == 1


class MaskedGrouped(torch.nn.Module):
    """Grouped-query attention (4 query heads over 2 kv heads) under a padding mask, then a projection."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.kv, self.o = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 2, 4).permute(3, 0, 2, 1, 4)
        mask = keep[:, None, None, :] & torch.ones(s, s, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, s, 16))


def test_a_masked_grouped_query_step_keeps_attention_fused_and_equals_torch():
    torch.manual_seed(1)
    x, keep = torch.randn(2, 6, 16), torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    ops = _ops(_one_step_matches(MaskedGrouped(), (x, keep), lambda m, x, keep: m(x, keep).square().mean()))
    assert ops["flash_attention_masked"] == 1 and ops["flash_attention_masked_backward"] == 1


class AttentionDropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)


def test_attention_dropout_falls_back_to_math_and_draws_as_eager_torch():
    """The fused CPU kernel would draw its own mask: with dropout the step takes the math path, whose draw is an
    input made each call from torch's generator, as eager torch draws it."""
    model, x = AttentionDropout(), torch.randn(2, 6, 16)
    loss = lambda m, x: m(x).square().mean()  # noqa: E731
    imported = tapestry.from_torch(model, (x,), training=tapestry.Training(loss=loss, lr=0.1), verbose=False)
    assert _ops(imported)["flash_attention"] == 0 and len(imported.translation.draws) == 1
    torch.manual_seed(4)
    ours = imported.outputs(evaluate(imported.graph, imported.inputs(x)))
    torch.manual_seed(4)
    reference = copy.deepcopy(model)
    value = loss(reference, x)
    value.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert float(ours["loss"]) == pytest.approx(value.item(), rel=1e-5)
    np.testing.assert_allclose(ours["parameters"]["qkv.weight"], reference.qkv.weight.detach().numpy(), atol=1e-6)


def test_gpt2_without_attention_dropout_trains_fused_as_torch():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, attn_pdrop=0.0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False)
    model, ids = transformers.GPT2LMHeadModel(config).train(), torch.randint(0, 64, (2, 8))
    imported = _one_step_matches(model, (ids, ids), lambda m, i, labels: m(input_ids=i, labels=labels).loss)
    ops = _ops(imported)  # use_cache=False: GPT-2 passes its causal mask as a tensor
    assert ops["flash_attention_masked"] + ops["flash_attention"] == 2 and ops["softmax"] == 0
    assert ops["flash_attention_masked_backward"] + ops["flash_attention_backward"] == 2


HIDDEN = {"q.weight": 0, "k.weight": 0, "v.weight": 0, "o.weight": 1, "gate.weight": 0, "up.weight": 0,
          "down.weight": 1}
BATCHES = [tuple(torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(k)) for _ in range(2))
           for k in range(2)]


def _step_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _block() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaBlock(32, 4, 64)


def _train_two_ranks() -> list[float]:
    step = tapestry.parallelize_step(_block(), _step_loss, BATCHES[0], mesh=tapestry.Mesh(2),
                                     plan=lambda graph, mesh: megatron(graph, mesh, HIDDEN),
                                     optimizer=torch.optim.SGD, lr=0.1, compile=False, cache=False)
    fused = [s for s in step.plan.steps if getattr(s, "kernel", "").startswith("flash_attention")]
    assert len(fused) == 2 and all(s.blocks[0] != s.blocks[1] for s in fused)  # split by heads
    return [float(step(*batch)) for batch in BATCHES]


def test_a_llama_block_trains_on_two_gloo_ranks_with_its_fused_attention_split_by_heads_as_torch():
    model = _block()
    want = torch_losses(model, torch.optim.SGD(model.parameters(), lr=0.1), _step_loss, BATCHES)
    for rank, got in enumerate(launch(_train_two_ranks, 2, timeout=300)):
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"rank {rank}")
