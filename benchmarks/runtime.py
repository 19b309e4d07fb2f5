"""Persistent runtime benchmark: a model served and trained by Tapestry's plan on N gloo ranks.

    torchrun --nproc-per-node 2 benchmarks/runtime.py [--model mlp|gpt2|llama_block]     # and --nproc-per-node 4

Models (issue 26): the MLP 256-1024-1024-256 (the default), a 2-layer GPT-2 (its last hidden state) and a LLaMA-style
decoder block (tapestry.importer.zoo.LlamaBlock), each with an MSE loss against a random target.

Inference: a fresh batch of 256 every call. Tapestry's plan (tapestry.parallelize's parts: the plan from
spmd.planning, a ParallelProgram compiled whole, and eager) on N ranks, against the module eager and
torch.compile'd in one process (rank 0, one thread, while the other ranks wait). Per call: the mean over `--calls`
calls between two barriers. Start-up, separately: import (from_torch), planning cold (a fresh plan cache) and warm
(the cache hit), lowering and placing, and the first call's trace and compile, cold (a fresh inductor cache) and
warm (torch._dynamo.reset(), then inductor's on-disk cache, as a second start finds it). Every rank uses one
thread. Training: AdamW steps under DDP, FSDP2 (fully_shard per layer), DTensor tensor parallel (column, row,
column, where the model's layers allow it) and Tapestry's plan, one after another in the same run, with the losses
against one device and the peak memory per rank (torch.profiler's allocation events). Writes the "Persistent runtime (N gloo ranks)" section of docs/benchmarks.md from rank 0 (the
MLP's; another model's is "Persistent runtime, MODEL (N gloo ranks)").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from tapestry.importer.zoo import LlamaBlock  # noqa: E402
from tapestry.lower import Comm  # noqa: E402
from tapestry.spmd.planning import shared_plan  # noqa: E402
from tapestry.spmd.program import ParallelProgram, join_group  # noqa: E402
from tapestry.testing.reference import torch_losses  # noqa: E402

T = TypeVar("T")
DIMS = (256, 1024, 1024, 256)
BATCH = 256
TOKENS, WIDTH, HEADS = 32, 64, 4  # the GPT-2 and the LLaMA block: 8 sequences of 32 tokens, width 64, 4 heads
SEQUENCES = 8


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(DIMS, DIMS[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            x = layer(x) if k == len(self.layers) - 1 else torch.relu(layer(x))
        return x


class GPT2Hidden(torch.nn.Module):
    """A 2-layer GPT-2 (transformers, random weights, no dropout): token ids -> its last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2Model

        self.gpt2 = GPT2Model(GPT2Config(n_layer=2, n_embd=WIDTH, n_head=HEADS, vocab_size=2 * WIDTH,
                                         n_positions=TOKENS, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt2(ids, use_cache=False).last_hidden_state


def _tensor_parallel_mlp() -> dict[str, object]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel(),
            "layers.2": ColwiseParallel(output_layouts=Replicate())}


@dataclass(frozen=True)
class Model:
    """One benchmarked model: built alike (seed 0) for every strategy, a batch and its MSE target, the submodules
    FSDP2 shards one by one (then the root), and DTensor's tensor-parallel plan or why there is none."""

    title: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    units: Callable[[torch.nn.Module], list[torch.nn.Module]]
    tensor_parallel: Callable[[], dict[str, object]] | str


MODELS = {
    "mlp": Model(f"MLP {'-'.join(map(str, DIMS))}, batch {BATCH}", MLP,
                 lambda gen: (torch.randn(BATCH, DIMS[0], generator=gen),
                              torch.randn(BATCH, DIMS[-1], generator=gen)),
                 lambda m: list(m.layers), _tensor_parallel_mlp),
    "gpt2": Model(f"GPT-2 (transformers GPT2Model, 2 layers, width {WIDTH}, {HEADS} heads, vocabulary {2 * WIDTH}), "
                  f"{SEQUENCES} sequences of {TOKENS} tokens, MSE of the last hidden state", GPT2Hidden,
                  lambda gen: (torch.randint(0, 2 * WIDTH, (SEQUENCES, TOKENS), generator=gen),
                               torch.randn(SEQUENCES, TOKENS, WIDTH, generator=gen)),
                  lambda m: list(m.gpt2.h),
                  "not applicable: GPT-2's projections are transformers' Conv1D, which DTensor's ColwiseParallel and "
                  "RowwiseParallel do not take (nn.Linear and nn.Embedding only)"),
    "llama_block": Model(f"LLaMA block (tapestry.importer.zoo.LlamaBlock: RMSNorm, causal attention, SiLU-gated MLP; "
                         f"width {WIDTH}, {HEADS} heads, hidden {2 * WIDTH}), {SEQUENCES} sequences of {TOKENS} tokens",
                         lambda: LlamaBlock(WIDTH, HEADS, 2 * WIDTH),
                         lambda gen: (torch.randn(SEQUENCES, TOKENS, WIDTH, generator=gen),
                                      torch.randn(SEQUENCES, TOKENS, WIDTH, generator=gen)),
                         lambda m: [],
                         "not applicable on the CPU: with Megatron's split (q, k, v, gate, up by columns, o, down by "
                         "rows) as local tensors the block's reshape into heads uses the whole width, and as DTensors "
                         "attention stops: \"Operator aten._scaled_dot_product_flash_attention_for_cpu.default does "
                         "not have a sharding strategy registered\" (torch 2.13)"),
}


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


def reference_losses(model: Model, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> list[float]:
    """One device: the module, AdamW, every whole batch."""
    torch.manual_seed(0)
    module = model.build()
    return torch_losses(module, torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.01), mse, batches)


def torch_step(model: Model, kind: str, lr: float, batch: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A training step of the same model under DDP, FSDP2 (fully_shard) or DTensor tensor parallel; the loss of
    the whole batch (`batch` rows), on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    module = model.build()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    share = slice(rank * batch // world, (rank + 1) * batch // world)
    if kind == "DDP":
        wrapped: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(module)
    elif kind == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        for unit in model.units(module):
            fully_shard(unit, mesh=mesh)
        wrapped = fully_shard(module, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import parallelize_module

        assert callable(model.tensor_parallel), model.tensor_parallel
        wrapped = parallelize_module(module, mesh, model.tensor_parallel())
        share = slice(0, batch)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=lr, weight_decay=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = mse(wrapped(x[share]), y[share])
        loss.backward()
        opt.step()
        if kind != "TP":  # each rank's loss is the mean of its share: the whole batch's is their mean
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        return loss.detach()

    return step


def training(model: Model, steps: int, lr: float
             ) -> tuple[list[str], dict[str, float], dict[str, float], dict[str, int]]:
    """Per strategy: the median step time over `steps` steps after 3 warm-up steps, the strategies interleaved step
    by step in a rotating order (so that the shared machine's load falls on all alike), the largest loss difference
    from one device, and the peak bytes of the third warm-up step (`peak_allocated`)."""
    gen = torch.Generator().manual_seed(2)
    batches = [model.batch(gen) for _ in range(steps + 3)]
    rows = len(batches[0][0])
    want = reference_losses(model, batches, lr)
    kinds = ("DDP", "FSDP2", "TP") if callable(model.tensor_parallel) else ("DDP", "FSDP2")
    makers: dict[str, Callable[[], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = {
        kind: (lambda kind=kind: torch_step(model, kind, lr, rows)) for kind in kinds}
    notes = [] if callable(model.tensor_parallel) else [f"DTensor tensor parallel: {model.tensor_parallel}."]

    def tapestry_step() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        return tapestry.parallelize_step(model.build(), mse, batches[0], mesh=tapestry.Mesh(dist.get_world_size()),
                                         optimizer=torch.optim.AdamW, lr=lr, weight_decay=0.01, verbose=False)
    makers["Tapestry plan"] = tapestry_step
    made, losses, peaks = {}, {}, {}
    for name, make in makers.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            made[name] = make()
            losses[name] = [float(made[name](x, y)) for x, y in batches[:2]]
            last_warmup = time.time_ns()
            losses[name].append(float(made[name](*batches[2])))
        peaks[name] = peak_allocated(prof, last_warmup)
    seconds: dict[str, list[float]] = {name: [] for name in made}
    names = list(made)
    for i, (x, y) in enumerate(batches[3:]):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            losses[name].append(float(made[name](x, y)))
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
    times = {name: statistics.median(s) for name, s in seconds.items()}
    errors = {name: max(abs(a - b) for a, b in zip(losses[name], want)) for name in made}
    return notes, times, errors, peaks


def peak_allocated(prof: torch.profiler.profile, since_ns: int) -> int:
    """The most bytes live at once from `since_ns` on, of all allocated since the profile began (the model built,
    wrapped or planned, its optimizer state, a step's activations): CPU allocations have no allocator counter, but
    the profiler's allocation events carry the running total of what it saw allocated and not freed."""
    def walk(events):  # noqa: ANN001, ANN202 - the profiler's private event tree
        for event in events:
            yield event
            yield from walk(event.children)

    from torch._C._profiler import _EventType

    allocations = sorted((e.start_time_ns, e.typed[1].total_allocated, e.typed[1].alloc_size)
                         for e in walk(prof.profiler.kineto_results.experimental_event_tree())
                         if e.tag == _EventType.Allocation)
    _, first_total, first_size = allocations[0]
    base = first_total - first_size  # the running total counts what earlier profiles left: start from it
    before = [total for at, total, _ in allocations if at < since_ns][-1:]
    return max(before + [total for at, total, _ in allocations if at >= since_ns]) - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--steps", type=int, default=50, help="training steps per strategy")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    join_group(int(os.environ.get("WORLD_SIZE", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = MODELS[args.model]
    torch.manual_seed(0)
    module = model.build().eval()
    gen = torch.Generator().manual_seed(1)
    batches = [model.batch(gen)[0] for _ in range(args.calls)]
    mesh = tapestry.Mesh(world)
    start: dict[str, float] = {}

    imported, start["import (from_torch)"] = clocked(lambda: tapestry.from_torch(module, (batches[0],), verbose=False))
    graph = imported.graph
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    state = {name: tensors[name].detach() for name in imported.translation.state}
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
    notes, step_times, loss_errors, step_peaks = training(model, args.steps, 1e-3)
    peaks = [None] * world
    dist.all_gather_object(peaks, step_peaks)
    starts = [None] * world
    dist.all_gather_object(starts, start)
    if rank != 0:
        dist.destroy_process_group()
        return
    best = min(rows.values())
    comms = [f"{s.kind} of {s.src}" for s in program.program.ranks[0].steps if isinstance(s, Comm)]
    lines = [
        f"{model.title} (a fresh batch every call), float32, {world} gloo ranks of "
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
        f"Training: one AdamW step (lr 1e-3, weight decay 0.01, MSE loss) on a fresh batch per step, "
        f"{args.steps} steps after 3 warm-up steps, the strategies interleaved step by step in a rotating order, "
        f"each step timed between barriers (median); the loss of the whole batch on every rank, against one device.",
        "",
        "| training step | ms per step | x best | peak MiB per rank (largest) | largest loss difference from one "
        "device |",
        "|---|---:|---:|---:|---:|",
        *(f"| {name} | {t * 1e3:.2f} | {t / min(step_times.values()):.2f} | "
          f"{max(p[name] for p in peaks) / 2**20:.2f} | {loss_errors[name]:.1e} |" for name, t in step_times.items()),
        *(["", *notes] if notes else []),
        "",
        "Peak memory per rank: the most bytes live at once during the third step, of all allocated since the "
        "strategy began to be built (the module, its wrapping or plan, optimizer state, activations), read from "
        "torch.profiler's allocation events (profile_memory; on the CPU there is no allocator counter); the largest "
        "rank's.",
    ]
    if args.model == "mlp":
        lines += ["", "Before this runtime, `run_plan` spawned new ranks on every call: 14.9 s per inference call of "
                  "this MLP on 2 ranks (issue 26)."]
    body = "\n".join(lines)
    if args.no_write:
        print(body)
    else:
        which = "" if args.model == "mlp" else f", {args.model}"
        option = "" if args.model == "mlp" else f" --model {args.model}"
        extra = "".join(f" --{k} {getattr(args, k)}" for k in ("calls", "steps")
                        if getattr(args, k) != parser.get_default(k))
        write_section(f"Persistent runtime{which} ({world} gloo ranks)",
                      f"torchrun --nproc-per-node {world} benchmarks/runtime.py{option}{extra}", body)
        print(body)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
