"""Pipeline benchmark (issue 24, item 3): a 70B-width LLaMA training step planned with pipeline parallelism.

80 LLaMA blocks (`importer.zoo.LlamaBlock` at LLaMA-2 70B's width: hidden 8192, MLP 28672, 64 heads; multi-head
attention where LLaMA-2 70B has 8 KV heads, so 78B parameters), one Adam step of `--global-batch` sequences of
`--seq` tokens, on an 8x8 mesh of H100s (`gpu-h100-cluster`: NVLink in a node, InfiniBand across). One layer's
step is imported on the meta device (`pipeline.layer_step`), and `tapestry.plan_pipeline` plans it on each
stage's sub-mesh and chooses stages, schedule, micro-batches and recomputation under 80 GB per device with
mixed precision (16 bytes per parameter). Beside it, the hand recipes priced by the same model from their own
layer plans (tapestry.training.plans): Megatron-LM's (tensor parallel 8 in the node, pipeline over the 8 nodes),
tensor parallel 8 x data parallel 8 with gradient accumulation, and FSDP (ZeRO-3) over all 64.
Writes the "Pipeline" section of docs/benchmarks.md and docs/img/pipeline-70b.png.

    python benchmarks/pipeline.py                       # 70B width, 8x8
    python benchmarks/pipeline.py --quick               # a small width on 2x4, to check the script
"""
from __future__ import annotations

import argparse
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from _report import write_section

PROFILE = "gpu-h100-cluster"
WIDTHS = {"70B": (8192, 28672, 64), "7B": (4096, 11008, 32), "tiny": (256, 512, 4)}
PICTURE = Path(__file__).resolve().parent.parent / "docs" / "img" / "pipeline-70b.png"


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def layer_builder(width: str, seq: int, kv_heads: int | None = None) -> Any:
    """Micro-batch size -> one block's training step (bfloat16, meta device), imported once per size."""
    import torch

    from tapestry.importer.zoo import LlamaBlock
    from tapestry.pipeline import layer_step

    hidden, mlp, heads = WIDTHS[width]
    made: dict[int, Any] = {}

    def build(micro_batch: int) -> Any:
        if micro_batch not in made:
            with torch.device("meta"):
                block = LlamaBlock(hidden, heads, mlp, kv_heads).to(torch.bfloat16)
            x = torch.zeros(micro_batch, seq, hidden, dtype=torch.bfloat16, device="meta")
            made[micro_batch] = layer_step(block, x)
        return made[micro_batch]

    return build


def layer_arguments(parser: argparse.ArgumentParser) -> None:
    """The one-layer scripts' shared arguments: the layer `layer_builder` builds and its micro-batch."""
    parser.add_argument("--width", default="7B")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")


def user_inputs(graph: Any) -> list[str]:
    return [n.name for n in graph.inputs if n.name not in graph.carried.values() and n.name not in graph.static
            and n.name != "lr"]


def hidden_dims(graph: Any) -> dict[str, int]:
    """Megatron's split of each block weight: column-parallel q, k, v, gate, up; row-parallel o, down."""
    found = {}
    for n in graph.inputs:
        if n.name.startswith("adam."):
            continue
        if re.search(r"\.(q|k|v|gate|up)\.weight$", n.name):
            found[n.name] = 0
        elif re.search(r"\.(o|down)\.weight$", n.name):
            found[n.name] = 1
    return found


def recipes(build: Any, args: argparse.Namespace, mesh: Any, model: Any) -> list[tuple[str, Any]]:
    """The hand recipes, each its layer plan priced and scheduled by the pipeline model (best schedule and the
    least recomputation that fits); a plan that cannot be built is reported, not dropped. Their layer plans are
    written for a mesh of nodes x GPUs per node: none for other meshes."""
    import tapestry
    from tapestry.pipeline import MIXED, layer_cost
    from tapestry.pipeline.planner import best_configuration
    from tapestry.training.plans import data_tensor_parallel, megatron, zero3

    if mesh.ndim != 2:
        print(f"hand recipes: written for 2-D meshes (nodes x GPUs per node), none for {mesh}", flush=True)
        return []
    nodes, per_node = mesh.shape
    link = model.profile.axis_links(mesh.shape)[0]
    found: list[tuple[str, Any]] = []
    cases = [
        (f"Megatron-LM: TP {per_node} in node, PP {nodes} across, micro-batch 1", 1, nodes,
         lambda g: megatron(g, tapestry.Mesh(per_node), hidden_dims(g)), ("1f1b", "interleaved")),
        (f"TP {per_node} x DP {nodes}, gradient accumulation, micro-batch {nodes}", nodes, 1,
         lambda g: data_tensor_parallel(g, tapestry.Mesh(nodes, per_node), user_inputs(g), hidden_dims(g)),
         ("1f1b",)),
        (f"FSDP (ZeRO-3) over {mesh.size}, gradient accumulation, micro-batch {mesh.size}", mesh.size, 1,
         lambda g: zero3(g, tapestry.Mesh(mesh.size), user_inputs(g)), ("1f1b",)),
    ]
    for name, micro, stages, make, schedules in cases:
        started = time.perf_counter()
        try:
            layer = layer_cost(make(build(micro)), model)
        except Exception as err:  # a recipe that cannot split this graph: say so in the table
            found.append((name, None, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"))
            continue
        plan = best_configuration(layer, args.layers, mesh, 0, stages, args.global_batch // micro, MIXED, link,
                                  args.memory_budget, schedules,
                                  spec_peak_flops=model.profile.device.spec_peak("bfloat16"), micro_batch=micro)
        print(f"{name}: {time.perf_counter() - started:.0f} s; {layer}", flush=True)
        found.append((name, layer, plan if plan is not None else "does not fit, even with every layer recomputed"))
    return found


def layer_row(name: str, layer: Any, micro_batch: int) -> str:
    """What one layer's plan costs per device: the numbers the pipeline is priced from."""
    ms, gib = 1e3, 2**-30
    return (f"| {name} | {micro_batch} | {layer.forward * ms:.1f} | {layer.backward * ms:.1f} | "
            f"{layer.update * ms:.1f} | {layer.reduce * ms:.1f} | {layer.params / 1e6:.0f} | "
            f"{layer.activations * gib:.2f} | {layer.working * gib:.2f} | {layer.boundary / 2**20:.0f} |")


def row(name: str, plan: Any, seconds: str = "") -> str:
    """A table row; MFU the plan's (against the spec sheet's peak, whatever profile priced the plan)."""
    if isinstance(plan, str):
        return f"| {name} | {plan} |" + " |" * 7
    s = plan.schedule
    schedule = "—" if s.stages == 1 else s.name + (f" (v={s.chunks})" if s.chunks > 1 else "")
    return (f"| {name} | {s.stages} x {plan.stage_mesh} | {schedule} | {s.micro_batches} x {plan.micro_batch} | "
            f"{sum(plan.recompute)} of {len(plan.recompute)} | {plan.cost:.2f} | "
            f"{plan.mfu:.1%} | "
            f"{plan.peak_memory / 2**30:.1f} | {seconds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", default="70B", choices=sorted(WIDTHS))
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=256, help="sequences per step")
    parser.add_argument("--micro-batches", default="1", help="micro-batch sizes (sequences) plan_pipeline tries")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="key/value heads (grouped-query attention; default: as many as query heads)")
    parser.add_argument("--memory-budget", type=float, default=80e9)
    parser.add_argument("--budget", type=float, default=30.0, help="Budget.seconds per layer plan")
    parser.add_argument("--time-limit", type=float, default=None, help="each layer extraction's time_limit (the "
                        "ILP's budget of counted work, in seconds; default plan_pipeline's LAYER_TIME_LIMIT)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", default=PROFILE, help="device profile (gpu-h100-cluster-measured: the "
                        "H100's calibrated rates)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers, args.mesh, args.seq, args.global_batch = "tiny", 8, "2x4", 128, 16
    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile

    model = DefaultCostModel(load_profile(args.profile))
    mesh = tapestry.Mesh(*(int(n) for n in args.mesh.split("x")))
    build = layer_builder(args.width, args.seq, args.kv_heads)
    sizes = tuple(int(b) for b in args.micro_batches.split(","))
    started = time.perf_counter()
    for b in sizes:
        build(b)
    imported = time.perf_counter() - started
    started, cpu_started = time.perf_counter(), time.process_time()
    result = tapestry.plan_pipeline(build, args.layers, mesh, args.global_batch, model, micro_batch_sizes=sizes,
                                    memory_budget=args.memory_budget,
                                    budget=tapestry.Budget(seconds=args.budget),
                                    **({} if args.time_limit is None else {"time_limit": args.time_limit}))
    planned, planned_cpu = time.perf_counter() - started, time.process_time() - cpu_started
    load = os.getloadavg()[0]
    print(f"plan_pipeline: {planned:.0f} s wall, {planned_cpu:.1f} CPU s, peak RSS {peak_rss() / 2**30:.2f} GiB, "
          f"load {load:.1f}", flush=True)
    print(result.explain(), flush=True)
    for c in result.candidates:  # which of the layer extraction's fits made the plan (a fusion-priced refit or not)
        if c.plan is not None and isinstance(c.plan.stage_plan, tapestry.OptimizeResult):
            notes = c.plan.stage_plan.plan.notes
            print(f"S={c.stages} layer plan: node costs {notes.get('node_costs', 'plain')}, extractor "
                  f"{notes.get('extractor_status')}", flush=True)
    hand = recipes(build, args, mesh, model)
    rows = [row("**plan_pipeline (chosen)**", result.plan, f"{planned:.0f} ({planned_cpu:.0f} CPU)")]
    rows += [row(f"plan_pipeline, best with S={c.stages}", c.plan if c.plan is not None else c.why)
             for c in result.candidates]
    rows += [row(name, plan) for name, _, plan in hand]
    micro_of = {name: micro for name, micro in zip((n for n, _, _ in hand), (1, mesh.shape[0], mesh.size))}
    layer_head = ("| layer plan | micro-batch | forward ms | backward ms | update ms (as imported) | exposed "
                  "reductions ms | parameters/device (M) | activations GiB | working GiB | input MiB (sent per hop) |")
    layer_rows = [layer_row(f"optimizer, S={c.stages} (on {c.plan.stage_mesh})", c.plan.layer, c.plan.micro_batch)
                  for c in result.candidates if c.plan is not None]
    layer_rows += [layer_row(name.split(",")[0], layer, micro_of[name]) for name, layer, _ in hand
                   if layer is not None]
    if not args.quick and not args.no_write:
        result.plan.draw(PICTURE)
    one_layer = build(sizes[0])
    params = args.layers * sum(math.prod(n.shape) for n in one_layer.inputs
                               if n.name in one_layer.carried.values() and not n.name.startswith("adam.") and n.shape)
    heads = WIDTHS[args.width][2]
    attention = "multi-head attention, where LLaMA-2 70B has 8 KV heads" if args.kv_heads in (None, heads) else \
        f"grouped-query attention, {heads} query heads over {args.kv_heads} key/value heads"
    head = ("| configuration | stages x stage mesh | schedule | micro-batches x size | recomputed layers | "
            "predicted s/step | MFU | GiB/device | plan s (CPU s) |")
    body = "\n".join([
        f"{args.layers} LLaMA blocks at the {args.width} width ({params / 1e9:.1f}B parameters: {attention}), "
        f"one Adam step of {args.global_batch} sequences x "
        f"{args.seq} tokens, mesh {args.mesh} with the `{args.profile}` profile (NVLink in 8-GPU nodes, InfiniBand "
        f"across; the pipeline runs over mesh axis 0), {args.memory_budget / 1e9:g} GB per device, mixed "
        "precision (bf16 compute, fp32 master weights and Adam moments: 16 bytes per parameter). One layer's "
        "step is imported under the meta device once per micro-batch size "
        f"({imported:.0f} s) and planned by `tapestry.optimize` once per stage sub-mesh "
        f"(`Budget(seconds={args.budget:g})`; its leaner plans, a Pareto front of up to 3, only where its "
        f"ideal time beat the best step found); `plan_pipeline` chose among stage counts, schedules and "
        f"recomputation in {planned:.0f} s wall, {planned_cpu:.0f} CPU s in all (peak RSS "
        f"{peak_rss() / 2**30:.1f} GiB), on a loaded 2-core machine (load average {load:.1f} at the end). The "
        "recipes' layer plans are "
        "training/plans.py's, priced and scheduled by the same model (their best schedule and the least "
        "recomputation that fits). MFU (`PipelinePlan.mfu`): model FLOPs (recomputation not counted) over "
        "predicted time x devices x the spec sheet's bfloat16 peak, whichever profile priced the step. Plans "
        "only: pipelined plans are not lowered to rank programs yet.",
        "",
        head, "|" + "---|" * (head.count("|") - 1), *rows,
        "",
        "What one layer's plan costs per device (per micro-batch; the update and the gradient reductions the "
        "last backward leaves exposed once per step), the numbers each row above is priced from:",
        "",
        layer_head, "|" + "---|" * (layer_head.count("|") - 1), *layer_rows,
        "",
        "The chosen plan:",
        "",
        "    " + result.explain().replace("\n", "\n    "),
        "",
        "![the chosen schedule](img/pipeline-70b.png)",
    ])
    print(body)
    if not args.no_write and not args.quick:
        command = "python benchmarks/pipeline.py" + (f" --micro-batches {args.micro_batches}"
                                                     if args.micro_batches != "1" else "")
        write_section("Pipeline", command, body)


if __name__ == "__main__":
    main()
