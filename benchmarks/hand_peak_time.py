"""CPU seconds `cost.peak_memory` takes for the hand plans on many devices (issue 24): the 2-layer LLaMA-7B-wide
blocks' training step (benchmarks/cluster.py's `--arch block` case) planned by training/plans.py's data parallel,
ZeRO-3 and Megatron tensor parallel on a flat mesh, as cluster.py prices them.

    python benchmarks/hand_peak_time.py --devices 512
"""
from __future__ import annotations

import argparse
import time

from cluster import Case, build, tensor_parallel_dims


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=512)
    args = parser.parse_args()
    import tapestry
    from tapestry.cost import peak_memory
    from tapestry.training.plans import data_parallel, megatron, zero3

    imported = build(Case("7B", 2, "training", "8x8", 8, 2048, arch="block"))
    graph, arguments = imported.graph, imported.translation.user_inputs
    mesh = tapestry.Mesh(args.devices)
    hidden = tensor_parallel_dims([n.name for n in graph.inputs])
    for name, plan in (("DP", data_parallel(graph, mesh, arguments)), ("ZeRO-3", zero3(graph, mesh, arguments)),
                       ("TP", megatron(graph, mesh, hidden))):
        started = time.process_time()
        peaks = peak_memory(plan)
        print(f"{name}: {len(plan.steps)} steps on {args.devices} devices, peak {max(peaks):,} bytes: "
              f"{time.process_time() - started:.1f} CPU s", flush=True)


if __name__ == "__main__":
    main()
