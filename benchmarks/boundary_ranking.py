"""One stage count's fastest layer plan extracted plainly and with its stage hops priced (`BoundaryPriced`), each
weighed by both objectives and by the pipeline (issue 24, item 3).

benchmarks/pipeline.py's layer (a LLaMA block at `--width`) is explored on the sub-mesh `--stages` stages of `--mesh`
get, and its fastest plan for `--micro-batches` runs per update extracted twice: by the cost model as is (the
optimizer prices placing an input as free) and as `plan_pipeline` ranks it over more than one stage
(`pipeline.boundary.BoundaryPriced`, a layer's share of the hops, `planner.exposed_share`). For each plan: the
extraction's notes (which fit won), the objective without hops (`accumulated_cost`, what the extraction's fits are
weighed by), the hops' seconds per update (the micro-batches x each boundary Place's `BoundaryPriced.hop`), the
boundary inputs' layouts and bytes per device, the layer's costs (`layer_cost`) and the best configuration of
`--layers` layers (`best_configuration`, the 80 GB budget, mixed precision).

    python benchmarks/boundary_ranking.py --mesh 8x8 --stages 4
"""
from __future__ import annotations

import argparse
import time

from pipeline import PROFILE, layer_arguments, layer_builder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layer_arguments(parser)
    parser.add_argument("--global-batch", type=int, default=2048, help="sequences per step")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--stages", type=int, default=4, help="stages over mesh axis 0")
    parser.add_argument("--memory-budget", type=float, default=80e9)
    args = parser.parse_args()
    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.optimizer import explore
    from tapestry.pipeline import MIXED, layer_cost
    from tapestry.pipeline.boundary import BoundaryPriced, boundary_inputs
    from tapestry.pipeline.planner import (
        CHUNKS,
        LAYER_TIME_LIMIT,
        best_configuration,
        configurations,
        exposed_share,
        ideal_time,
        stage_mesh,
    )
    from tapestry.pipeline.schedule import SCHEDULES
    from tapestry.plan import Place

    model = DefaultCostModel(load_profile(PROFILE))
    graph = layer_builder(args.width, args.seq, args.kv_heads)(args.micro_batch)
    mesh = tapestry.Mesh(*(int(n) for n in args.mesh.split("x")))
    sub, m = stage_mesh(mesh, 0, args.stages), args.global_batch // args.micro_batch
    link = model.profile.axis_links(mesh.shape)[0]
    hops = exposed_share(configurations(args.stages, m, args.layers, SCHEDULES, CHUNKS), args.layers, m)
    ranking = BoundaryPriced.of(model, graph, link, hops)
    started = time.process_time()
    explored = explore(graph, sub, budget=tapestry.Budget(seconds=30))
    print(f"explore {sub}: {time.process_time() - started:.1f} CPU s; {args.stages} stages, {m} micro-batches, "
          f"{hops:g} round trips a layer and micro-batch, link beta {link.beta:.3g} B/s", flush=True)
    crossing = boundary_inputs(graph)
    for name, by in (("plain", model), ("hops priced", ranking)):
        started = time.process_time()
        result = explored.extract(by, time_limit=LAYER_TIME_LIMIT, micro_batches=m)
        spent = time.process_time() - started
        plan = result.plan
        places = [s for s in plan.steps if isinstance(s, Place) and s.input in crossing]
        hop_s = m * sum(ranking.hop(s) for s in places)
        blind = plan.notes["accumulated_cost"]
        layer = layer_cost(plan, model)
        found = best_configuration(layer, args.layers, mesh, 0, args.stages, m, MIXED, link, args.memory_budget,
                                   micro_batch=args.micro_batch)
        notes = {k: plan.notes[k] for k in ("status", "extractor_status", "node_costs", "extractor", "overlap_rounds")
                 if k in plan.notes}
        print(f"{name}: {spent:.1f} CPU s; notes {notes}", flush=True)
        print(f"  objective without hops {blind * 1e3:.3f} ms per update, hops {hop_s * 1e3:.3f} ms, with hops "
              f"{(blind + hop_s) * 1e3:.3f} ms", flush=True)
        for s in places:
            most = max((b.size for b in s.layout.blocks if b is not None), default=0)
            print(f"  Place {s.input} {s.layout}: {most:,} elements ({plan.dtypes[s.out]}) on the fullest device",
                  flush=True)
        print(f"  layer: forward {layer.forward * 1e3:.4f} ms, backward {layer.backward * 1e3:.4f} ms, update "
              f"{layer.update * 1e3:.4f} ms, reduce {layer.reduce * 1e3:.4f} ms, input {layer.boundary:,} bytes per "
              f"device; floor {ideal_time(layer, args.layers, args.stages, m, MIXED) * 1e3:.1f} ms", flush=True)
        print("  best configuration: " + ("none fits" if found is None else
                                         f"{found.schedule.name} v={found.schedule.chunks}, {found.cost * 1e3:.1f} "
                                         f"ms, {found.peak_memory / 2**30:.2f} GiB"), flush=True)


if __name__ == "__main__":
    main()
