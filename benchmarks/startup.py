"""Where a start of the training example spends its CPU, per rank and phase (docs/benchmarks.md, "Start-up of the
training example"): CPU seconds, not wall clock, so that other load on the machine does not count.

    S=$(mktemp -d); export TORCHINDUCTOR_CACHE_DIR=$S/inductor TAPESTRY_PLAN_CACHE=$S/plans
    torchrun --nproc-per-node 2 benchmarks/startup.py             # cold (then again: warm)
    torchrun --nproc-per-node 2 benchmarks/startup.py --dynamo    # the rank program through torch.compile instead

It builds examples/train_torchrun.py's step eager (imports, the model, the traced step, the plan, lowering), then
compiles the rank's program alone: `make_fx`, then tapestry's `compiled` (inductor's standalone_compile) or, with
--dynamo, torch.compile of the same graph (what tapestry did before). Children: g++ of inductor's kernels.
"""
from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_torchrun as example  # noqa: E402

import tapestry  # noqa: E402
from tapestry.spmd.trace import compiled, place  # noqa: E402
from tapestry.training import LR  # noqa: E402


def cpu() -> tuple[float, float]:
    """CPU seconds of this process and of its waited-for children (g++)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dynamo", action="store_true", help="compile with torch.compile(graph, fullgraph=True)")
    args = parser.parse_args()
    torch._inductor.config.compile_threads = 1  # kernels compiled in the rank itself: their g++ is its children
    phases: list[tuple[str, float, float]] = []
    mark = (0.0, 0.0)  # the process's start: the first phase is the imports above

    def phase(name: str) -> None:
        nonlocal mark
        now = cpu()
        phases.append((name, now[0] - mark[0], now[1] - mark[1]))
        mark = now

    phase("imports (torch, transformers, tapestry, the example)")
    model = example.build_model()
    phase("build the model")
    batch = next(iter(example.loader(0, 1)))
    step = tapestry.parallelize_step(model, example.loss_fn, batch, optimizer=torch.optim.AdamW, lr=example.PEAK_LR,
                                     weight_decay=0.01, max_norm=1.0, compile=False, verbose=False,
                                     extractor="greedy-dag", time_limit=30.0)  # the example's defaults
    phase("parallelize_step, eager (trace, plan, lower, place)")
    program, fn = step.program, step.program.function
    names = step.imported.translation.user_inputs
    inputs = {**dict(zip(names, batch)), LR: torch.tensor(example.PEAK_LR, dtype=torch.float64)}
    buffers = {**program._state, **place(program.program, program.rank, inputs, program.device, only=inputs)}
    if args.dynamo:
        blocks = [buffers[name] for name in fn.inputs]
        graph = make_fx(fn.flat, tracing_mode="fake")(*blocks)
        phase("make_fx")
        torch.compile(graph, fullgraph=True, dynamic=False)(*blocks)
        phase("torch.compile and the first call")
    else:
        compiled(fn)(buffers)
        phase("make_fx, standalone_compile and the first call")
    dist.barrier()
    for name, own, children in phases:
        print(f"rank {dist.get_rank()}: {name}: {own:.1f} s CPU" + (f", children {children:.1f} s" if children else ""),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
