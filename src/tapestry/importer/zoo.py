"""Small real models, built from configs with random weights (nothing is downloaded).

The importer's tests, its benchmark and docs/importing.md use the same set, so what the docs claim is what the
tests check. Each entry builds (module in eval mode, args, kwargs) at a named size.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Case = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


class LlamaBlock(nn.Module):
    """A LLaMA-style decoder block: RMSNorm, causal SDPA over heads, and a SiLU-gated MLP."""

    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 128) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.attn_norm(x)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        attn = nn.functional.scaled_dot_product_attention(heads(self.q(h)), heads(self.k(h)), heads(self.v(h)),
                                                          is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, d))
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class SmallCNN(nn.Module):
    """conv (with bias) -> batch norm -> relu -> max pool -> conv -> adaptive average pool -> linear."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.pool, self.head = nn.MaxPool2d(2), nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


@dataclass(frozen=True)
class Size:
    """Model dimensions: `small` is what the tests check; `large` is where sharding pays (the benchmark)."""

    batch: int
    tokens: int
    hidden: int
    heads: int
    image: int


SIZES = {"small": Size(batch=4, tokens=16, hidden=64, heads=4, image=16),
         "large": Size(batch=8, tokens=512, hidden=1024, heads=16, image=128)}


def _seeded(build: Callable[[Size], Case]) -> Callable[..., Case]:
    def make(size: str = "small") -> Case:
        torch.manual_seed(0)
        module, args, kwargs = build(SIZES[size])
        module.eval()
        for m in module.modules():  # batch norm's running statistics, so eval mode is not the identity
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
        return module, args, kwargs

    return make


def _tokens(s: Size) -> torch.Tensor:
    return torch.randn(s.batch, s.tokens, s.hidden)


def _gpt2(s: Size) -> Case:
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_layer=2, n_embd=s.hidden, n_head=s.heads, vocab_size=2 * s.hidden, n_positions=s.tokens,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2Model(config), (torch.randint(0, config.vocab_size, (s.batch, s.tokens)),), {"use_cache": False}


def _bert(s: Size) -> Case:
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=s.hidden, num_hidden_layers=2, num_attention_heads=s.heads,
                        intermediate_size=2 * s.hidden, vocab_size=2 * s.hidden, max_position_embeddings=s.tokens,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, config.vocab_size, (s.batch, s.tokens))
    mask = torch.ones(s.batch, s.tokens, dtype=torch.int64)
    mask[1, s.tokens * 3 // 4:] = 0  # a padded sequence: the mask reaches attention
    return BertModel(config, add_pooling_layer=False), (ids,), {"attention_mask": mask}


MODELS: dict[str, Callable[..., Case]] = {
    "transformer_encoder_layer": _seeded(lambda s: (
        nn.TransformerEncoderLayer(s.hidden, s.heads, 2 * s.hidden, dropout=0.0, batch_first=True), (_tokens(s),),
        {})),
    "multihead_attention": _seeded(lambda s: (
        nn.MultiheadAttention(s.hidden, s.heads, batch_first=True), (_tokens(s),) * 3, {})),
    "llama_block": _seeded(lambda s: (LlamaBlock(s.hidden, s.heads, 2 * s.hidden), (_tokens(s),), {})),
    "gpt2": _seeded(_gpt2),
    "bert": _seeded(_bert),
    "cnn": _seeded(lambda s: (SmallCNN(), (torch.randn(s.batch, 3, s.image, s.image),), {})),
}
