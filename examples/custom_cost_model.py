"""A user-defined cost model: price plans by the bytes they move, ignoring compute.

Any class with `step_cost(step, mesh) -> float` is a cost model (tapestry.cost.CostModel
is a typing.Protocol; no subclassing). Here it prices hand-built plans next to the
built-in DefaultCostModel, then drives the optimizer: `tapestry.optimize(graph, mesh,
cost_model=BytesMoved())`.
"""
from __future__ import annotations

import tapestry
from tapestry.cost import DefaultCostModel, load_profile, plan_cost
from tapestry.graph import Graph
from tapestry.plan import Reshard, Step, build_plan
from tapestry.sharding import Mesh
from tapestry.sharding.comm import received_elements


class BytesMoved:
    """Bytes the busiest device receives: a proxy for a network-bound cluster."""

    def step_cost(self, step: Step, mesh: Mesh) -> float:
        if not isinstance(step, Reshard):
            return 0.0
        return 4.0 * max(received_elements(step.src_layout, step.layout))


def mlp() -> Graph:
    g = Graph()
    x = g.input("x", (512, 256))
    h = g.linear_relu(x, g.input("w1", (256, 1024)), g.input("b1", (1024,)), name="up")
    g.output("y", g.linear(h, g.input("w2", (1024, 256)), g.input("b2", (256,)), name="down"))
    return g


def main() -> None:
    graph, mesh = mlp(), Mesh(4)
    plans = {
        "replicated": build_plan(graph, mesh),
        "data parallel": build_plan(graph, mesh, {"up": (0,), "down": (0,)}),
        "columns, then rows": build_plan(graph, mesh, {"up": (1,), "down": (0,)}),
    }
    default = DefaultCostModel(load_profile("cpu-gloo"))
    for name, plan in plans.items():
        print(f"{name:>16}: {plan_cost(plan, BytesMoved()):>10,.0f} bytes moved, "
              f"{plan_cost(plan, default) * 1e3:8.3f} ms on cpu-gloo")
    chosen = tapestry.optimize(graph, mesh, cost_model=BytesMoved()).plan
    print(f"{'optimised':>16}: {plan_cost(chosen, BytesMoved()):>10,.0f} bytes moved, "
          f"{plan_cost(chosen, default) * 1e3:8.3f} ms on cpu-gloo")


if __name__ == "__main__":
    main()
