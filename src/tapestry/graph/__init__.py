"""Block graph IR, builder, JSON and pictures."""
from tapestry.graph.graph import INPUT, Graph, GraphError, Node, Value, check_name
from tapestry.graph.serialize import graph_from_json, graph_to_json, load_graph, save_graph

__all__ = ["INPUT", "Graph", "GraphError", "Node", "Value", "check_name", "graph_from_json", "graph_to_json",
           "load_graph", "save_graph"]
