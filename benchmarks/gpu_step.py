"""GPU: one LLaMA block's training step measured with torch against what the cost model predicts for it.

The Cluster section's predicted MFU rests on the roofline's prices of a LLaMA block's kernels (bfloat16 matmuls at
the tensor-core peak, flash attention, memory-bound elementwise work, the Adam update). This measures the same step
on one GPU: `importer.zoo.LlamaBlock` at a LLaMA-2 width in bfloat16, `--batch` x `--seq` tokens, MSE loss, one
torch.optim.Adam step, each phase (forward, backward, update) timed with CUDA events (median of RUNS after WARMUP),
eager and under torch.compile (the block; the optimizer eager, foreach and fused), against `cost.breakdown` of
the imported step planned whole on Mesh(1) (`build_plan`: no communication) under the `gpu-h100-cluster` profile.
Measuring needs torch and a GPU; pricing needs the optimizer's packages, so the two can run on different machines:

    python benchmarks/gpu_step.py --measure gpu_step.json     # on the GPU (writes nothing else)
    python benchmarks/gpu_step.py --load a.json b.json        # anywhere: prices the steps, a table per GPU
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from _report import write_section
from step_breakdown import PROFILE, WIDTHS, import_block

WARMUP, RUNS = 3, 10
PHASES = ("forward", "backward", "update")
PROFILES = (PROFILE, "gpu-h100-measured")  # the spec sheet, and an H100 calibrated
SIZES = (("7B", 8, 2048), ("13B", 4, 2048), ("70B", 2, 2048))  # width, batch, seq: the Cluster section's widths


def measure_step(width: str, batch: int, seq: int, compiled: bool, fused: bool) -> dict[str, float]:
    """Median seconds of each phase of one Adam step of the block on the current GPU."""
    import torch

    from tapestry.importer.zoo import LlamaBlock

    hidden, mlp, heads = WIDTHS[width]
    torch.manual_seed(0)
    block = LlamaBlock(hidden, heads, mlp).to(device="cuda", dtype=torch.bfloat16)
    run = torch.compile(block) if compiled else block
    opt = torch.optim.Adam(block.parameters(), lr=1e-4, fused=fused, foreach=None if fused else True)
    x = torch.randn(batch, seq, hidden, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    times: dict[str, list[float]] = defaultdict(list)
    for i in range(WARMUP + RUNS):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        marks[0].record()
        loss = torch.nn.functional.mse_loss(run(x), y)
        marks[1].record()
        loss.backward()
        marks[2].record()
        opt.step()
        marks[3].record()
        torch.cuda.synchronize()
        if i >= WARMUP:
            for phase, start, end in zip(PHASES, marks, marks[1:]):
                times[phase].append(start.elapsed_time(end) / 1e3)
    del block, opt, x, y, loss
    torch.cuda.empty_cache()
    return {phase: statistics.median(t) for phase, t in times.items()}


def measure(path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_step.py --measure needs a CUDA GPU")
    found: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "when": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "runs": RUNS, "warmup": WARMUP, "steps": []}
    for width, batch, seq in SIZES:
        for compiled, fused in ((False, False), (False, True), (True, True)):
            seconds = measure_step(width, batch, seq, compiled, fused)
            found["steps"].append({"width": width, "batch": batch, "seq": seq, "compiled": compiled,
                                   "fused": fused, "seconds": seconds})
            print(width, batch, seq, "compiled" if compiled else "eager", "fused" if fused else "foreach",
                  {k: f"{v * 1e3:.2f} ms" for k, v in seconds.items()}, flush=True)
            path.write_text(json.dumps(found, indent=1))  # kept as it goes: a run cut short keeps what it measured


def predicted(width: str, batch: int, seq: int) -> dict[str, tuple[dict[str, float], float]]:
    """Per profile: the cost model's seconds by phase for the step on one device, and its FLOPs at that profile's
    bfloat16 peak."""
    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.cost.breakdown import breakdown
    from tapestry.plan import build_plan

    plan = build_plan(import_block(width, batch, seq).graph, tapestry.Mesh(1))
    found = {}
    for profile in PROFILES:
        model = DefaultCostModel(load_profile(profile))
        split = breakdown(plan, model, model.profile.device)
        by_phase = dict.fromkeys(PHASES, 0.0)
        for (phase, _), seconds in split.seconds.items():
            by_phase[phase] += seconds
        found[profile] = by_phase, split.model_seconds
    return found


def table(measured: dict[str, Any]) -> str:
    spec, calibrated = PROFILES
    lines = [f"| width | batch x seq | phase | predicted ms, {spec} | predicted ms, {calibrated} | eager, foreach Adam "
             f"| eager, fused Adam | torch.compile, fused Adam | compiled / {spec} | compiled / {calibrated} |",
             "|---|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    summary = []
    for width, batch, seq in dict.fromkeys((s["width"], s["batch"], s["seq"]) for s in measured["steps"]):
        rows = {(s["compiled"], s["fused"]): s["seconds"] for s in measured["steps"]
                if (s["width"], s["batch"], s["seq"]) == (width, batch, seq)}
        prices = predicted(width, batch, seq)
        for phase in (*PHASES, "step"):
            guess = [sum(want.values()) if phase == "step" else want[phase] for want, _ in prices.values()]
            got = {k: sum(v.values()) if phase == "step" else v[phase] for k, v in rows.items()}
            compiled = got.get((True, True))
            lines.append(f"| {width} | {batch}x{seq} | {phase} | " + " | ".join(f"{g * 1e3:.2f}" for g in guess)
                         + " | " + " | ".join("" if t is None else f"{t * 1e3:.2f}" for t in (
                             got.get((False, False)), got.get((False, True)), compiled)) + " | "
                         + " | ".join("" if compiled is None else f"{compiled / g:.2f}" for g in guess) + " |")
        want, peak = prices[spec]
        best = min(sum(v.values()) for v in rows.values())
        summary.append(f"- {width}, {batch}x{seq}: predicted {sum(want.values()) * 1e3:.2f} ms a step under {spec} "
                       f"(MFU {peak / sum(want.values()):.0%} by the model), fastest measured {best * 1e3:.2f} ms "
                       f"(MFU {peak / best:.0%} of the same peak).")
    head = (f"On one {measured['device']} (torch {measured['torch']}, CUDA {measured['cuda']}, Python "
            f"{measured['python']}; {measured['when']}):")
    return "\n".join([head, "", *lines, "", *summary])


def calibration(profile: dict[str, Any]) -> str:
    """What a calibration measured, in the units people quote."""
    device, made = profile["device"], profile["provenance"]
    return (f"{device['peak_flops_by_dtype']['bfloat16'] / 1e12:.0f} TFLOP/s bfloat16 matmuls, "
            f"{device['mem_bandwidth'] / 1e12:.2f} TB/s, {device['launch_overhead'] * 1e6:.0f} µs a launch "
            f"({made['machine'].split(',')[0]}, {made['date'][:10]})")


def report(measured: list[dict[str, Any]], recalibrated: list[Path]) -> str:
    from tapestry.cost import load_profile

    spec, calibrated = PROFILES
    shipped = load_profile(calibrated).to_json()
    again = "".join(f"; `tapestry calibrate --device cuda` run again ({path}): "
                    f"{calibration(json.loads(path.read_text()))}" for path in recalibrated)
    head = (f"One `importer.zoo.LlamaBlock` at each width, bfloat16, one torch.optim.Adam step (MSE loss): each "
            f"phase timed with CUDA events, median of the runs after a warm-up; torch.compile compiles the block "
            f"(forward and backward), the optimizer runs eager. Predicted: the same step imported under the meta "
            f"device, planned whole on Mesh(1) and split by `cost.breakdown` under the `{spec}` profile (the H100 "
            f"SXM's spec sheet: 989 TFLOP/s bfloat16, 3.35 TB/s) and under `{calibrated}` (shipped: "
            f"{calibration(shipped)}{again}). An H200 has the H100's bfloat16 peak and 4.8 TB/s, so on one the "
            f"memory-bound steps, the update above all, run faster than either prediction means. MFU: the step's "
            f"FLOPs at the spec-sheet peak over its time.")
    return "\n\n".join([head, *map(table, measured)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", type=Path, help="measure on this machine's GPU and save here")
    parser.add_argument("--load", type=Path, nargs="+", help="price the saved measurements (one table per file) "
                        "and write the section")
    parser.add_argument("--recalibrated", type=Path, nargs="*", default=[],
                        help="profiles `tapestry calibrate --device cuda` wrote again, quoted beside the shipped one")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.measure:
        measure(args.measure)
    if args.load:
        body = report([json.loads(path.read_text()) for path in args.load], args.recalibrated)
        print(body)
        if not args.no_write:
            write_section("GPU: a LLaMA block's training step", "python benchmarks/gpu_step.py --measure "
                          "gpu_step.json (on each GPU), then python benchmarks/gpu_step.py --load "
                          "benchmarks/data/gpu_step.json benchmarks/data/gpu_step_h100.json --recalibrated "
                          "benchmarks/data/gpu-h100-calibration-2026-11-27.json", body)


if __name__ == "__main__":
    main()
