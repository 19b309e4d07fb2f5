"""MoE routing block by block: each sequence's tokens sorted by expert among themselves, not across the batch.

Why: transformers' grouped experts (`integrations.moe.grouped_mm_experts_forward`) sort every (token, choice)
pair of the batch by expert in one sort, dispatch and combine by positions in that batch-wide order and run one
grouped_mm over it, so every op downstream of the sort reads the whole batch and no batch split survives
(docs/benchmarks.md, "Why the tiny MoE decoders shard ~1% of their FLOPs"). A token's output is the sum of its
chosen experts' outputs weighted by the router, whatever other tokens it is grouped with, so sorting within each
block of rows gives the same answer. Here the block is a sequence of the batch: the sort, the dispatch (a
`gather` along the block's rows), the counts, the inverse order and the combine keep the batch as a dim of their
own, and the experts are `tapestry::grouped_mm_blocks` (each block's rows with its own `ends`, the
`grouped_mm_blocks` kernel), so data parallelism splits the whole MoE layer.

Rewritten (importer/rewrites.py's `ROUTING_BY_BLOCK`): Mixtral's, OLMoE's, Qwen2-MoE's, Qwen3-MoE's, GraniteMoE's,
Jamba's and DeepSeek-V3's sparse MoE blocks (DeepSeek-V3's router with its expert choice sorted:
`_deepseek_v3_choices`). A capture, inference or training step, routes them by block by default, and opts out
with `with exact_rewrites(BATCH_WIDE_REWRITES)` (training.plans' expert-parallel hand plans take either routing's
kernels). The custom op's backward is grouped_mm_blocks again (the rows' gradient)
and `tapestry::grouped_mm_blocks_k` (the weights'); both kernels are expert parallel as grouped_mm and
grouped_mm_k are (their `Exchange`). A batch of one sequence is one block: no batch split runs through the MoE
layer, and its expert steps split by experts (partial sums or the exchange), rows or features, or run whole
(as priced at the tests' tiny width). tests/test_block_routing.py compares it with the original on uneven
routings and an expert that no token chooses, forward and backward.
"""
from __future__ import annotations

from typing import Any

import torch

from tapestry.importer.errors import TorchImportError
from tapestry.kernels import get_kernel


@torch.library.custom_op("tapestry::grouped_mm_blocks", mutates_args=())
def grouped_mm_blocks(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """out[b, r] = x[b, r] @ w[e] for the expert e whose block-local rows [ends[b, e-1], ends[b, e]) hold r
    (rows past ends[b, -1] are zero): transformers' grouped_mm_fallback for each block b on its own. Eager runs
    the `grouped_mm_blocks` kernel's own torch form, so the op and what it imports as agree on every input."""
    return get_kernel("grouped_mm_blocks").torch(x, w, ends, block_start=(0,) * 5)


@grouped_mm_blocks.register_fake
def _grouped_mm_blocks_fake(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:2], w.shape[2]))


@torch.library.custom_op("tapestry::grouped_mm_blocks_k", mutates_args=())
def grouped_mm_blocks_k(x: torch.Tensor, g: torch.Tensor, ends: torch.Tensor, experts: int) -> torch.Tensor:
    """out[e] = sum over blocks b of x[b, rows of e].T @ g[b, rows of e], [experts, M, N]: grouped_mm_blocks'
    weight gradient (the `grouped_mm_blocks_k` kernel's own torch form)."""
    shape = (experts, x.shape[2], g.shape[2])
    return get_kernel("grouped_mm_blocks_k").torch(x, g, ends, out_shape=shape, block_start=(0,) * 5)


@grouped_mm_blocks_k.register_fake
def _grouped_mm_blocks_k_fake(x: torch.Tensor, g: torch.Tensor, ends: torch.Tensor, experts: int) -> torch.Tensor:
    return x.new_empty((experts, x.shape[2], g.shape[2]))


def _keep_operands(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_blocks_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """The rows' gradient, each block's rows by their experts' weights transposed (grouped_mm_blocks again), and
    the weights', each expert's rows summed over every block (grouped_mm_blocks_k); `ends` has none."""
    x, w, ends = ctx.saved_tensors
    return (grouped_mm_blocks(grad, w.transpose(-2, -1), ends),
            grouped_mm_blocks_k(x, grad, ends, w.shape[0]), None)


grouped_mm_blocks.register_autograd(_grouped_mm_blocks_backward, setup_context=_keep_operands)


def _refuse_unless_plain(experts: torch.nn.Module) -> None:
    """The block form covers transformers' gated, concatenated, untransposed, bias-free experts without a post
    norm or expert-parallel sentinels (Mixtral's); others compute more than it does."""
    plain = dict(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True,
                 has_post_expert_norm=False, _is_expert_parallel=False)
    differs = {name: getattr(experts, name, None) for name, want in plain.items()
               if getattr(experts, name, None) != want}
    if differs:
        raise TorchImportError(f"{type(experts).__name__} has {differs}; routing by block takes experts with "
                               f"{plain} (Mixtral's)")


def experts_by_block(experts: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """What `grouped_mm_experts_forward(experts, hidden.flatten(0, 1), top_k_index, top_k_weights)` computes, for
    hidden[B, T, D] and the router's [B·T, k] choices, with each block b's T·k (token, choice) pairs sorted by
    expert on their own: [B·T, D]."""
    _refuse_unless_plain(experts)
    blocks, tokens, width = hidden.shape
    choices = top_k_index.shape[-1]
    pairs = tokens * choices
    expert_ids, order = torch.sort(top_k_index.reshape(blocks, pairs), dim=-1, stable=True)  # ties read: stable
    rows = torch.gather(hidden, 1, (order // choices).unsqueeze(-1).expand(blocks, pairs, width))
    weights = torch.gather(top_k_weights.reshape(blocks, pairs), 1, order)
    # sorted ids: expert e's rows end after the ids <= e, so the block's ends count them
    ends = (expert_ids.unsqueeze(-1) <= torch.arange(experts.num_experts, device=hidden.device)).sum(1)
    gate_up = experts.gate_up_proj
    up = grouped_mm_blocks(rows.to(gate_up.dtype), gate_up.transpose(-2, -1), ends)
    down = experts.down_proj
    out = grouped_mm_blocks(experts._apply_gate(up).to(down.dtype), down.transpose(-2, -1), ends)
    weighted = torch.gather(out * weights.unsqueeze(-1), 1,
                            torch.argsort(order, dim=-1, stable=True).unsqueeze(-1).expand(blocks, pairs, width))
    return weighted.view(blocks * tokens, choices, width).sum(dim=1).to(hidden.dtype)


def _routed(router: torch.nn.Module, experts: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A sparse MoE block's routed experts ([B·T, D]): its router (logits, weights, expert ids) on the flattened
    tokens, its experts routed sequence by sequence (`experts_by_block`)."""
    _, top_k_weights, top_k_index = router(hidden_states.reshape(-1, hidden_states.shape[-1]))
    return experts_by_block(experts, hidden_states, top_k_index, top_k_weights)


def mixtral_sparse_moe_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """MixtralSparseMoeBlock.forward (OLMoE's and Qwen3-MoE's have no jitter) with its experts routed sequence by
    sequence."""
    if self.training and getattr(self, "jitter_noise", 0) > 0:
        raise TorchImportError(f"{type(self).__name__}'s router jitter (noise {self.jitter_noise}) runs in "
                               "training mode; routing by block replays no random draws: call .eval()")
    return _routed(self.gate, self.experts, hidden_states).reshape(hidden_states.shape)


def router_moe_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """GraniteMoeMoE.forward and JambaSparseMoeBlock.forward (Mixtral's, the router named `router`) with its
    experts routed sequence by sequence."""
    return _routed(self.router, self.experts, hidden_states).reshape(hidden_states.shape)


def qwen2_moe_sparse_moe_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen2MoeSparseMoeBlock.forward with its routed experts by sequence; the shared expert, gated by a sigmoid,
    is added as the original adds it."""
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    shared = torch.nn.functional.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
    return (_routed(self.gate, self.experts, hidden_states) + shared).reshape(hidden_states.shape)


def _deepseek_v3_choices(router: torch.nn.Module, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepseekV3TopkRouter.forward's (weights, expert ids) on flat[N, D], its expert choice `topk(sorted=True)`
    where transformers' is `sorted=False`, whose order torch leaves unspecified (CPU torch's is nth_element's) and
    the importer keeps opaque. The MoE block reads the choices only through a sum over them (the experts' weighted
    outputs, the weights' normalizer), so any order gives its output: the same, for k <= 2 to the bit (a float sum of
    two terms commutes), for larger k up to the order of a k-term float sum. The group choice stays unsorted: only a
    scatter reads it, which the topk converter takes as it is."""
    if type(router).__name__ != "DeepseekV3TopkRouter" or type(router).forward.__qualname__ != (
            "DeepseekV3TopkRouter.forward"):
        raise TorchImportError(f"DeepseekV3MoE's gate is a {type(router).__name__} with its own forward; the rewrite "
                               "routes as DeepseekV3TopkRouter.forward does")
    scores = torch.nn.functional.linear(flat.type(torch.float32), router.weight.type(torch.float32)).sigmoid()
    for_choice = scores + router.e_score_correction_bias
    per_group = router.num_experts // router.num_group
    group_scores = for_choice.view(-1, router.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, router.num_group, per_group).reshape(-1, router.num_experts)
    for_choice = for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    expert_ids = torch.topk(for_choice, k=router.top_k, dim=-1, sorted=True)[1]
    weights = scores.gather(1, expert_ids)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor, expert_ids


def deepseek_v3_moe_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """DeepseekV3MoE.forward with its expert choice sorted (`_deepseek_v3_choices`) and its routed experts by
    sequence; the shared experts added as the original adds them."""
    weights, expert_ids = _deepseek_v3_choices(self.gate, hidden_states.reshape(-1, hidden_states.shape[-1]))
    routed = experts_by_block(self.experts, hidden_states, expert_ids, weights).reshape(hidden_states.shape)
    return routed + self.shared_experts(hidden_states)
