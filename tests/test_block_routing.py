"""MoE routing block by block (importer/block_routing.py): the rewrite computes what transformers' batch-wide
grouped experts compute (uneven routings, an expert no token chooses), its graph evaluates to eager's, and its
plans on 2x2 split the batch through the MoE layer and simulate to eager's answer."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tapestry
from tapestry.importer import from_torch
from tapestry.importer.block_routing import ROUTING_BY_BLOCK, experts_by_block, grouped_mm_blocks
from tapestry.importer.errors import TorchImportError
from tapestry.importer.rewrites import exact_rewrites
from tapestry.importer.zoo import FAMILIES
from tapestry.plan import Compute
from tapestry.plan.simulate import simulate

transformers = pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")


def mixtral_experts(experts: int = 4, width: int = 8, inner: int = 12) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=width, intermediate_size=inner, num_local_experts=experts,
                                        num_experts_per_tok=2)
    module = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
    torch.nn.init.normal_(module.gate_up_proj)
    torch.nn.init.normal_(module.down_proj)
    return module


# (blocks of 3 tokens, top 2 of 4 experts): block 0 sends every pair to experts 0 and 1, block 1 all but one to
# expert 2; no token chooses expert 3
UNEVEN = torch.tensor([[0, 1], [1, 0], [0, 1], [2, 0], [2, 1], [2, 2]])


RANDOM = torch.randint(0, 4, (6, 2), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("top_k_index", [UNEVEN, RANDOM], ids=["uneven, expert 3 empty", "random"])
def test_routing_by_block_computes_what_the_batch_wide_grouped_experts_compute(top_k_index):
    experts = mixtral_experts()
    hidden = torch.randn(2, 3, 8)
    weights = torch.rand(6, 2)
    want = moe.grouped_mm_experts_forward(experts, hidden.reshape(6, 8), top_k_index, weights)
    got = experts_by_block(experts, hidden, top_k_index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_blocks_grouped_mm_uses_each_blocks_own_ends_and_leaves_rows_past_them_zero():
    x, w = torch.randn(2, 4, 3), torch.randn(2, 3, 5)
    ends = torch.tensor([[1, 3], [0, 4]])  # block 0: expert 0 row 0, expert 1 rows 1-2, row 3 past the ends
    out = grouped_mm_blocks(x, w, ends)
    want = torch.stack([torch.cat([x[0, :1] @ w[0], x[0, 1:3] @ w[1], torch.zeros(1, 5)]), x[1] @ w[1]])
    torch.testing.assert_close(out, want)


def test_experts_routing_by_block_does_not_cover_raise_naming_what_differs():
    experts = mixtral_experts()
    experts.has_bias = True
    with pytest.raises(TorchImportError, match="has_bias"):
        experts_by_block(experts, torch.randn(1, 2, 8), torch.zeros(2, 2, dtype=torch.long), torch.rand(2, 2))


MOE_FAMILIES = ["mixtral", "olmoe", "qwen2_moe"]  # the zoo's decoders whose sparse MoE blocks are rewritten


def eager_hidden(module: torch.nn.Module, args: tuple, kwargs: dict) -> np.ndarray:
    with torch.no_grad():
        return module(*args, **kwargs).last_hidden_state.numpy()


def routed(family: str):
    """The zoo family imported routed by block, its inputs, and eager's (unrewritten) hidden states."""
    module, args, kwargs = FAMILIES[family].build()
    module.eval()
    with exact_rewrites(ROUTING_BY_BLOCK):
        imported = from_torch(module, args, kwargs, verbose=False)
    return imported, imported.inputs(*args, **kwargs), eager_hidden(module, args, kwargs)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_zoo_moe_routed_by_block_imports_without_a_batch_wide_sort_and_evaluates_to_eager(family):
    module, args, kwargs = FAMILIES[family].build()
    module.eval()
    with exact_rewrites(ROUTING_BY_BLOCK):
        imported = from_torch(module, args, kwargs, verbose=False)
    ops = [node.op for node in imported.graph.nodes]
    assert ops.count("grouped_mm_blocks") == 4 and "grouped_mm" not in ops and "opaque" not in ops  # 2 layers
    (batch, tokens), choices = args[0].shape, 2
    sorts = [imported.graph[node.args[0]].shape for node in imported.graph.nodes if node.op == "topk"]
    assert (batch, tokens * choices) in sorts and (batch * tokens * choices,) not in sorts  # per sequence
    shuffled = args[0].flatten()[torch.randperm(args[0].numel(), generator=torch.Generator().manual_seed(5))]
    for ids in (args[0], shuffled.reshape(args[0].shape)):  # the capture's ids, and others: another routing
        got = imported.outputs(tapestry.evaluate(imported.graph, imported.inputs(ids, **kwargs)))[0]
        np.testing.assert_allclose(got, eager_hidden(module, (ids,), kwargs), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_zoo_moe_routed_by_block_plans_on_2x2_split_its_experts_by_batch_and_simulate_to_eager(family):
    imported, given, want = routed(family)
    plan = tapestry.optimize(imported.graph, mesh=tapestry.Mesh(2, 2)).plan
    experts = [s for s in plan.steps if isinstance(s, Compute) and s.kernel == "grouped_mm_blocks"]
    assert len(experts) == 4 and all(len(set(s.blocks)) > 1 for s in experts)
    got = imported.outputs(simulate(plan, given))[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def serve_routed_mixtral(mesh: tapestry.Mesh) -> tuple[list[str], torch.Tensor]:
    """On each launched rank: the tiny Mixtral routed by block, parallelized (eager), the kernels of its split
    steps and its output."""
    module, args, kwargs = FAMILIES["mixtral"].build()
    with exact_rewrites(ROUTING_BY_BLOCK):
        model = tapestry.parallelize(module.eval(), args, kwargs, mesh=mesh, compile=False, cache=False,
                                     verbose=False)
        split = [s.kernel for s in model.plan.steps if isinstance(s, Compute) and len(set(s.blocks)) > 1]
        return split, model(*args, **kwargs).last_hidden_state


@pytest.mark.slow
def test_the_tiny_mixtral_routed_by_block_runs_on_four_gloo_ranks_as_eager_does():
    from tapestry.spmd.launch import launch

    module, args, kwargs = FAMILIES["mixtral"].build()
    with torch.no_grad():
        want = module.eval()(*args, **kwargs).last_hidden_state
    for split, got in launch(serve_routed_mixtral, 4, tapestry.Mesh(2, 2), timeout=900):
        assert split.count("grouped_mm_blocks") == 4, split
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
