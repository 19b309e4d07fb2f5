"""The held-back zoo (issue 25's measure): model families that are not in tapestry.importer.zoo (so no test was
written against them), each imported with `from_torch`, optimized on each mesh under several PYTHONHASHSEED values,
its plan simulated and compared with eager PyTorch. Writes the "Held-back zoo (issue 25)" section of
docs/benchmarks.md.

    .venv/bin/python benchmarks/heldback_zoo.py [NAME ...] [--seeds 0 1] [--meshes 4 2x2] [--extractor ilp]
        [--timeout 600] [--jobs N] [--json OUT] [--write]
    .venv/bin/python benchmarks/heldback_zoo.py --list
    .venv/bin/python benchmarks/heldback_zoo.py --summarize OUT.json [...]

Each model and seed runs in its own process (the hash seed is fixed at interpreter start) under a time limit;
the seeds' processes run side by side (`--jobs` at a time). Each worker reports its CPU seconds (its whole process,
the imports of torch and transformers included), and `--json` keeps every run's result. The checks and the
verdict are benchmarks/zoo_sweep.py's: a model passes when every run imports, optimizes and matches eager within
1e-4 of the largest output, with the same plan cost under every seed. Tiny configs (1-2 layers, hidden 32,
random weights; nothing is downloaded).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section  # noqa: E402
from zoo_sweep import check, merged_rows, shards, verdict  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from tapestry.importer.zoo import (  # noqa: E402
    B, DECODER, ENCODER, FAMILIES, H, HEADS, IMAGE, SEQ2SEQ, SEQ2SEQ_T5, Family, _audio, _decoder_text, _hf,
    _module, _pixels, _seeded, _seq2seq, _text, _tiny_ids)

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
T = 8  # tokens


class GroupNormUNet(nn.Module):
    """A diffusion-style U-Net: GroupNorm and SiLU blocks, strided conv down, transposed conv up, a concatenated
    skip at each level (the zoo's U-Net has batch norm, max pooling and nearest upsampling instead)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()

        def block(i: int, o: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(4, o), nn.SiLU())

        self.inp, self.down = block(3, c), nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.middle = block(2 * c, 2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.out = nn.Sequential(block(2 * c, c), nn.Conv2d(c, 3, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.inp(x)
        return self.out(torch.cat([self.up(self.middle(self.down(skip))), skip], dim=1))


class AttentionGRU(nn.Module):
    """A GRU encoder-decoder with dot-product (Luong) attention of the decoder's states over the encoder's."""

    def __init__(self, vocab: int = 2 * H, hidden: int = H) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder, self.decoder = nn.GRU(hidden, hidden, batch_first=True), nn.GRU(hidden, hidden, batch_first=True)
        self.mix, self.head = nn.Linear(2 * hidden, hidden), nn.Linear(hidden, vocab)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        memory, state = self.encoder(self.embed(source))
        out, _ = self.decoder(self.embed(target), state)
        context = torch.softmax(out @ memory.transpose(1, 2), -1) @ memory
        return self.head(torch.tanh(self.mix(torch.cat([out, context], -1))))


class WeightedBagDLRM(nn.Module):
    """DLRM with per-sample-weighted embedding bags of ragged lengths (the zoo's DLRM sums unweighted bags of two
    ids), and a concatenation interaction instead of dot products."""

    def __init__(self, dense: int = 8, dim: int = 16, tables: tuple[int, ...] = (40, 30)) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, dim), nn.ReLU())
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in tables)
        self.top = nn.Sequential(nn.Linear(dim * (len(tables) + 1), 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        bags = [bag(ids[i], offsets[i], per_sample_weights=weights[i]) for i, bag in enumerate(self.bags)]
        return self.top(torch.cat([self.bottom(dense), *bags], dim=1))


def _bags() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randint(0, n, (3 * B,)) for n in (40, 30)])
    offsets = torch.tensor([0, 2, 5, 9]).repeat(2, 1)  # bags of 2, 3, 4 and 3 ids
    return ids, offsets, torch.rand(2, 3 * B)


def _layout(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    corners = torch.randint(0, 500, (B, T, 2))
    bbox = torch.cat([corners, corners + torch.randint(1, 400, (B, T, 2))], -1)
    return (_tiny_ids(cfg.vocab_size),), {"bbox": bbox, "attention_mask": torch.ones(B, T, dtype=torch.int64)}


WHISPER = dict(vocab_size=2 * H, num_mel_bins=16, d_model=H, encoder_layers=1, decoder_layers=1,
               encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * H,
               decoder_ffn_dim=2 * H, max_source_positions=16, max_target_positions=2 * T, dropout=0.0,
               attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=0, pad_token_id=1)


def _whisper(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (torch.randn(B, 16, 32),), {"decoder_input_ids": _tiny_ids(cfg.vocab_size, T // 2), "use_cache": False}


def _no_eos_ids(cfg: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Ids without the end-of-sequence token (models that pool at it need one per row: kept out of the way)."""
    return (_tiny_ids(cfg.vocab_size),), {"use_cache": False}


AUDIO_FE = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=2 * H,
                conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8,
                num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                feat_proj_dropout=0.0, apply_spec_augment=False)

_MODELS: dict[str, tuple[str, Any]] = {
    # encoder-decoders
    "whisper": ("audio encoder-decoder", _hf("WhisperModel", "WhisperConfig", _whisper, **WHISPER)),
    "blenderbot": ("encoder-decoder, pre-norm", _hf("BlenderbotModel", "BlenderbotConfig", _seq2seq, **SEQ2SEQ)),
    "plbart": ("encoder-decoder", _hf("PLBartModel", "PLBartConfig", _seq2seq, **SEQ2SEQ)),
    "m2m100": ("encoder-decoder, sinusoidal positions", _hf("M2M100Model", "M2M100Config", _seq2seq, **SEQ2SEQ)),
    "umt5": ("encoder-decoder, per-layer relative bias, tied head", _hf(
        "UMT5ForConditionalGeneration", "UMT5Config", _seq2seq, **SEQ2SEQ_T5, tie_word_embeddings=True)),
    # encoders
    "funnel": ("encoder, pooled sequence (funnel)", _hf(
        "FunnelBaseModel", "FunnelConfig", _text, vocab_size=2 * H, block_sizes=[1, 1], d_model=H, n_head=HEADS,
        d_head=8, d_inner=2 * H, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)),
    "fnet": ("encoder, Fourier mixing", _hf("FNetModel", "FNetConfig", lambda cfg: ((_tiny_ids(cfg.vocab_size),), {}),
                                            **{k: v for k, v in ENCODER.items() if "attention" not in k})),
    "layoutlm": ("encoder, 2-d box positions", _hf("LayoutLMModel", "LayoutLMConfig", _layout, **ENCODER)),
    "big_bird": ("encoder, block-sparse attention (full at this length)", _hf(
        "BigBirdModel", "BigBirdConfig", _text, **ENCODER, attention_type="original_full")),
    "squeezebert": ("encoder, grouped 1x1 convs", _hf("SqueezeBertModel", "SqueezeBertConfig", _text, **ENCODER,
                                                      embedding_size=H, q_groups=2, k_groups=2, v_groups=2,
                                                      post_attention_groups=2, intermediate_groups=2,
                                                      output_groups=2)),
    "xlnet": ("encoder, two-stream relative attention", _hf(
        "XLNetModel", "XLNetConfig", _text, vocab_size=2 * H, d_model=H, n_layer=2, n_head=HEADS, d_inner=2 * H,
        dropout=0.0)),
    "modernbert": ("encoder, rotary, GeGLU, local-global", _hf(
        "ModernBertModel", "ModernBertConfig", _text, vocab_size=2 * H, hidden_size=H, intermediate_size=2 * H,
        num_hidden_layers=2, num_attention_heads=HEADS, max_position_embeddings=2 * T, local_attention=4,
        global_attn_every_n_layers=2, pad_token_id=1, embedding_dropout=0.0, attention_dropout=0.0, mlp_dropout=0.0)),
    # decoders
    "persimmon": ("decoder, QK layer norm, partial rotary", _hf(
        "PersimmonModel", "PersimmonConfig", _decoder_text, **{k: v for k, v in DECODER.items()
                                                               if k != "num_key_value_heads"},
        partial_rotary_factor=0.5, hidden_dropout=0.0, attention_dropout=0.0)),
    "cohere": ("decoder, parallel block, logit scale", _hf("CohereModel", "CohereConfig", _decoder_text, **DECODER)),
    "nemotron": ("decoder, squared ReLU, partial rotary", _hf("NemotronModel", "NemotronConfig", _decoder_text,
                                                             **DECODER, partial_rotary_factor=0.5, head_dim=8)),
    "biogpt": ("decoder, learned positions, scaled embedding", _hf(
        "BioGptModel", "BioGptConfig", _decoder_text, vocab_size=2 * H, hidden_size=H, num_hidden_layers=2,
        num_attention_heads=HEADS, intermediate_size=2 * H, max_position_embeddings=2 * T, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, layerdrop=0.0)),
    "mpt": ("decoder, ALiBi, no biases", _hf("MptModel", "MptConfig", _decoder_text, vocab_size=2 * H, d_model=H,
                                             n_layers=2, n_heads=HEADS, expansion_ratio=2, max_seq_len=2 * T)),
    "gemma3_text": ("decoder, local-global, QK norm", _hf("Gemma3TextModel", "Gemma3TextConfig", _decoder_text,
                                                         **DECODER, head_dim=8, sliding_window=4)),
    "qwen3_moe": ("MoE decoder, QK norm", _hf("Qwen3MoeModel", "Qwen3MoeConfig", _decoder_text, **DECODER,
                                              head_dim=8, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=H, decoder_sparse_step=1)),
    "granitemoe": ("MoE decoder, scaled residuals", _hf("GraniteMoeModel", "GraniteMoeConfig", _decoder_text,
                                                        **DECODER, num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("MoE decoder, multi-head latent attention, shared expert", _hf(
        "DeepseekV3Model", "DeepseekV3Config", _decoder_text, **{**DECODER, "num_key_value_heads": HEADS},
        moe_intermediate_size=H, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8)),
    "gpt_sw3": ("GPT-2 architecture, GPT-SW3 config (tied, no bias dropout)", _hf(
        "GPT2LMHeadModel", "GPT2Config", _decoder_text, vocab_size=2 * H, n_embd=H, n_layer=1, n_head=HEADS,
        n_positions=2 * T, n_inner=2 * H, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, scale_attn_by_inverse_layer_idx=True, bos_token_id=0, eos_token_id=0)),
    # state-space and recurrent decoders
    "mamba": ("state-space decoder (selective scan)", _hf(
        "MambaModel", "MambaConfig", _no_eos_ids, vocab_size=2 * H, hidden_size=H, state_size=4, num_hidden_layers=2,
        expand=2, conv_kernel=4, time_step_rank=4, use_mambapy=False)),
    "jamba": ("hybrid attention/Mamba MoE decoder", _hf(
        "JambaModel", "JambaConfig", _no_eos_ids, **DECODER, num_experts=2, num_experts_per_tok=1,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False)),
    "rwkv": ("recurrent decoder (RWKV-4 time mixing)", _hf(
        "RwkvModel", "RwkvConfig", _no_eos_ids, vocab_size=2 * H, hidden_size=H, num_hidden_layers=2,
        attention_hidden_size=H, intermediate_size=2 * H, context_length=2 * T)),
    "recurrent_gemma": ("hybrid decoder: RG-LRU recurrence, local attention", _hf(
        "RecurrentGemmaModel", "RecurrentGemmaConfig", _decoder_text, vocab_size=2 * H, hidden_size=H,
        intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=1, lru_width=H,
        attention_window_size=4, conv1d_width=4, block_types=["recurrent", "attention"], head_dim=8)),
    # vision
    "efficientnet": ("CNN, MBConv, squeeze-excite, swish", _hf(
        "EfficientNetModel", "EfficientNetConfig", _pixels, image_size=IMAGE, width_coefficient=0.25,
        depth_coefficient=0.25, hidden_dim=320, dropout_rate=0.0, drop_connect_rate=0.0)),
    "mobilenet_v1": ("CNN, depthwise separable", _hf("MobileNetV1Model", "MobileNetV1Config", _pixels,
                                                     image_size=IMAGE, depth_multiplier=0.25)),
    "convnextv2": ("CNN, global response norm", _hf("ConvNextV2Model", "ConvNextV2Config", _pixels,
                                                    hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)),
    "swinv2": ("vision transformer, cosine attention, log-CPB", _hf(
        "Swinv2Model", "Swinv2Config", _pixels, image_size=IMAGE, patch_size=4, embed_dim=16, depths=[2, 1],
        num_heads=[2, 4], window_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0)),
    "siglip_vision": ("vision transformer, attention-pooling head", _hf(
        "SiglipVisionModel", "SiglipVisionConfig", _pixels, image_size=IMAGE, patch_size=8, hidden_size=H,
        num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=2 * H)),
    "poolformer": ("vision, pooling token mixer", _hf("PoolFormerModel", "PoolFormerConfig", _pixels,
                                                      hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2,
                                                      patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1])),
    "levit": ("vision, attention with conv stem and biases", _hf(
        "LevitModel", "LevitConfig", _pixels, image_size=IMAGE, hidden_sizes=[16, 32, 48],
        num_attention_heads=[2, 2, 3], depths=[1, 1, 1], key_dim=[8, 8, 8], mlp_ratio=[2, 2, 2],
        attention_ratio=[2, 2, 2])),
    "bit": ("CNN, weight-standardized convs", _hf("BitModel", "BitConfig", _pixels, embedding_size=16,
                                                  hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck",
                                                  num_groups=8)),
    "mobilevit": ("hybrid CNN-transformer", _hf(
        "MobileViTModel", "MobileViTConfig", _pixels, image_size=IMAGE, hidden_sizes=[16, 24, 32],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 48], num_attention_heads=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)),
    # audio
    "wav2vec2_conformer": ("audio encoder, conformer blocks", _hf(
        "Wav2Vec2ConformerModel", "Wav2Vec2ConformerConfig", _audio, **AUDIO_FE, position_embeddings_type="rotary",
        conformer_conv_dropout=0.0)),
    "wavlm": ("audio encoder, gated relative position bias", _hf("WavLMModel", "WavLMConfig", _audio, **AUDIO_FE,
                                                                 num_buckets=8, max_bucket_distance=16)),
    # hand-written
    "groupnorm_unet": ("U-Net: GroupNorm, strided conv, conv_transpose2d", _module(
        GroupNormUNet, lambda: torch.randn(B, 3, 16, 16))),
    "attention_gru": ("GRU encoder-decoder with attention", _module(AttentionGRU, lambda: _tiny_ids(),
                                                                    lambda: _tiny_ids(tokens=T // 2))),
    "weighted_dlrm": ("DLRM, weighted embedding bags of ragged length",
                      lambda: (WeightedBagDLRM(), (torch.randn(B, 8), *_bags()), {})),
}

MODELS: dict[str, Family] = {name: Family(_seeded(lambda _size, make=make: make()), kind)
                             for name, (kind, make) in _MODELS.items()}
assert not set(MODELS) & set(FAMILIES), "the held-back zoo holds families the tests do not"


def run(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """`name` checked in its own process under hash seed `seed`: its result, or why there is none (the process
    timed out or died)."""
    command = [sys.executable, __file__, "--worker", name, "--meshes", *args.meshes, "--extractor", args.extractor]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                              env={**os.environ, "PYTHONHASHSEED": str(seed)})
        out, why = done.stdout, f"worker exited {done.returncode}: {done.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired:
        out, why = "", f"timed out ({args.timeout:.0f} s)"
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return results[-1] if results else {"family": name, "error": why}


def row(name: str, runs: dict[int, dict[str, Any]], args: argparse.Namespace) -> str:
    first = runs[args.seeds[0]]
    cells = [f"{shards(first[m])}, {first[m]['seconds']:.1f}" if "sharded" in first.get(m, {}) else "—"
             for m in args.meshes]
    opaque = ", ".join(f"`{op.removeprefix('aten.')}`" for op in first.get("opaque", [])) or "none"
    return f"| {name} | {MODELS[name].kind} | " + " | ".join(cells) + f" | {opaque} | {verdict(runs, args.meshes)} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", help="models of the held-back zoo (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--meshes", nargs="+", default=["4", "2x2"])
    parser.add_argument("--extractor", default="ilp", help="ilp (optimize's default) or greedy-dag")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model and seed")
    parser.add_argument("--jobs", type=int, help="seeds' processes at a time (default: every seed at once)")
    parser.add_argument("--json", type=Path, help="write every run's result here, by model and seed")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--summarize", nargs="+", type=Path, help="what --json files hold, summed: runs, worst "
                        "error, plan costs per mesh, CPU s")
    parser.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args()
    if args.worker:
        result = check(args.worker, MODELS[args.worker].build, args.meshes, args.extractor)
        print(json.dumps({**result, "cpu_s": round(time.process_time(), 1)}), flush=True)
        return
    if args.list:
        print("\n".join(f"{name}: {family.kind}" for name, family in MODELS.items()))
        return
    if args.summarize:
        summarize(args.summarize, args.meshes)
        return
    rows = ["| model | kind | " + " | ".join(f"{m}: plan shards, optimize s" for m in args.meshes)
            + " | opaque ops | outcome |", "|---|---|" + "---:|" * len(args.meshes) + "---|---|"]
    names = args.names or list(MODELS)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for name in names:
        with ThreadPoolExecutor(args.jobs or len(args.seeds)) as pool:  # the seeds' processes side by side
            results[name] = dict(zip(args.seeds, pool.map(lambda seed: run(name, seed, args), args.seeds)))
        rows.append(row(name, results[name], args))
        print(rows[-1], f"(CPU s by seed: {[r.get('cpu_s') for r in results[name].values()]})", flush=True)
        if args.json:  # after each model: a cut run leaves what it checked
            args.json.write_text(json.dumps(results, indent=1))
    print(f"{sum('| passes' in line for line in rows[2:])} of {len(names)} pass", flush=True)
    if args.write:
        write(rows, args)


def summarize(paths: list[Path], meshes: list[str]) -> None:
    """Per model of the `--json` files: its seeds, the worst error over its runs, how many distinct plan costs
    each mesh got, and its workers' CPU seconds summed; then the totals."""
    cpu, runs = 0.0, 0
    for path in paths:
        for name, by_seed in json.loads(path.read_text()).items():
            results = list(by_seed.values())
            cells = [r.get(m, {}) for r in results for m in meshes]
            worst = max((c.get("error", float("inf")) for c in cells), default=float("inf"))
            costs = {m: len({r.get(m, {}).get("cost") for r in results}) for m in meshes}
            seconds = sum(r.get("cpu_s") or 0.0 for r in results)
            cpu, runs = cpu + seconds, runs + len(results)
            print(f"{name}: seeds {', '.join(by_seed)}; worst error {worst:.1e}; distinct plan costs {costs}; "
                  f"{seconds:.1f} CPU s")
    print(f"{runs} runs, {cpu:.1f} CPU s")


def write(rows: list[str], args: argparse.Namespace) -> None:
    """The "Held-back zoo (issue 25)" section of docs/benchmarks.md. Rows of models this run did not check are kept
    from the section as it was when it was run with the same seeds, meshes and extractor (so a sweep can go in
    batches); the command then names every model in the table."""
    table, options = merged_rows(BENCHMARKS, "Held-back zoo (issue 25)", rows, args, MODELS)
    passed = sum("| passes" in line for line in table.values())
    body = "\n".join(rows[:2] + list(table.values())) + (
        f"\n\n{passed} of {len(table)} pass: imported with `from_torch`, optimized on {' and '.join(args.meshes)} "
        f"with the {args.extractor} extractor under PYTHONHASHSEED {', '.join(map(str, args.seeds))} (one process "
        "each), simulated and compared with eager PyTorch (1e-4 of the largest output), the plan's cost the same "
        f"under every seed. `plan shards` is `tapestry import-report`'s (seed {args.seeds[0]}): the share of the "
        "FLOPs each run pays that the plan splits over devices, and the FLOPs of its prepared steps (made from "
        "static inputs alone, run once ahead of time) where it has some; `optimize s` its planning time on the "
        "shared 2-core machine (load "
        f"{os.getloadavg()[0]:.0f} at the last row written); `opaque ops` run whole through torch.")
    write_section("Held-back zoo (issue 25)", f"python benchmarks/heldback_zoo.py {' '.join(table)} {options} --write",
                  body, BENCHMARKS)


if __name__ == "__main__":
    main()
