"""Pipelined training steps run (issue 24, item 3): step time on 2 and 4 gloo ranks against one process.

A LLaMA-style decoder (`tapestry.models.llama_decoder`: embedding, `--layers` blocks, final norm, LM head), one
AdamW step over a global batch of `--batch` sequences of `--seq` tokens, cut into one stage per rank by
`tapestry.parallelize_step(..., pipeline=Schedule(...))` (torch.distributed.pipelining's tracer and schedules),
against the same step in plain torch in one process. Every process runs torch on one thread (so one rank is one
core's worth of compute, as one process is). Each row is the median over `--steps` timed steps after
`--warmup`, each step starting at a barrier, a step's time the slowest rank's; the losses of the timed steps
are checked against the one-process run's (the max difference is reported). Writes the "Pipelined steps run"
section of docs/benchmarks.md.

With `--stage-plans` (default megatron,zero3,planned), 4 ranks also run 2 stages over axis 0 of a 2x2 mesh, each
stage's layers on its 2 ranks under a stage plan (spmd/stage_plan.py): training.plans' Megatron tensor parallel
or ZeRO-3 for one block's step (`pipeline.layer_step`), or the one `plan_pipeline` chooses on 2x2 with the
`cpu-gloo` profile; each scheduled (1F1B) by the pipeline model.

    python benchmarks/pipeline_run.py                     # 2 and 4 ranks, GPipe, 1F1B and interleaved
    python benchmarks/pipeline_run.py --quick             # a small model, 2 and 4 ranks, to check the script
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import tapestry
from tapestry.models import llama_decoder
from tapestry.pipeline import Schedule
from tapestry.spmd.launch import launch

from _report import write_section


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator),
             torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator))
            for _ in range(args.warmup + args.steps)]


def model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    return llama_decoder(args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, hidden=4 * args.dim)


def timed(step: Any, data: list[tuple[torch.Tensor, torch.Tensor]], warmup: int) -> tuple[list[float], list[float]]:
    """Each step's seconds (the slowest rank's) and loss, the warm-up steps left out."""
    seconds, losses = [], []
    for k, (ids, labels) in enumerate(data):
        dist.barrier()
        start = time.perf_counter()
        loss = step(ids, labels)
        took = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if k >= warmup:
            seconds.append(float(took))
            losses.append(float(loss))
    return seconds, losses


def one_process(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    torch.set_num_threads(1)
    module = model(args)
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr)

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = cross_entropy(module(ids), labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return timed(step, batches(args), args.warmup)


def pipelined(args: argparse.Namespace, schedule: Any) -> tuple[list[float], list[float]]:
    torch.set_num_threads(1)
    data = batches(args)
    step = tapestry.parallelize_step(model(args), cross_entropy, data[0], optimizer=torch.optim.AdamW, lr=args.lr,
                                     pipeline=schedule)
    return timed(step, data, args.warmup)


def stage_planned(args: argparse.Namespace, which: str) -> tuple[str, Any]:
    """A pipeline plan of 2 stages x 2 devices (mesh 2x2, stages over axis 0) whose stage plan is `which`
    ("megatron", "zero3", or "planned": plan_pipeline's choice), and a few words on that stage plan."""
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.importer.zoo import LlamaBlock
    from tapestry.pipeline import MIXED, layer_cost, layer_step, model_steps
    from tapestry.pipeline.planner import best_configuration
    from tapestry.spmd.stage_plan import layer_placements
    from tapestry.training.plans import megatron, zero3

    from pipeline import hidden_dims, user_inputs

    mesh, micro = tapestry.Mesh(2, 2), args.batch // args.micro_batches
    cost_model = DefaultCostModel(load_profile("cpu-gloo"))
    if which == "planned":
        steps = model_steps(model(args), batches(args)[0], cross_entropy)
        plan = tapestry.plan_pipeline(steps.layer, steps.layers, mesh, global_batch=args.batch, cost_model=cost_model,
                                      stages=(2,), micro_batch_sizes=(micro,), schedules=("1f1b",),
                                      memory_budget=None, pareto_points=1, budget=tapestry.Budget(seconds=30),
                                      first=steps.first, last=steps.last).plan
        name = "plan_pipeline's"
    else:
        block = LlamaBlock(args.dim, args.heads, 4 * args.dim)
        graph = layer_step(block, torch.zeros(micro, args.seq, args.dim))
        layer_plan = megatron(graph, tapestry.Mesh(2), hidden_dims(graph)) if which == "megatron" \
            else zero3(graph, tapestry.Mesh(2), user_inputs(graph))
        link = cost_model.profile.axis_links(mesh.shape)[0]
        plan = best_configuration(layer_cost(layer_plan, cost_model), args.layers, mesh, 0, 2, args.micro_batches,
                                  MIXED, link, None, ("1f1b",), stage_plan=layer_plan, micro_batch=micro)
        name = {"megatron": "Megatron TP", "zero3": "ZeRO-3"}[which]
    placed = layer_placements(plan.layer_plan, LlamaBlock(args.dim, args.heads, 4 * args.dim))
    split = sum(any(p.is_shard() for p in v) for v in placed.weights.values())
    gathered = sum(placed.computed[k] != v for k, v in placed.weights.items())
    whole = all(p.is_replicate() for p in placed.activation)
    return (f"{name}: {split} of {len(placed.weights)} weights split, {gathered} gathered for use, input "
            f"{'whole' if whole else 'split'}"), plan


def schedules(ranks: int, names: list[str], micro_batches: int) -> list[Schedule]:
    found = []
    for name in names:
        if name == "interleaved":
            if micro_batches % ranks == 0:
                found.append(Schedule(name, ranks, micro_batches, 2))
        else:
            found.append(Schedule(name, ranks, micro_batches))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--stage-plans", default="megatron,zero3,planned",
                        help="2 stages x 2 devices on 4 ranks under these stage plans ('' for none)")
    parser.add_argument("--quick", action="store_true", help="a small model on 2 ranks; no docs written")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.layers, args.dim, args.vocab, args.batch, args.seq, args.steps = "2", 4, 32, 64, 8, 16, 3
        args.micro_batches = 4
    ranks = [int(r) for r in args.ranks.split(",")]

    base_seconds, base_losses = launch(one_process, args, nproc=1, timeout=1800)[0]
    base = statistics.median(base_seconds)
    params = sum(p.numel() for p in model(args).parameters())
    rows = [f"| one process (torch eager) | 1 | — | — | {base * 1e3:.1f} | 1.00 | — |"]
    print(rows[-1], flush=True)
    for world in ranks:
        for schedule in schedules(world, args.schedules.split(","), args.micro_batches):
            per_rank = launch(pipelined, args, schedule, nproc=world, timeout=1800)
            seconds, losses = per_rank[-1]
            median = statistics.median(seconds)
            drift = max(abs(a - b) for a, b in zip(losses, base_losses))
            name = schedule.name + (f" (v={schedule.chunks})" if schedule.chunks > 1 else "")
            rows.append(f"| {name} | {world} | {schedule.micro_batches} x {args.batch // schedule.micro_batches} | "
                        f"{schedule.bubble:.0%} | {median * 1e3:.1f} | {base / median:.2f} | {drift:.1e} |")
            print(rows[-1], flush=True)
    for which in filter(None, args.stage_plans.split(",")):
        described, plan = stage_planned(args, which)
        per_rank = launch(pipelined, args, plan, nproc=4, timeout=1800)
        seconds, losses = per_rank[-1]
        median = statistics.median(seconds)
        drift = max(abs(a - b) for a, b in zip(losses, base_losses))
        s = plan.schedule
        rows.append(f"| {s.name}, 2 stages x 2 devices ({described}) | 4 | {s.micro_batches} x "
                    f"{args.batch // s.micro_batches} | {s.bubble:.0%} | {median * 1e3:.1f} | {base / median:.2f} | "
                    f"{drift:.1e} |")
        print(rows[-1], flush=True)
    if args.quick:
        return
    body = (
        f"A LLaMA-style decoder (`tapestry.models.llama_decoder`: embedding {args.vocab} x {args.dim}, {args.layers} "
        f"blocks of width {args.dim} with {args.heads} heads and MLP {4 * args.dim}, RMSNorm, LM head; "
        f"{params / 1e6:.1f}M parameters), one AdamW step of {args.batch} sequences x {args.seq} tokens, float32, "
        f"cut into one stage per gloo rank by `tapestry.parallelize_step(..., pipeline=Schedule(...))` "
        f"(torch.distributed.pipelining's tracer and schedules; layers split evenly, the embedding on the first stage, "
        f"the head and loss on the last), against the same step in torch in one process. One torch thread per process. "
        f"Median of {args.steps} steps after {args.warmup} of warm-up, each from a barrier, the slowest rank's time. "
        f"`loss drift`: the largest difference of a timed step's loss from the one-process run's. Measured on the "
        f"2-core machine shared with other jobs (load {os.getloadavg()[0]:.0f}): more ranks than cores time-share "
        f"them, so the 4-rank rows measure overheads, not a 4-core speed-up. `2 stages x 2 devices`: mesh 2x2, the "
        f"stages over axis 0, each stage's layers on its 2 ranks as DTensors in a stage plan's layouts "
        f"(spmd/stage_plan.py): training.plans' Megatron tensor parallel or ZeRO-3 for one block's step, or the one "
        f"`plan_pipeline` chose on 2x2 with the `cpu-gloo` profile; the layers per stage as the pipeline model "
        f"balanced them, 1F1B; attention runs as its math decomposition there (DTensor has no rule for torch's CPU "
        f"flash kernel).\n\n"
        "| schedule | ranks | micro-batches x size | bubble (ideal) | ms/step | speed-up | loss drift |\n"
        "|---|---:|---|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")
    command = "python benchmarks/pipeline_run.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "quick"
        and v != parser.get_default(k))
    write_section("Pipelined steps run", command.strip(), body)


if __name__ == "__main__":
    main()
