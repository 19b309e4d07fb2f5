"""`tapestry import-report MODEL...`: what importing each model makes of it (importer/report.py)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tapestry.cli import UserError
from tapestry.sharding import Mesh

HELP = "report what importing a PyTorch model makes of it: kernels, opaque ops and why, FLOPs that can shard"


def register(subparsers: Any) -> None:
    from tapestry.importer.zoo import FAMILIES

    parser = subparsers.add_parser("import-report", help=HELP, description=HELP + ".")
    parser.add_argument("models", nargs="+", metavar="MODEL",
                        help="a script defining `model` and `example_inputs` (and optionally `example_kwargs`), "
                             f"a family of the built-in tiny zoo ({', '.join(FAMILIES)}), or `zoo` for all of them")
    parser.add_argument("--mesh", type=Mesh.parse, default=Mesh(4), help="the mesh sharding is judged on (4, 2x2)")
    parser.add_argument("--optimize", action="store_true", help="also optimize, and report the FLOPs the plan shards")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tapestry import optimize
    from tapestry.importer import from_torch
    from tapestry.importer.report import import_report
    from tapestry.importer.zoo import FAMILIES
    from tapestry.program import load_model

    names = [n for m in args.models for n in (FAMILIES if m == "zoo" else [m])]
    for name in names:
        if name in FAMILIES:
            module, inputs, kwargs = FAMILIES[name].build()
        elif name.endswith(".py"):
            module, inputs, kwargs = load_model(Path(name))
        else:
            raise UserError(f"{name!r} is neither a .py model script nor a zoo family ({', '.join(FAMILIES)})")
        imported = from_torch(module, inputs, kwargs, verbose=False)
        plan = optimize(imported.graph, mesh=args.mesh).plan if args.optimize else None
        print(import_report(name, imported, args.mesh, plan).text(), flush=True)
    return 0
