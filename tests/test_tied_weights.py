"""Tied weights (one tensor under several module paths) import as one graph input holding the module's value."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tapestry
from tapestry.importer import TorchImportError, from_torch
from tapestry.plan.simulate import simulate


class SharedLayers(torch.nn.Module):
    """Two linears that share one weight, as T5's input embedding and LM head do."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 16, bias=False)
        self.second = torch.nn.Linear(16, 16, bias=False)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def eager(module, args, kwargs) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*args, **kwargs)
    return [t.numpy() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def assert_plan_matches_eager(module, args, kwargs=None) -> tapestry.TorchImport:
    kwargs = kwargs or {}
    imp = from_torch(module, args, kwargs, verbose=False)
    plan = tapestry.optimize(imp.graph, mesh=tapestry.Mesh(4)).plan
    got = imp.outputs(simulate(plan, imp.inputs(*args, **kwargs)))
    want = eager(module, args, kwargs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())
    return imp


def test_a_weight_shared_by_two_layers_is_one_input_with_the_modules_value():
    torch.manual_seed(0)
    module = SharedLayers().eval()
    imp = assert_plan_matches_eager(module, (torch.randn(4, 16),))
    assert imp.translation.state == ("first.weight",)


def test_a_tiny_t5_with_tied_embeddings_matches_eager_on_four_devices():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                      dropout_rate=0.0, tie_word_embeddings=True, decoder_start_token_id=0,
                      relative_attention_num_buckets=8)
    module = T5ForConditionalGeneration(config).eval()
    ids, decoder_ids = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 6))
    imp = assert_plan_matches_eager(module, (ids,), {"decoder_input_ids": decoder_ids, "use_cache": False})
    assert "shared.weight" in imp.translation.state
    assert not {"lm_head.weight", "encoder.embed_tokens.weight"} & set(imp.translation.state)


def test_module_state_the_module_no_longer_has_is_an_error_not_zeros():
    torch.manual_seed(0)
    module = SharedLayers().eval()
    x = torch.randn(4, 16)
    imp = from_torch(module, (x,), verbose=False)
    del module.first.weight  # the module changed after import: its weight is gone
    with pytest.raises(TorchImportError, match="'first.weight' is module state"):
        imp.inputs(x)
