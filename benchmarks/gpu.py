"""GPU benchmark: on one GPU, the unsharded plan against eager torch and torch.compile of the same module, and the
cost model's per-kernel predictions against the kernels' measured times.

Workloads at sizes that keep a GPU busy (hidden 4096, 8192 tokens), in float32 and bfloat16. The three contenders
run in one process, interleaved run by run in a rotating order, each run timed from an idle GPU to its outputs
computed (torch.cuda.synchronize at both ends). Ours is the plan lowered and run by the runtime on one nccl rank
(inductor-compiled shard kernels, per-step bookkeeping, the output gather to rank 0); eager torch and
torch.compile run the graph's kernels as one plain torch function on whole tensors. Per kernel: the runtime's own
step times (CUDA events, `RankRunner.run`) against `run_costs` under the spec-sheet profile and under the profile
`tapestry calibrate --device cuda` measured. Writes the "GPU" section of docs/benchmarks.md; --save/--load keep the
measurements, so the report can be redone without a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _report import write_section
from tapestry import dtypes
from tapestry.cost import DefaultCostModel, Profile, load_profile, run_costs
from tapestry.cost.calibrate import driver_version
from tapestry.evaluator import random_inputs
from tapestry.graph import Graph
from tapestry.importer.report import model_flops
from tapestry.lower import lower
from tapestry.models import mlp, seeds_example, transformer_block
from tapestry.plan import Compute, Plan, build_plan
from tapestry.runtime.execute import InputSource, RankRunner
from tapestry.runtime.launch import default_backend, free_port, init_group, rank_device
from tapestry.sharding import Mesh
from tapestry.zspace import ZRange

WARMUP, RUNS = 3, 20
STEP_WARMUP, STEP_REPEAT = 2, 10
DTYPES = ("float32", "bfloat16")
OURS, FUSED, EAGER, COMPILED = "unsharded plan", "optimised plan", "eager torch", "torch.compile"
SPEC = "gpu-h100-nccl"
CONTENDERS = (EAGER, COMPILED, OURS, FUSED)
RATIOS = ((OURS, EAGER), (OURS, COMPILED), (FUSED, COMPILED))
FIRST_CALLED = (OURS, FUSED, COMPILED)
MEASURED = "gpu-h100-measured"

WORKLOADS: dict[str, Callable[[str], Graph]] = {
    "seeds layer 8192x4096x4096": lambda dtype: seeds_example(8192, 4096, 4096, dtype),
    "4-layer MLP 8192x4096": lambda dtype: mlp(4, 8192, 4096, dtype),
    "transformer block 4x2048x4096, 32 heads": lambda dtype: transformer_block(4, 2048, 4096, 32, dtype),
}
SMALL: dict[str, Callable[[str], Graph]] = {  # --small: the script's own check, seconds on a CPU
    "seeds layer 64x32x32": lambda dtype: seeds_example(64, 32, 32, dtype),
    "4-layer MLP 64x32": lambda dtype: mlp(4, 64, 32, dtype),
    "transformer block 2x16x32, 4 heads": lambda dtype: transformer_block(2, 16, 32, 4, dtype),
}


def as_torch(graph: Graph) -> Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The graph as one plain torch function: each op's kernel on whole tensors, its arguments and kwargs bound
    ahead, so that torch.compile traces torch calls alone (the same work as `tapestry.runtime.eager.interpret`)."""
    calls = []
    for node in graph.ops:
        sig = graph.signature(node.name)
        pads = [_pad(p.apply(sig.index), graph[a].shape) for a, p in zip(node.args, sig.projections)]
        calls.append((node.name, sig.kernel.torch, node.args, pads, sig.call_kwargs(sig.index)))
    outputs = dict(graph.outputs)

    def run(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        env = dict(values)
        for name, fn, args, pads, kwargs in calls:
            env[name] = fn(*[env[a] if pad is None else F.pad(env[a], pad) for a, pad in zip(args, pads)], **kwargs)
        return {key: env[target] for key, target in outputs.items()}

    return run


def _pad(region: ZRange, shape: tuple[int, ...]) -> list[int] | None:
    """F.pad's list for a read that leaves the tensor (conv padding); None for a read of the whole tensor."""
    if region == ZRange.from_shape(shape):
        return None
    return [p for d in reversed(range(region.ndim)) for p in (-region.start[d], region.end[d] - shape[d])]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude of `want`, in float32."""
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(torch.finfo(torch.float32).tiny))


def _plan_runner(plan: Plan, device: torch.device) -> tuple[RankRunner, Callable[[], dict[str, torch.Tensor]]]:
    """The plan lowered for one rank, its inputs placed; each call of the function runs it once and returns its
    outputs."""
    program = lower(plan)
    runner = RankRunner(program, 0, InputSource(), True, device)
    placed, _ = runner.place()

    def run() -> dict[str, torch.Tensor]:
        buffers, _ = runner.once(placed)
        return {name: buffers[buffer] for name, buffer in program.outputs.items()}

    return runner, run


def measure_one(graph: Graph, plans: Mapping[str, Plan], device: torch.device) -> dict:
    """Interleaved runs of the contenders, their outputs' differences from eager torch, and the runtime's per-step
    times for the unsharded plan."""
    inputs = {k: dtypes.to_tensor(v).to(device) for k, v in random_inputs(graph).items()}
    module = as_torch(graph)
    runners = {label: _plan_runner(plan, device) for label, plan in plans.items()}
    contenders: dict[str, Callable[[], dict[str, torch.Tensor]]] = {label: run for label, (_, run) in runners.items()}
    contenders[EAGER] = lambda: module(inputs)
    contenders[COMPILED] = functools.partial(torch.compile(module, fullgraph=True), inputs)
    want = module(inputs)
    errors, first = {}, {}
    for label in (*plans, COMPILED):
        start = time.perf_counter()
        got = contenders[label]()  # compiles: the shard kernels, or the whole module
        _sync(device)
        first[label] = time.perf_counter() - start
        errors[label] = max(_difference(got[k], v) for k, v in want.items())
    del want, got
    labels = list(contenders)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for i in range(WARMUP + RUNS):
        for label in labels[i % len(labels):] + labels[: i % len(labels)]:
            times[label].append(_timed(contenders[label], device))
    _, report = runners[OURS][0].run(STEP_WARMUP, STEP_REPEAT)
    return {"runs": {label: t[WARMUP:] for label, t in times.items()}, "errors": errors, "first_call_seconds": first,
            "steps": [[s.step, s.label, s.kind, s.seconds] for s in report.steps],
            "wall": float(np.median(report.iterations))}


def plans_for(graph: Graph) -> dict[str, Plan]:
    """The unsharded plan (the graph's own kernels), and the one `tapestry.optimize` picks for one GPU under the
    spec-sheet profile (fused kernels), where egglog is installed."""
    plans = {OURS: build_plan(graph, Mesh(1))}
    try:
        from tapestry.optimizer import optimize
    except ModuleNotFoundError:
        return plans
    plans[FUSED] = optimize(graph, Mesh(1), cost_model=DefaultCostModel(load_profile(SPEC))).plan
    return plans


def environment(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"device": platform.processor() or platform.machine(), "torch": torch.__version__,
                "python": platform.python_version()}
    import triton
    props = torch.cuda.get_device_properties(device)
    return {"device": props.name, "memory_mib": props.total_memory >> 20, "sms": props.multi_processor_count,
            "driver": driver_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "python": platform.python_version(), "tf32": torch.backends.cuda.matmul.allow_tf32,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def measure(workloads: dict[str, Callable[[str], Graph]], save: Path | None) -> dict:
    backend = default_backend()
    device = rank_device(backend, 0)
    init_group(backend, 0, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    data: dict = {"environment": environment(device), "results": {}}
    for name, make in workloads.items():
        for dtype in DTYPES:
            graph = make(dtype)
            data["results"][f"{name}|{dtype}"] = measure_one(graph, plans_for(graph), device)
            print(f"{name} {dtype}: " + ", ".join(f"{label} {np.median(t) * 1e3:.2f} ms" for label, t in
                                                 data["results"][f"{name}|{dtype}"]["runs"].items()), flush=True)
            if save:
                save.write_text(json.dumps(data, indent=1))  # kept as it grows: a run cut short still reports
            if device.type == "cuda":
                torch.cuda.empty_cache()
    dist.destroy_process_group()
    return data


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _ratio(ours: list[float], theirs: list[float]) -> str:
    ratios = np.asarray(ours) / np.asarray(theirs)
    low, mid, high = np.percentile(ratios, [25, 50, 75])
    return f"{mid:.2f} ({low:.2f}-{high:.2f})"


def report(workloads: dict[str, Callable[[str], Graph]], data: dict, spec: Profile, measured: Profile | None) -> str:
    env = data["environment"]
    lines = [
        f"One {env['device']} ({env.get('memory_mib', '?')} MiB, driver {env.get('driver')}), torch {env['torch']}, "
        f"CUDA {env.get('cuda')}, triton {env.get('triton')}, Python {env['python']}, TF32 "
        f"{'on' if env.get('tf32') else 'off'} (torch's default: float32 matmuls in full float32); {env.get('date')}.",
        "",
        f"Runtime against plain torch: all run in one process, interleaved run by run in a rotating order "
        f"({RUNS} runs each after {WARMUP} warm-up), each run from an idle GPU to its outputs computed; medians in ms. "
        f"The plans are lowered and run by the runtime on one nccl rank (inductor-compiled shard kernels, per-step "
        f"bookkeeping, the output gather): the unsharded plan runs the graph's own kernels, the optimised plan is "
        f"`tapestry.optimize` for one device under the {SPEC} profile (fused kernels such as linear_relu). Eager "
        f"torch and torch.compile (default mode, fullgraph) run the graph's kernels as one torch function on whole "
        f"tensors. Ratios are run by run: the median and, in brackets, the middle half.",
        "",
        "| workload | dtype | GFLOP | " + " | ".join(CONTENDERS) + " | " + " | ".join(f"{a} / {b}" for a, b in RATIOS)
        + " | TFLOP/s, " + " | TFLOP/s, ".join(CONTENDERS) + " |",
        "|---|---|--:|" + "--:|" * (2 * len(CONTENDERS) + len(RATIOS)),
    ]
    graphs = {(name, dtype): make(dtype) for name, make in workloads.items() for dtype in DTYPES}
    for (name, dtype), graph in graphs.items():
        found = data["results"].get(f"{name}|{dtype}")
        if found is None:
            continue
        runs, work = found["runs"], model_flops(graph)
        med = {label: float(np.median(runs[label])) if label in runs else None for label in CONTENDERS}
        lines.append(
            f"| {name} | {dtype} | {work / 1e9:,.0f} | " + " | ".join(_ms(m) if m else "-" for m in med.values())
            + " | " + " | ".join(_ratio(runs[a], runs[b]) if a in runs and b in runs else "-" for a, b in RATIOS)
            + " | " + " | ".join(f"{work / m / 1e12:.0f}" if m else "-" for m in med.values()) + " |")
    lines += ["", "Compared with eager torch's outputs (largest difference relative to the largest output magnitude), "
              "and the first call's seconds (compiling: each plan's shard kernels with inductor, the module with "
              "torch.compile; a shard kernel already compiled for an earlier workload's same blocks is reused, and "
              "the first workload's also pays for starting inductor):", "",
              "| workload | dtype | " + " | ".join(f"max diff, {c}" for c in FIRST_CALLED) + " | "
              + " | ".join(f"first call s, {c}" for c in FIRST_CALLED) + " |",
              "|---|---|" + "--:|" * (2 * len(FIRST_CALLED))]
    for (name, dtype) in graphs:
        found = data["results"].get(f"{name}|{dtype}")
        if found is None:
            continue
        errors, first = found["errors"], found["first_call_seconds"]
        lines.append(f"| {name} | {dtype} | " + " | ".join(f"{errors[c]:.1e}" if c in errors else "-" for c in FIRST_CALLED)
                     + " | " + " | ".join(f"{first[c]:.1f}" if c in first else "-" for c in FIRST_CALLED) + " |")
    profiles = [spec, *([measured] if measured else [])]
    lines += ["", "The device profiles: the spec sheet's and what `tapestry calibrate --device cuda` measured here "
              "(float32 matmul peak; bfloat16 in its provenance):", "",
              "| | " + " | ".join(p.name for p in profiles) + " |", "|---|" + "--:|" * len(profiles)]
    rows = (("peak float32 FLOP/s (T)", lambda p: p.device.peak_flops / 1e12, "{:.1f}"),
            ("memory bandwidth (TB/s)", lambda p: p.device.mem_bandwidth / 1e12, "{:.2f}"),
            ("launch overhead per shard call (µs)", lambda p: p.device.launch_overhead * 1e6, "{:.1f}"),
            ("link alpha (µs) / beta (GB/s)", lambda p: (p.links[0].alpha * 1e6, p.links[0].beta / 1e9), None))
    for label, get, fmt in rows:
        cells = [f"{get(p)[0]:.1f} / {get(p)[1]:.0f}" if fmt is None else fmt.format(get(p)) for p in profiles]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if measured:
        half = measured.provenance.get("bfloat16_matmul_flops_by_size", {})
        if half:
            lines += ["", "bfloat16 n×n matmul, measured: " + ", ".join(
                f"n={n} {r / 1e12:.0f} TFLOP/s" for n, r in half.items()) + "; the roofline has one peak for every "
                "dtype (float32's), so it overprices bfloat16 matmuls by about the ratio of the two."]
        method = measured.provenance.get("method", "")
        if "links: " in method:
            lines += ["", f"Links: {method.split('links: ')[-1]}."]
    lines += ["", "Per kernel, float32: the runtime's step times (median of "
              f"{STEP_REPEAT} runs after {STEP_WARMUP} warm-up, CUDA events from the end of the step before to the "
              "step's own end) against the roofline's prediction (`run_costs`) under each profile; ms. Views "
              "(transpose, reshape) cost nothing in either.", "",
              "| workload | step | kernel -> output | GFLOP | MB moved | measured | " +
              " | ".join(f"{p.name}" for p in profiles) + " | " +
              " | ".join(f"measured / {p.name}" for p in profiles) + " |",
              "|---|--:|---|--:|--:|--:|" + "--:|" * (2 * len(profiles))]
    models = [DefaultCostModel(p) for p in profiles]
    totals: list[str] = []
    heavy: list[list[float]] = [[] for _ in profiles]  # measured / predicted, float32 kernels bound by flops
    light: list[list[float]] = [[] for _ in profiles]  # and those bound by memory (under the spec sheet's roofline)
    for (name, dtype), graph in graphs.items():
        found = data["results"].get(f"{name}|{dtype}")
        if found is None:
            continue
        plan = build_plan(graph, Mesh(1))
        predicted = [run_costs(plan, m) for m in models]
        compute = [(k, label, seconds) for k, label, kind, seconds in found["steps"] if kind == "compute"]
        for k, label, seconds in compute if dtype == "float32" else []:
            step = plan.steps[k]
            assert isinstance(step, Compute)
            sig = step.signature
            if sig.kernel.is_view:
                continue
            work, moved = sig.cost(sig.index)
            guesses = [p[k] for p in predicted]
            bound = work / spec.device.peak_flops > moved / spec.device.mem_bandwidth
            for kept, guess in zip(heavy if bound else light, guesses):
                kept.append(seconds / guess)
            lines.append(f"| {name} | {k} | {sig.kernel.name} -> {'x'.join(map(str, sig.output_shape))} | "
                         f"{work / 1e9:,.1f} | {moved / 1e6:,.0f} | {_ms(seconds)} | " +
                         " | ".join(_ms(g) for g in guesses) + " | " +
                         " | ".join(f"{seconds / g:.2f}" if g else "-" for g in guesses) + " |")
        measured_sum = sum(s for _, _, s in compute)
        guesses = [sum(p[k] for k, _, _ in compute) for p in predicted]
        totals.append(f"| {name} | {dtype} | {_ms(measured_sum)} | {_ms(found['wall'])} | " +
                      " | ".join(_ms(g) for g in guesses) + " | " +
                      " | ".join(f"{measured_sum / g:.2f}" for g in guesses) + " |")
    lines += ["", "All compute steps together, and the run's wall time (ms):", "",
              "| workload | dtype | compute, measured | wall, measured | " +
              " | ".join(f"compute, {p.name}" for p in profiles) + " | " +
              " | ".join(f"measured / {p.name}" for p in profiles) + " |",
              "|---|---|--:|--:|" + "--:|" * (2 * len(profiles)), *totals]
    return "\n".join(lines + ["", *reading(data, profiles, heavy, light)])


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f} to {max(values):.2f}" if values else "none"


def reading(data: dict, profiles: list[Profile], heavy: list[list[float]], light: list[list[float]]) -> list[str]:
    """What the tables say, computed from them: the ranges of the run-by-run ratios and of measured / predicted."""
    lines = ["In short:", ""]
    for dtype in DTYPES:
        found = [r for key, r in data["results"].items() if key.endswith(f"|{dtype}")]
        ratio = {(a, b): [float(np.median(np.asarray(r["runs"][a]) / np.asarray(r["runs"][b]))) for r in found
                          if a in r["runs"] and b in r["runs"]] for a, b in ((OURS, EAGER), (OURS, COMPILED))}
        lines.append(f"- {dtype}: the unsharded plan takes {_spread(ratio[OURS, EAGER])} times eager torch's time and "
                     f"{_spread(ratio[OURS, COMPILED])} times torch.compile's (median run-by-run ratios per workload).")
    lines.append("- The runtime compiles each shard kernel on its own, fusing only what the plan fuses (linear_relu); "
                 "torch.compile compiles the whole graph and can fuse across ops (a softmax with its scale, a norm with "
                 "its neighbours).")
    for profile, big, small in zip(profiles, heavy, light):
        lines.append(f"- float32 kernels, measured / predicted under {profile.name}: {_spread(big)} for those the "
                     f"roofline calls bound by flops ({len(big)}), {_spread(small)} for those bound by memory "
                     f"({len(small)}).")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured-profile", default=MEASURED, help="the profile calibrate measured (name or path)")
    parser.add_argument("--save", type=Path, help="write the measurements here (JSON), as they are made")
    parser.add_argument("--load", type=Path, help="report these saved measurements instead of measuring")
    parser.add_argument("--small", action="store_true", help="tiny sizes, any device: a check of the script itself")
    args = parser.parse_args()
    workloads = SMALL if args.small else WORKLOADS
    data = json.loads(args.load.read_text()) if args.load else measure(workloads, args.save)
    try:
        measured: Profile | None = load_profile(args.measured_profile)
    except (ValueError, FileNotFoundError):
        measured = None
    body = report(workloads, data, load_profile(SPEC), measured)
    print(body)
    if not args.small:
        write_section("GPU", "tapestry calibrate --device cuda -o src/tapestry/profiles/gpu-h100-measured.json && "
                      "python benchmarks/gpu.py", body)


if __name__ == "__main__":
    main()
