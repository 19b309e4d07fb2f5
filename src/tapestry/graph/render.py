"""Graphviz pictures of block graphs."""
from __future__ import annotations

import shutil
from pathlib import Path

import graphviz

from tapestry.graph.graph import Graph


def graph_to_dot(graph: Graph) -> graphviz.Digraph:
    dot = graphviz.Digraph("graph", graph_attr={"rankdir": "LR"}, node_attr={"fontname": "Helvetica"})
    for node in graph:
        shape_text = "×".join(map(str, node.shape)) or "scalar"
        if node.is_input:
            dot.node(node.name, f"{node.name}\n{shape_text}", shape="box", style="filled", fillcolor="#D6EAF8")
        else:
            params = "".join(f"\n{k}={v}" for k, v in node.params)
            dot.node(node.name, f"{node.op}{params}\n{shape_text}", shape="ellipse", tooltip=node.name)
        for arg in node.args:
            dot.edge(arg, node.name)
    for out, target in graph.outputs.items():
        dot.node(f"output_{out}", out, shape="doubleoctagon", style="filled", fillcolor="#D5F5E3")
        dot.edge(target, f"output_{out}")
    return dot


def write_picture(dot: graphviz.Digraph, path: str | Path) -> Path:
    """Write .svg/.png/.pdf through graphviz's `dot`, or the .dot source itself."""
    path = Path(path)
    fmt = path.suffix.lstrip(".") or "svg"
    if fmt in ("dot", "gv"):
        path.write_text(dot.source)
        return path
    if shutil.which("dot") is None:
        raise FileNotFoundError(f"cannot write {path}: graphviz's `dot` is not installed (apt-get install graphviz), "
                           "or ask for a .dot file instead")
    path.write_bytes(dot.pipe(format=fmt))
    return path
