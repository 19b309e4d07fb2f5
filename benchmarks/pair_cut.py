"""Does a cluster case's plan depend on an op it does not care about? (issue 24, path24: generation's cut on layout
pairs kept a different set of sharded runs after the importer folded the causal mask's `& True`, one op fewer.)

    python benchmarks/pair_cut.py --model Mixtral --mesh 8x8x8 --layers 2 --memory-budget 80 [--extra-op]

Plans benchmarks/cluster.py's training case (`build`, its profile, the default budget), with --extra-op the causal
mask's `mask & True` imported as `mask & mask` (one op more, as before d3d99e5's fold), and prints the graph's op
count, generation's stop, runs and layout pairs, the layout pairs when each round of sharded runs started, the
plan's ms, a digest of its compute steps without value names (equal digests: the same plan), the extraction's
extractor and stop, the moves priced, and optimize's CPU s. With --generation it stops after generation and lists
the sharded runs made (kernel and input shapes, counted): equal lists with and without --extra-op (but the extra
op's own) say the cut kept the same runs. Run it under several PYTHONHASHSEEDs to compare hash seeds.
"""
from __future__ import annotations

import argparse
import hashlib
import time
from dataclasses import replace

from cluster import PROFILE, Case, build


def _mask_kept() -> None:
    """`x & True` on a bool value imported as `x & x`: the importer before d3d99e5's fold, one op more."""
    from tapestry.importer.aten import elementwise

    folded = elementwise.binary

    def binary(b, kernel, lhs, rhs):  # noqa: ANN001, ANN202
        left, right = elementwise._scalar(lhs), elementwise._scalar(rhs)
        if kernel == "logical_and" and (left is None) != (right is None) and bool(left if right is None else right):
            value = b.tensor(rhs if right is None else lhs)
            if value.dtype == "bool":
                return b.op("logical_and", value, value)
        return folded(b, kernel, lhs, rhs)

    elementwise.binary = binary


def _rounds() -> tuple[list[int], list[str]]:
    """Layout pairs when each round of sharded runs starts (Generator._runs called with a new rank), and each
    sharded run's node (rank, kernel, input shapes), in the order generation inserted them."""
    from tapestry.egraph.generate import Generator

    seen: list[int] = []
    made: list[str] = []
    runs = Generator._runs

    def logged(self, item, sharded, rank=None, data=None):  # noqa: ANN001, ANN202
        if sharded and rank is not None and rank >= len(seen):
            seen.append(self.layout_pairs)
        if sharded:
            made.append(f"{rank} {item.sig.kernel.name} {list(item.sig.input_shapes)}")
        return runs(self, item, sharded, rank, data)

    Generator._runs = logged
    return seen, made


def _generation(graph, mesh, seconds: float, rounds: list[int], made: list[str]) -> None:  # noqa: ANN001
    """Saturate as `explore` does (the hand plans seeded) and print what generation's sharded rounds held."""
    from collections import Counter

    from tapestry.egraph.driver import Budget, saturate
    from tapestry.egraph.rules import load_rules
    from tapestry.training.plans import baselines

    cpu = time.process_time()
    _, _, stats = saturate(graph, mesh, load_rules(), Budget(seconds=seconds), None,
                           tuple(baselines(graph, mesh).values()), ())
    gen = stats.generation
    print(f"{sum(1 for node in graph if not node.is_input)} ops, {gen.nodes} nodes distributed; stopped by "
          f"{gen.stopped_by or '-'}, {gen.runs} runs, {gen.layout_pairs:,} pairs; pairs at each round's start "
          f"{rounds}; {len(made)} sharded runs, the last: {made[-3:]}; {time.process_time() - cpu:.1f} CPU s")
    for line, n in sorted(Counter(made).items()):
        print(f"  {n} x {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Mixtral")
    parser.add_argument("--mesh", default="8x8x8")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=30.0, help="Budget.seconds (the default)")
    parser.add_argument("--memory-budget", type=float, help="GB (10**9 bytes) per device")
    parser.add_argument("--extra-op", action="store_true", help="import the mask's `& True` as `mask & mask`")
    parser.add_argument("--generation", action="store_true", help="stop after generation: print which nodes got "
                        "sharded runs (their kernel and input shapes, a multiset: names differ with the op)")
    args = parser.parse_args()

    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.plan import Compute

    if args.extra_op:
        _mask_kept()
    rounds, made = _rounds()
    case = Case(args.model, args.layers, "training", args.mesh, args.batch, args.seq,
                memory_budget=None if args.memory_budget is None else int(args.memory_budget * 10**9))
    graph = build(case).graph
    model = DefaultCostModel(load_profile(PROFILE))
    if args.generation:
        _generation(graph, tapestry.Mesh(*case.shape), args.budget, rounds, made)
        return
    cpu = time.process_time()
    result = tapestry.optimize(graph, tapestry.Mesh(*case.shape), cost_model=model,
                               budget=tapestry.Budget(seconds=args.budget), memory_budget=case.memory_budget)
    cpu = time.process_time() - cpu
    gen = result.stats.generation
    steps = "\n".join(sorted(repr(replace(step, out="?", args=("?",) * len(step.args), origin=""))
                             for step in result.plan.steps if isinstance(step, Compute)))
    print(f"{case.model} {case.mesh} {case.layers} layers{' +1 op' if args.extra_op else ''}: "
          f"{sum(1 for node in graph if not node.is_input)} ops; generation: stopped by {gen.stopped_by or '-'}, "
          f"{gen.runs} runs, {gen.runs_left_out} left out, {gen.layout_pairs:,} layout pairs; pairs at each round's "
          f"start {rounds}; plan {result.plan.cost * 1e3:.4f} ms, {result.status}, peak "
          f"{result.peak_memory / 1e9:.2f} GB, steps {hashlib.sha256(steps.encode()).hexdigest()[:12]}; "
          f"extraction {result.selection.extractor}, stopped by {result.selection.stopped_by}, "
          f"node sum {result.selection.dag_cost * 1e3:.4f} ms; moves priced {result.stats.moves:,}, unpriced "
          f"{result.stats.moves_unpriced:,}; optimize {cpu:.1f} CPU s", flush=True)


if __name__ == "__main__":
    main()
