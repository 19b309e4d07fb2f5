"""One training step of every zoo family (SGD and Adam), imported with `from_torch`, evaluated, and compared with
torch.optim's step element by element (tapestry.testing.versus_torch: the tolerance is torch's own float32
rounding of the gradient, measured per model against its float64 one, carried through the optimizer's update). One
process per family, so a crash or a hang is named.

    .venv/bin/python benchmarks/zoo_training.py [NAME ...] [--optimizers sgd adam] [--timeout 300] [--json OUT]

Prints a markdown table: per family and optimizer, the parameter worst against its bound (its element's miss over
that element's bound; <= 1 passes), that parameter's largest miss as a share of its largest update, the step's CPU
seconds (import, evaluate, torch's gradients and optimizer steps) and the outcome. It checks correctness, not speed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tapestry.importer.zoo import FAMILIES

LR = {"sgd": 0.1, "adam": 1e-3, "adamw": 1e-3}


def check(name: str, optimizer: str) -> dict[str, Any]:
    """The family's step under `optimizer` against torch's: the worst parameter, or the exception."""
    import tapestry
    from tapestry.evaluator import evaluate
    from tapestry.testing.versus_torch import case_of, check_step

    start = time.process_time()
    result: dict[str, Any] = {"family": name, "optimizer": optimizer}
    try:
        case = case_of(*FAMILIES[name].build())
        training = tapestry.Training(loss=case.loss, optimizer=optimizer, lr=LR[optimizer])
        imported = tapestry.from_torch(case.module, case.inputs, training=training, verbose=False)
        values = evaluate(imported.graph, imported.inputs(*case.inputs))
        checks = check_step(case, training, imported.outputs(values)["parameters"])
    except Exception as err:  # noqa: BLE001  the sweep records what failed
        result["exception"] = f"{type(err).__name__}: {str(err).splitlines()[0][:240] if str(err) else ''}"
        result["cpu_s"] = round(time.process_time() - start, 1)
        return result
    worst = max(checks, key=lambda c: c.ratio)
    result.update(worst=worst.path, ratio=worst.ratio,
                  relative=worst.relative, failed=[c.path for c in checks if not c.passed],
                  opaque=sorted(op for op, kinds in imported.coverage.items() if kinds.get("opaque")),
                  cpu_s=round(time.process_time() - start, 1))
    return result


def run(name: str, optimizers: list[str], timeout: float) -> list[dict[str, Any]]:
    """`name`'s checks in a process of its own: each optimizer's result, or why there is none."""
    command = [sys.executable, __file__, "--worker", name, "--optimizers", *optimizers]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        out, why = done.stdout, f"worker exited {done.returncode}: {done.stderr.strip()[-240:]}"
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
        why = f"timed out ({timeout:.0f} s)"
    results = {r["optimizer"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    return [results.get(o, {"family": name, "optimizer": o, "exception": why}) for o in optimizers]


def outcome(result: dict[str, Any]) -> str:
    if "exception" in result:
        return result["exception"].replace("|", "\\|")
    if result["failed"]:
        return f"misses {len(result['failed'])}: {', '.join(result['failed'][:3])}"
    return "passes"


def row(result: dict[str, Any]) -> str:
    if "exception" in result:
        return (f"| {result['family']} | {result['optimizer']} | — | — | — | {result.get('cpu_s', '—')} | "
                f"{outcome(result)} |")
    return (f"| {result['family']} | {result['optimizer']} | `{result['worst']}` | {result['ratio']:.2f} | "
            f"{result['relative']:.1e} | {result['cpu_s']} | {outcome(result)} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", help="zoo families (default: all of FAMILIES, EXTRA included)")
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adam"], choices=sorted(LR))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per family (all optimizers)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="write every result here (a list of objects)")
    args = parser.parse_args()
    if args.worker:
        for optimizer in args.optimizers:
            print(json.dumps(check(args.worker, optimizer)), flush=True)
        return
    print("| family | optimizer | worst parameter | error / bound | error / update | CPU s | outcome |")
    print("|---|---|---|---:|---:|---:|---|", flush=True)
    results = []
    for name in args.names or list(FAMILIES):
        for result in run(name, args.optimizers, args.timeout):
            results.append(result)
            print(row(result), flush=True)
        if args.json:  # after each family: a cut run leaves what it swept
            args.json.write_text(json.dumps(results, indent=1))
    passed = sum(outcome(r) == "passes" for r in results)
    print(f"\n{passed} of {len(results)} steps pass", flush=True)


if __name__ == "__main__":
    main()
