"""Exact capture-time rewrites of model code torch.export cannot trace.

Why: some Hugging Face modules loop in Python over data-dependent values (Switch Transformers' experts:
`for expert_idx in expert_hit` over `nonzero()` of the experts hit), which no captured graph can hold. Where the
same function has a form with static shapes, the capture runs that form instead. Each rewrite computes what the
original computes, for every input (tests/test_rewrites.py compares them with eager on routings that drop tokens
and leave experts empty); a module the rewrite cannot express exactly raises TorchImportError naming what and why.
"""
from __future__ import annotations

import contextlib
import importlib
import contextvars
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tapestry.importer.block_routing import (
    deepseek_v3_moe_forward, mixtral_sparse_moe_forward, qwen2_moe_sparse_moe_forward, router_moe_forward)
from tapestry.importer.errors import TorchImportError


@dataclass(frozen=True)
class Rewrite:
    """`module`'s class `name` runs `forward` instead of its own while a capture traces it."""

    module: str
    name: str
    forward: Callable[..., Any]


def _refuse_dropout(module: torch.nn.Module, p: float, what: str) -> None:
    """A rewrite draws its dropout masks in other shapes than the original: in training mode with p > 0 the two
    would differ (a training step replays eager's draws, docs/training.md), so it is refused."""
    if module.training and p > 0:
        raise TorchImportError(f"{what} dropout (p={p}) runs in training mode; the exact rewrite that makes it "
                               "traceable draws its masks in other shapes, so they would not match eager's: call "
                               ".eval() or set its dropout to 0")


SWITCH = "transformers.models.switch_transformers.modeling_switch_transformers"


def _experts_weights(experts: torch.nn.ModuleDict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Switch's experts (one DenseActDense each: wi, act, dropout, wo) as stacked weights wi[E, D, F] and
    wo[E, F, D] and their one activation. Experts that differ in what they compute (activation, dtype, a bias,
    active dropout) have no one grouped form: raised."""
    dense = list(experts.values())
    for index, expert in enumerate(dense):
        if expert.wi.bias is not None or expert.wo.bias is not None:
            raise TorchImportError(f"SwitchTransformersExperts expert_{index} has a bias; the grouped rewrite of "
                                   "its expert loop takes bias-free experts (Switch's own)")
        if type(expert.act) is not type(dense[0].act):
            raise TorchImportError(f"SwitchTransformersExperts expert_{index}'s activation "
                                   f"{type(expert.act).__name__} differs from expert_0's; the grouped rewrite "
                                   "applies one activation to every expert's rows")
        _refuse_dropout(expert.dropout, expert.dropout.p, f"SwitchTransformersExperts expert_{index}'s")
    weights = {t.dtype for e in dense for t in (e.wi.weight, e.wo.weight)}
    if weights != {dtype}:
        raise TorchImportError(f"SwitchTransformersExperts' weights have dtypes {sorted(map(str, weights))} and "
                               f"its input {dtype}; the grouped rewrite takes experts of the input's dtype (the "
                               "original casts per expert, and quantized experts are not taken)")
    wi = torch.stack([e.wi.weight for e in dense]).transpose(1, 2)
    wo = torch.stack([e.wo.weight for e in dense]).transpose(1, 2)
    return wi, wo, dense[0].act


def grouped_switch_experts(experts: torch.nn.ModuleDict, hidden_states: torch.Tensor, one_hot: torch.Tensor,
                           routing_weights: torch.Tensor) -> torch.Tensor:
    """What SwitchTransformersExperts.forward computes for top-1 routing, with static shapes: the tokens sorted by
    their expert, each expert's rows through its wi, activation and wo as two grouped matmuls (transformers'
    `grouped_mm_fallback`, imported as `grouped_mm`), scaled by the routing weight and put back in token order.

    Exact where `one_hot[T, E]` has at most one nonzero per row (the top-1 router's: a token over its expert's
    capacity is dropped, its row all zero). The loop gives token t `expert_e(h[t]) * w[t]` added into zeros when
    row t has its one at e, and 0 when it is all zero; here a dropped token is routed to expert 0 (argmax of
    zeros) and its row is replaced by 0 with `where`, so it is 0 whatever expert 0 computes on it (inf and NaN
    included)."""
    import transformers.integrations.moe  # noqa: F401  registers torch.ops.transformers.grouped_mm_fallback

    tokens, count = one_hot.shape
    wi, wo, act = _experts_weights(experts, hidden_states.dtype)
    kept = one_hot.sum(-1, keepdim=True) > 0
    sorted_experts, order = torch.sort(one_hot.argmax(-1), stable=True)
    ends = torch.cumsum(torch.histc(sorted_experts.float(), bins=count, min=0, max=count - 1), dim=0,
                        dtype=torch.int32)
    inner = act(torch.ops.transformers.grouped_mm_fallback(hidden_states[order], wi, ends))
    out = torch.ops.transformers.grouped_mm_fallback(inner, wo, ends)
    back = torch.empty_like(order)
    back[order] = torch.arange(tokens, device=order.device)
    scaled = out[back] * routing_weights
    return torch.where(kept, scaled, torch.zeros((), dtype=scaled.dtype))


def switch_sparse_mlp_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """SwitchTransformersSparseMLP.forward with its experts' loop as `grouped_switch_experts`. Only under the
    top-1 router (a one-hot row or none per token, which the grouped form relies on): another router raises."""
    router = getattr(sys.modules[SWITCH], "SwitchTransformersTop1Router")
    if type(self.router) is not router:
        raise TorchImportError(f"SwitchTransformersSparseMLP routes with {type(self.router).__name__}; the grouped "
                               "rewrite of its expert loop is exact for SwitchTransformersTop1Router's routing (at "
                               "most one expert per token) only")
    batch, length, hidden = hidden_states.shape
    one_hot, routing_weights, _ = self.router(hidden_states)
    out = grouped_switch_experts(self.experts, hidden_states.reshape(-1, hidden),
                                 one_hot.reshape(-1, self.router.num_experts), routing_weights.reshape(-1, 1))
    return out.reshape(batch, length, hidden)


def _refuse_attention_outputs(module: torch.nn.Module, output_attentions: bool) -> None:
    """Longformer's attention probabilities are laid out by the number of global tokens (a data-dependent shape),
    which the static-shape rewrite does not build."""
    if output_attentions:
        raise TorchImportError(f"{type(module).__name__} with output_attentions=True: the static-shape rewrite that "
                               "makes it traceable does not build the original's attention-probability layout "
                               "(sized by the number of global tokens); import with output_attentions=False")


def longformer_self_attention_forward(
        self: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
        is_index_masked: torch.Tensor | None = None, is_index_global_attn: torch.Tensor | None = None,
        is_global_attn: Any = None, output_attentions: bool = False) -> tuple[torch.Tensor]:
    """LongformerSelfAttention.forward with static shapes, for every mask: global tokens (mask value 2) or none.

    The original branches on `is_global_attn` (a Python bool read from the mask with `.item()`) and sizes its
    global tensors by the most global tokens in a row (`nonzero()`); neither can be captured. Here every position
    is a candidate global key and a candidate global query:

    - local rows: the sliding-window scores beside scores against every key, those of non-global keys set to
      finfo.min (the original's padding slots hold the same finfo.min, so they get probability 0 either way), one
      softmax, the window's probabilities by the local values and the keys' by the values of all positions;
    - global rows: each position's global query (`query_global`) against every `key_global`, padding keys at
      finfo.min, by `value_global`, kept where the position is global (`where`), as the original overwrites them.

    Without global tokens the extra probabilities are exactly 0, so the result is the local-only branch's. The
    cost: two [S, S] score matrices per head and layer (full attention's order) where the original's global part
    is [S, G]."""
    _refuse_attention_outputs(self, output_attentions)
    _refuse_dropout(self, self.dropout, "LongformerSelfAttention's attention")
    hidden_states = hidden_states.transpose(0, 1)
    seq_len, batch_size, embed_dim = hidden_states.size()
    heads, head_dim, window = self.num_heads, self.head_dim, self.one_sided_attn_window_size
    lowest = torch.finfo(hidden_states.dtype).min

    def by_head(x: torch.Tensor) -> torch.Tensor:
        return x.view(seq_len, batch_size, heads, head_dim).transpose(0, 1)

    query = by_head(self.query(hidden_states) / math.sqrt(head_dim))
    key, value = by_head(self.key(hidden_states)), by_head(self.value(hidden_states))
    local = self._sliding_chunks_query_key_matmul(query, key, window)
    removed = (attention_mask != 0)[:, :, None, None]
    float_mask = removed.type_as(query).masked_fill(removed, lowest)
    local = local + self._sliding_chunks_query_key_matmul(float_mask.new_ones(size=float_mask.size()), float_mask,
                                                          window)
    to_global = torch.einsum("blhd,bshd->blhs", query, key)
    to_global = to_global.masked_fill(~is_index_global_attn[:, None, None, :], lowest)
    probs = torch.softmax(torch.cat((to_global, local), dim=-1), dim=-1, dtype=torch.float32)
    probs = probs.masked_fill(is_index_masked[:, :, None, None], 0.0).type_as(local)
    from_global = torch.matmul(probs[..., :seq_len].transpose(1, 2), value.transpose(1, 2)).transpose(1, 2)
    out = from_global + self._sliding_chunks_matmul_attn_probs_value(
        probs[..., seq_len:].contiguous(), value, window)
    out = out.transpose(0, 1).reshape(seq_len, batch_size, embed_dim)

    def flat_heads(x: torch.Tensor) -> torch.Tensor:
        return x.contiguous().view(seq_len, batch_size * heads, head_dim).transpose(0, 1)

    global_query = flat_heads(self.query_global(hidden_states) / math.sqrt(head_dim))
    global_key, global_value = flat_heads(self.key_global(hidden_states)), flat_heads(self.value_global(hidden_states))
    scores = torch.bmm(global_query, global_key.transpose(1, 2)).view(batch_size, heads, seq_len, seq_len)
    scores = scores.masked_fill(is_index_masked[:, None, None, :], lowest).view(batch_size * heads, seq_len, seq_len)
    global_probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(scores)
    global_out = torch.bmm(global_probs, global_value).view(batch_size, heads, seq_len, head_dim)
    global_out = global_out.permute(2, 0, 1, 3).reshape(seq_len, batch_size, embed_dim)
    out = torch.where(is_index_global_attn.transpose(0, 1)[:, :, None], global_out, out)
    return (out.transpose(0, 1),)


def longformer_encoder_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                               attention_mask: torch.Tensor | None = None, padding_len: int = 0,
                               output_attentions: bool = False, output_hidden_states: bool = False,
                               return_dict: bool = True) -> Any:
    """LongformerEncoder.forward without `is_index_global_attn.flatten().any().item()`: that Python bool chose the
    self-attention's branch, and `longformer_self_attention_forward` computes both branches' answer from the mask
    itself, so nothing reads it."""
    from transformers.models.longformer.modeling_longformer import LongformerBaseModelOutput

    _refuse_attention_outputs(self, output_attentions)
    masked, global_attn = attention_mask < 0, attention_mask > 0
    states = [hidden_states]
    for layer in self.layer:
        states.append(layer(states[-1], attention_mask=attention_mask, is_index_masked=masked,
                            is_index_global_attn=global_attn, is_global_attn=None)[0])
    every = tuple(state[:, : state.shape[1] - padding_len] for state in states) if output_hidden_states else None
    last = states[-1][:, : states[-1].shape[1] - padding_len]
    if not return_dict:
        return tuple(v for v in (last, every) if v is not None)
    return LongformerBaseModelOutput(last_hidden_state=last, hidden_states=every)


BATCH_WIDE_REWRITES: tuple[Rewrite, ...] = (
    Rewrite(SWITCH, "SwitchTransformersSparseMLP", switch_sparse_mlp_forward),
    Rewrite("transformers.models.longformer.modeling_longformer", "LongformerSelfAttention",
            longformer_self_attention_forward),
    Rewrite("transformers.models.longformer.modeling_longformer", "LongformerEncoder", longformer_encoder_forward),
)
"""Every rewrite but the MoE routing by block: a capture's opt-out (`with exact_rewrites(BATCH_WIDE_REWRITES)`),
inference or training, for transformers' batch-wide routing (grouped_mm and take_rows)."""

ROUTING_BY_BLOCK: tuple[Rewrite, ...] = (
    Rewrite("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock", mixtral_sparse_moe_forward),
    Rewrite("transformers.models.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock", mixtral_sparse_moe_forward),
    Rewrite("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock",
            qwen2_moe_sparse_moe_forward),
    Rewrite("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock", mixtral_sparse_moe_forward),
    Rewrite("transformers.models.granitemoe.modeling_granitemoe", "GraniteMoeMoE", router_moe_forward),
    Rewrite("transformers.models.jamba.modeling_jamba", "JambaSparseMoeBlock", router_moe_forward),
    Rewrite("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE", deepseek_v3_moe_forward),
)
"""Mixtral's, OLMoE's, Qwen2-MoE's, Qwen3-MoE's, GraniteMoE's, Jamba's and DeepSeek-V3's sparse MoE blocks routed
sequence by sequence (importer/block_routing.py; DeepSeek-V3's expert choice sorted, which its block's sum over the
choices allows)."""

REWRITES: tuple[Rewrite, ...] = BATCH_WIDE_REWRITES + ROUTING_BY_BLOCK
"""Every exact rewrite: a capture's default, inference and training."""

_IN_FORCE: contextvars.ContextVar[tuple[Rewrite, ...] | None] = contextvars.ContextVar("exact_rewrites", default=None)


@contextlib.contextmanager
def exact_rewrites(rewrites: tuple[Rewrite, ...] | None = None, import_modules: bool = True) -> Iterator[None]:
    """While a capture traces, each rewritten class runs its rewrite's forward. `rewrites` None takes those of the
    innermost enclosing `exact_rewrites`, else REWRITES (the captures' default): so `with exact_rewrites(
    BATCH_WIDE_REWRITES): from_torch(...)` keeps a MoE's batch-wide routing, inference or training. A class's
    module is imported if it is not yet (a model built inside the block, by a lazily importing library, gets the
    rewrite too), unless not
    `import_modules`: the captures, which run on a model already built, whose classes' modules are therefore
    loaded, leave a class whose module is not loaded alone (no model of theirs holds it) rather than import every
    rewritten library on each capture. A module that does not import, or that lacks the class (a library version
    the rewrite was not written for), raises TorchImportError: a rewrite is never skipped silently."""
    enclosing = _IN_FORCE.get()
    chosen = rewrites if rewrites is not None else enclosing if enclosing is not None else REWRITES
    patched = []
    for rewrite in chosen:
        cls = _rewritten_class(rewrite, import_modules)
        if cls is not None:
            patched.append((cls, cls.forward))
            cls.forward = rewrite.forward
    token = _IN_FORCE.set(chosen)
    try:
        with _stable_grouped_experts():
            yield
    finally:
        _IN_FORCE.reset(token)
        for cls, forward in reversed(patched):
            cls.forward = forward


SORTS = (torch.sort, torch.Tensor.sort, torch.argsort, torch.Tensor.argsort)


class StableSorts(TorchFunctionMode):
    """Every sort and argsort called under it is stable (torch's default is not: importer/aten/indexing.py takes an
    unstable one whose indices are read as an opaque op)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return func(*args, **({**(kwargs or {}), "stable": True} if func in SORTS else kwargs or {}))


@contextlib.contextmanager
def _stable_grouped_experts() -> Iterator[None]:
    """transformers' batch-wide grouped experts (`grouped_mm_experts_forward`, a MoE's routing where the block
    rewrites are opted out of) with their sort by expert stable. Exact: each (token, choice) row is computed by its
    own expert (tied rows share it), weighted by its own weight, and put back by the inverse permutation before the
    sum over choices, so any order of ties gives the same output; only its indices' reads made the sort opaque."""
    moe = sys.modules.get("transformers.integrations.moe")
    mapping = getattr(getattr(moe, "ExpertsInterface", None), "_global_mapping", None)
    original = mapping.get("grouped_mm") if isinstance(mapping, dict) else None
    if original is None:
        yield
        return

    def stable(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        with StableSorts():
            return original(self, *args, **kwargs)

    mapping["grouped_mm"] = stable
    try:
        yield
    finally:
        mapping["grouped_mm"] = original


def _rewritten_class(rewrite: Rewrite, import_modules: bool) -> type | None:
    """The class `rewrite` patches; None where its module is not loaded and not to be imported."""
    module = sys.modules.get(rewrite.module)
    if module is None and not import_modules:
        return None
    if module is None:
        try:
            module = importlib.import_module(rewrite.module)
        except ImportError as err:
            raise TorchImportError(f"the exact rewrite of {rewrite.module}.{rewrite.name} cannot import its "
                                   f"module: {err}") from err
    cls = getattr(module, rewrite.name, None)
    if not isinstance(cls, type):
        raise TorchImportError(f"the exact rewrite of {rewrite.module}.{rewrite.name}: the module has no class "
                               f"{rewrite.name!r} (a version of its library the rewrite was not written for?)")
    return cls
