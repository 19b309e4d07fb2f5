"""Plans shared by the lowering, runtime and SPMD tests (test_lower, test_runtime, test_spmd): small graphs, and
hand-built plans of them on 2 ranks (CASES) and on a 2x2 grid (GRID), each run and compared with the evaluator."""
from __future__ import annotations

from collections.abc import Callable

from tapestry.demo import seeds_example
from tapestry.graph import Graph
from tapestry.plan import Plan, build_plan
from tapestry.sharding import Mesh

MESH = Mesh(2)


def matmul_relu(a: tuple[int, int], b: tuple[int, int]) -> Graph:
    g = Graph()
    g.output("y", g.relu(g.matmul(g.input("a", a), g.input("b", b))))
    return g


def matmul_half_relu(a: tuple[int, int], b: tuple[int, int]) -> Graph:
    """relu of the first half of a matmul's columns (a chunk's half, as a fused gate-up projection's)."""
    g = Graph()
    m = g.matmul(g.input("a", a), g.input("b", b))
    g.output("y", g.relu(g.slice(m, axis=1, start=0, stop=b[1] // 2)))
    return g


def chain(batch: int, features: int, out: int) -> Graph:
    g = Graph()
    x = g.input("x", (batch, features))
    h = g.relu(g.linear(x, g.input("w0", (features, out)), g.input("b0", (out,))))
    g.output("y", g.linear(h, g.input("w1", (out, out)), g.input("b1", (out,))))
    return g


def conv() -> Graph:
    g = Graph()
    x = g.relu(g.input("x", (1, 2, 9, 6)))
    g.output("y", g.conv2d(x, g.input("w", (3, 2, 3, 3)), padding=1))
    return g


def padding_only() -> Graph:
    """Stride 2 over a padded 1x1 image: every output cell reads only padding or the one input cell."""
    g = Graph()
    x, w = g.input("x", (1, 1, 1, 1), "float64"), g.input("w", (1, 1, 1, 1), "float64")
    g.output("y", g.relu(g.conv2d(x, w, padding=1, stride=2)))
    return g


# name -> plan on 2 ranks; test_runtime runs every one of these and compares with tapestry.evaluate
CASES: dict[str, Callable[[], Plan]] = {
    "seeds split on batch": lambda: build_plan(seeds_example(8, 4, 6), MESH, {"linear_0": (0,), "relu_0": (0,)}),
    "seeds split on out": lambda: build_plan(seeds_example(8, 4, 6), MESH, {"linear_0": (1,), "relu_0": (1,)}),
    "matmul split on k, then rows": lambda: build_plan(matmul_relu((6, 8), (8, 5)), MESH,
                                                       {"matmul_0": (2,), "relu_0": (0,)}),
    "matmul split on k, then whole": lambda: build_plan(matmul_relu((6, 8), (8, 5)), MESH, {"matmul_0": (2,)}),
    "matmul split on k, then half of it whole": lambda: build_plan(matmul_half_relu((6, 8), (8, 10)), MESH,
                                                                   {"matmul_0": (2,)}),
    "chain of different splits": lambda: build_plan(chain(8, 4, 6), MESH, {"linear_0": (0,), "relu_0": (1,)}),
    "conv2d split on rows": lambda: build_plan(conv(), MESH, {"relu_0": (2,), "conv2d_0": (2,)}),
    "uneven sizes": lambda: build_plan(chain(7, 3, 5), MESH, {"linear_0": (0,), "relu_0": (1,)}),
    "float64 reads of padding only": lambda: build_plan(padding_only(), MESH, {"conv2d_0": (2,)}),
}


# name -> plan on a 2x2 grid of ranks
GRID: dict[str, Callable[[], Plan]] = {
    "partial sums reduced in each row of devices": lambda: build_plan(
        matmul_relu((8, 12), (12, 6)), Mesh(2, 2), {"matmul_0": (0, 2), "relu_0": (0, 1)}),
    "columns gathered in each row of devices": lambda: build_plan(
        matmul_relu((8, 12), (12, 6)), Mesh(2, 2), {"matmul_0": (0, 1), "relu_0": (0, None)}),
}
