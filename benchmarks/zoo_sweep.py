"""A zoo sweep: many small model families, each imported with `from_torch`, optimized on each mesh under several
PYTHONHASHSEED values, its plan simulated and compared with eager PyTorch (what tests/test_zoo.py checks for the
zoo's FAMILIES, here for families and configs outside them too). Writes the "Zoo sweep" section of
docs/importing.md.

    .venv/bin/python benchmarks/zoo_sweep.py [NAME ...] [--seeds 0 1 2] [--meshes 4 2x2] [--extractor greedy-dag]
    .venv/bin/python benchmarks/zoo_sweep.py --list

Each (family, seed) runs in its own process (the hash seed is fixed at interpreter start). A family passes when
every run imports, optimizes, and matches eager within 1e-4 of the largest output, with the same plan cost under
every seed. The models are tiny (1-2 layers, hidden 32, random weights; nothing is downloaded): the sweep checks
soundness, not speed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

IMPORTING = Path(__file__).resolve().parent.parent / "docs" / "importing.md"
Case = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]
B, T, H, HEADS, IMAGE = 4, 8, 32, 4, 32  # batch, tokens, hidden, heads, image side


def _ids(vocab: int = 2 * H, tokens: int = T) -> torch.Tensor:
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
    return (_ids(cfg.vocab_size),), {"attention_mask": _mask()}


def _decoder_text(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_ids(cfg.vocab_size),), {"use_cache": False}


def _seq2seq(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_ids(cfg.vocab_size),), {"decoder_input_ids": _ids(cfg.vocab_size, T // 2), "use_cache": False}


def _pixels(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (torch.randn(B, 3, IMAGE, IMAGE),), {}


def _audio(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (torch.randn(B, 1024),), {}


ENCODER = dict(vocab_size=2 * H, hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
               intermediate_size=2 * H, max_position_embeddings=2 * T + 2, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
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


SWEEP: dict[str, tuple[str, Callable[[], Case]]] = {
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
    "gru_seq2seq": ("GRU encoder-decoder", _module(GRUSeq2Seq, lambda: _ids(), lambda: _ids(tokens=T // 2))),
    "bilstm": ("bidirectional LSTM, given states", _module(BiLSTM, lambda: torch.randn(B, T, 8),
                                                          lambda: torch.randn(2, B, 16), lambda: torch.randn(2, B, 16))),
    "conv_autoencoder": ("strided and transposed convs, GroupNorm", _module(ConvAutoencoder,
                                                                           lambda: torch.randn(B, 3, 16, 16))),
    "mlp_mixer": ("MLP-Mixer", _module(MLPMixer, lambda: torch.randn(B, 3, IMAGE, IMAGE))),
    "topk_moe": ("switch MoE by topk and gather", _module(TopKRouter, lambda: torch.randn(B, T, H))),
}


def build(name: str) -> Case:
    torch.manual_seed(0)
    module, args, kwargs = SWEEP[name][1]()
    return module.eval(), args, kwargs


def worker(name: str, meshes: list[str], extractor: str) -> dict[str, Any]:
    """One family under this process's hash seed: per mesh, the plan's cost, sharded share and error, or the
    exception."""
    import numpy as np

    import tapestry
    from tapestry.importer.report import import_report
    from tapestry.plan.simulate import simulate

    result: dict[str, Any] = {"family": name}
    try:
        module, args, kwargs = build(name)
        with torch.no_grad():
            want = [t.numpy() for t in torch.utils._pytree.tree_leaves(module(*args, **kwargs))
                    if isinstance(t, torch.Tensor)]
        imported = tapestry.from_torch(module, args, kwargs, verbose=False)
        result["opaque"] = sorted(op for op, kinds in imported.coverage.items() if kinds.get("opaque"))
    except Exception as err:  # noqa: BLE001  the sweep records what failed
        result["error"] = f"import: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        return result
    for text in meshes:
        mesh = tapestry.Mesh.parse(text)
        start = time.perf_counter()
        try:
            plan = tapestry.optimize(imported.graph, mesh, extractor=extractor).plan
            seconds = time.perf_counter() - start
            got = imported.outputs(simulate(plan, imported.inputs(*args, **kwargs)))
            error = max(float(np.abs(g.astype(np.float64) - w).max() / max(np.abs(w).max(), 1.0))
                        if g.shape == w.shape else float("inf") for g, w in zip(got, want))
            if len(got) != len(want):
                error = float("inf")
            report = import_report(name, imported, mesh, plan)
            result[text] = {"cost": plan.cost, "error": error, "sharded": report.plan_sharded,
                            "seconds": round(seconds, 2)}
        except Exception as err:  # noqa: BLE001
            first = str(err).splitlines()[0][:300] if str(err) else ""
            result[text] = {"exception": f"{type(err).__name__}: {first}"}
    return result


def run(name: str, seed: int, meshes: list[str], extractor: str, timeout: float) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", name, "--meshes", *meshes, "--extractor", extractor]
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"family": name, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"family": name, "error": f"worker exited {done.returncode}: {done.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


def verdict(runs: dict[int, dict[str, Any]], meshes: list[str]) -> str:
    """'passes', or the first failure: an exception, a wrong answer, or plans whose cost differs by seed."""
    for seed, result in runs.items():
        if "error" in result:
            return f"seed {seed}: {result['error']}"
        for mesh in meshes:
            cell = result[mesh]
            if "exception" in cell:
                return f"{mesh}, seed {seed}: {cell['exception']}"
            if not cell["error"] <= 1e-4:
                return f"{mesh}, seed {seed}: differs from eager by {cell['error']:.2e}"
    for mesh in meshes:
        costs = {seed: result[mesh]["cost"] for seed, result in runs.items()}
        if max(costs.values()) - min(costs.values()) > 1e-9 * max(costs.values()):
            return f"{mesh}: plan cost depends on the hash seed {costs}"
    return "passes"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", help="families (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--meshes", nargs="+", default=["4", "2x2"])
    parser.add_argument("--extractor", default="greedy-dag", help="ilp (optimize's default) or greedy-dag")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per family and seed")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--write", action="store_true", help="write the section of docs/importing.md")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.meshes, args.extractor)), flush=True)
        return
    if args.list:
        print("\n".join(f"{name}: {kind}" for name, (kind, _) in SWEEP.items()))
        return
    rows = ["| family | kind | " + " | ".join(f"{m}: plan shards" for m in args.meshes) + " | opaque ops | outcome |",
            "|---|---|" + "---:|" * len(args.meshes) + "---|---|"]
    passed = 0
    for name in args.names or list(SWEEP):
        runs = {seed: run(name, seed, args.meshes, args.extractor, args.timeout) for seed in args.seeds}
        outcome = verdict(runs, args.meshes)
        passed += outcome == "passes"
        first = runs[args.seeds[0]]
        shares = [f"{first[m]['sharded']:.1%}" if "sharded" in first.get(m, {}) else "—" for m in args.meshes]
        opaque = ", ".join(f"`{op.removeprefix('aten.')}`" for op in first.get("opaque", [])) or "none"
        row = f"| {name} | {SWEEP[name][0]} | " + " | ".join(shares) + f" | {opaque} | {outcome} |"
        print(row, flush=True)
        rows.append(row)
    print(f"{passed} of {len(rows) - 2} pass", flush=True)
    if args.write:
        body = "\n".join(rows) + (
            f"\n\n{passed} of {len(rows) - 2} families pass: imported with `from_torch`, optimized on "
            f"{' and '.join(args.meshes)} with the {args.extractor} extractor under PYTHONHASHSEED "
            f"{', '.join(map(str, args.seeds))}, simulated, and compared with eager PyTorch (1e-4 of the largest "
            "output), the plan's cost the same under every seed. `plan shards` is `tapestry import-report`'s share "
            "of FLOPs the plan splits over devices (seed " f"{args.seeds[0]}).")
        command = "python benchmarks/zoo_sweep.py" + (f" --extractor {args.extractor}" if args.extractor else "")
        write_section("Zoo sweep", command, body, IMPORTING)


if __name__ == "__main__":
    main()
