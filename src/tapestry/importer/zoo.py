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
    """A LLaMA-style decoder block: RMSNorm, causal SDPA over heads, and a SiLU-gated MLP. `kv_heads` below
    `heads` makes the attention grouped-query (LLaMA-2 70B's 8 key/value heads for 64 query heads)."""

    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 128, kv_heads: int | None = None) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        if heads % self.kv_heads:
            raise ValueError(f"LlamaBlock: {heads} query heads do not group over {self.kv_heads} key/value heads")
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        shared = dim // heads * self.kv_heads
        self.q, self.o = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.k, self.v = nn.Linear(dim, shared, bias=False), nn.Linear(dim, shared, bias=False)
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.attn_norm(x)

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(b, s, n, d // self.heads).transpose(1, 2)

        attn = nn.functional.scaled_dot_product_attention(
            heads(self.q(h), self.heads), heads(self.k(h), self.kv_heads), heads(self.v(h), self.kv_heads),
            is_causal=True, enable_gqa=self.kv_heads != self.heads)
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


# -- Families: one tiny model of each kind users bring (docs/importing.md's table, tests/test_zoo.py) ----------

class GRUClassifier(nn.Module):
    """Embedding -> one GRU layer -> linear on the last step's state."""

    def __init__(self, vocab: int = 64, hidden: int = 32, classes: int = 8) -> None:
        super().__init__()
        self.embed, self.rnn = nn.Embedding(vocab, hidden), nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        states, _ = self.rnn(self.embed(ids))
        return self.head(states[:, -1])


class LSTMTagger(nn.Module):
    """Embedding -> two LSTM layers -> a tag per token."""

    def __init__(self, vocab: int = 64, hidden: int = 32, tags: int = 8) -> None:
        super().__init__()
        self.embed, self.rnn = nn.Embedding(vocab, hidden), nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, tags)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(ids))[0])


class TinyUNet(nn.Module):
    """Two levels down (conv, pool) and up (nearest upsample, concat with the skip, conv): a U-Net's shape."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        c = channels

        def block(i: int, o: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())

        self.down1, self.down2, self.middle = block(3, c), block(c, 2 * c), block(2 * c, 4 * c)
        self.up2, self.up1 = block(4 * c + 2 * c, 2 * c), block(2 * c + c, c)
        self.out = nn.Conv2d(c, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.down1(x)
        s2 = self.down2(nn.functional.max_pool2d(s1, 2))
        m = self.middle(nn.functional.max_pool2d(s2, 2))
        u2 = self.up2(torch.cat([nn.functional.interpolate(m, scale_factor=2.0, mode="nearest"), s2], dim=1))
        u1 = self.up1(torch.cat([nn.functional.interpolate(u2, scale_factor=2.0, mode="nearest"), s1], dim=1))
        return self.out(u1)


class DLRM(nn.Module):
    """DLRM-like: a bottom MLP on dense features, sum-pooled embedding bags of sparse ids, pairwise dot
    interactions, a top MLP."""

    def __init__(self, dense: int = 8, dim: int = 16, tables: tuple[int, ...] = (50, 40, 30)) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, 32), nn.ReLU(), nn.Linear(32, dim), nn.ReLU())
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in tables)
        pairs = (len(tables) + 1) * len(tables) // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        features = torch.stack([x, *(bag(ids[i], offsets[i]) for i, bag in enumerate(self.bags))], dim=1)
        dots = features @ features.transpose(1, 2)
        i, j = torch.tril_indices(features.shape[1], features.shape[1], offset=-1)
        return torch.sigmoid(self.top(torch.cat([x, dots[:, i, j]], dim=1)))


def _ids(s: Size, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (s.batch, s.tokens))


def _decoder(config_class: str, model_class: str, **extra: Any) -> Callable[[Size], Case]:
    """A Hugging Face decoder-only model with grouped-query attention (2 key/value heads)."""

    def build(s: Size) -> Case:
        import transformers

        config = getattr(transformers, config_class)(
            vocab_size=2 * s.hidden, hidden_size=s.hidden, intermediate_size=2 * s.hidden, num_hidden_layers=2,
            num_attention_heads=s.heads, num_key_value_heads=2, max_position_embeddings=2 * s.tokens, **extra)
        return getattr(transformers, model_class)(config), (_ids(s, config.vocab_size),), {"use_cache": False}

    return build


def _gpt_neox(s: Size) -> Case:
    from transformers import GPTNeoXConfig, GPTNeoXModel

    config = GPTNeoXConfig(vocab_size=2 * s.hidden, hidden_size=s.hidden, num_hidden_layers=2,
                           num_attention_heads=s.heads, intermediate_size=2 * s.hidden,
                           max_position_embeddings=2 * s.tokens, rotary_pct=0.5, hidden_dropout=0.0,
                           attention_dropout=0.0)
    return GPTNeoXModel(config), (_ids(s, config.vocab_size),), {"use_cache": False}


def _t5(s: Size) -> Case:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=2 * s.hidden, d_model=s.hidden, d_kv=s.hidden // s.heads, d_ff=2 * s.hidden,
                      num_layers=1, num_decoder_layers=1, num_heads=s.heads, dropout_rate=0.0,
                      tie_word_embeddings=True, decoder_start_token_id=0, relative_attention_num_buckets=8)
    decoder_ids = torch.randint(0, config.vocab_size, (s.batch, s.tokens // 2))
    return (T5ForConditionalGeneration(config), (_ids(s, config.vocab_size),),
            {"decoder_input_ids": decoder_ids, "use_cache": False})


def _bart(s: Size) -> Case:
    from transformers import BartConfig, BartModel

    config = BartConfig(vocab_size=2 * s.hidden, d_model=s.hidden, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=s.heads, decoder_attention_heads=s.heads,
                        encoder_ffn_dim=2 * s.hidden, decoder_ffn_dim=2 * s.hidden,
                        max_position_embeddings=2 * s.tokens,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    return BartModel(config), (_ids(s, config.vocab_size),), {"use_cache": False}


def _encoder(config_class: str, model_class: str, **extra: Any) -> Callable[[Size], Case]:
    """A BERT-like encoder with its pooler (tanh of a linear of token 0), token types and a padded sequence."""

    def build(s: Size) -> Case:
        import transformers

        config = getattr(transformers, config_class)(
            vocab_size=2 * s.hidden, hidden_size=s.hidden, num_hidden_layers=2, num_attention_heads=s.heads,
            intermediate_size=2 * s.hidden, max_position_embeddings=2 * s.tokens + 2, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, type_vocab_size=2, **extra)
        ids = _ids(s, config.vocab_size)
        mask = torch.ones(s.batch, s.tokens, dtype=torch.int64)
        mask[1, s.tokens * 3 // 4:] = 0
        types = torch.zeros(s.batch, s.tokens, dtype=torch.int64)
        types[:, s.tokens // 2:] = 1
        return getattr(transformers, model_class)(config), (ids,), {"attention_mask": mask, "token_type_ids": types}

    return build


def _vit(s: Size) -> Case:
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(image_size=s.image, patch_size=4, num_channels=3, hidden_size=s.hidden, num_hidden_layers=2,
                       num_attention_heads=s.heads, intermediate_size=2 * s.hidden, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    return ViTModel(config), (torch.randn(s.batch, 3, s.image, s.image),), {}


def _whisper_encoder(s: Size) -> Case:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(num_mel_bins=16, d_model=s.hidden, encoder_layers=2, encoder_attention_heads=s.heads,
                           encoder_ffn_dim=2 * s.hidden, max_source_positions=s.tokens, dropout=0.0,
                           attention_dropout=0.0, activation_dropout=0.0)
    return WhisperEncoder(config), (torch.randn(s.batch, 16, 2 * s.tokens),), {}


def _wav2vec2(s: Size) -> Case:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(hidden_size=s.hidden, num_hidden_layers=2, num_attention_heads=s.heads,
                            intermediate_size=2 * s.hidden, conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4),
                            num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
                            attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                            do_stable_layer_norm=True,
                            apply_spec_augment=False)
    return Wav2Vec2Model(config), (torch.randn(s.batch, 64 * s.tokens),), {}


def _dlrm(s: Size) -> Case:
    module = DLRM()
    ids = torch.stack([torch.randint(0, n, (2 * s.batch,)) for n in (50, 40, 30)])
    offsets = torch.arange(0, 2 * s.batch, 2).repeat(3, 1)  # two ids per bag
    return module, (torch.randn(s.batch, 8), ids, offsets), {}


@dataclass(frozen=True)
class Family:
    """One kind of model: how to build a tiny one, what it is, and why it does not pass end to end yet (None
    when it does: tests/test_zoo.py checks both, strictly)."""

    build: Callable[..., Case]
    kind: str
    fails: str | None = None


# -- More families, at one tiny size: benchmarks/zoo_sweep.py sweeps them under several hash seeds -------------

B, T, H, HEADS, IMAGE = 4, 8, 32, 4, 32  # the sweep's families: batch, tokens, hidden, heads, image side


def _tiny_ids(vocab: int = 2 * H, tokens: int = T) -> torch.Tensor:
    return torch.randint(0, vocab, (B, tokens))


def _mask() -> torch.Tensor:
    mask = torch.ones(B, T, dtype=torch.int64)
    mask[1, T * 3 // 4:] = 0  # a padded sequence
    return mask


def _hf(model: str, config: str, inputs: Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]],
        **fields: Any) -> Callable[[], Case]:
    """A Hugging Face model class built from its config class with `fields` (random weights)."""

    def build() -> Case:
        import transformers

        cfg = getattr(transformers, config)(**fields)
        args, kwargs = inputs(cfg)
        return getattr(transformers, model)(cfg), args, kwargs

    return build


def _text(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_tiny_ids(cfg.vocab_size),), {"attention_mask": _mask()}


def _decoder_text(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_tiny_ids(cfg.vocab_size),), {"use_cache": False}


def _seq2seq(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_tiny_ids(cfg.vocab_size),), {"decoder_input_ids": _tiny_ids(cfg.vocab_size, T // 2), "use_cache": False}


def _masked_seq2seq(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """With the encoder's mask given (Switch Transformers indexes a missing one under torch.export)."""
    args, kwargs = _seq2seq(cfg)
    return args, {**kwargs, "attention_mask": _mask()}


def _global_text(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Padded ids with Longformer's global-attention mask: rows with one, two and no global tokens (the branch the
    original takes depends on it; the import must not)."""
    global_mask = torch.zeros(B, T, dtype=torch.int64)
    global_mask[0, 0] = global_mask[1, [0, 3]] = global_mask[3, T - 1] = 1
    return (_tiny_ids(cfg.vocab_size),), {"attention_mask": _mask(), "global_attention_mask": global_mask}


def _pixels(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (torch.randn(B, 3, IMAGE, IMAGE),), {}


def _audio(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (torch.randn(B, 1024),), {}


ENCODER = dict(vocab_size=2 * H, hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
               intermediate_size=2 * H, max_position_embeddings=2 * T + 2, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
SEQ2SEQ_T5 = dict(vocab_size=2 * H, d_model=H, d_kv=8, d_ff=2 * H, num_layers=1, num_decoder_layers=1, num_heads=HEADS,
                  dropout_rate=0.0, decoder_start_token_id=0, relative_attention_num_buckets=8)
DECODER = dict(vocab_size=2 * H, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
               num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=2 * T)
SEQ2SEQ = dict(vocab_size=2 * H, d_model=H, encoder_layers=1, decoder_layers=1, encoder_attention_heads=HEADS,
               decoder_attention_heads=HEADS, encoder_ffn_dim=2 * H, decoder_ffn_dim=2 * H,
               max_position_embeddings=2 * T, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
               decoder_start_token_id=0, pad_token_id=1)
VISION = dict(image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=H, num_hidden_layers=2,
              num_attention_heads=HEADS, intermediate_size=2 * H, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0)
AUDIO = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=2 * H,
             conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8,
             num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
             feat_proj_dropout=0.0, apply_spec_augment=False)


class TCN(nn.Module):
    """A temporal convolutional network: dilation-free causal Conv1d blocks (left padding) with residuals."""

    def __init__(self, channels: int = 16, levels: int = 2) -> None:
        super().__init__()
        self.inp = nn.Conv1d(4, channels, 1)
        self.convs = nn.ModuleList(nn.Conv1d(channels, channels, 3) for _ in range(levels))
        self.head = nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for conv in self.convs:
            h = h + torch.relu(conv(nn.functional.pad(h, (2, 0))))
        return self.head(h.mean(-1))


class EinsumAttention(nn.Module):
    """Multi-head attention written with einsum (projections, scores and the weighted sum)."""

    def __init__(self, dim: int = H, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Parameter(torch.randn(3, dim, heads, dim // heads) / dim ** 0.5)
        self.out = nn.Parameter(torch.randn(heads, dim // heads, dim) / dim ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = torch.einsum("bsd,tdhe->tbhse", x, self.qkv)
        scores = torch.einsum("bhse,bhte->bhst", q, k) / q.shape[-1] ** 0.5
        mixed = torch.einsum("bhst,bhte->bhse", scores.softmax(-1), v)
        return x + torch.einsum("bhse,hed->bsd", mixed, self.out)


class GRUSeq2Seq(nn.Module):
    """An encoder GRU whose final state starts a decoder GRU over the target tokens, then a vocabulary head."""

    def __init__(self, vocab: int = 2 * H, hidden: int = H) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder, self.decoder = nn.GRU(hidden, hidden, batch_first=True), nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _, state = self.encoder(self.embed(source))
        out, _ = self.decoder(self.embed(target), state)
        return self.head(out)


class BiLSTM(nn.Module):
    """A bidirectional LSTM over features, with explicit initial states, pooled by max over time."""

    def __init__(self, features: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.rnn = nn.LSTM(features, hidden, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden, 2)

    def forward(self, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x, (h0, c0))
        return self.head(out.amax(1))


class ConvAutoencoder(nn.Module):
    """Strided convs down, transposed convs up, GroupNorm and SiLU between (a diffusion-style block)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.GroupNorm(4, 8), nn.SiLU(),
                                  nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.SiLU())
        self.up = nn.Sequential(nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), nn.SiLU(),
                                nn.ConvTranspose2d(8, 3, 4, stride=2, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class MLPMixer(nn.Module):
    """Patches by a strided conv, then token-mixing and channel-mixing MLPs with layer norms."""

    def __init__(self, dim: int = H, patch: int = 8) -> None:
        super().__init__()
        tokens = (IMAGE // patch) ** 2
        self.patches = nn.Conv2d(3, dim, patch, stride=patch)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.tokens = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channels = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patches(x).flatten(2).transpose(1, 2)  # [B, tokens, dim]
        h = h + self.tokens(self.norm1(h).transpose(1, 2)).transpose(1, 2)
        h = h + self.channels(self.norm2(h))
        return self.head(h.mean(1))


class TopKRouter(nn.Module):
    """A switch-style MoE layer: softmax router, top-1 expert per token by gather of per-expert outputs."""

    def __init__(self, dim: int = H, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
                                     for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, choice = self.router(x).softmax(-1).topk(1, dim=-1)  # [B, T, 1]
        every = torch.stack([e(x) for e in self.experts], dim=-2)  # [B, T, E, D]
        picked = every.gather(-2, choice.unsqueeze(-1).expand(*choice.shape, x.shape[-1])).squeeze(-2)
        return x + weight * picked


def _module(make: Callable[[], nn.Module], *inputs: Callable[[], torch.Tensor]) -> Callable[[], Case]:
    return lambda: (make(), tuple(i() for i in inputs), {})


_EXTRA: dict[str, tuple[str, Callable[[], Case]]] = {
    # encoders
    "distilbert": ("encoder", _hf("DistilBertModel", "DistilBertConfig", _text, vocab_size=2 * H, dim=H, n_layers=2,
                                  n_heads=HEADS, hidden_dim=2 * H, max_position_embeddings=2 * T, dropout=0.0,
                                  attention_dropout=0.0)),
    "albert": ("encoder, shared layers, factorized embedding",
               _hf("AlbertModel", "AlbertConfig", _text, **ENCODER, embedding_size=16, classifier_dropout_prob=0.0)),
    "deberta_v2": ("encoder, disentangled relative attention",
                   _hf("DebertaV2Model", "DebertaV2Config", _text, **ENCODER, relative_attention=True,
                       position_buckets=8, max_relative_positions=T, pos_att_type=["p2c", "c2p"])),
    "electra": ("encoder, embedding projection", _hf("ElectraModel", "ElectraConfig", _text, **ENCODER,
                                                     embedding_size=16)),
    "mpnet": ("encoder, relative position bias", _hf("MPNetModel", "MPNetConfig", _text, **ENCODER)),
    "xlm_roberta": ("encoder with pooler", _hf("XLMRobertaModel", "XLMRobertaConfig", _text, **ENCODER,
                                               pad_token_id=1)),
    "mobilebert": ("encoder, bottlenecks, no-norm", _hf("MobileBertModel", "MobileBertConfig", _text, **ENCODER,
                                                        embedding_size=16, intra_bottleneck_size=16,
                                                        true_hidden_size=16, num_feedforward_networks=2)),
    "roformer": ("encoder, rotary positions", _hf("RoFormerModel", "RoFormerConfig", _text, **ENCODER,
                                                  embedding_size=H)),
    "longformer": ("encoder, sliding-window and global attention", _hf(
        "LongformerModel", "LongformerConfig", _global_text, **{**ENCODER, "max_position_embeddings": 4 * T},
        attention_window=[4, 4], pad_token_id=1)),
    "esm": ("protein encoder, rotary", _hf("EsmModel", "EsmConfig", _text, **ENCODER, pad_token_id=1,
                                           position_embedding_type="rotary", mask_token_id=2)),
    "convbert": ("encoder, span-based dynamic conv", _hf("ConvBertModel", "ConvBertConfig", _text, **ENCODER,
                                                         embedding_size=H, conv_kernel_size=3, head_ratio=2)),
    # decoders
    "opt": ("decoder, learned positions", _hf("OPTModel", "OPTConfig", _decoder_text, vocab_size=2 * H,
                                              hidden_size=H, num_hidden_layers=2, ffn_dim=2 * H,
                                              num_attention_heads=HEADS, max_position_embeddings=2 * T,
                                              word_embed_proj_dim=H, dropout=0.0, attention_dropout=0.0)),
    "bloom": ("decoder, ALiBi", _hf("BloomModel", "BloomConfig", _decoder_text, vocab_size=2 * H, hidden_size=H,
                                    n_layer=2, n_head=HEADS, hidden_dropout=0.0, attention_dropout=0.0)),
    "falcon": ("decoder, multi-query attention", _hf("FalconModel", "FalconConfig", _decoder_text, vocab_size=2 * H,
                                                     hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
                                                     multi_query=True, new_decoder_architecture=False,
                                                     parallel_attn=True, bias=False, alibi=False,
                                                     hidden_dropout=0.0, attention_dropout=0.0)),
    "gptj": ("decoder, interleaved rotary", _hf("GPTJModel", "GPTJConfig", _decoder_text, vocab_size=2 * H, n_embd=H,
                                                n_layer=2, n_head=HEADS, rotary_dim=4, n_positions=2 * T,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "phi": ("decoder, partial rotary, parallel block", _hf("PhiModel", "PhiConfig", _decoder_text, **DECODER,
                                                           partial_rotary_factor=0.5, resid_pdrop=0.0,
                                                           embd_pdrop=0.0, attention_dropout=0.0)),
    "phi3": ("decoder, fused QKV and gate-up", _hf("Phi3Model", "Phi3Config", _decoder_text, **DECODER,
                                                   pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attention_dropout=0.0)),
    "gemma": ("decoder, multi-query, scaled embedding", _hf("GemmaModel", "GemmaConfig", _decoder_text,
                                                            **{**DECODER, "num_key_value_heads": 1}, head_dim=8)),
    "gemma2": ("decoder, soft-capping, sliding window", _hf("Gemma2Model", "Gemma2Config", _decoder_text, **DECODER,
                                                            head_dim=8, sliding_window=4)),
    "qwen2_moe": ("MoE decoder, shared expert", _hf("Qwen2MoeModel", "Qwen2MoeConfig", _decoder_text, **DECODER,
                                                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=H,
                                                    shared_expert_intermediate_size=H, decoder_sparse_step=1)),
    "olmo": ("decoder, non-parametric layer norm", _hf("OlmoModel", "OlmoConfig", _decoder_text, **DECODER)),
    "olmo2": ("decoder, QK norm", _hf("Olmo2Model", "Olmo2Config", _decoder_text, **DECODER)),
    "stablelm": ("decoder, partial rotary, layer norm", _hf("StableLmModel", "StableLmConfig", _decoder_text,
                                                           **DECODER, partial_rotary_factor=0.25)),
    "starcoder2": ("decoder, GQA with biases", _hf("Starcoder2Model", "Starcoder2Config", _decoder_text, **DECODER,
                                                  residual_dropout=0.0, embedding_dropout=0.0)),
    "gpt_bigcode": ("decoder, multi-query attention", _hf("GPTBigCodeModel", "GPTBigCodeConfig", _decoder_text,
                                                          vocab_size=2 * H, n_embd=H, n_layer=2, n_head=HEADS,
                                                          n_positions=2 * T, multi_query=True, resid_pdrop=0.0,
                                                          embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_neo": ("decoder, local attention layers", _hf("GPTNeoModel", "GPTNeoConfig", _decoder_text,
                                                       vocab_size=2 * H, hidden_size=H, num_layers=2,
                                                       attention_types=[[["global", "local"], 1]], num_heads=HEADS,
                                                       window_size=4, max_position_embeddings=2 * T,
                                                       resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0)),
    "codegen": ("decoder, fused QKV, rotary", _hf("CodeGenModel", "CodeGenConfig", _decoder_text, vocab_size=2 * H,
                                                  n_embd=H, n_layer=2, n_head=HEADS, rotary_dim=4, n_positions=2 * T,
                                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "qwen3": ("decoder, QK norm, GQA", _hf("Qwen3Model", "Qwen3Config", _decoder_text, **DECODER, head_dim=8)),
    "granite": ("decoder, scaled residuals", _hf("GraniteModel", "GraniteConfig", _decoder_text, **DECODER)),
    "olmoe": ("MoE decoder", _hf("OlmoeModel", "OlmoeConfig", _decoder_text, **DECODER, num_experts=4,
                                 num_experts_per_tok=2)),
    "xglm": ("decoder, sinusoidal positions", _hf("XGLMModel", "XGLMConfig", _decoder_text, vocab_size=2 * H,
                                                  d_model=H, num_layers=2, attention_heads=HEADS, ffn_dim=2 * H,
                                                  max_position_embeddings=2 * T, dropout=0.0, attention_dropout=0.0,
                                                  activation_dropout=0.0)),
    # encoder-decoders
    "pegasus": ("encoder-decoder, sinusoidal positions", _hf("PegasusModel", "PegasusConfig", _seq2seq, **SEQ2SEQ)),
    "marian": ("encoder-decoder", _hf("MarianModel", "MarianConfig", _seq2seq, **SEQ2SEQ)),
    "mbart": ("encoder-decoder, pre-norm", _hf("MBartModel", "MBartConfig", _seq2seq, **SEQ2SEQ)),
    "mt5": ("encoder-decoder, gated GELU, untied head", _hf(
        "MT5ForConditionalGeneration", "MT5Config", _seq2seq, vocab_size=2 * H, d_model=H, d_kv=8, d_ff=2 * H,
        num_layers=1, num_decoder_layers=1, num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "switch_transformers": ("MoE encoder-decoder, top-1 routing with capacity", _hf(
        "SwitchTransformersModel", "SwitchTransformersConfig", _masked_seq2seq, **SEQ2SEQ_T5, num_experts=4,
        encoder_sparse_step=1, decoder_sparse_step=1, expert_capacity=3, router_jitter_noise=0.0)),
    # vision
    "deit": ("vision transformer, distillation token", _hf("DeiTModel", "DeiTConfig", _pixels, **VISION)),
    "beit": ("vision transformer, relative position bias", _hf("BeitModel", "BeitConfig", _pixels, **VISION,
                                                               use_relative_position_bias=True)),
    "dinov2": ("vision transformer, layer scale", _hf("Dinov2Model", "Dinov2Config", _pixels, **VISION)),
    "clip_vision": ("vision transformer, CLIP", _hf("CLIPVisionModel", "CLIPVisionConfig", _pixels, image_size=IMAGE,
                                                   patch_size=8, hidden_size=H, num_hidden_layers=2,
                                                   num_attention_heads=HEADS, intermediate_size=2 * H)),
    "clip_text": ("text encoder, causal, argmax pooling", _hf(
        "CLIPTextModel", "CLIPTextConfig", _text, vocab_size=2 * H, hidden_size=H, num_hidden_layers=2,
        num_attention_heads=HEADS, intermediate_size=2 * H, max_position_embeddings=2 * T, eos_token_id=2)),
    "swin": ("vision transformer, shifted windows", _hf("SwinModel", "SwinConfig", _pixels, image_size=IMAGE,
                                                       patch_size=4, embed_dim=16, depths=[2, 1], num_heads=[2, 4],
                                                       window_size=4, hidden_dropout_prob=0.0,
                                                       attention_probs_dropout_prob=0.0, drop_path_rate=0.0)),
    "convnext": ("CNN, depthwise convs, layer norm", _hf("ConvNextModel", "ConvNextConfig", _pixels,
                                                        hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)),
    "resnet": ("CNN, residual bottlenecks", _hf("ResNetModel", "ResNetConfig", _pixels, embedding_size=16,
                                                hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck")),
    "regnet": ("CNN, grouped convs, squeeze-excite", _hf("RegNetModel", "RegNetConfig", _pixels, embedding_size=16,
                                                        hidden_sizes=[16, 32], depths=[1, 1], groups_width=8)),
    "segformer": ("vision encoder, efficient attention", _hf(
        "SegformerModel", "SegformerConfig", _pixels, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
        hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)),
    "mobilenet_v2": ("CNN, inverted residuals, depthwise", _hf("MobileNetV2Model", "MobileNetV2Config", _pixels,
                                                              image_size=IMAGE, depth_multiplier=0.25)),
    # audio
    "hubert": ("audio encoder (conv features)", _hf("HubertModel", "HubertConfig", _audio, **AUDIO)),
    "data2vec_audio": ("audio encoder, conv positions", _hf("Data2VecAudioModel", "Data2VecAudioConfig", _audio,
                                                            **{**AUDIO, "num_conv_pos_embeddings": 4})),
    # hand-written
    "tcn": ("temporal conv net (Conv1d, pad)", _module(TCN, lambda: torch.randn(B, 4, 16))),
    "einsum_attention": ("attention in einsum", _module(EinsumAttention, lambda: torch.randn(B, T, H))),
    "gru_seq2seq": ("GRU encoder-decoder", _module(GRUSeq2Seq, lambda: _tiny_ids(),
                                                   lambda: _tiny_ids(tokens=T // 2))),
    "bilstm": ("bidirectional LSTM, given states", _module(BiLSTM, lambda: torch.randn(B, T, 8),
                                                          lambda: torch.randn(2, B, 16),
                                                          lambda: torch.randn(2, B, 16))),
    "conv_autoencoder": ("strided and transposed convs, GroupNorm", _module(ConvAutoencoder,
                                                                           lambda: torch.randn(B, 3, 16, 16))),
    "mlp_mixer": ("MLP-Mixer", _module(MLPMixer, lambda: torch.randn(B, 3, IMAGE, IMAGE))),
    "topk_moe": ("switch MoE by topk and gather", _module(TopKRouter, lambda: torch.randn(B, T, H))),
}

EXTRA: dict[str, Family] = {name: Family(_seeded(lambda _size, make=make: make()), kind)
                             for name, (kind, make) in _EXTRA.items()}


FAMILIES: dict[str, Family] = {
    "t5": Family(_seeded(_t5), "encoder-decoder, tied embedding and LM head"),
    "bart": Family(_seeded(_bart), "encoder-decoder"),
    "llama": Family(_seeded(_decoder("LlamaConfig", "LlamaModel")), "decoder, grouped-query attention, RoPE"),
    "qwen2": Family(_seeded(_decoder("Qwen2Config", "Qwen2Model")), "decoder, grouped-query attention, QKV bias"),
    "mistral": Family(_seeded(_decoder("MistralConfig", "MistralModel")), "decoder, grouped-query attention"),
    "mixtral": Family(_seeded(_decoder("MixtralConfig", "MixtralModel", num_local_experts=4, num_experts_per_tok=2)),
                      "mixture-of-experts decoder"),
    "gpt2": Family(MODELS["gpt2"], "decoder, fused QKV"),
    "gpt_neox": Family(_seeded(_gpt_neox), "decoder, parallel attention and MLP, partial RoPE"),
    "bert": Family(_seeded(_encoder("BertConfig", "BertModel")), "encoder with pooler and token types"),
    "roberta": Family(_seeded(_encoder("RobertaConfig", "RobertaModel", pad_token_id=1)), "encoder with pooler"),
    "vit": Family(_seeded(_vit), "vision transformer"),
    "cnn": Family(MODELS["cnn"], "convolutional network"),
    "unet": Family(_seeded(lambda s: (TinyUNet(), (torch.randn(s.batch, 3, s.image, s.image),), {})),
                   "U-Net: skips, pooling, upsampling"),
    "whisper_encoder": Family(_seeded(_whisper_encoder), "audio encoder (conv1d front end)"),
    "wav2vec2": Family(_seeded(_wav2vec2), "audio encoder (conv feature extractor)"),
    "gru": Family(_seeded(lambda s: (GRUClassifier(), (_ids(s, 64),), {})), "recurrent classifier (GRU)"),
    "lstm": Family(_seeded(lambda s: (LSTMTagger(), (_ids(s, 64),), {})), "recurrent tagger (2-layer LSTM)"),
    "dlrm": Family(_seeded(_dlrm), "recommendation: embedding bags, dot interactions"),
    "llama_block": Family(MODELS["llama_block"], "hand-written decoder block"),
    **EXTRA,
}
