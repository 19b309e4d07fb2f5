"""`tapestry optimize` and `tapestry schema`: saturate, extract and save a plan, showing progress.

A CLI module at the top level, not in egraph/: it drives the optimizer, and nothing below the optimizer imports it."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tapestry.egraph.driver import Budget, IterationStats
from tapestry.egraph.schema import schema_text
from tapestry.program import load_program
from tapestry.sharding import Mesh


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("optimize", help="find the cheapest plan for a graph on a mesh")
    p.add_argument("program", type=Path, help="GRAPH.json or SCRIPT.py (defining `graph`)")
    p.add_argument("--mesh", type=Mesh.parse, default=None, help="devices, e.g. 4 or 2x2 (default 1)")
    p.add_argument("--rules", type=Path, action="append", default=[], help="extra rule file or directory")
    p.add_argument("--no-builtin-rules", action="store_true", help="use only the --rules given")
    p.add_argument("--budget-nodes", type=int, default=Budget.nodes)
    p.add_argument("--budget-seconds", type=float, default=Budget.seconds)
    p.add_argument("--budget-iterations", type=int, default=Budget.iterations)
    p.add_argument("--extractor", default="ilp", choices=["bottom-up", "greedy-dag", "ilp"])
    p.add_argument("--time-limit", type=float, default=10.0, help="extraction time limit (s)")
    p.add_argument("--profile", default="cpu-gloo", help="cost-model profile name or JSON path")
    p.add_argument("--stats", type=Path, help="write per-iteration saturation stats as JSON")
    p.add_argument("--egraph-svg", type=Path, help="draw the e-graph (small ones only)")
    p.add_argument("--egraph-json", type=Path,
                   help="write the costed distributed layer as egraph-serialize JSON (for `tapestry extract`)")
    p.add_argument("--memory-budget", type=int, help="bytes per device; the fastest plan that fits")
    p.add_argument("--pareto", action="store_true", help="print the time/peak-memory front, save each plan")
    p.add_argument("--pareto-plot", type=Path, help="plot the front as PNG/SVG (implies --pareto)")
    p.add_argument("--out", "-o", type=Path, default=Path("plan.json"))
    p.set_defaults(func=run)
    schema = sub.add_parser("schema", help="print the egglog schema generated from the kernel registry")
    schema.set_defaults(func=lambda _: print(schema_text()) or 0)


def run(args: argparse.Namespace) -> int:
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.egraph.rules import builtin_rule_paths
    from tapestry.optimizer import explore

    console = Console(stderr=True)
    graph, script_mesh = load_program(args.program)
    mesh = args.mesh or script_mesh or Mesh(1)
    rules = ([] if args.no_builtin_rules else builtin_rule_paths()) + list(args.rules)
    budget = Budget(args.budget_nodes, args.budget_seconds, args.budget_iterations)

    def progress(stats: IterationStats) -> None:
        fired = sum(stats.matches.values())
        console.print(f"  round {stats.iteration}: {stats.enodes} e-nodes, {stats.eclasses} e-classes, "
                      f"{stats.new_logical_nodes} new ops, {fired} matches, {stats.seconds:.2f}s")

    console.print(f"optimizing {args.program} ({len(graph.ops)} ops) on mesh {mesh}")
    model = DefaultCostModel(load_profile(args.profile))
    explored = explore(graph, mesh, rules, budget, progress)
    if args.egraph_json:
        args.egraph_json.write_text(json.dumps(explored.decoder.serialized(list(explored.roots), model)))
        console.print(f"wrote {args.egraph_json}")
    if args.pareto or args.pareto_plot:
        front = explored.pareto(model, args.extractor, args.time_limit)
        _report_front(front, args.out, args.pareto_plot)
        result = front[0]
    else:
        result = explored.extract(model, args.extractor, args.time_limit, args.memory_budget)
    console.print(f"saturation stopped by {result.stats.stopped_by}; extraction {result.selection.status}")
    result.plan.save(args.out)
    if args.stats:
        args.stats.write_text(result.stats.dumps())
    if args.egraph_svg:
        result.render_egraph(args.egraph_svg)
    table = Table("step", "kind", "what", "layout")
    for step in result.plan.steps:
        kind = type(step).__name__.lower()
        what = getattr(step, "kernel", getattr(step, "input", getattr(step, "src", "")))
        table.add_row(step.out, kind, str(what), step.layout.name(step.shape, mesh))
    Console().print(table)
    print(json.dumps({"plan": str(args.out), "cost": result.plan.cost, "steps": len(result.plan.steps),
                      "stopped_by": result.stats.stopped_by}))
    return 0


def _report_front(front: list, out: Path, plot: Path | None) -> None:
    """A table of the time/memory front; each plan saved beside `out`; optionally a plot."""
    table = Table("plan", "predicted time (s)", "peak memory per device (bytes)", "steps", title="Pareto front")
    for i, result in enumerate(front):
        path = out.with_name(f"{out.stem}.pareto{i}{out.suffix}")
        result.plan.save(path)
        table.add_row(str(path), f"{result.plan.cost:.6g}", f"{result.peak_memory:,}", str(len(result.plan.steps)))
    Console().print(table)
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        points = sorted((r.peak_memory / 2**20, r.plan.cost) for r in front)
        ax.step([m for m, _ in points], [t for _, t in points], "o-", where="post")
        ax.set_xlabel("peak memory per device (MiB)")
        ax.set_ylabel("predicted time (s)")
        ax.set_title("time / memory Pareto front")
        fig.tight_layout()
        fig.savefig(plot)
