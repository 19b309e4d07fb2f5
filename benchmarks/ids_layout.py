"""Why a cluster plan keeps the token ids whole (issue 24: `ids split` is 1 on most training rows of the "Cluster"
table): the plan's layouts of the ids, the embedding table and the LM head, the steps that read the ids with their
prices, the embedding output's moves, and what gathering the table whole would cost.

    python benchmarks/ids_layout.py --model 7B --mesh 8

One of benchmarks/cluster.py's training cases (transformers' model at its real width under torch.device("meta"),
--layers layers, batch 8 x 2048), planned by `tapestry.optimize` with the gpu-h100-cluster profile at an 80 GB
budget, as the table's rows are.
"""
from __future__ import annotations

import argparse
import time
import warnings

from cluster import PROFILE, Case, build, distinct_blocks

TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="7B")
    parser.add_argument("--mesh", default="8")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.plan import Compute, Place, Reshard
    from tapestry.sharding import Layout

    case = Case(args.model, args.layers, "training", args.mesh, 8, 2048, memory_budget=80 * 10**9)
    imported = build(case)
    model, mesh = DefaultCostModel(load_profile(PROFILE)), tapestry.Mesh(*case.shape)
    started = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tapestry.optimize(imported.graph, mesh, cost_model=model, memory_budget=case.memory_budget)
    plan = result.plan
    print(f"plan {plan.cost * 1e3:.4f} ms, {result.status}, optimize {time.process_time() - started:.1f} CPU s")
    arguments = imported.translation.user_inputs
    places = {s.input: s for s in plan.steps if isinstance(s, Place)}
    for name in (*arguments, *TABLES):
        s = places[name]
        print(f"place {name}: {distinct_blocks(s.layout)} blocks, first {s.layout.blocks[0]}")
    ms = lambda step: f"{model.step_cost(step, mesh) * 1e3:.3f} ms"  # noqa: E731
    reads = {places[a].out for a in arguments}
    for s in plan.steps:
        if isinstance(s, Reshard) and s.src in reads:
            reads.add(s.out)
            print(f"move of the ids {s.src} -> {s.out}: {ms(s)}")
        elif isinstance(s, Compute) and reads & set(s.args) and s.kernel in ("embedding", "scatter_rows"):
            print(f"{s.kernel} {s.out}: {ms(s)}, reads " + ", ".join(str(l.blocks[0]) for l in s.arg_layouts))
            if s.kernel == "embedding":
                for r in plan.steps:
                    if isinstance(r, Reshard) and r.src == s.out:
                        print(f"  its output moved: {ms(r)}, to a first block {r.layout.blocks[0]}")
    table = places[TABLES[0]]
    whole = Reshard("whole", table.out, table.shape, table.layout, Layout.replicated(table.shape, mesh),
                    plan.dtypes[table.out])
    print(f"the table gathered whole ({plan.dtypes[table.out]}): {ms(whole)}")


if __name__ == "__main__":
    main()
