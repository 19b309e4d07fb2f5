"""One pipeline stage's layer plans on one sub-mesh, as `plan_pipeline` extracts them, timed (issue 24).

A LLaMA block's training step (benchmarks/pipeline.py's layer) explored on `--mesh`, its fastest plan extracted for
`--micro-batches` runs per update, then its leaner plans (`Explored.leaner_plans`, each under a memory budget one
byte below the last one's peak) up to `--points` plans in all: CPU seconds, the process's RSS and high-water mark
after each, and each plan's accumulated time and peak. With `--constraints`, also what the ILP's memory-budget
constraints alone cost to build (`extract.cpsat._limit`) at the fastest plan's peak.

    python benchmarks/leaner_sweep.py --width 70B --seq 4096 --kv-heads 8 --micro-batch 8 --micro-batches 128 \
        --mesh 8x8
"""
from __future__ import annotations

import argparse
import re
import time

from pipeline import PROFILE, layer_arguments, layer_builder


def rss_gib() -> tuple[float, float]:
    """The process's resident set and its high-water mark, GiB."""
    with open("/proc/self/status") as f:
        status = f.read()
    return tuple(int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) / 2**20 for key in ("VmRSS", "VmHWM"))


def report(what: str, started: float, result: object = None, model: object = None) -> None:
    """One phase's CPU seconds and RSS; of a plan, its time per update, its peak and the bytes per device of its input
    (what a stage receives per micro-batch: `LayerCost.boundary`)."""
    from tapestry.pipeline import layer_cost

    spent = time.process_time() - started  # the input's bytes read after: not the phase's
    rss, peak = rss_gib()
    found = "" if result is None else (f", {result.plan.notes.get('accumulated_cost', result.plan.cost) * 1e3:.1f} ms"
                                       f" per update, peak {result.peak_memory:,} bytes, input "
                                       f"{layer_cost(result.plan, model).boundary:,} bytes per device")
    print(f"{what}: {spent:.1f} CPU s, RSS {rss:.2f} GiB (high-water {peak:.2f}){found}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layer_arguments(parser)
    parser.add_argument("--micro-batches", type=int, default=256, help="micro-batches per update")
    parser.add_argument("--mesh", default="8")
    parser.add_argument("--points", type=int, default=3, help="layer plans in all, the fastest included")
    parser.add_argument("--constraints", action="store_true")
    parser.add_argument("--time-limit", type=float, default=10.0, help="each extraction's time_limit (default "
                        "optimize's; plan_pipeline's is LAYER_TIME_LIMIT)")
    args = parser.parse_args()
    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.optimizer import explore

    model = DefaultCostModel(load_profile(PROFILE))
    graph = layer_builder(args.width, args.seq, args.kv_heads)(args.micro_batch)
    started = time.process_time()
    mesh = tapestry.Mesh(*(int(n) for n in args.mesh.split("x")))
    explored = explore(graph, mesh, budget=tapestry.Budget(seconds=30))
    report(f"explore ({len(explored.decoder.nodes):,} e-nodes)", started)
    started = time.process_time()
    fastest = explored.extract(model, time_limit=args.time_limit, micro_batches=args.micro_batches)
    report("fastest plan", started, fastest, model)
    if args.constraints:
        constraints(explored, fastest.peak_memory - 1)
    leaner = explored.leaner_plans(fastest, model, time_limit=args.time_limit, micro_batches=args.micro_batches)
    for k in range(1, args.points):
        started = time.process_time()
        found = next(leaner, None)
        report(f"leaner plan {k}" if found is not None else f"leaner plan {k}: none found", started, found, model)
        if found is None:
            break


def constraints(explored: object, limit: int) -> None:
    """What the ILP's budget constraints over every e-node cost to build."""
    from ortools.sat.python import cp_model

    from tapestry.egraph.budget import device_budget
    from tapestry.extract.cpsat import _limit

    started = time.process_time()
    budget = device_budget(explored.decoder, explored._held, explored.layered, limit)
    report("device budget", started)
    model = cp_model.CpModel()
    x = {n: model.new_bool_var("") for n in range(len(explored.decoder.nodes))}
    before = rss_gib()[0]
    started = time.process_time()
    _limit(model, budget, x)
    report(f"budget constraints: {len(model.proto.constraints):,} over {len(next(iter(budget.transient.values())))} "
           f"device sets, RSS +{rss_gib()[0] - before:.2f} GiB", started)


if __name__ == "__main__":
    main()
