"""Exact capture-time rewrites of model code torch.export cannot trace.

Why: some Hugging Face modules loop in Python over data-dependent values (Switch Transformers' experts:
`for expert_idx in expert_hit` over `nonzero()` of the experts hit), which no captured graph can hold. Where the
same function has a form with static shapes, the capture runs that form instead. Each rewrite computes what the
original computes, for every input (tests/test_rewrites.py compares them with eager on routings that drop tokens
and leave experts empty); a module the rewrite cannot express exactly raises TorchImportError naming what and why.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tapestry.importer.errors import TorchImportError


@dataclass(frozen=True)
class Rewrite:
    """`module`'s class `name` runs `forward` instead of its own while a capture traces it."""

    module: str
    name: str
    forward: Callable[..., Any]


def _experts_weights(experts: torch.nn.ModuleDict) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Switch's experts (one DenseActDense each: wi, act, dropout, wo) as stacked weights wi[E, D, F] and
    wo[E, F, D] and their one activation. Experts that differ in what they compute (activation, dtype, a bias,
    active dropout) have no one grouped form: raised."""
    dense = list(experts.values())
    first = dense[0]
    for index, expert in enumerate(dense):
        if expert.wi.bias is not None or expert.wo.bias is not None:
            raise TorchImportError(f"SwitchTransformersExperts expert_{index} has a bias; the grouped rewrite of "
                                   "its expert loop takes bias-free experts (Switch's own)")
        if type(expert.act) is not type(first.act):
            raise TorchImportError(f"SwitchTransformersExperts expert_{index}'s activation "
                                   f"{type(expert.act).__name__} differs from expert_0's; the grouped rewrite "
                                   "applies one activation to every expert's rows")
        if expert.dropout.training and expert.dropout.p > 0:
            raise TorchImportError(f"SwitchTransformersExperts expert_{index} applies dropout (p={expert.dropout.p}) "
                                   "in training mode: its masks are drawn per expert in routing order, which the "
                                   "grouped rewrite does not reproduce; call .eval() or set dropout_rate=0")
    dtypes = {t.dtype for e in dense for t in (e.wi.weight, e.wo.weight)}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise TorchImportError(f"SwitchTransformersExperts' weights have dtypes {sorted(map(str, dtypes))}; the "
                               "grouped rewrite takes experts of one floating dtype (quantized experts cast per "
                               "expert in the original loop)")
    wi = torch.stack([e.wi.weight for e in dense]).transpose(1, 2)
    wo = torch.stack([e.wo.weight for e in dense]).transpose(1, 2)
    return wi, wo, first.act


def switch_experts_forward(self: torch.nn.ModuleDict, hidden_states: torch.Tensor, selected_experts: torch.Tensor,
                           routing_weights: torch.Tensor) -> torch.Tensor:
    """SwitchTransformersExperts.forward with static shapes: the tokens sorted by their expert, each expert's rows
    through its wi, activation and wo as two grouped matmuls (transformers' `grouped_mm_fallback`, imported as
    `grouped_mm`), scaled by the routing weight and put back in token order.

    Exact: `selected_experts[T, 1, E]` is one-hot or all zero (top-1 routing; a token over its expert's capacity
    is dropped). The loop gives token t `expert_e(h[t]) * w[t]` added into zeros when row t has its one at e, and
    0 when it is all zero; here a dropped token is routed to expert 0 (argmax of zeros) and its row is replaced by
    0 with `where`, so it is 0 whatever expert 0 computes on it (inf and NaN included)."""
    import transformers.integrations.moe  # noqa: F401  registers torch.ops.transformers.grouped_mm_fallback

    tokens, experts = hidden_states.shape[0], selected_experts.shape[-1]
    if selected_experts.shape != (tokens, 1, experts) or routing_weights.shape != (tokens, 1):
        raise TorchImportError(f"SwitchTransformersExperts called with selected_experts {list(selected_experts.shape)}"
                               f" and routing_weights {list(routing_weights.shape)}; the grouped rewrite takes "
                               f"top-1 routing: [{tokens}, 1, E] and [{tokens}, 1]")
    wi, wo, act = _experts_weights(self)
    one_hot = selected_experts.reshape(tokens, experts)
    kept = one_hot.sum(-1, keepdim=True) > 0
    expert_of_token = one_hot.argmax(-1)
    sorted_experts, order = torch.sort(expert_of_token, stable=True)
    rows = hidden_states[order].to(wi.dtype)
    counts = torch.histc(sorted_experts.float(), bins=experts, min=0, max=experts - 1)
    ends = torch.cumsum(counts, dim=0, dtype=torch.int32)
    inner = act(torch.ops.transformers.grouped_mm_fallback(rows, wi, ends))
    out = torch.ops.transformers.grouped_mm_fallback(inner, wo, ends)
    back = torch.empty_like(order)
    back[order] = torch.arange(tokens, device=order.device)
    scaled = out[back] * routing_weights
    return torch.where(kept, scaled, torch.zeros((), dtype=scaled.dtype)).to(hidden_states.dtype)


REWRITES: tuple[Rewrite, ...] = (
    Rewrite("transformers.models.switch_transformers.modeling_switch_transformers", "SwitchTransformersExperts",
            switch_experts_forward),
)


@contextlib.contextmanager
def exact_rewrites(rewrites: tuple[Rewrite, ...] = REWRITES) -> Iterator[None]:
    """While a capture traces, each rewritten class (where its module is loaded) runs its rewrite's forward.
    A class whose module was never imported cannot be in the model: it is left alone, and nothing is imported."""
    patched = []
    for rewrite in rewrites:
        cls = getattr(sys.modules.get(rewrite.module), rewrite.name, None)
        if cls is not None:
            patched.append((cls, cls.forward))
            cls.forward = rewrite.forward
    try:
        yield
    finally:
        for cls, forward in patched:
            cls.forward = forward
