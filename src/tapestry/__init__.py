"""Tapestry: shard, fuse and substitute tensor block programs with an e-graph, then run them.

    g = tapestry.Graph(); ...; result = tapestry.optimize(g, mesh=tapestry.Mesh(4))

Names load on first use, so that running a saved plan needs only torch and numpy (a GPU machine that runs plans
need not have egglog, islpy or ortools) and `tapestry --help` imports nothing heavy.
"""
from __future__ import annotations

import importlib
from typing import Any

# Every name loads on first use: `tapestry --help` and a rank that runs a saved plan import none of torch, egglog, islpy
# or ortools until they need them.
_LAZY = {"evaluate": "tapestry.evaluator", "evaluate_sharded": "tapestry.evaluator", "random_inputs": "tapestry.evaluator",
         "Graph": "tapestry.graph", "GraphError": "tapestry.graph", "load_graph": "tapestry.graph",
         "save_graph": "tapestry.graph", "KERNELS": "tapestry.kernels", "Kernel": "tapestry.kernels",
         "get_kernel": "tapestry.kernels", "Plan": "tapestry.plan", "Mesh": "tapestry.sharding",
         "Budget": "tapestry.egraph.driver", "OptimizeResult": "tapestry.optimizer",
         "explore": "tapestry.optimizer", "optimize": "tapestry.optimizer",
         "from_torch": "tapestry.importer", "TorchImport": "tapestry.importer",
         "TorchImportError": "tapestry.importer", "Training": "tapestry.training",
         "equivalent": "tapestry.prove", "Equivalence": "tapestry.prove", "parallelize": "tapestry.spmd.module",
         "ParallelModule": "tapestry.spmd.module", "ParallelProgram": "tapestry.spmd.program",
         "launch": "tapestry.spmd.launch", "run_plan": "tapestry.runtime",
         "parallelize_step": "tapestry.spmd.step", "ParallelStep": "tapestry.spmd.step",
         "plan_pipeline": "tapestry.pipeline"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    try:  # `import tapestry; tapestry.cost.plan_cost(...)` worked while this file imported everything
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KERNELS", "Budget", "Equivalence", "Graph", "GraphError", "Kernel", "Mesh", "OptimizeResult",
           "ParallelModule", "ParallelProgram", "ParallelStep", "Plan", "TorchImport", "TorchImportError", "Training",
           "equivalent", "evaluate", "evaluate_sharded", "explore", "from_torch", "get_kernel", "launch", "load_graph",
           "optimize", "parallelize", "parallelize_step", "plan_pipeline", "random_inputs", "run_plan", "save_graph"]
