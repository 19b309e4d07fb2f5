"""Any module trains: Hugging Face decoders with rotary embeddings (their `inv_freq` buffer) and tied embeddings
import as one training step, and that step computes what torch computes (tiny configs, random weights)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import tapestry
from tapestry.evaluator import evaluate
from tapestry.importer.rewrites import BATCH_WIDE_REWRITES, exact_rewrites

transformers = pytest.importorskip("transformers")

COMMON = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 64}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(num_key_value_heads=2, **COMMON),
    "mistral": lambda: transformers.MistralConfig(num_key_value_heads=2, **COMMON),
    "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=2, **COMMON),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**COMMON),
    "llama_tied": lambda: transformers.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **COMMON),
}
IDS = torch.randint(0, COMMON["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))


def causal_lm(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()  # eval: dropout off


def lm_loss(module: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return module(input_ids=ids, labels=labels, use_cache=False).loss


def one_step(model: torch.nn.Module, optimizer: type, options: dict, atol: float) -> tapestry.TorchImport:
    """Import one step of `optimizer`, evaluate it, and check the loss and every updated weight against torch."""
    training = tapestry.Training.from_torch_optimizer(optimizer, lm_loss, **options)
    imported = tapestry.from_torch(model, (IDS, IDS), training=training, verbose=False)
    ours = imported.outputs(evaluate(imported.graph, imported.inputs(IDS, IDS)))
    reference = copy.deepcopy(model)
    opt = optimizer(reference.parameters(), **options)
    loss = lm_loss(reference, IDS, IDS)
    loss.backward()
    opt.step()
    assert abs(float(ours["loss"]) - loss.item()) <= 1e-5 * abs(loss.item())
    want = dict(reference.named_parameters())
    assert ours["parameters"].keys() == want.keys()
    for path, value in ours["parameters"].items():
        np.testing.assert_allclose(value, want[path].detach().numpy(), rtol=1e-5, atol=atol, err_msg=path)
    return imported


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gpt_neox"])
def test_a_rotary_decoder_step_imports_and_equals_torch(name):
    model = causal_lm(name)
    imported = one_step(model, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, atol=1e-6)
    (inv_freq,) = [path for path, _ in model.named_buffers() if path.endswith("rotary_emb.inv_freq")]
    assert inv_freq in imported.graph.static, "the rotary table's buffer is a static input, not a closure"
    fused = [n.op for n in imported.graph.ops if n.op.startswith("flash_attention")]  # grouped heads too
    assert len(fused) == 2 * COMMON["num_hidden_layers"] and sum(op.endswith("_backward") for op in fused) == 2
    # the label shift, the loss's one-hot and the embedding's gradient are kernels: none runs whole on every device
    assert not imported.opaque, imported.translation.declined


def mixtral(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **COMMON)
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)


def test_a_mixtral_step_through_transformers_fallback_grouped_mm_has_no_opaque_op_and_equals_torch(monkeypatch):
    """transformers runs its own grouped mm and backward where torch's cannot (non-bfloat16 weights under
    compile; here forced, as torch's fake grouped mm takes bfloat16 only): the experts' weight gradients are
    grouped_mm_k kernels and the router's topk backward a scatter, so nothing in the step runs opaque."""
    moe = pytest.importorskip("transformers.integrations.moe")
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *args: False)
    with exact_rewrites(BATCH_WIDE_REWRITES):  # routed batch-wide, as transformers routes (by block: the default)
        imported = one_step(mixtral(torch.float32), torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, atol=1e-6)
    ops = {n.op for n in imported.graph.ops}
    assert {"grouped_mm", "grouped_mm_k", "scatter"} <= ops and not imported.opaque, imported.translation.declined


def test_a_float32_mixtral_step_imports_through_transformers_fallback_grouped_mm_unforced_and_equals_torch():
    """torch's fake grouped mm takes bfloat16 only: the capture takes transformers' exact fallback for the rest."""
    moe = pytest.importorskip("transformers.integrations.moe")
    usable = moe._can_use_grouped_mm
    with exact_rewrites(BATCH_WIDE_REWRITES):
        imported = one_step(mixtral(torch.float32), torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, atol=1e-6)
    assert {"grouped_mm", "grouped_mm_k"} <= {n.op for n in imported.graph.ops} and not imported.opaque
    assert moe._can_use_grouped_mm is usable, "put back after the capture"


def test_a_bfloat16_mixtral_step_through_torchs_grouped_mm_has_no_opaque_op_and_equals_torch():
    """torch's `_grouped_mm` backward: the input's gradient a 2-D by 3-D grouped mm, the weights' a 2-D by 2-D one
    (grouped_mm_k). In bfloat16, with a learning rate so large that every update is many roundings of the weight:
    each weight within one rounding of torch's plus a tenth of its largest update (the gradients' own bfloat16
    roundings; a wrong gradient is off by its whole size)."""
    model = mixtral(torch.bfloat16)
    training = tapestry.Training.from_torch_optimizer(torch.optim.SGD, lm_loss, lr=10.0)
    with exact_rewrites(BATCH_WIDE_REWRITES):
        imported = tapestry.from_torch(model, (IDS, IDS), training=training, verbose=False)
    assert {"grouped_mm", "grouped_mm_k", "scatter"} <= {n.op for n in imported.graph.ops} and not imported.opaque
    ours = imported.outputs(evaluate(imported.graph, imported.inputs(IDS, IDS)))
    reference = copy.deepcopy(model)
    loss = lm_loss(reference, IDS, IDS)
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=10.0).step()
    assert abs(float(ours["loss"]) - loss.item()) <= 1e-3 * loss.item()
    before = dict(model.named_parameters())
    for path, value in reference.named_parameters():
        want, old = value.detach().float().numpy(), before[path].detach().float().numpy()
        update = np.abs(want - old).max()
        assert update > 0, path
        np.testing.assert_allclose(np.asarray(ours["parameters"][path], np.float32), want, rtol=2**-7,
                                   atol=0.1 * update, err_msg=path)


def test_a_tied_embedding_is_one_input_that_both_uses_read():
    model = causal_lm("llama_tied")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # Adam's first step is lr·sign(g) where |g| >> eps, and ill-conditioned where g is near eps (1e-8): gradients
    # equal within float32 rounding then differ by up to lr·1e-2 in such elements
    imported = one_step(model, torch.optim.AdamW, {"lr": 1e-3}, atol=1e-5)
    inputs = {n.name for n in imported.graph.inputs}
    assert "model.embed_tokens.weight" in inputs and "lm_head.weight" not in inputs


class TiedWithBuffers(torch.nn.Module):
    """An embedding whose weight the head reuses, a frozen scale and a float and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.scale = torch.nn.Parameter(torch.rand(8) + 0.5, requires_grad=False)
        self.register_buffer("shift", torch.randn(8))
        self.register_buffer("order", torch.arange(4).flip(0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)[:, self.order] * self.scale + self.shift
        return self.head(h)


def token_loss(module: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(module(ids).flatten(0, 1), labels.flatten())


def test_tied_frozen_and_buffers_in_a_plain_module_train_as_torch():
    model = TiedWithBuffers()
    ids = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(2))
    training = tapestry.Training.from_torch_optimizer(torch.optim.SGD, token_loss, lr=0.5, momentum=0.9)
    imported = tapestry.from_torch(model, (ids, ids), training=training, verbose=False)
    assert imported.trained == ("embed.weight",)
    assert {"scale", "shift"} <= imported.graph.static and "order" not in {n.name for n in imported.graph.inputs}
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    state = None
    for _ in range(3):
        opt.zero_grad()
        loss = token_loss(reference, ids, ids)
        loss.backward()
        opt.step()
        state = imported.outputs(evaluate(imported.graph, imported.inputs(ids, ids, state=state)))
        assert abs(float(state["loss"]) - loss.item()) <= 1e-5
        np.testing.assert_allclose(state["parameters"]["embed.weight"], reference.embed.weight.detach().numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_a_parameter_the_loss_never_reads_is_a_clear_error():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 1), "unused": torch.nn.Linear(4, 1)})
    training = tapestry.Training(loss=lambda m, x: m["used"](x).sum(), optimizer="sgd")
    with pytest.raises(tapestry.TorchImportError, match=r"parameter\(s\) unused.weight, unused.bias do not reach"):
        tapestry.from_torch(model, (torch.randn(2, 4),), training=training, verbose=False)


def test_a_cnn_whose_first_conv_needs_no_input_gradient_trains_as_torch():
    """convolution_backward leaves out (None) the gradient of an input that needs none: the import skips it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 5))
    x, y = torch.randn(2, 3, 8, 8), torch.randn(2, 5)

    def loss(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(module(x), y)

    training = tapestry.Training.from_torch_optimizer(torch.optim.SGD, loss, lr=0.1, momentum=0.9)
    imported = tapestry.from_torch(model, (x, y), training=training, verbose=False)
    ours = imported.outputs(evaluate(imported.graph, imported.inputs(x, y)))
    reference = copy.deepcopy(model)
    expected = loss(reference, x, y)
    expected.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9).step()
    assert abs(float(ours["loss"]) - expected.item()) <= 1e-5 * abs(expected.item())
    for path, value in reference.named_parameters():
        np.testing.assert_allclose(ours["parameters"][path], value.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=path)
