"""Programs on the command line: a graph JSON, or a Python script defining one.

A script defines `graph` (a tapestry.Graph), or `model` (a torch.nn.Module) and `example_inputs` (a tuple of
its arguments; `example_kwargs` optional), which is imported with tapestry.from_torch. It may also define `mesh`.
"""
from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

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
        from tapestry.importer import from_torch

        graph = from_torch(*model_of(scope, path)).graph
    if not isinstance(graph, Graph):
        raise ValueError(f"{path}: the script must define `graph` (a tapestry.Graph), or `model` and "
                         "`example_inputs` (a torch module and its arguments)")
    return graph, scope.get("mesh")


def model_of(scope: dict[str, Any], path: Path) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """(model, example_inputs, example_kwargs) of a script's globals."""
    if "model" not in scope or "example_inputs" not in scope:
        raise ValueError(f"{path}: a model script defines `model` (a torch.nn.Module) and `example_inputs` (a tuple "
                         "of its arguments; `example_kwargs` optional)")
    inputs = scope["example_inputs"]
    return scope["model"], inputs if isinstance(inputs, tuple) else (inputs,), dict(scope.get("example_kwargs") or {})


def load_model(path: Path) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """A model script's (model, example_inputs, example_kwargs)."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such script")
    return model_of(runpy.run_path(str(path), run_name="__tapestry__"), path)
