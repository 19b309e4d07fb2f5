"""Train a small LLaMA-style model with Tapestry's plan under torchrun, one process per rank:

    torchrun --nproc-per-node 2 examples/train_torchrun.py --steps 20 --checkpoint ckpt/
    torchrun --nproc-per-node 2 examples/train_torchrun.py --steps 40 --checkpoint ckpt/ --resume
    python examples/train_torchrun.py --nproc 2 --steps 20        # no torchrun: tapestry.launch starts the ranks

The model is transformers' LlamaForCausalLM from a tiny config (random weights, nothing downloaded). A DataLoader
hands every rank the same global batch, a new one each step; the step runs AdamW with warm-up and cosine decay
and gradient clipping; every --save-every steps the state is saved with torch.distributed.checkpoint (sharded where
the plan shards it), and --resume continues from the latest checkpoint, on this or another number of ranks.
Rank 0 prints one line per step: `step <i> loss <loss> lr <lr>`.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers

import tapestry

VOCAB, SEQ, BATCH = 96, 16, 8
PEAK_LR, WARMUP = 3e-3, 3


def build_model() -> torch.nn.Module:
    """The same weights on every rank (seeded): LLaMA with rotary embeddings, grouped-query attention, RMSNorm."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config).eval()  # eval: no dropout (it would train: docs/training.md)


class Sequences(torch.utils.data.Dataset):
    """Sequence i: tokens of an arithmetic progression modulo VOCAB with a step and start drawn from seed i, as
    (input ids, next-token labels); a model learns to continue them."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, stride = torch.randint(0, VOCAB, (2,), generator=torch.Generator().manual_seed(i))
        tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        return tokens[:-1], tokens[1:]


def loader(first_step: int, last_step: int) -> torch.utils.data.DataLoader:
    """Batches first_step .. last_step - 1, the same on every rank (so a resumed run sees what it would have)."""
    return torch.utils.data.DataLoader(Sequences(), batch_size=BATCH,
                                       sampler=range(first_step * BATCH, last_step * BATCH))


def loss_fn(output: transformers.modeling_outputs.CausalLMOutputWithPast, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), labels.flatten())


def lr_at(step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, total - WARMUP)
    return PEAK_LR * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def latest(checkpoints: Path) -> Path | None:
    """The latest whole checkpoint: a rank killed during dcp.save leaves a folder without the `.metadata` that
    dcp.save writes last, after every rank's shards."""
    saved = sorted((p for p in checkpoints.glob("step-*") if (p / ".metadata").exists()),
                   key=lambda p: int(p.name.split("-")[1]))
    return saved[-1] if saved else None


def train(steps: int, stop: int | None, checkpoints: Path | None, save_every: int, resume: bool, compile: bool,
          extractor: str, time_limit: float) -> list[float]:
    """On every rank: build the step, resume, train to `steps` (or `stop`), checkpoint. Returns the losses."""
    # mesh: every rank of the group (tapestry opens it from torchrun's environment); Mesh(2, 2) etc. for more axes
    step = tapestry.parallelize_step(build_model(), loss_fn, next(iter(loader(0, 1))), optimizer=torch.optim.AdamW,
                                     lr=PEAK_LR, weight_decay=0.01, max_norm=1.0, compile=compile,
                                     extractor=extractor, time_limit=time_limit)
    rank, first = dist.get_rank(), 0
    found = latest(checkpoints) if resume and checkpoints else None
    if found is not None:
        state = {**step.state_dict(), "trainer": {"step": 0}}
        dcp.load(state, checkpoint_id=found)  # resharded onto this run's plan and ranks
        step.load_state_dict(state)
        first = state["trainer"]["step"]
        if rank == 0:
            print(f"resumed from {found} at step {first}", flush=True)
    losses = []
    for i, (ids, labels) in enumerate(loader(first, min(steps, stop or steps)), first):
        loss = step(ids, labels, lr=lr_at(i, steps))
        losses.append(loss.item())
        if rank == 0:
            print(f"step {i} loss {loss.item():.6f} lr {lr_at(i, steps):.6f}", flush=True)
        if checkpoints is not None and (i + 1) % save_every == 0:
            dcp.save({**step.state_dict(), "trainer": {"step": i + 1}}, checkpoint_id=checkpoints / f"step-{i + 1}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="train up to this step (the schedule's length)")
    parser.add_argument("--stop", type=int, help="stop before this step, as if interrupted")
    parser.add_argument("--checkpoint", type=Path, help="directory of the checkpoints (step-N/)")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--eager", action="store_true", help="run each rank's program eager (not compiled by inductor)")
    parser.add_argument("--nproc", type=int, help="start this many local ranks (without torchrun)")
    parser.add_argument("--extractor", default="greedy-dag", help="tapestry.optimize's extractor (ilp: the best "
                        "plan the time limit finds; greedy-dag: a steady plan fast)")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds for planning")
    args = parser.parse_args()
    run = (args.steps, args.stop, args.checkpoint, args.save_every, args.resume, not args.eager, args.extractor,
           args.time_limit)
    if args.nproc:
        tapestry.launch(train, *run, nproc=args.nproc)
    else:
        train(*run)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
