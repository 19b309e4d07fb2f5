"""A saturation experiment from a script: mesh sizes × rule sets, written as CSV and a plot.

    .venv/bin/python examples/sweep.py [--out out/sweep]

Each row is one `tapestry.optimize` run: how big the e-graph grew, how long saturation and
extraction took, and the predicted time of the chosen plan, so the effect of each rule set on the
plan can be read off next to its cost in search.
"""
from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import tapestry  # noqa: E402
from tapestry.egraph.rules import BUILTIN_DIR  # noqa: E402
from tapestry.models import mlp, transformer_block  # noqa: E402

RULE_SETS = {
    "none": [],
    "fusion": [BUILTIN_DIR / "fusion.egg"],
    "fusion+substitution": [BUILTIN_DIR],
}
MESHES = (1, 2, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/sweep"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model_name, graph in [("mlp8", mlp(8, 1024, 1024)), ("transformer", transformer_block())]:
        for rules_name, rules in RULE_SETS.items():
            for devices in MESHES:
                start = time.perf_counter()
                result = tapestry.optimize(graph, tapestry.Mesh(devices), rules=rules, time_limit=10)
                rows.append({
                    "model": model_name, "rules": rules_name, "devices": devices,
                    "enodes": result.stats.enodes, "iterations": len(result.stats.iterations),
                    "stopped_by": result.stats.stopped_by, "seconds": round(time.perf_counter() - start, 3),
                    "predicted_s": result.plan.cost, "peak_bytes": result.peak_memory,
                })
                print(rows[-1], flush=True)
    with open(args.out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, model_name in zip(axes, ("mlp8", "transformer")):
        for rules_name in RULE_SETS:
            pts = [(r["devices"], r["predicted_s"]) for r in rows if r["model"] == model_name and r["rules"] == rules_name]
            ax.plot([d for d, _ in pts], [t * 1e3 for _, t in pts], "o-", label=rules_name)
        ax.set(title=model_name, xlabel="devices", ylabel="predicted time (ms)", xscale="log", xticks=MESHES)
        ax.set_xticklabels([str(m) for m in MESHES])
        ax.minorticks_off()
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "sweep.png")
    print(f"wrote {args.out / 'sweep.csv'} and {args.out / 'sweep.png'}")


if __name__ == "__main__":
    main()
