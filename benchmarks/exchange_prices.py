"""One exchanged grouped mm's price, whole-axis against grouped (issue 24, gep24b).

`python benchmarks/exchange_prices.py` prices grouped_mm_blocks of Qwen2-MoE's sizes (60 experts, 8 blocks of
2048 x 4 routed rows, hidden 2048, 2 x 1408 features, float32) on Mesh(8) by gpu-h100-nccl: its experts over the
whole axis (ragged: 8 or 7 a device) and in runs of 4 (15 each), the outer part splitting the rows, the blocks or
nothing. Compute is the busiest device's; the all-to-alls' seconds follow.
"""
from __future__ import annotations

from tapestry.cost import DefaultCostModel, load_profile
from tapestry.graph import Graph
from tapestry.plan import Compute
from tapestry.sharding import Mesh
from tapestry.sharding.partition import make_partition


def main() -> None:
    model = DefaultCostModel(load_profile("gpu-h100-nccl"))
    g = Graph()
    blocks, rows, hidden, features, experts = 8, 2048 * 4, 2048, 2 * 1408, 60
    x, w = g.input("x", (blocks, rows, hidden)), g.input("w", (experts, hidden, features))
    g.output("y", g.op("grouped_mm_blocks", x, w, g.input("ends", (blocks, experts), "int64"), name="mm"))
    sig, mesh = g.signature("mm"), Mesh(8)
    for label, outer, group in [("whole axis", None, 0), ("runs of 4, rows between", "row", 4),
                                ("runs of 4, blocks between", "block", 4), ("runs of 4, nothing between", None, 4)]:
        axes = (None if outer is None else sig.dims.index(outer),)
        step = Compute.running(sig, make_partition(sig, mesh, axes, (0,), exchange_group=group))
        print(f"{label}: compute {model.roofline.compute_time(step, mesh) * 1e3:.3f} ms, "
              f"all-to-alls {model.comm.exchange_time(step, mesh) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
