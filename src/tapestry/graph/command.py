"""`tapestry show FILE -o OUT.svg`: a picture of a graph (and, once registered, of a plan)."""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import graphviz

from tapestry.graph.render import graph_to_dot, write_picture
from tapestry.graph.serialize import FORMAT, graph_from_json

# format tag of a JSON document -> function drawing it; other modules add their formats here.
RENDERERS: dict[str, Callable[[dict[str, Any], str], graphviz.Digraph]] = {
    FORMAT: lambda data, source: graph_to_dot(graph_from_json(data, source)),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="draw a graph or plan JSON as SVG/PNG/PDF (or .dot)")
    p.add_argument("file", type=Path, help="graph.json or plan.json")
    p.add_argument("-o", "--out", type=Path, help="output picture (default: FILE with .svg)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    data = json.loads(args.file.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{args.file}: the top level is a JSON {type(data).__name__}; a graph or plan is an object")
    fmt = data.get("format")
    if fmt not in RENDERERS:
        raise ValueError(f"{args.file}: unknown document format {fmt!r}; expected one of {sorted(RENDERERS)}")
    out = write_picture(RENDERERS[fmt](data, str(args.file)), args.out or args.file.with_suffix(".svg"))
    print(out)
    return 0
