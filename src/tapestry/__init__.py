"""Tapestry: shard, fuse and substitute tensor block programs with an e-graph, then run them.

    g = tapestry.Graph(); ...; result = tapestry.optimize(g, mesh=tapestry.Mesh(4))
"""
from tapestry.egraph.driver import Budget
from tapestry.evaluator import evaluate, evaluate_sharded, random_inputs
from tapestry.graph import Graph, GraphError, load_graph, save_graph
from tapestry.kernels import KERNELS, Kernel, get_kernel
from tapestry.optimizer import OptimizeResult, explore, optimize
from tapestry.plan import Plan
from tapestry.sharding import Mesh

__all__ = ["KERNELS", "Budget", "Graph", "GraphError", "Kernel", "Mesh", "OptimizeResult", "Plan", "evaluate",
           "evaluate_sharded", "explore", "get_kernel", "load_graph", "optimize", "random_inputs", "save_graph"]
