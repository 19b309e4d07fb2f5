"""CPU seconds of the ILP's passes before CP-SAT, one by one, on the graph `tapestry.optimize` extracts from.

    PYTHONHASHSEED=0 python benchmarks/ilp_passes.py --model gpt_neox [--mesh 2x2] [--repeats 5]

Runs benchmarks/phases.py's `--optimize` case for a zoo FAMILY (`--extractor ilp`), keeps the first graph the ILP
extractor is given (`extract.ilp._extract`: the floored extraction graph), then times on it, each the least CPU
seconds (`time.process_time`) of `--repeats` runs: the tree choice, greedy-dag's warm start with its local search
(its 0.3 share of a 10 s limit, as `warm_start` runs it), `reduction.reduce`, the contracted problem
(`contract.contracted`), its value blocks (`contract.value_blocks`), its LP's set-up (`relax.Lp`) and solve (one
run). Prints one JSON line, with the LP's bound and the reduced candidates' count: equal on two trees where the
passes compute the same. Uses only APIs main's older trees have too, so the same file times an older checkout
(PYTHONPATH=OLD/src python benchmarks/ilp_passes.py ...).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import tapestry.extract.ilp as ilp
from tapestry.extract.contract import contracted, value_blocks
from tapestry.extract.greedy_dag import greedy_dag_choice
from tapestry.extract.reduction import reduce
from tapestry.extract.relax import Lp
from tapestry.extract.tree import tree_choice
from tapestry.extract.work import Meter

LIMIT = 10.0  # the ILP's time limit the passes' work budgets are shares of


def least(run: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(The least CPU seconds of `repeats` runs, the last run's result.)"""
    spent, result = [], None
    for _ in range(repeats):
        started = time.process_time()
        result = run()
        spent.append(time.process_time() - started)
    return min(spent), result


def captured(model: str, mesh: str) -> Any:
    """The first graph `tapestry.optimize` hands the ILP for `model` on `mesh`."""
    graphs: list[Any] = []
    real = ilp._extract

    def keep(egraph: Any, *args: Any) -> Any:
        graphs.append(egraph)
        return real(egraph, *args)

    ilp._extract = keep
    sys.path.insert(0, str(Path(__file__).parent))
    import phases  # benchmarks/, this script's folder

    argv, sys.argv = sys.argv, ["phases.py", "--model", model, "--mesh", mesh, "--extractor", "ilp", "--optimize"]
    try:
        phases.main()
    finally:
        sys.argv, ilp._extract = argv, real
    return graphs[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt_neox")
    parser.add_argument("--mesh", default="2x2")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    egraph = captured(args.model, args.mesh)
    egraph.child_sets, egraph.parents, egraph.selectable_nodes  # made once per graph, before any pass
    seconds: dict[str, float] = {}
    seconds["tree"], tree = least(lambda: tree_choice(egraph), args.repeats)
    seconds["greedy_dag"], _ = least(lambda: greedy_dag_choice(egraph, tree, Meter(LIMIT).until(0.3 * LIMIT)),
                                     args.repeats)
    seconds["reduce"], reduced = least(lambda: reduce(egraph, tree), args.repeats)
    block = {c: reduced.block(c) for c in reduced.candidates}
    seconds["contracted"], (graph, kept) = least(lambda: contracted(egraph, reduced.candidates, block), args.repeats)
    seconds["value_blocks"], (grown, needs) = least(
        lambda: value_blocks(egraph, reduced.candidates, block, reduced.needs), args.repeats)
    seconds["contracted_child_sets"], _ = least(lambda: graph.child_sets, 1)  # on main: made here, once
    seconds["lp_setup"], lp = least(lambda: Lp(graph, kept, grown, needs, (), Meter(LIMIT).until(LIMIT)), args.repeats)
    seconds["lp_solve"], (bound, _) = least(lambda: lp.solve(Meter(LIMIT).until(LIMIT)), 1)
    print(json.dumps({"model": args.model, "mesh": args.mesh, "nodes": egraph.num_nodes,
                      "candidates": sum(map(len, reduced.candidates.values())), "lp_bound": bound,
                      **{k: round(v, 4) for k, v in seconds.items()}}))


if __name__ == "__main__":
    main()
