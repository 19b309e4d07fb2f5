"""Persistent runtime benchmark: the MLP 256-1024-1024-256 served and trained by Tapestry's plan on N gloo ranks.

    torchrun --nproc-per-node 2 benchmarks/runtime.py          # and --nproc-per-node 4

Inference: a fresh batch of 256 every call. Tapestry's plan (tapestry.parallelize's parts: the plan from
spmd.planning, a ParallelProgram compiled whole, and eager) on N ranks, against the module eager and
torch.compile'd in one process (rank 0, one thread, while the other ranks wait). Per call: the mean over `--calls`
calls between two barriers. Start-up, separately: import (from_torch), planning cold (a fresh plan cache) and warm
(the cache hit), lowering and placing, and the first call's trace and compile, cold (a fresh inductor cache) and
warm (torch._dynamo.reset(), then inductor's on-disk cache, as a second start finds it). Every rank uses one
thread. Training: AdamW steps under DDP, FSDP2 (fully_shard per layer), DTensor tensor parallel (column, row,
column) and, where `tapestry.parallelize_step` exists, Tapestry's plan, one after another in the same run, with
the losses against one device. Writes the "Persistent runtime (N gloo ranks)" section of docs/benchmarks.md from rank 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

SCRATCH = tempfile.mkdtemp(prefix="tapestry-runtime-bench-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(SCRATCH) / "inductor")  # cold compile: a fresh inductor cache
os.environ["TAPESTRY_PLAN_CACHE"] = str(Path(SCRATCH) / "plans")  # cold planning: a fresh plan cache

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section  # noqa: E402

import tapestry  # noqa: E402
from tapestry.lower import Comm  # noqa: E402
from tapestry.spmd.planning import shared_plan  # noqa: E402
from tapestry.spmd.program import ParallelProgram, join_group  # noqa: E402

T = TypeVar("T")
DIMS = (256, 1024, 1024, 256)
BATCH = 256


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(DIMS, DIMS[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            x = layer(x) if k == len(self.layers) - 1 else torch.relu(layer(x))
        return x


def clocked(fn: Callable[[], T]) -> tuple[T, float]:
    """fn's result and the seconds it took."""
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def per_call(call: Callable[[torch.Tensor], object], batches: list[torch.Tensor], everyone: bool) -> float:
    """Mean seconds per call over `batches`, between barriers (`everyone`: all ranks call; else rank 0 alone)."""
    for x in batches[:3]:  # warm-up
        if everyone or dist.get_rank() == 0:
            call(x)
    dist.barrier()
    start = time.perf_counter()
    if everyone or dist.get_rank() == 0:
        for x in batches:
            call(x)
    dist.barrier()
    return (time.perf_counter() - start) / len(batches)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def reference_losses(batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> list[float]:
    """One device: the module, AdamW, every whole batch."""
    torch.manual_seed(0)
    module = MLP()
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = mse(module(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def torch_step(kind: str, lr: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A training step of the same MLP under DDP, FSDP2 (fully_shard) or DTensor tensor parallel; the loss of the
    whole batch, on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    module = MLP()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    if kind == "DDP":
        model: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(module)
    elif kind == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        for layer in module.layers:
            fully_shard(layer, mesh=mesh)
        model = fully_shard(module, mesh=mesh)
    else:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = parallelize_module(module, mesh, {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel(),
                                                  "layers.2": ColwiseParallel(output_layouts=Replicate())})
        share = slice(0, BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = mse(model(x[share]), y[share])
        loss.backward()
        opt.step()
        if kind != "TP":  # each rank's loss is the mean of its share: the whole batch's is their mean
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        return loss.detach()

    return step


def training(steps: int, lr: float) -> tuple[list[str], dict[str, float], dict[str, float]]:
    """Step times (mean over `steps`, after 3 warm-up steps) and the largest loss difference from one device."""
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(BATCH, DIMS[0], generator=gen), torch.randn(BATCH, DIMS[-1], generator=gen))
               for _ in range(steps + 3)]
    want = reference_losses(batches, lr)
    makers: dict[str, Callable[[], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = {
        kind: (lambda kind=kind: torch_step(kind, lr)) for kind in ("DDP", "FSDP2", "TP")}
    notes = []
    if hasattr(tapestry, "parallelize_step"):
        def tapestry_step() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
            torch.manual_seed(0)
            return tapestry.parallelize_step(MLP(), mse, batches[0], mesh=tapestry.Mesh(dist.get_world_size()),
                                             optimizer=torch.optim.AdamW, lr=lr, weight_decay=0.01)
        makers["Tapestry plan"] = tapestry_step
    else:
        notes.append("Tapestry's training step is not measured: `tapestry.parallelize_step` is not on this branch.")
    times, errors = {}, {}
    for name, make in makers.items():
        step = make()
        losses = [float(step(x, y)) for x, y in batches[:3]]
        dist.barrier()
        start = time.perf_counter()
        losses += [float(step(x, y)) for x, y in batches[3:]]
        dist.barrier()
        times[name] = (time.perf_counter() - start) / steps
        errors[name] = max(abs(a - b) for a, b in zip(losses, want))
    return notes, times, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--steps", type=int, default=20, help="training steps per strategy")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    join_group(int(os.environ.get("WORLD_SIZE", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = MLP().eval()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(BATCH, DIMS[0], generator=gen) for _ in range(args.calls)]
    mesh = tapestry.Mesh(world)
    start: dict[str, float] = {}

    imported, start["import (from_torch)"] = clocked(lambda: tapestry.from_torch(module, (batches[0],), verbose=False))
    graph = imported.graph
    state = {name: dict(module.named_parameters())[name].detach() for name in imported.translation.state}
    cold, start["planning, cold (fresh plan cache)"] = clocked(lambda: shared_plan(graph, mesh, verbose=False))
    plan, start["planning, warm (plan cache hit)"] = clocked(lambda: shared_plan(graph, mesh, verbose=False))
    assert cold.to_json() == plan.to_json()
    program, start["lower, place weights, prepare"] = clocked(lambda: ParallelProgram(plan, state))
    _, start["first call: trace + compile, cold (fresh inductor cache)"] = clocked(lambda: program(batches[0]))
    torch._dynamo.reset()
    again = ParallelProgram(plan, state)
    _, start["first call: trace + compile, warm (inductor's cache)"] = clocked(lambda: again(batches[0]))
    eager = ParallelProgram(plan, state, compile=False)

    with torch.no_grad():
        want = module(batches[0])
        got = program(batches[0])[imported.translation.outputs[0]]
        error = (got - want).abs().max().item()
        compiled_module = torch.compile(module)
        rows = {
            "eager, one process": per_call(module, batches, everyone=False),
            "torch.compile, one process": per_call(compiled_module, batches, everyone=False),
            f"Tapestry plan, {world} ranks, compiled whole": per_call(lambda x: program(x), batches, True),
            f"Tapestry plan, {world} ranks, eager": per_call(lambda x: eager(x), batches, True),
        }
    notes, step_times, loss_errors = training(args.steps, 1e-3)
    starts = [None] * world
    dist.all_gather_object(starts, start)
    if rank != 0:
        dist.destroy_process_group()
        return
    best = min(rows.values())
    comms = [f"{s.kind} of {s.src}" for s in program.program.ranks[0].steps if isinstance(s, Comm)]
    lines = [
        f"MLP {'-'.join(map(str, DIMS))}, batch {BATCH} (a fresh batch every call), float32, {world} gloo ranks of "
        f"one thread on this machine ({os.cpu_count()} cores); {args.calls} calls per row.",
        "",
        f"The plan: {len(plan.steps)} steps; rank 0's communication per call: {', '.join(comms) or 'none'}. "
        f"Largest difference from the module: {error:.1e}.",
        "",
        "| inference | ms per call | x best |",
        "|---|---:|---:|",
        *(f"| {name} | {t * 1e3:.2f} | {t / best:.2f} |" for name, t in rows.items()),
        "",
        "| start-up (slowest rank) | seconds |",
        "|---|---:|",
        *(f"| {name} | {max(s[name] for s in starts):.2f} |" for name in start),
        "",
        f"Training: one AdamW step (lr 1e-3, weight decay 0.01, MSE loss) on a fresh batch of {BATCH} per step, "
        f"{args.steps} steps after 3 warm-up steps; the loss of the whole batch on every rank, against one device.",
        "",
        "| training step | ms per step | x best | largest loss difference from one device |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {t * 1e3:.2f} | {t / min(step_times.values()):.2f} | {loss_errors[name]:.1e} |"
          for name, t in step_times.items()),
        *(["", *notes] if notes else []),
        "",
        "Peak memory per rank is not reported: on the CPU there is no allocator counter to read it from.",
        "",
        "Before this runtime, `run_plan` spawned new ranks on every call: 14.9 s per inference call of this MLP on 2 "
        "ranks (issue 26).",
    ]
    body = "\n".join(lines)
    if args.no_write:
        print(body)
    else:
        write_section(f"Persistent runtime ({world} gloo ranks)",
                      f"torchrun --nproc-per-node {world} benchmarks/runtime.py", body)
        print(body)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
