"""CPU seconds `validate_plan` takes on a large mesh (issue 24, item 4): the 2-layer LLaMA-7B-wide blocks' training
step (benchmarks/cluster.py's `--arch block` case), planned by the hand DP x TP recipe on a 2-D mesh.

    python benchmarks/validation_time.py --mesh 8x64      # 512 devices
"""
from __future__ import annotations

import argparse
import re
import time

from cluster import Case, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="8x64", help="a 2-D mesh: data parallel x tensor parallel")
    args = parser.parse_args()
    import tapestry
    from tapestry.plan.validate import validate_plan
    from tapestry.training.plans import data_tensor_parallel

    imported = build(Case("7B", 2, "training", "8x8", 8, 2048, arch="block"))
    graph = imported.graph
    hidden = {n.name: 0 if re.search(r"\.(q|k|v|gate|up)\.weight$", n.name) else 1 for n in graph.inputs
              if re.search(r"\.(q|k|v|gate|up|o|down)\.weight$", n.name) and not n.name.startswith("adam.")}
    mesh = tapestry.Mesh(*(int(n) for n in args.mesh.split("x")))
    plan = data_tensor_parallel(graph, mesh, imported.translation.user_inputs, hidden)
    started = time.process_time()
    validate_plan(plan)
    print(f"validate_plan: {len(plan.steps)} steps on {args.mesh}: {time.process_time() - started:.2f} CPU s")


if __name__ == "__main__":
    main()
