"""What greedy-dag's delivered pick (`pins.steady_picks`' second warm start, bisect70's fix) does to the ILP's plan of
one LLaMA block's training step, per time limit: the plan `Explored.extract` returns with both steady picks among the
ILP's starts, and with the replicated pick alone (the second dropped, as before the fix). A fresh `explore` each.

    PYTHONHASHSEED=0 PYTHONPATH=src python benchmarks/warm_starts.py --width 7B --seq 512 --kv-heads 2 \\
        --micro-batch 1 --mesh 2x2 --time-limits 0.2 2 10

Prints per time limit and variant the plan's cost (one run, ms), the selection's status, gap and stopped_by, the
process's CPU seconds for the extraction, and the steady picks' dag costs (replicated, delivered; the extraction's
objective, not a plan's time).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from layer_regression import PROFILE, WIDTHS, layer_graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", default="7B", choices=sorted(WIDTHS))
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--mesh", default="2x2")
    parser.add_argument("--time-limits", type=float, nargs="+", default=[0.2, 2.0, 10.0])
    args = parser.parse_args()
    import tapestry
    import tapestry.optimizer as optimizer
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.egraph.pins import steady_picks

    model = DefaultCostModel(load_profile(PROFILE))
    graph = layer_graph(args.width, args.seq, args.kv_heads, args.micro_batch)
    mesh = tapestry.Mesh(*(int(n) for n in args.mesh.split("x")))

    costs: list[float] = []

    def both(*picks_args: Any) -> tuple[Any, ...]:
        picks = steady_picks(*picks_args)
        costs[:] = [pick.dag_cost for pick in picks]
        return picks

    def replicated_only(*picks_args: Any) -> tuple[Any, ...]:
        return both(*picks_args)[:1]

    variants: dict[str, Callable[..., tuple[Any, ...]]] = {"both picks": both, "replicated only": replicated_only}
    for limit in args.time_limits:
        for name, picks in variants.items():
            optimizer.steady_picks = picks  # the name `Explored._warm_starts` calls
            try:
                explored = optimizer.explore(graph, mesh)
                start = time.process_time()
                plan = explored.extract(model, "ilp", limit).plan
            finally:
                optimizer.steady_picks = steady_picks
            notes = {k: plan.notes.get(k) for k in ("extractor", "status", "gap", "stopped_by")}
            print(f"{args.width} seq {args.seq} on {args.mesh}, time limit {limit:g}, {name}: "
                  f"{plan.cost * 1e3:.4f} ms, {notes}, {time.process_time() - start:.1f} CPU s; the picks' dag costs "
                  f"{', '.join(f'{c * 1e3:.3f}' for c in costs)} ms", flush=True)


if __name__ == "__main__":
    main()
