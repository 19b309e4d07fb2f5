"""`tapestry extract FILE.json`: extract from any egraph-serialize file; the last stdout line is JSON."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from tapestry.cli import UserError
from tapestry.extract import EXTRACTORS, EGraph, EGraphError, extract, validate
from tapestry.extract.validate import cycles


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "extract",
        help="extract the cheapest acyclic selection from a serialized e-graph",
        description="Extract from an egraph-serialize JSON file. The last line of output is a JSON summary.",
    )
    parser.add_argument("file", type=Path, help="egraph-serialize JSON file")
    parser.add_argument("--extractor", choices=tuple(EXTRACTORS), default="ilp")
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="ILP time limit (seconds)")
    parser.add_argument("--stop-gap", type=float, default=0.0, metavar="SHARE",
                        help="ILP: stop at a selection within this share of its bound (default 0: prove it optimal)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Exit 0 on a valid selection, 1 if the validator objects; input problems raise UserError (exit 2)."""
    if args.time_limit <= 0:
        raise UserError(f"--time-limit must be positive, got {args.time_limit}")
    if not 0 <= args.stop_gap < 1:
        raise UserError(f"--stop-gap must be a share in [0, 1), got {args.stop_gap}")
    console = Console(stderr=True)
    try:
        with console.status(f"loading {args.file}"):
            egraph = EGraph.load(args.file)
        with console.status(f"{args.extractor}: {egraph.num_nodes} nodes, {egraph.num_classes} classes"):
            selection = extract(egraph, args.extractor, args.time_limit, stop_gap=args.stop_gap)
    except EGraphError as err:
        message = str(err)
        raise UserError(message if message.startswith(str(args.file)) else f"{args.file}: {message}") from None
    problems = validate(egraph, selection)
    for problem in problems:
        console.print(f"invalid selection: {problem}", style="red", markup=False)
    summary: dict[str, Any] = {
        "dag_cost": selection.dag_cost,
        "seconds": round(selection.seconds, 3),
        "extractor": selection.extractor,
        "acyclic": not cycles(egraph, selection),
        "valid": not problems,
        "nodes_chosen": len(selection.choice),
    }
    if selection.status != "heuristic":
        summary.update(status=selection.status, bound=selection.bound, gap=selection.gap)
    print(json.dumps(summary))
    return 1 if problems else 0
