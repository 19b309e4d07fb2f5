"""Programs on the command line: a graph JSON, or a Python script defining one.

A script defines `graph` (a tapestry.Graph), or `model` (a torch.nn.Module) and `example_inputs` (a tuple of
its arguments; `example_kwargs` optional), which is imported with tapestry.from_torch. It may also define `mesh`.
"""
from __future__ import annotations

import runpy
from pathlib import Path

from tapestry.graph import Graph, load_graph
from tapestry.sharding import Mesh


def load_program(path: Path) -> tuple[Graph, Mesh | None]:
    if path.suffix != ".py":
        return load_graph(path), None
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such script")
    scope = runpy.run_path(str(path), run_name="__tapestry__")
    graph = scope.get("graph")
    if graph is None and "model" in scope:
        if "example_inputs" not in scope:
            raise ValueError(f"{path}: a script defining `model` must also define `example_inputs` (a tuple)")
        from tapestry.importer import from_torch

        graph = from_torch(scope["model"], scope["example_inputs"], scope.get("example_kwargs")).graph
    if not isinstance(graph, Graph):
        raise ValueError(f"{path}: the script must define `graph` (a tapestry.Graph), or `model` and "
                         "`example_inputs` (a torch module and its arguments)")
    return graph, scope.get("mesh")
