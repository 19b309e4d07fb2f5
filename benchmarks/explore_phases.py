"""Where a training step's exploration (`optimizer.explore`: saturation, generation, reshards) spends its CPU.

    python benchmarks/explore_phases.py --model 7B --layers 32 --mesh 8x8
    python benchmarks/explore_phases.py --zoo gpt_neox --mesh 2x2

Builds the case as benchmarks/cluster.py does (LLaMA-2 widths on the meta device, one Adam step at batch 8 x
sequence 2048), or with `--zoo` the graph benchmarks/phases.py plans for a tiny zoo model, then explores it once
with the default budget, each phase in EXPLORE_PHASES timed (CPU seconds of this process, inclusive: a phase's
seconds include the phases called inside it). Also egglog's side: each ruleset's CPU seconds over the rule rounds,
and per round what each rule matched and whether the e-graph changed (egglog's run report). Ends with the explored
e-graph's size, which a cut that keeps the e-graph must keep.
A phase missing from the tree on PYTHONPATH (an older commit's) is left out, so trees compare.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import time
from collections import defaultdict
from typing import Any

import phases
from cluster import Case, build

EXPLORE_PHASES = (
    "tapestry.optimizer:explore", "tapestry.optimizer:find_layers", "tapestry.optimizer:fold",
    "tapestry.optimizer:baselines", "tapestry.optimizer:saturate", "tapestry.egraph.generate:Generator.encode",
    "tapestry.egraph.generate:Generator.refresh", "tapestry.egraph.generate:Generator.distribute",
    "tapestry.egraph.generate:runs_for", "tapestry.egraph.distributed:Interner.candidates",
    "tapestry.egraph.distributed:partition_issues", "tapestry.egraph.generate:Generator._seed_runs",
    "tapestry.egraph.generate:Generator._unions", "tapestry.egraph.session:Session.insert",
    "tapestry.egraph.session:Session.serialize", "tapestry.optimizer:make_reshards",
    "tapestry.egraph.decode:reshard_pairs", "tapestry.egraph.distributed:movable", "tapestry.sharding.comm:can_move",
    "tapestry.optimizer:Decoder", "tapestry.optimizer:Layered")


def timed(spent: dict[str, list[float]], name: str, function: Any) -> Any:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name].append(time.process_time() - start)
    return run


def wrap(spent: dict[str, list[float]], names: tuple[str, ...]) -> None:
    """Each "module:attribute" timed under its own name, where the tree has it."""
    for name in names:
        module_name, attribute = name.split(":")
        owner: Any = importlib.import_module(module_name)
        *path, last = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        if not hasattr(owner, last):
            continue
        wrapped = timed(spent, f"{module_name.rsplit('.', 1)[-1]}.{attribute}", getattr(owner, last))
        setattr(owner, last, staticmethod(wrapped) if isinstance(inspect.getattr_static(owner, last), staticmethod)
                else wrapped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="7B")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--zoo", help="a tiny zoo model by benchmarks/phases.py's name, instead of --model/--layers")
    args = parser.parse_args()
    import tapestry
    from tapestry.egraph.session import Session

    case = Case(args.model, args.layers, "training", args.mesh, 8, 2048)
    start = time.process_time()
    graph = phases.model(args.zoo, 1) if args.zoo else build(case).graph
    print(f"import: {time.process_time() - start:.1f} CPU s, {len(graph.ops):,} ops")
    spent: dict[str, list[float]] = defaultdict(list)
    wrap(spent, EXPLORE_PHASES)
    rounds: list[tuple[str, float, bool, dict[str, int]]] = []
    run_ruleset = Session.run_ruleset

    def report(self: Session, name: str) -> tuple[dict[str, int], bool]:
        start = time.process_time()
        matches, updated = run_ruleset(self, name)
        rounds.append((name, time.process_time() - start, updated, {k: n for k, n in matches.items() if n}))
        return matches, updated

    Session.run_ruleset = report
    from tapestry import optimizer  # wrapped above

    explored = optimizer.explore(graph, tapestry.Mesh(*case.shape))
    print("| phase | calls | CPU s |\n|---|---:|---:|")
    for name, calls in spent.items():
        print(f"| `{name}` | {len(calls):,} | {sum(calls):.2f} |")
    by_ruleset: dict[str, float] = defaultdict(float)
    for name, seconds, _, _ in rounds:
        by_ruleset[name] += seconds
    print("rulesets, CPU s over all rounds:", {name: round(s, 4) for name, s in by_ruleset.items()})
    for name, seconds, updated, matched in rounds:
        print(f"  {name}: {seconds:.4f} s, changed {updated}, matches {matched}")
    stats = explored.stats
    print(f"rule rounds: {[(r.iteration, r.enodes, r.new_logical_nodes) for r in stats.iterations]}, "
          f"stopped by {stats.stopped_by}")
    print(f"e-graph: {stats.enodes:,} e-nodes, {stats.eclasses:,} e-classes; generation {stats.generation}")


if __name__ == "__main__":
    main()
