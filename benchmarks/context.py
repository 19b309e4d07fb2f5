"""Context parallelism (issue 24, item 5): a LLaMA-7B-width decoder block at long sequences, on 8 and 64 H100s.

Per case (sequence length; mesh 8, 2x4, 8x8): the plan the search chooses with ring attention available, its
attention split (`ring(query/8)` is ring attention; `split(query/8)` with the keys whole is all-gather context
parallelism), its
context-parallel degree (the devices splitting attention's queries), predicted time and peak memory per device,
beside the best plan the search finds with attention's ring removed from the kernel registry (so attention splits
only as it could before: queries with the keys whole, heads, batch), and the hand recipe, Megatron tensor
parallelism over all devices (training.plans.megatron), priced by the same cost model. Inference, batch 1,
bfloat16, causal attention, built on the meta device. Each variant runs in its own spawned process (removing the
ring edits that process's registry only). Writes the "Context parallelism" section of docs/benchmarks.md.

    python benchmarks/context.py            # 2K-128K tokens on 8, 2x4 and 8x8
    python benchmarks/context.py --quick    # one small case, to check the script

With --training: one Adam step of the same block (MSE loss), attention fused (kernels/flash.py: the forward and the
backward each one kernel, each with its ring), 8K-128K tokens on 8x8, the search beside the search with both fused
kernels' ring candidates removed. Writes the "Context parallelism in training" section.

    python benchmarks/context.py --training           # 8K, 32K and 128K tokens on 8x8
    python benchmarks/context.py --training --quick   # 8K tokens on 2x4, to check the script
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import time
from typing import Any

from _report import write_section

PROFILE = "gpu-h100-nccl"
HIDDEN, HEADS, MLP = 4096, 32, 11008  # LLaMA-2 7B
HAND_NOTE = ("On 8x8 the hand plan is Megatron over all 64 devices (hand plans are priced on the flat mesh, as in "
             "benchmarks/cluster.py): 32 heads cannot split 64 ways, so its attention runs whole on every device; "
             "the hand recipe for that mesh, TP 8 in a node times CP 8 across (torchtitan's), is not built here.")


def block_graph(seq: int) -> Any:
    import torch

    import tapestry
    from tapestry.importer.zoo import LlamaBlock

    with torch.device("meta"):
        module = LlamaBlock(HIDDEN, HEADS, MLP).to(torch.bfloat16).eval()
    x = torch.zeros(1, seq, HIDDEN, dtype=torch.bfloat16, device="meta")
    return tapestry.from_torch(module, (x,), verbose=False).graph


def training_graph(seq: int) -> Any:
    import torch

    import tapestry
    from tapestry.importer.zoo import LlamaBlock

    with torch.device("meta"):
        module = LlamaBlock(HIDDEN, HEADS, MLP).to(torch.bfloat16)
    x = torch.zeros(1, seq, HIDDEN, dtype=torch.bfloat16, device="meta")

    def loss(m: Any, x: Any, y: Any) -> Any:
        return torch.nn.functional.mse_loss(m(x), y)

    return tapestry.from_torch(module, (x, x), training=tapestry.Training(loss=loss, optimizer="adam", lr=1e-4),
                               verbose=False).graph


def attention_split(plan: Any, kernel: str = "sdpa") -> tuple[str, int]:
    """What the attention step (of `kernel`) splits (its index dims cut by its blocks; `ring(...)` when it is a
    ring step) and its context-parallel degree (how many devices split its queries)."""
    from tapestry.plan import Compute

    step = next(s for s in plan.steps if isinstance(s, Compute) and s.kernel == kernel)
    sig = step.signature
    if "query" not in sig.dims:  # a backward over keys of another length: batch dims only
        return "split(none)", 1
    held = [b for b in step.blocks if b is not None]
    cut = [f"{name}/{len({(b.start[d], b.end[d]) for b in held})}" for d, name in enumerate(sig.dims)
           if any(b.shape[d] != sig.index.shape[d] for b in held)]
    query = sig.dims.index("query")
    degree = len({(b.start[query], b.end[query]) for b in held})
    kind = "split" if not step.ring else "ring~work" if len({b.shape[query] for b in held}) > 1 else "ring"
    return f"{kind}({', '.join(cut) or 'none'})", degree


def run_training_variant(seq: int, mesh: tuple[int, ...], variant: str, queue: Any) -> None:
    """The search's training plan, with the fused attention kernels' rings or ("no ring") without."""
    import warnings

    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile, peak_memory, plan_cost

    warnings.simplefilter("ignore")
    model = DefaultCostModel(load_profile(PROFILE))
    graph = training_graph(seq)
    start = time.perf_counter()
    if variant == "no ring":  # no ring candidates; the kernels keep their meaning (the backward's rows split only
        # in a ring, so without one they stay whole)
        from tapestry.sharding import partition

        partition._ring_partitions = lambda sig, mesh, parts: []
    result = tapestry.optimize(graph, mesh=tapestry.Mesh(*mesh), cost_model=model, memory_budget=80 * 10**9)
    forward, backward = (attention_split(result.plan, k) for k in ("flash_attention", "flash_attention_backward"))
    queue.put({"seconds": plan_cost(result.plan, model), "peak": max(peak_memory(result.plan)), "split": forward[0],
               "cp": forward[1], "backward": backward[0], "backward cp": backward[1],
               "wall": time.perf_counter() - start})


def run_variant(seq: int, mesh: tuple[int, ...], variant: str, queue: Any) -> None:
    import warnings

    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile, peak_memory, plan_cost

    warnings.simplefilter("ignore")
    model = DefaultCostModel(load_profile(PROFILE))
    graph = block_graph(seq)
    start = time.perf_counter()
    if variant == "hand TP":
        from tapestry.training.plans import megatron

        hidden = {n.name: 0 if n.name.split(".")[0] in ("q", "k", "v", "gate", "up") else 1
                  for n in graph.inputs if n.name.endswith(".weight") and "norm" not in n.name}
        try:
            plan = megatron(graph, tapestry.Mesh(math.prod(mesh)), hidden)
        except Exception as err:  # e.g. more devices than heads: say so in the table
            queue.put({"error": f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"})
            return
        split = attention_split(plan)
    else:
        if variant == "no ring":
            from dataclasses import replace

            from tapestry.kernels import KERNELS

            KERNELS["sdpa"] = replace(KERNELS["sdpa"], ring=None)
        plan = tapestry.optimize(graph, mesh=tapestry.Mesh(*mesh), cost_model=model).plan
        split = attention_split(plan)
    queue.put({"seconds": plan_cost(plan, model), "peak": max(peak_memory(plan)), "split": split[0],
               "cp": split[1], "wall": time.perf_counter() - start})


def measure(seq: int, mesh: tuple[int, ...], variant: str, training: bool = False) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=run_training_variant if training else run_variant, args=(seq, mesh, variant, queue))
    proc.start()
    row = queue.get(timeout=1800)
    proc.join()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small case, to check the script")
    parser.add_argument("--training", action="store_true", help="training steps with fused attention instead")
    args = parser.parse_args()
    if args.training:
        training(args.quick)
        return
    cases = [(2048, (8,))] if args.quick else [(s, m) for m in ((8,), (2, 4), (8, 8))
                                               for s in (2048, 8192, 32768, 131072)]
    lines = ["| tokens | mesh | search: attention split | CP | predicted ms | peak GiB | optimize s | "
             "no ring: split | CP | ms | peak GiB | no ring / search | hand TP ms | peak GiB | hand / search |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    errors: list[str] = []
    for seq, mesh in cases:
        rows = {v: measure(seq, mesh, v) for v in ("search", "no ring", "hand TP")}
        s, n, h = rows["search"], rows["no ring"], rows["hand TP"]
        print(seq, mesh, rows, flush=True)
        if "error" in h:
            errors.append(f"hand TP on {math.prod(mesh)} devices at {seq:,} tokens: {h['error']}")
        hand = ("— | — | —" if "error" in h else
                f"{h['seconds'] * 1e3:.3f} | {h['peak'] / 2**30:.2f} | {h['seconds'] / s['seconds']:.2f}x")
        lines.append(f"| {seq:,} | {'x'.join(map(str, mesh))} | {s['split']} | {s['cp']} | {s['seconds'] * 1e3:.3f} | "
                     f"{s['peak'] / 2**30:.2f} | {s['wall']:.0f} | {n['split']} | {n['cp']} | "
                     f"{n['seconds'] * 1e3:.3f} | {n['peak'] / 2**30:.2f} | {n['seconds'] / s['seconds']:.2f}x | "
                     f"{hand} |")
    body = "\n".join([
        f"One LLaMA-7B-width decoder block (hidden {HIDDEN}, {HEADS} heads, MLP {MLP}; causal attention), "
        f"inference, batch 1, bfloat16, priced with the `{PROFILE}` profile. *search*: `tapestry.optimize` with "
        "ring attention available; *no ring*: the same search with attention's ring removed from the registry "
        "(attention can still split its queries with the keys whole, i.e. all-gather context parallelism, or its "
        "heads); *hand TP*: Megatron tensor parallelism over all the devices (training.plans.megatron). "
        "Attention split: the index dims its blocks cut and into how many parts (batch1 is the heads), `ring(...)` "
        "where it is a ring step (its keys and values passed round the devices that split its queries), "
        "`ring~work(...)` a ring whose query blocks are cut for equal causal work; CP is the number of devices "
        "splitting attention's queries. Predicted times; peak is the largest device's; optimize s is wall time on "
        "a shared 2-core machine.", "", *lines, "", *(f"- {e}" for e in errors), "", HAND_NOTE])
    if not args.quick:
        write_section("Context parallelism", "python benchmarks/context.py", body)
    print(body)


def training(quick: bool) -> None:
    cases = [(8192, (2, 4))] if quick else [(s, (8, 8)) for s in (8192, 32768, 131072)]
    lines = ["| tokens | mesh | search: forward split | backward split | CP | predicted ms | peak GiB | optimize s | "
             "no ring: forward split | backward split | CP | ms | peak GiB | no ring / search |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for seq, mesh in cases:
        s, n = (measure(seq, mesh, v, training=True) for v in ("search", "no ring"))
        print(seq, mesh, s, n, flush=True)
        lines.append(f"| {seq:,} | {'x'.join(map(str, mesh))} | {s['split']} | {s['backward']} | {s['cp']} | "
                     f"{s['seconds'] * 1e3:.3f} | {s['peak'] / 2**30:.2f} | {s['wall']:.0f} | {n['split']} | "
                     f"{n['backward']} | {n['cp']} | {n['seconds'] * 1e3:.3f} | {n['peak'] / 2**30:.2f} | "
                     f"{n['seconds'] / s['seconds']:.2f}x |")
    body = "\n".join([
        f"One Adam step (MSE loss) of a LLaMA-7B-width decoder block (hidden {HIDDEN}, {HEADS} heads, MLP {MLP}; "
        f"causal attention), batch 1, bfloat16, attention fused as the training import keeps it (flash_attention "
        f"and flash_attention_backward), priced with the `{PROFILE}` profile under an 80 GB budget. *search*: "
        "`tapestry.optimize` with both fused kernels' rings available (context parallelism in the forward and "
        "the backward); *no ring*: the same search with no ring candidates generated (the forward can still "
        "split its queries with the keys whole; the backward, whose rows split only in a ring, then splits only "
        "batch and heads). Splits as "
        "in the inference table; `ring(...)` on the backward is its gradient ring (dk, dv sums passed home with "
        "their keys). Predicted times; peak is the largest device's; optimize s is wall time on a shared 2-core "
        "machine.", "", *lines])
    if not quick:
        write_section("Context parallelism in training", "python benchmarks/context.py --training", body)
    print(body)


if __name__ == "__main__":
    main()
