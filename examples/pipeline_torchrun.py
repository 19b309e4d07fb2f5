"""Train a small LLaMA-style decoder pipelined over the ranks, one stage per rank:

    torchrun --nproc-per-node 2 examples/pipeline_torchrun.py --steps 20 --schedule 1f1b
    torchrun --nproc-per-node 4 examples/pipeline_torchrun.py --schedule interleaved --chunks 2
    python examples/pipeline_torchrun.py --nproc 2 --plan        # no torchrun; stages chosen by plan_pipeline

The model is `tapestry.models.llama_decoder` (embedding, LLaMA blocks, RMSNorm, LM head; random weights). With
`--plan`, rank 0's `tapestry.plan_pipeline` prices the layers, the embedding and the head (`pipeline.model_steps`)
for an H100 cluster and chooses the schedule, micro-batches and layers per stage; every rank makes the same plan
(it is deterministic), and the step runs it. Otherwise `--schedule` and `--micro-batches` say what runs. Rank 0
prints one line per step: `step <i> loss <loss>`.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import tapestry
from tapestry.models import llama_decoder
from tapestry.pipeline import Schedule, model_steps

VOCAB, SEQ, BATCH, LAYERS = 96, 16, 8, 8


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch i, the same on every rank: arithmetic progressions modulo VOCAB as (ids, next-token labels)."""
    generator = torch.Generator().manual_seed(i)
    start, stride = torch.randint(0, VOCAB, (2, BATCH, 1), generator=generator)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def planned(model: torch.nn.Module, ranks: int) -> tapestry.pipeline.PipelinePlan:
    from tapestry.cost import DefaultCostModel, load_profile

    steps = model_steps(model, batch(0), loss_fn)
    result = tapestry.plan_pipeline(steps.layer, steps.layers, tapestry.Mesh(ranks), global_batch=BATCH,
                                    cost_model=DefaultCostModel(load_profile("gpu-h100-cluster")), stages=(ranks,),
                                    micro_batch_sizes=(1, 2), memory_budget=None, pareto_points=1,
                                    budget=tapestry.Budget(seconds=20), first=steps.first, last=steps.last)
    return result.plan


def train(steps: int, schedule: str, micro_batches: int, chunks: int, plan: bool) -> list[float]:
    """On every rank: build the pipelined step, train `steps` steps; the losses."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # under torchrun: from its environment
    ranks, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = llama_decoder(VOCAB, dim=64, layers=LAYERS)
    pipeline = planned(model, ranks) if plan else Schedule(schedule, ranks, micro_batches, chunks)
    if rank == 0 and plan:
        print(pipeline.describe(), flush=True)
    step = tapestry.parallelize_step(model, loss_fn, batch(0), optimizer=torch.optim.AdamW, lr=3e-3,
                                     weight_decay=0.01, max_norm=1.0, pipeline=pipeline)
    losses = []
    for i in range(steps):
        loss = step(*batch(i))
        losses.append(loss.item())
        if rank == 0:
            print(f"step {i} loss {loss.item():.6f}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved"))
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=1, help="chunks per rank (interleaved: 2 or more)")
    parser.add_argument("--plan", action="store_true", help="let plan_pipeline choose the schedule and stages")
    parser.add_argument("--nproc", type=int, help="start this many local ranks (without torchrun)")
    args = parser.parse_args()
    run = (args.steps, args.schedule, args.micro_batches, args.chunks, args.plan)
    if args.nproc:
        tapestry.launch(train, *run, nproc=args.nproc)
    else:
        train(*run)


if __name__ == "__main__":
    main()
