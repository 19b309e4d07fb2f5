"""Which hand plans (training.plans.baselines) lie in the e-graph of one benchmarks/cluster.py training case, and
what each costs: the optimizer's floor (`Explored._against_baselines`) keeps only those that do (issue 24).

    python benchmarks/hand_plans_embedded.py --model Mixtral --mesh 8x8 --layers 2
    python benchmarks/hand_plans_embedded.py --model tiny-GQA --mesh 8x8 --layers 3 --batch 8 --seq 16 \
        --vocab 96 --fold        # a folded step in small (issue 24: do the hand plans embed in a fold?)

Prints what the budget left out (`stats.undone`), then per hand plan its predicted ms under the cluster profile
and "in the e-graph" or the first step the e-graph has no selectable e-node for (`egraph.embed.NotInEGraph`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cluster import PROFILE, Case, build  # noqa: E402  benchmarks/, this script's folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Mixtral")
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--budget", type=float, default=30.0, help="Budget.seconds")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--fold", action="store_true", help="explore the repeated layers folded (layers=True): "
                        "the hand plans are the folded graph's")
    args = parser.parse_args()

    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile, plan_cost
    from tapestry.egraph.embed import NotInEGraph, plan_selection
    from tapestry.egraph.pins import restrict_outputs, steady_ties

    case = Case(args.model, args.layers, "training", args.mesh, args.batch, args.seq, vocab=args.vocab)
    graph = build(case).graph
    model = DefaultCostModel(load_profile(PROFILE))
    explored = tapestry.explore(graph, tapestry.Mesh(*case.shape), budget=tapestry.Budget(seconds=args.budget),
                                layers=True if args.fold else None)
    print(f"folded: {explored.layered is not None}; budget left out: {explored.stats.undone or 'nothing'}")
    priced = explored.decoder.extraction_graph(list(explored.roots), model, explored.priced_moves)
    egraph, _ = steady_ties(explored.decoder, restrict_outputs(explored.decoder, priced, "any"),
                            dict(explored.graph.carried))
    for name, hand in sorted(explored.baselines.items()):
        try:
            plan_selection(explored.decoder, egraph, hand, name)
            where = "in the e-graph"
        except NotInEGraph as err:
            where = f"not in the e-graph: {err}"
        print(f"{name}: {plan_cost(hand, model) * 1e3:.2f} ms, {where}")


if __name__ == "__main__":
    main()
