"""`tapestry explain PLAN.json`, and plan pictures for `tapestry show` (registered on import)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tapestry.graph.command import RENDERERS
from tapestry.plan.explain import explain
from tapestry.plan.plan import FORMAT, Plan
from tapestry.plan.render import plan_to_dot

RENDERERS[FORMAT] = lambda data, source: plan_to_dot(Plan.from_json(data, source))


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("explain", help="print a plan step by step: blocks, layouts, communication")
    parser.add_argument("file", type=Path, help="plan JSON file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = Plan.load(args.file)  # checked: an edited file is refused
    print(explain(plan))
    return 0
