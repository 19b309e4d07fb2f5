"""Each hand plan's peak as built (its own step order, the program's) and as decoded from its selection of the
e-graph (`LeanPlans.leaner`: the decoder's order or the lean order): a budget between the two was met by no plan
found before `LeanPlans.hand` (issue 24, budget5b). The held-back call's model, small, by default the tiny LLaMA of
tests/test_memory_cuts.py::test_a_budget_zero3_meets_in_its_own_order_returns_a_plan_within_it.

    python benchmarks/hand_order_peaks.py [--hidden 64] [--vocab 2048] [--layers 1] [--seq 16] [--batch 8]
        [--mesh 2]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import tapestry  # noqa: E402
from heldback_call import arguments, build  # noqa: E402  benchmarks/, this script's folder
from tapestry.cost import DefaultCostModel, load_profile  # noqa: E402
from tapestry.egraph.budget import leaner  # noqa: E402
from tapestry.egraph.embed import embedded_plans  # noqa: E402
from tapestry.egraph.pins import restrict_outputs, steady_ties  # noqa: E402
from tapestry.optimizer import explore  # noqa: E402


def main() -> None:
    parser = arguments()
    parser.set_defaults(hidden=64, intermediate=128, heads=4, vocab=2048, layers=1, seq=16, batch=8, mesh="2")
    args = parser.parse_args()
    model, ids = build(args)

    def loss(module, ids, labels):  # noqa: ANN001, ANN202
        return module(input_ids=ids, labels=labels, use_cache=False).loss

    graph = tapestry.from_torch(model, (ids, ids), verbose=False,
                                training=tapestry.Training(loss=loss, optimizer="adam", lr=1e-4)).graph
    explored = explore(graph, tapestry.Mesh(*(int(n) for n in args.mesh.split("x"))))
    decoder = explored.decoder
    egraph = decoder.extraction_graph(list(explored.roots), DefaultCostModel(load_profile(args.profile)),
                                      explored.priced_moves, drop_dominated=False)
    egraph, ties = steady_ties(decoder, restrict_outputs(decoder, egraph, "any"), dict(graph.carried))
    for plan, selection in embedded_plans(decoder, egraph, explored.baselines, ties):
        built = max(p.bytes for p in leaner(plan, list(range(len(plan.steps))))[2])
        decoded = max(p.bytes for p in explored._lean.leaner(egraph, selection)[2])
        print(f"{selection.extractor}: {built:,} bytes per device as built, {decoded:,} decoded", flush=True)


if __name__ == "__main__":
    main()
