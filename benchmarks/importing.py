"""Real models through the importer: import time, op coverage, optimisation time and predicted speed-up.
Writes the "Importing real models" section of docs/benchmarks.md.

    .venv/bin/python benchmarks/importing.py [--meshes 4 2x2] [--runs small:cpu-gloo large:gpu-h100-nccl]
    .venv/bin/python benchmarks/importing.py --families [NAME ...]

--families writes the "Model families" table of docs/importing.md instead: each family of the zoo's FAMILIES,
imported, optimized on each mesh, its plan simulated and compared with eager PyTorch (what tests/test_zoo.py
checks), with what `tapestry import-report` says of it.

The models are tapestry.importer.zoo's: at size `small` the ones tests/test_importer.py checks, at size `large`
(hidden 1024, 8 x 512 tokens; 128x128 images) big enough for sharding to pay. The predicted speed-up is the plan's
predicted time on one device over its predicted time on the mesh, both under the same profile.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section  # noqa: E402
from zoo_sweep import shards  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tapestry import Mesh, from_torch, optimize  # noqa: E402
from tapestry.cost import DefaultCostModel, load_profile  # noqa: E402
from tapestry.importer.report import import_report  # noqa: E402
from tapestry.importer.zoo import FAMILIES, MODELS  # noqa: E402
from tapestry.plan.plan import Compute  # noqa: E402
from tapestry.plan.simulate import simulate  # noqa: E402

IMPORTING = Path(__file__).resolve().parent.parent / "docs" / "importing.md"
ZOO_TESTS = Path(__file__).resolve().parent.parent / "tests" / "test_zoo.py"


def default_suite() -> set[tuple[str, str]]:
    """(family, mesh) cases tests/test_zoo.py runs in the default suite (`make test`, not marked slow), read from
    pytest's own collection, so the table cannot claim a test CI does not run."""
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", str(ZOO_TESTS)],
                               capture_output=True, text=True, cwd=ZOO_TESTS.parent.parent, check=True).stdout
    return {tuple(case.rsplit("-", 1)) for case in re.findall(r"plan_matches_eager\[(.+?)\]", collected)}


def family_row(name: str, meshes: list[Mesh], suite: set[tuple[str, str]]) -> str:
    """One family imported, optimized on each mesh, its plans simulated and compared with eager PyTorch."""
    family = FAMILIES[name]
    module, args, kwargs = family.build()
    with torch.no_grad():
        want = [t.numpy() for t in torch.utils._pytree.tree_leaves(module(*args, **kwargs))
                if isinstance(t, torch.Tensor)]
    imported = from_torch(module, args, kwargs, verbose=False)
    cells, failure = [], None
    for mesh in meshes:
        start = time.perf_counter()
        try:
            plan = optimize(imported.graph, mesh).plan
        except Exception as err:  # noqa: BLE001  the table says what failed
            failure = failure or f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            cells.append("—")
            continue
        seconds = time.perf_counter() - start
        got = imported.outputs(simulate(plan, imported.inputs(*args, **kwargs)))
        if len(got) != len(want) or not all(
                g.shape == w.shape and np.abs(g.astype(np.float64) - w).max() <= 1e-4 * max(np.abs(w).max(), 1.0)
                for g, w in zip(got, want)):
            failure = failure or f"the plan on {mesh} differs from eager"
        report = import_report(name, imported, mesh, plan)
        cells.append(f"{shards({'sharded': report.plan_sharded, 'prepared_flops': report.plan_prepared_flops})}, "
                     f"{seconds:.1f}")
    report = import_report(name, imported, meshes[0])
    opaque = ", ".join(f"`{op.aten.removeprefix('aten.')}` x{op.count}" for op in report.opaque) or "none"
    verdict = "passes" if failure is None else f"fails: {failure}"
    tested = ", ".join(str(m) for m in meshes if (name, str(m)) in suite) or "`slow`"
    return (f"| {name} | {family.kind} | {report.aten_ops} | {report.made.get('kernels', 0)} | {opaque} | "
            f"{report.shardable:.1%} | " + " | ".join(cells) + f" | {verdict} | {tested} |")


def families(names: list[str], meshes: list[Mesh]) -> None:
    """The "Model families" section of docs/importing.md: does each family pass end to end, what shards, and
    which of its cases the default suite tests. Rows of families not named are kept from the table as it was
    (when its columns are these meshes'), so one family can be rerun alone; the section is written after each
    row, so a cut run keeps what it measured."""
    header = ["| family | kind | ATen ops | kernels | opaque ops | FLOPs that can shard | "
              + " | ".join(f"{m}: plan shards, optimize s" for m in meshes) + " | end to end | in `make test` |",
              "|---|---|---:|---:|---|---:|" + "---:|" * len(meshes) + "---|---|"]
    text = IMPORTING.read_text()
    kept = {line.split(" | ")[0].removeprefix("| "): line for line in text.splitlines()
            if line.startswith("| ") and line.count(" | ") == header[0].count(" | ")} if header[0] in text else {}
    rows = {name: row for name, row in kept.items() if name in FAMILIES and name not in names}
    suite = default_suite()
    for name in names:
        rows[name] = family_row(name, meshes, suite)
        print(rows[name], flush=True)
        body = "\n".join(header + [rows[n] for n in FAMILIES if n in rows]) + (
            "\n\nEach family is the tiny model `tapestry.importer.zoo.FAMILIES` builds from a config with random"
            " weights (nothing downloaded), imported with `from_torch`, optimized on each mesh under the default cost"
            " model, its plan simulated and compared with eager PyTorch (1e-4 of the largest output), as"
            " tests/test_zoo.py does. `in `make test`` names the meshes on which the default suite runs that test"
            " (read from pytest's collection); `slow` means only `make test-all` (`-m ''`) runs it. `FLOPs that can"
            f" shard` (on {meshes[0]}) and `plan shards` are `tapestry import-report`'s (importer/report.py): the"
            " FLOPs of ops with a candidate partition that splits them, and of the FLOPs each run pays those of the"
            " plan's compute steps split over devices (its prepared steps, made from static inputs alone and run"
            " once ahead of time, left out). At these sizes the cost model keeps much of the work whole"
            " (communication costs more than it saves), so `plan shards` is low for some families; it is what the plan does, not a limit. `optimize s`"
            f" depends on the machine's load (here {os.getloadavg()[1]:.1f} on {os.cpu_count()} cores at the last"
            " row written).")
        write_section("Model families", "python benchmarks/importing.py --families", body, IMPORTING)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--meshes", nargs="+", type=Mesh.parse, default=[Mesh(4), Mesh(2, 2)])
    parser.add_argument("--runs", nargs="+", default=["small:cpu-gloo", "large:gpu-h100-nccl"],
                        help="SIZE:PROFILE pairs")
    parser.add_argument("--families", nargs="*", metavar="NAME",
                        help="write docs/importing.md's family table (every family, or those named)")
    args = parser.parse_args()
    if args.families is not None:
        families(args.families or list(FAMILIES), args.meshes)
        return
    rows = ["| model | size | import s | ATen ops | as kernels | folded | opaque | graph ops | profile | mesh "
            "| optimize s | sharded steps | predicted speed-up |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for name, build in MODELS.items():
        for size, profile in (run.split(":") for run in args.runs):
            module, inputs, kwargs = build(size)
            start = time.perf_counter()
            imported = from_torch(module, inputs, kwargs, verbose=False)
            import_s = time.perf_counter() - start
            made = [kind for kinds in imported.coverage.values() for kind, n in kinds.items() for _ in range(n)]
            opaque, folded = made.count("opaque"), made.count("folded")
            kernels = len(made) - opaque - folded - made.count("dropped")
            model = DefaultCostModel(load_profile(profile))
            alone = optimize(imported.graph, Mesh(1), cost_model=model).plan.cost
            for mesh in args.meshes:
                start = time.perf_counter()
                plan = optimize(imported.graph, mesh, cost_model=model).plan
                seconds = time.perf_counter() - start
                computes = [s for s in plan.steps if isinstance(s, Compute)]
                sharded = sum(len(set(s.blocks)) > 1 for s in computes)
                row = (f"| {name} | {size} | {import_s:.2f} | {len(made)} | {kernels} | {folded} | {opaque} | "
                       f"{len(imported.graph.ops)} | {profile} | {mesh} | {seconds:.1f} | {sharded}/{len(computes)} | "
                       f"{alone / plan.cost:.2f} |")
                print(row, flush=True)
                rows.append(row)
    body = "\n".join(rows) + (
        "\n\n`ATen ops` counts the functional ATen graph's call nodes; each is converted to kernels, folded (constant"
        " subgraphs: masks, position ids), dropped (bookkeeping such as `clone` or `_assert_*`) or run opaque."
        " `optimize s` is the whole of `tapestry.optimize` (saturation, pricing, ILP extraction, the plan's meaning"
        " check). `sharded steps` counts compute steps whose index blocks differ between devices. At the small"
        " size, under cpu-gloo, a mesh of 4 ranks on this 2-core machine is oversubscribed (the profile's `cores`),"
        " so no plan beats one device and the speed-up is below 1. The large rows show what sharding buys when compute dominates."
    )
    body += (f"\n\nLoad average over the run's last minutes: {os.getloadavg()[1]:.1f} on {os.cpu_count()} cores; seconds"
             " grow with it, the counts and predicted speed-ups do not.")
    command = "python benchmarks/importing.py"
    write_section("Importing real models", command, body)


if __name__ == "__main__":
    main()
