"""Issue 24's held-back call, timed: a Hugging Face decoder built under torch.device("meta"), its training step
imported with `from_torch`, then `tapestry.optimize(..., Mesh(8, 8), gpu-h100-nccl, memory_budget=80 GB)`.

    python benchmarks/heldback_call.py [--family llama] [--hidden 256] [--intermediate 512] [--heads 8]
        [--kv-heads 8] [--head-dim 0] [--vocab 1024] [--layers 2] [--mesh 8x8] [--batch 8] [--seq 128]
        [--budget-gb 80] [--profile gpu-h100-nccl] [--dtype float32] [--inference] [--optimizer adam|adamw|sgd]
        [--momentum 0] [--hand] [--json OUT]
    python benchmarks/heldback_call.py --table OUT     # the rows as docs/benchmarks.md's table

`--family` picks the transformers config and model class (llama, mistral, qwen2, mixtral, qwen2_moe, gemma, gemma2,
phi3, olmo, stablelm, falcon, gpt_neox, gpt2); the widths are flags, the defaults a small LLaMA. Prints import and
optimize wall and CPU seconds, peak RSS, the plan's predicted step, peak memory per device against the budget, status
and MFU; `--hand` also prices the hand plans of benchmarks/cluster.py (data parallel, ZeRO-3, Megatron, DP x TP) by the
same cost model, to judge the MFU by.
A MemoryBudgetError (or any error) is printed and recorded, not raised: the row says what failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import time
import traceback
from collections import Counter
from typing import Any

import torch
import transformers

import tapestry
from tapestry.cost import DefaultCostModel, load_profile
from tapestry.importer.report import model_flops

FAMILIES = {  # the config and model classes of each family
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "olmo": (transformers.OlmoConfig, transformers.OlmoForCausalLM),
    "stablelm": (transformers.StableLmConfig, transformers.StableLmForCausalLM),
    "falcon": (transformers.FalconConfig, transformers.FalconForCausalLM),
    "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
}
RENAMED = {  # a family's own names for the LLaMA config's widths
    "falcon": {"intermediate_size": "ffn_hidden_size", "num_key_value_heads": "num_kv_heads"},
    "qwen2_moe": {"intermediate_size": "moe_intermediate_size"},
    "gpt2": {"hidden_size": "n_embd", "intermediate_size": "n_inner", "num_hidden_layers": "n_layer",
             "num_attention_heads": "n_head", "max_position_embeddings": "n_positions"},
}


def peak_rss() -> int:
    """This process's peak resident set in bytes (/proc VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def tree() -> str:
    """The commit this row ran on, `+` when the working tree differs from it."""
    here = os.path.dirname(os.path.abspath(__file__))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True,
                           text=True)
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model on the meta device, in `args.dtype`, and a batch of token ids made on the CPU (as a user makes
    one)."""
    config_class, model_class = FAMILIES[args.family]
    widths: dict[str, Any] = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or 2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=max(2 * args.seq, 4096))
    if args.family == "mixtral":
        widths.update(num_local_experts=args.experts, num_experts_per_tok=args.top)
    if args.family == "qwen2_moe":  # its shared expert 4 routed experts wide, as Qwen1.5-MoE-A2.7B's
        widths.update(num_experts=args.experts, num_experts_per_tok=args.top,
                      shared_expert_intermediate_size=4 * widths["intermediate_size"])
    if args.family in ("gemma", "gemma2"):  # their config's head_dim (256) does not follow the width
        widths.update(head_dim=args.head_dim or args.hidden // args.heads)
    if args.family == "falcon":  # Falcon-40B's grouped-query layout, where the KV heads are a flag
        widths.update(new_decoder_architecture=True)
    if args.family in ("gpt_neox", "gpt2"):  # multi-head attention only (no KV-head flag)
        widths.pop("num_key_value_heads")
    widths = {RENAMED.get(args.family, {}).get(name, name): value for name, value in widths.items()}
    with torch.device("meta"):
        model = model_class(config_class(**widths)).to(getattr(torch, args.dtype))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    return model, ids


def call(args: argparse.Namespace) -> dict[str, Any]:
    """The held-back call, with what it reads (plan.cost, peak_memory) and what judges it; an error is a row."""
    model, ids = build(args)
    row: dict[str, Any] = {"args": vars(args), "load": os.getloadavg()[0], "tree": tree()}

    def loss(module: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return module(input_ids=ids, labels=labels, use_cache=False).loss

    wall, cpu = time.perf_counter(), time.process_time()
    if args.inference:
        imported = tapestry.from_torch(model.eval(), (ids,), {"use_cache": False}, verbose=False)
    else:
        imported = tapestry.from_torch(model, (ids, ids), verbose=False,
                                       training=training(args, loss))
    row.update(import_s=time.perf_counter() - wall, import_cpu_s=time.process_time() - cpu,
               ops=len(imported.graph.ops))
    print(f"import: {row['import_s']:.1f} s wall, {row['import_cpu_s']:.1f} s CPU, {row['ops']} ops", flush=True)
    mesh = tapestry.Mesh(*(int(n) for n in args.mesh.split("x")))
    profile = load_profile(args.profile)
    cost_model = DefaultCostModel(profile)
    budget = int(args.budget_gb * 10**9)
    flops = model_flops(imported.graph)
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        search = {} if args.search_seconds is None else {"budget": tapestry.Budget(seconds=args.search_seconds)}
        search.update({} if args.extractor is None else {"extractor": args.extractor})
        result = tapestry.optimize(imported.graph, mesh=mesh, memory_budget=budget, cost_model=cost_model, **search)
    except Exception as err:
        traceback.print_exc()
        row.update(error=f"{type(err).__name__}: {err}", optimize_s=time.perf_counter() - wall,
                   optimize_cpu_s=time.process_time() - cpu)
        print(f"optimize raised after {row['optimize_s']:.1f} s wall, {row['optimize_cpu_s']:.1f} s CPU: "
              f"{row['error'][:2000]}", flush=True)
    else:
        row.update(optimize_s=time.perf_counter() - wall, optimize_cpu_s=time.process_time() - cpu,
                   cost=result.plan.cost, peak_memory=result.peak_memory, fits=result.peak_memory <= budget,
                   status=result.status, gap=result.gap, extractor=result.selection.extractor,
                   replicated=result.replicated_share, exchanges=exchanges(result.plan),
                   mfu=profile.device.mfu(flops, result.plan.cost, mesh.size, args.dtype))
        print(f"optimize: {row['optimize_s']:.1f} s wall, {row['optimize_cpu_s']:.1f} s CPU", flush=True)
        print(f"plan: {row['cost'] * 1e3:.2f} ms predicted (MFU {row['mfu']:.1%}), "
              f"{row['peak_memory'] / 10**9:.2f} GB per device of {budget / 10**9:g} GB "
              f"({'fits' if row['fits'] else 'OVER BUDGET'}), status {row['status']} ({row['extractor']}), "
              f"{row['replicated']:.0%} of compute replicated; exchanges {row['exchanges'] or 'none'}", flush=True)
    if args.hand:
        row["hand"] = hand(imported, mesh, cost_model, flops, args.dtype)
    row["rss"] = peak_rss()
    print(f"peak RSS {row['rss'] / 2**30:.2f} GiB", flush=True)
    return row


def exchanges(plan: Any) -> dict[str, int]:
    """The plan's expert-parallel steps (`Compute.exchange`), counted by kernel, mesh axes and group size (trees
    before gep24's groups have no `exchange_group`)."""
    from tapestry.plan import Compute

    found = Counter(f"{s.kernel} over {list(s.exchange)}" + (f" in groups of {s.exchange_group}"
                                                             if getattr(s, "exchange_group", 0) else "")
                    for s in plan.steps if isinstance(s, Compute) and s.exchange)
    return dict(sorted(found.items()))


def training(args: argparse.Namespace, loss: Any) -> tapestry.Training:
    """The step's optimizer from the flags (Adam by default, as the held-back call's)."""
    options: dict[str, Any] = {"momentum": args.momentum} if args.optimizer == "sgd" else {}
    return tapestry.Training(loss=loss, optimizer=args.optimizer, lr=1e-4, **options)


def hand(imported: Any, mesh: Any, cost_model: Any, flops: float, dtype: str) -> dict[str, Any]:
    """benchmarks/cluster.py's hand plans for this graph on as many devices, each (ms, GB per device, MFU)."""
    from cluster import Case, hand_plans

    case = Case("7B", 0, "training", "x".join(map(str, mesh.shape)), 0, 0)  # hand_plans reads the mesh only
    errors: dict[str, str] = {}
    device = cost_model.profile.device
    found = {name: (t * 1e3, m / 10**9, device.mfu(flops, t, mesh.size, dtype) if t == t else math.nan)
             for name, (t, m) in hand_plans(imported, case, cost_model, errors).items()}
    for name, (ms, gb, mfu) in found.items():
        print(f"  hand {name}: {ms:.2f} ms, {gb:.2f} GB per device, MFU {mfu:.1%}", flush=True)
    return {"plans": found, "errors": errors}


def command(args: dict[str, Any], defaults: dict[str, Any]) -> str:
    """The command line that makes a row: the flags that differ from the defaults."""
    flags = []
    for name, value in args.items():
        if name in ("json", "table") or value == defaults[name] and name not in ("layers", "mesh"):
            continue
        flag = "--" + name.replace("_", "-")
        if name == "inference":
            flags.append("--inference" if value else "--training")
        else:
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            flags.append(flag if value is True else f"{flag} {shown}")
    return " ".join(["python benchmarks/heldback_call.py", *flags])


def table(rows: list[dict[str, Any]], defaults: dict[str, Any]) -> str:
    """The rows as docs/benchmarks.md's table: one command per row, what the call returned, the load it ran at."""
    head = ("| command | tree | load | import s (CPU) | optimize s wall (CPU) | RSS GiB | returns | predicted ms | "
            "MFU | GB/device (budget) | status | replicated | best hand in budget: ms (MFU) | vs best hand |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        a = r["args"]
        hands = [(ms, name, mfu) for name, (ms, gb, mfu) in r.get("hand", {}).get("plans", {}).items()
                 if ms == ms and gb <= a["budget_gb"]]
        best = min(hands, default=None)
        first = (f"| `{command(a, defaults)}` | {r.get('tree', '—')} | {r['load']:.1f} | "
                 f"{r['import_s']:.1f} ({r['import_cpu_s']:.1f}) | "
                 f"{r['optimize_s']:.0f} ({r['optimize_cpu_s']:.0f}) | {r['rss'] / 2**30:.2f} |")
        against = "—" if best is None or "cost" not in r else f"{r['cost'] * 1e3 / best[0]:.2f}"
        refused = ", ".join(r.get("hand", {}).get("errors", {}))
        none = f"none (refused: {refused}) | — |" if refused else "— | — |"
        hand_cells = none if best is None else f"{best[1]} {best[0]:.1f} ({best[2]:.1%}) | {against} |"
        if "error" in r:
            lines.append(first + f" **{r['error'][:400]}** | — | — | — ({a['budget_gb']:g}) | — | — | "
                         f"{hand_cells}")
            continue
        lines.append(first + f" yes | {r['cost'] * 1e3:.2f} | {r['mfu']:.1%} | {r['peak_memory'] / 10**9:.2f} "
                     f"({a['budget_gb']:g}{'' if r['fits'] else ', OVER'}) | {r['status']} ({r['extractor']}) | "
                     f"{r['replicated']:.0%} | {hand_cells}")
    return "\n".join(lines)


def arguments() -> argparse.ArgumentParser:
    """The call's flags (benchmarks/tied_fits.py takes them too)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=0, help="MLP width (per expert); 0: twice --hidden")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=0, help="0: as many as --heads")
    parser.add_argument("--head-dim", type=int, default=0, help="gemma, gemma2: per head; 0: --hidden / --heads")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8, help="mixtral, qwen2_moe: experts per layer")
    parser.add_argument("--top", type=int, default=2, help="mixtral, qwen2_moe: experts per token")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--budget-gb", type=float, default=80.0, help="memory_budget, in 10**9 bytes per device")
    parser.add_argument("--search-seconds", type=float, help="tapestry.Budget(seconds=...): the search's work counts "
                        "(default: Budget()'s)")
    parser.add_argument("--extractor", help="tapestry.optimize's extractor (default: its own, the ILP)")
    parser.add_argument("--profile", default="gpu-h100-nccl")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    step = parser.add_mutually_exclusive_group()
    step.add_argument("--training", dest="inference", action="store_false", help="an Adam step (the default)")
    step.add_argument("--inference", action="store_true", help="the forward pass only")
    parser.set_defaults(inference=False)
    parser.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd"))
    parser.add_argument("--momentum", type=float, default=0.0, help="sgd: torch.optim.SGD's momentum")
    parser.add_argument("--hand", action="store_true", help="also price cluster.py's hand plans")
    parser.add_argument("--json", help="append the row to this JSON list")
    parser.add_argument("--table", help="print the rows of this JSON list (--json) as a markdown table, and stop")
    return parser


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f), vars(parser.parse_args([]))))
        return
    row = call(args)
    if args.json:
        rows = json.loads(open(args.json).read()) if os.path.exists(args.json) else []
        with open(args.json, "w") as f:
            json.dump([*rows, row], f, indent=1, default=str)


if __name__ == "__main__":
    main()
