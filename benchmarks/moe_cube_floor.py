"""The n-D MoE recipes (training.plans' DPxEP, DPx(TP+EP)) on a 3-D mesh against benchmarks/cluster.py's pricing of
them on the 2-D grid of (outer devices, last axis), and the search's plan on the cube against the hand plans its
e-graph holds (issue 24: Mixtral on 4x8x8 planned 63.3 ms where the DPxEP hand plan priced 50.8).

    python benchmarks/moe_cube_floor.py --batch 2 --cube 2x2x2
    python benchmarks/moe_cube_floor.py --batch 8 --cube 4x2x4 --no-search

The tiny Mixtral's SGD step (tests/experts_helpers.tiny_mixtral_step: 1 layer, 4 experts, top 2, sequence 8),
priced by the gpu-h100-cluster profile; prints each hand plan's ms on the cube and on the grid, then (unless
--no-search) the ILP's plan on the cube, each hand plan "in the e-graph" or why not, and the process's CPU s.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests")]

from experts_helpers import tiny_mixtral_step  # noqa: E402  tests/, the tiny Mixtral's step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--cube", default="2x2x2")
    parser.add_argument("--no-search", action="store_true", help="price the hand plans only")
    args = parser.parse_args()

    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile, plan_cost
    from tapestry.egraph.embed import plan_selection
    from tapestry.egraph.pins import steady_ties
    from tapestry.extract import validate
    from tapestry.training.plans import baselines

    model = DefaultCostModel(load_profile("gpu-h100-cluster"))
    shape = tuple(int(n) for n in args.cube.split("x"))
    cube, grid = tapestry.Mesh(*shape), tapestry.Mesh(math.prod(shape[:-1]), shape[-1])
    with pytest.MonkeyPatch.context() as monkeypatch:
        imported, _ = tiny_mixtral_step(monkeypatch, batch=args.batch)
        graph = imported.graph
        hands, flat = baselines(graph, cube), baselines(graph, grid)
        for name in sorted(hands):
            on_grid = f"{plan_cost(flat[name], model) * 1e3:.4f}" if name in flat else "-"
            print(f"{name}: {plan_cost(hands[name], model) * 1e3:.4f} ms on {args.cube}, {on_grid} on "
                  f"{grid.shape[0]}x{grid.shape[1]}", flush=True)
        if args.no_search:
            print(f"CPU s {time.process_time():.1f}")
            return
        explored = tapestry.explore(graph, cube)
        egraph, _ = steady_ties(explored.decoder, explored.decoder.extraction_graph(
            list(explored.roots), model, explored.priced_moves), dict(graph.carried))
        for name, hand in sorted(explored.baselines.items()):
            problems = validate(egraph, plan_selection(explored.decoder, egraph, hand, name))
            print(f"{name}: {'in the e-graph' if not problems else problems}")
        result = explored.extract(model, "ilp")
        print(f"search: {result.plan.cost * 1e3:.4f} ms ({result.selection.extractor}); "
              f"CPU s {time.process_time():.1f}")


if __name__ == "__main__":
    main()
