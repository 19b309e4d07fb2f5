"""A zoo sweep: many small model families, each imported with `from_torch`, optimized on each mesh under several
PYTHONHASHSEED values, its plan simulated and compared with eager PyTorch. Writes the "Zoo sweep" section of
docs/importing.md.

    .venv/bin/python benchmarks/zoo_sweep.py [NAME ...] [--seeds 0 1 2] [--meshes 4 2x2] [--extractor greedy-dag]
        [--write]
    .venv/bin/python benchmarks/zoo_sweep.py --list

The families are tapestry.importer.zoo's EXTRA (by default) or any of FAMILIES by name: tiny models (1-2 layers,
hidden 32, random weights; nothing is downloaded) of HF encoders, decoders, MoE decoders, encoder-decoders,
vision and audio models, and hand-written modules. The hash seed is fixed at interpreter start, so each seed runs
its own processes (`--chunk` families each, the seeds' side by side). A family passes when every run imports,
optimizes and matches eager within 1e-4 of the largest output, with the same plan cost under every seed. It
checks soundness, not speed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section  # noqa: E402

import torch  # noqa: E402

from tapestry.importer.zoo import EXTRA, FAMILIES, Case  # noqa: E402

IMPORTING = Path(__file__).resolve().parent.parent / "docs" / "importing.md"
ZOO = {**EXTRA, **FAMILIES}  # a name in both is one family


def check(name: str, build: Callable[[], Case], meshes: list[str], extractor: str) -> dict[str, Any]:
    """The model `build` makes, under this process's hash seed: per mesh, the plan's cost, its sharded share of the
    FLOPs each run pays and its prepared steps' FLOPs (run once ahead of time), and its error; or the exception."""
    import numpy as np

    import tapestry
    from tapestry.importer.report import import_report
    from tapestry.plan.simulate import simulate

    result: dict[str, Any] = {"family": name}
    try:
        module, args, kwargs = build()
        with torch.no_grad():
            want = [t.numpy() for t in torch.utils._pytree.tree_leaves(module(*args, **kwargs))
                    if isinstance(t, torch.Tensor)]
        imported = tapestry.from_torch(module, args, kwargs, verbose=False)
        result["opaque"] = sorted(op for op, kinds in imported.coverage.items() if kinds.get("opaque"))
    except Exception as err:  # noqa: BLE001  the sweep records what failed
        result["error"] = f"import: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        return result
    for text in meshes:
        mesh = tapestry.Mesh.parse(text)
        start = time.perf_counter()
        try:
            found = tapestry.optimize(imported.graph, mesh, extractor=extractor)
            plan = found.plan
            seconds = time.perf_counter() - start
            got = imported.outputs(simulate(plan, imported.inputs(*args, **kwargs)))
            error = max(float(np.abs(g.astype(np.float64) - w).max() / max(np.abs(w).max(), 1.0))
                        if g.shape == w.shape else float("inf") for g, w in zip(got, want))
            if len(got) != len(want):
                error = float("inf")
            report = import_report(name, imported, mesh, plan)
            result[text] = {"cost": plan.cost, "error": error, "sharded": report.plan_sharded,
                            "prepared_flops": report.plan_prepared_flops,
                            "seconds": round(seconds, 2), "status": found.status}
        except Exception as err:  # noqa: BLE001
            first = str(err).splitlines()[0][:300] if str(err) else ""
            result[text] = {"exception": f"{type(err).__name__}: {first}"}
    return result


def run(names: list[str], seed: int, meshes: list[str], extractor: str, timeout: float) -> dict[str, dict[str, Any]]:
    """`names` swept in one process under hash seed `seed` (one start-up for several families): each family's
    result, or why there is none (the process timed out or died before reaching it)."""
    command = [sys.executable, __file__, "--worker", *names, "--meshes", *meshes, "--extractor", extractor]
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout * len(names))
        out, why = done.stdout, f"worker exited {done.returncode}: {done.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
        why = f"timed out ({timeout:.0f} s a family)"
    results = {r["family"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    return {name: results.get(name, {"family": name, "error": why}) for name in names}


def verdict(runs: dict[int, dict[str, Any]], meshes: list[str]) -> str:
    """'passes', or the first failure: an exception, a wrong answer, or plans whose cost differs by seed."""
    for seed, result in runs.items():
        if "error" in result:
            return f"seed {seed}: {result['error']}"
        for mesh in meshes:
            cell = result[mesh]
            if "exception" in cell:
                return f"{mesh}, seed {seed}: {cell['exception']}"
            if not cell["error"] <= 1e-4:
                return f"{mesh}, seed {seed}: differs from eager by {cell['error']:.2e}"
    for mesh in meshes:
        costs = {seed: result[mesh]["cost"] for seed, result in runs.items()}
        if max(costs.values()) - min(costs.values()) > 1e-9 * max(costs.values()):
            timed = {seed: result[mesh]["status"] for seed, result in runs.items() if timed_out(result[mesh])}
            if timed:  # a clock stopped the search: the runs searched different spaces, whatever the seed
                return (f"passes; {mesh}: plan cost differs by run ({', '.join(f'{c:.4g}' for c in costs.values())}) "
                        f"where a time limit stopped the search ({timed})")
            return f"{mesh}: plan cost depends on the hash seed {costs}"
    return "passes"


def timed_out(cell: dict[str, Any]) -> bool:
    """The search stopped on a clock (a saturation or pricing budget of seconds, the ILP's time limit): another
    run on a differently loaded machine may search further."""
    status = cell.get("status", "")
    return "(seconds)" in status or status == "feasible"


def row(name: str, runs: dict[int, dict[str, Any]], args: argparse.Namespace) -> str:
    first = runs[args.seeds[0]]
    shares = [shards(first[m]) if "sharded" in first.get(m, {}) else "—" for m in args.meshes]
    opaque = ", ".join(f"`{op.removeprefix('aten.')}`" for op in first.get("opaque", [])) or "none"
    return f"| {name} | {ZOO[name].kind} | " + " | ".join(shares) + f" | {opaque} | {verdict(runs, args.meshes)} |"


def shards(cell: dict[str, Any]) -> str:
    """A run's `plan shards` cell: the share of the FLOPs each run pays that the plan splits, and the FLOPs of its
    prepared steps (made once ahead of time) where it has some. A result written before `prepared_flops` was kept
    counted those steps in `sharded` as if every run paid them."""
    prepared = cell.get("prepared_flops")
    return f"{cell['sharded']:.1%}" + (f" (+{prepared:.2g} FLOPs prepared)" if prepared else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", help="families of the zoo (default: its EXTRA families)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--meshes", nargs="+", default=["4", "2x2"])
    parser.add_argument("--extractor", default="greedy-dag", help="ilp (optimize's default) or greedy-dag")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per family and seed")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=8, help="families per process")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--write", action="store_true", help="write the section of docs/importing.md")
    args = parser.parse_args()
    if args.worker:
        for name in args.worker:
            print(json.dumps(check(name, ZOO[name].build, args.meshes, args.extractor)), flush=True)
        return
    if args.list:
        print("\n".join(f"{name}: {family.kind}" for name, family in ZOO.items()))
        return
    rows = ["| family | kind | " + " | ".join(f"{m}: plan shards" for m in args.meshes) + " | opaque ops | outcome |",
            "|---|---|" + "---:|" * len(args.meshes) + "---|---|"]
    passed = 0
    names = args.names or list(EXTRA)
    for start in range(0, len(names), args.chunk):
        chunk = names[start : start + args.chunk]
        with ThreadPoolExecutor(len(args.seeds)) as pool:  # the seeds' processes side by side
            futures = {seed: pool.submit(run, chunk, seed, args.meshes, args.extractor, args.timeout)
                       for seed in args.seeds}
        swept = {seed: future.result() for seed, future in futures.items()}
        for name in chunk:
            rows.append(row(name, {seed: swept[seed][name] for seed in args.seeds}, args))
            print(rows[-1], flush=True)
            passed += "| passes" in rows[-1]
        if args.write:  # after each chunk: a cut run leaves what it swept
            write(rows, args)
    print(f"{passed} of {len(rows) - 2} pass", flush=True)


def merged_rows(doc: Path, section: str, rows: list[str], args: argparse.Namespace,
                order: Iterable[str]) -> tuple[dict[str, str], str]:
    """This run's `rows` (a header, its rule, a row per model) and, for models it did not run, the rows the
    `section` of `doc` holds from a run with the same seeds, meshes and extractor, by name in `order`; and those
    options, as the command names them."""
    options = f"--seeds {' '.join(map(str, args.seeds))} --meshes {' '.join(args.meshes)} --extractor {args.extractor}"
    found = re.search(rf"<!-- BEGIN {re.escape(section)} -->(.*?)<!-- END {re.escape(section)} -->", doc.read_text(),
                      re.S)
    kept = {}
    if found and f" {options} --write`" in found.group(1) and rows[0] in found.group(1):
        kept = {line.split(" | ")[0].removeprefix("| "): line for line in found.group(1).splitlines()
                if line.startswith("| ") and line.count(" | ") == rows[0].count(" | ") and line != rows[0]}
    kept.update({line.split(" | ")[0].removeprefix("| "): line for line in rows[2:]})
    return {name: kept[name] for name in order if name in kept}, options


def write(rows: list[str], args: argparse.Namespace) -> None:
    """The "Zoo sweep" section of docs/importing.md. Rows of families this run did not sweep are kept from the
    section as it was when it was swept with the same seeds, meshes and extractor (so a sweep can go in batches);
    the command then names every family in the table."""
    table, options = merged_rows(IMPORTING, "Zoo sweep", rows, args, ZOO)
    passed = sum("| passes" in line for line in table.values())
    body = "\n".join(rows[:2] + list(table.values())) + (
        f"\n\n{passed} of {len(table)} families pass: imported with `from_torch`, optimized on "
        f"{' and '.join(args.meshes)} with the {args.extractor} extractor under PYTHONHASHSEED "
        f"{', '.join(map(str, args.seeds))}, simulated, and compared with eager PyTorch (1e-4 of the largest "
        "output), the plan's cost the same under every seed (where it differs and a run's search was stopped by a "
        "clock, a budget of seconds or the ILP's time limit, the row says so: the load, not the seed, cut it). "
        f"`plan shards` is `tapestry import-report`'s (seed {args.seeds[0]}): the share of the FLOPs each run pays "
        "that the plan splits over devices, and the FLOPs of its prepared steps (made from static inputs alone, run "
        "once ahead of time) where it has some; `opaque ops` run whole through torch.")
    write_section("Zoo sweep", f"python benchmarks/zoo_sweep.py {' '.join(table)} {options} --write", body, IMPORTING)


if __name__ == "__main__":
    main()
