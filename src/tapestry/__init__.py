"""Tapestry: shard, fuse and substitute tensor block programs with an e-graph, then run them."""
from tapestry.evaluator import evaluate, evaluate_sharded, random_inputs
from tapestry.graph import Graph, GraphError, load_graph, save_graph
from tapestry.kernels import KERNELS, Kernel, get_kernel

__all__ = ["KERNELS", "Graph", "GraphError", "Kernel", "evaluate", "evaluate_sharded", "get_kernel", "load_graph",
           "random_inputs", "save_graph"]
