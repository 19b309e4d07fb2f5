"""Fusion pricing against inductor on this CPU: a LLaMA block's RMSNorm and SiLU gate, eager vs torch.compile.

The chain `rms_norm(x) * w` and `silu(gate) * up` (float32, `--tokens` x `--hidden`, MLP width `--mlp`) is
imported with `tapestry.from_torch`, planned on one device, and priced with the `cpu-gloo` profile twice: each
step its own kernel (`DefaultCostModel(fuse=False)`) and fusion groups as one kernel (`cost.fusion`). The same
torch function is timed eager (each op its own kernel, every intermediate in memory) and compiled whole by
torch.compile (inductor), one thread, median of `--repeats` calls after warm-up. The ratios compiled/eager and
fused/unfused are what the fusion model claims. Writes the "Fusion pricing on CPU" section.

    python benchmarks/fusion.py                 # 4096 x 1024, MLP 2816
    python benchmarks/fusion.py --quick         # a small width, to check the script
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _report import write_section


def block(hidden: int) -> Any:
    import torch

    class NormGate(torch.nn.Module):
        """LLaMA's RMSNorm (float32 here: the CPU runs no bfloat16 fast) and SiLU-gated MLP product."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(hidden) + 0.5)

        def forward(self, x: Any, gate: Any, up: Any) -> tuple[Any, Any]:
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
            return normed, torch.nn.functional.silu(gate) * up

    return NormGate()


def timed(fn: Any, args: tuple[Any, ...], repeats: int) -> float:
    for _ in range(3):
        fn(*args)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--mlp", type=int, default=2816)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.hidden, args.mlp, args.repeats = 256, 128, 256, 5
    import torch

    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile, plan_cost
    from tapestry.cost.fusion import fusion_groups
    from tapestry.plan import build_plan

    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = block(args.hidden)
    inputs = (torch.randn(args.tokens, args.hidden), torch.randn(args.tokens, args.mlp),
              torch.randn(args.tokens, args.mlp))
    graph = tapestry.from_torch(module, inputs, verbose=False).graph
    plan = build_plan(graph, tapestry.Mesh(1))
    profile = load_profile("cpu-gloo")
    fused, alone = plan_cost(plan, DefaultCostModel(profile)), plan_cost(plan, DefaultCostModel(profile, fuse=False))
    kernels = [s for s in plan.steps if hasattr(s, "kernel") and not s.signature.kernel.is_view]
    groups = fusion_groups(plan)

    with torch.no_grad():
        eager = timed(module, inputs, args.repeats)
        compiled_fn = torch.compile(module)
        compiled = timed(compiled_fn, inputs, args.repeats)
        for got, want in zip(compiled_fn(*inputs), module(*inputs)):
            torch.testing.assert_close(got, want)

    rows = [
        "| | eager / each step alone | torch.compile / fused | ratio |",
        "|---|---:|---:|---:|",
        f"| measured, ms (median of {args.repeats}, 1 thread) | {eager * 1e3:.2f} | {compiled * 1e3:.2f} | "
        f"{compiled / eager:.2f} |",
        f"| predicted (`cpu-gloo`), ms | {alone * 1e3:.2f} | {fused * 1e3:.2f} | {fused / alone:.2f} |",
        f"| predicted / measured | {alone / eager:.2f} | {fused / compiled:.2f} | |",
    ]
    body = "\n".join([
        f"`rms_norm(x) * w` and `silu(gate) * up`, float32, x {args.tokens} x {args.hidden}, gate and up "
        f"{args.tokens} x {args.mlp}, imported with `from_torch` into {len(kernels)} kernels, "
        f"{len(groups)} fusion group(s) (`cost.fusion`), priced with the `cpu-gloo` profile "
        f"({profile.device.mem_bandwidth / 1e9:.1f} GB/s, {profile.device.launch_overhead * 1e6:.1f} µs a launch); "
        "measured eager (one torch kernel per op) and compiled by torch.compile (inductor) on this machine's "
        "CPU, one thread.", "", *rows, "",
    ])
    print(body)
    if not args.no_write and not args.quick:
        write_section("Fusion pricing on CPU", "python benchmarks/fusion.py", body)


if __name__ == "__main__":
    main()
