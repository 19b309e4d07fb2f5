"""A 4-layer MLP, the seeds' Y = ReLU(Linear(X, W, b)) stacked: `tapestry run examples/mlp.py --nproc 4 --verify`."""
from __future__ import annotations

from tapestry import Graph


def mlp(batch: int = 512, width: int = 256, layers: int = 4) -> Graph:
    g = Graph()
    h = g.input("x", (batch, width))
    for k in range(layers):
        w, b = g.input(f"w{k}", (width, width)), g.input(f"b{k}", (width,))
        h = g.relu(g.linear(h, w, b))
    g.output("y", h)
    return g


graph = mlp()
