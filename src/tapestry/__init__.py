"""Tapestry: shard, fuse and substitute tensor block programs with an e-graph, then run them.

    g = tapestry.Graph(); ...; result = tapestry.optimize(g, mesh=tapestry.Mesh(4))

The optimiser's names (`optimize`, `explore`, `OptimizeResult`, `Budget`) load egglog on first use, so that running
a saved plan needs only torch and numpy: a GPU machine that runs plans need not have egglog, islpy or ortools.
"""
from __future__ import annotations

import importlib
from typing import Any

from tapestry.evaluator import evaluate, evaluate_sharded, random_inputs
from tapestry.graph import Graph, GraphError, load_graph, save_graph
from tapestry.kernels import KERNELS, Kernel, get_kernel
from tapestry.plan import Plan
from tapestry.sharding import Mesh

_OPTIMIZER = {"Budget": "tapestry.egraph.driver", "OptimizeResult": "tapestry.optimizer",
              "explore": "tapestry.optimizer", "optimize": "tapestry.optimizer",
              "from_torch": "tapestry.importer", "TorchImport": "tapestry.importer",
              "TorchImportError": "tapestry.importer", "Training": "tapestry.training"}


def __getattr__(name: str) -> Any:
    if name in _OPTIMIZER:
        return getattr(importlib.import_module(_OPTIMIZER[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KERNELS", "Budget", "Graph", "GraphError", "Kernel", "Mesh", "OptimizeResult", "Plan", "TorchImport",
           "TorchImportError", "Training", "evaluate", "evaluate_sharded", "explore", "from_torch", "get_kernel", "load_graph",
           "optimize", "random_inputs", "save_graph"]
