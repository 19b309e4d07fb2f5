"""Builders shared by the expert-parallel tests (test_experts, test_baselines, test_block_routing): a cost model
that favours expert-parallel plans at tiny sizes, one training step of a 1-layer Mixtral with its expert weights,
and the zoo's tiny Mixtral parallelized on gloo ranks against eager."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import tapestry
from tapestry.importer.rewrites import Rewrite, exact_rewrites
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


def tiny_mixtral_step(monkeypatch: pytest.MonkeyPatch, batch: int = 2, rewrites: tuple[Rewrite, ...] | None = None,
                      experts: int = 4) -> tuple[tapestry.TorchImport, tuple]:
    """One SGD step of a 1-layer Mixtral (4 experts unless `experts` says, top 2) in float32, and its arguments:
    routed by block (the default), or as `rewrites` say (BATCH_WIDE_REWRITES: through transformers' own grouped mm,
    whose fake torch's takes bfloat16 only)."""
    moe = pytest.importorskip("transformers.integrations.moe")
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *args: False)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                                        num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(1))
    training = tapestry.Training.from_torch_optimizer(
        torch.optim.SGD, lambda m, x, y: m(input_ids=x, labels=y, use_cache=False).loss, lr=0.1)
    with exact_rewrites(rewrites):
        return tapestry.from_torch(model, (ids, ids), training=training, verbose=False), (ids, ids)


EXPERT_WEIGHTS = {"model.layers.0.mlp.experts.gate_up_proj": 0, "model.layers.0.mlp.experts.down_proj": 0}


def zoo_mixtral(experts: int = 4) -> tuple[torch.nn.Module, tuple, dict]:
    """The zoo's tiny Mixtral (4 experts, top 2), or the same with `experts` experts."""
    from tapestry.importer.zoo import FAMILIES, _decoder, _seeded

    if experts == 4:
        return FAMILIES["mixtral"].build()
    return _seeded(_decoder("MixtralConfig", "MixtralModel", num_local_experts=experts, num_experts_per_tok=2))()


def serve_zoo_mixtral(mesh: tapestry.Mesh, favour: tuple[str, ...], experts: int = 4
                      ) -> tuple[list[str], list[str], list[int], torch.Tensor]:
    """On each launched rank: the zoo's tiny Mixtral (`zoo_mixtral`) parallelized (eager; under
    `Favour(kernels=favour)` where given, else the default cost model), the kernels of its split steps and of its
    exchanged ones, the exchanged ones' groups (`Compute.exchange_group`), and its output."""
    module, args, kwargs = zoo_mixtral(experts)
    priced = {"cost_model": Favour(kernels=favour)} if favour else {}
    model = tapestry.parallelize(module.eval(), args, kwargs, mesh=mesh, compile=False, cache=False,
                                 verbose=False, **priced)
    steps = [s for s in model.plan.steps if isinstance(s, Compute)]
    return ([s.kernel for s in steps if len(set(s.blocks)) > 1], [s.kernel for s in steps if s.exchange],
            [s.exchange_group for s in steps if s.exchange], model(*args, **kwargs).last_hidden_state)


def zoo_mixtral_on_gloo_ranks(mesh: tapestry.Mesh, favour: tuple[str, ...] = (), experts: int = 4
                              ) -> list[tuple[list[str], list[str], list[int]]]:
    """The zoo's tiny Mixtral (`zoo_mixtral`) on mesh.size gloo ranks, each rank's output checked against eager:
    per rank, the kernels of its plan's split steps and of its exchanged (expert-parallel) ones, and the exchanged
    ones' groups."""
    from tapestry.spmd.launch import launch

    module, args, kwargs = zoo_mixtral(experts)
    with torch.no_grad():
        want = module.eval()(*args, **kwargs).last_hidden_state
    found = []
    for split, exchanged, groups, got in launch(serve_zoo_mixtral, mesh.size, mesh, favour, experts, timeout=900):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        found.append((split, exchanged, groups))
    return found
