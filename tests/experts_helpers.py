"""Builders shared by the expert-parallel tests (test_experts, test_baselines): a cost model that favours
expert-parallel plans at tiny sizes, and one training step of a 1-layer Mixtral with its expert weights."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import tapestry
from tapestry.optimizer import default_cost_model
from tapestry.plan import Compute


@dataclass(frozen=True)
class Favour:
    """The default cost model, with every grouped_mm and row gather (take, take_rows) that is not expert parallel
    priced out: plans at tiny sizes (where the honest price keeps experts whole) that split the experts and trade
    tokens by all-to-all."""

    base: Any = field(default_factory=default_cost_model)
    kernels: tuple[str, ...] = ("grouped_mm", "take_rows", "take")

    def step_cost(self, step, mesh) -> float:
        if isinstance(step, Compute) and step.kernel in self.kernels and not step.exchange:
            return 1.0
        return self.base.step_cost(step, mesh)


def tiny_mixtral_step(monkeypatch: pytest.MonkeyPatch, batch: int = 2) -> tuple[tapestry.TorchImport, tuple]:
    """One SGD step of a 1-layer Mixtral (4 experts, top 2) in float32, through transformers' own grouped mm
    (torch's fake grouped mm takes bfloat16 only), and its arguments."""
    moe = pytest.importorskip("transformers.integrations.moe")
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *args: False)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(1))
    training = tapestry.Training.from_torch_optimizer(
        torch.optim.SGD, lambda m, x, y: m(input_ids=x, labels=y, use_cache=False).loss, lr=0.1)
    return tapestry.from_torch(model, (ids, ids), training=training, verbose=False), (ids, ids)


EXPERT_WEIGHTS = {"model.layers.0.mlp.experts.gate_up_proj": 0, "model.layers.0.mlp.experts.down_proj": 0}
