"""One 70B layer planned on one stage's sub-mesh as `plan_pipeline` plans it, on this tree or an older one (issue 24).

The 70B step's layer on 8x8 cost 9.5 ms a micro-batch (forward + backward) at ebf0b3c and 15.1-15.2 at 7fe0a9b;
this probe plans that one layer (`--mesh`, `--micro-batch`, `--micro-batches` per update, `--stages` for the
stage-boundary pricing where the tree has it) with the tree's own planner defaults (its `LAYER_TIME_LIMIT` where it
has one, else 10 s; `plan_pipeline`'s `Budget()`) and prints the plan's `layer_cost`: forward, backward, update and
exposed reductions, in ms. It runs on older trees too (copy it into `git archive REV`'s benchmarks/, PYTHONPATH at
its src): the extraction's `micro_batches` is passed only where the tree's `Explored.extract` takes it.
`--leaner` then extracts the first leaner plan (under the fastest one's peak, as `plan_pipeline` does where the
fastest does not fit a stage). `--save` writes the plan (`Plan.save`); `--price PATH` prices a saved plan (another
tree's) with this tree's model, without planning: its `layer_cost` and what it costs per update of
`--micro-batches` runs.

    python benchmarks/layer_regression.py --save /tmp/layer.json            # 70B, seq 4096, 8 KV heads, 8x8
    python benchmarks/layer_regression.py --price /tmp/layer.json
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import time

PROFILE = "gpu-h100-cluster"
WIDTHS = {"70B": (8192, 28672, 64), "7B": (4096, 11008, 32), "tiny": (256, 512, 4)}


def layer_graph(width: str, seq: int, kv_heads: int | None, micro_batch: int) -> object:
    """One LLaMA block's training step (bfloat16, meta device): benchmarks/pipeline.py's `layer_builder`."""
    import torch

    from tapestry.importer.zoo import LlamaBlock
    from tapestry.pipeline import layer_step

    hidden, mlp, heads = WIDTHS[width]
    with torch.device("meta"):
        block = LlamaBlock(hidden, heads, mlp, kv_heads).to(torch.bfloat16)
    return layer_step(block, torch.zeros(micro_batch, seq, hidden, dtype=torch.bfloat16, device="meta"))


def describe(plan: object, model: object, micro_batches: int) -> str:
    """The plan's layer cost (ms) and, where the tree has `phase_times`, its time per update of `micro_batches`."""
    from tapestry.pipeline import layer_cost

    c = layer_cost(plan, model)
    said = (f"forward {c.forward * 1e3:.2f} + backward {c.backward * 1e3:.2f} = {(c.forward + c.backward) * 1e3:.2f} ms"
            f" per micro-batch, update {c.update * 1e3:.2f} ms, exposed reductions {c.reduce * 1e3:.2f} ms; "
            f"{micro_batches} x fwd+bwd + update + reductions = "
            f"{(micro_batches * (c.forward + c.backward) + c.update + c.reduce) * 1e3:.1f} ms per update; input "
            f"{c.boundary:,} bytes per device, activations {c.activations:,}, params {c.params:,} per device")
    try:
        from tapestry.cost.breakdown import phase_times
    except ImportError:
        return said
    accumulated = phase_times(plan, model, ('lr',)).accumulated(micro_batches)
    return said + f"; phase_times.accumulated = {accumulated * 1e3:.1f} ms"


def digest(plan: object) -> str:
    """A short hash of the plan's steps' layouts: equal plans, equal digests."""
    text = json.dumps([s for s in plan.to_json()["steps"]], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def watch_starts(explored: object, model: object, micro_batches: int) -> None:
    """Each budgeted ILP call's warm starts and its result, printed: the ILP's objective (`dag_cost` under the
    weighted graph it solved), whether the budget's linear constraints admit it, its plan's peak (`leaner`) and
    time per update of `micro_batches` (`phase_times(...).accumulated`, plan_cost's phases)."""
    from tapestry.cost.breakdown import phase_times
    from tapestry.egraph.pins import steady_picks
    from tapestry.extract import extract
    from tapestry.extract.selection import dag_cost

    selected = type(explored)._selected

    def told(egraph: object, selection: object) -> str:
        plan, _, peaks = explored._lean.leaner(egraph, selection)
        return (f"objective {dag_cost(egraph, selection.choice) * 1e3:.1f}, per update "
                f"{phase_times(plan, model, ('lr',)).accumulated(micro_batches) * 1e3:.1f} ms, peak "
                f"{max(p.bytes for p in peaks):,}")

    def watched(self, egraph, extractor, time_limit, budget, ties, carried, stop_gap=None, model_=None, hands=()):
        found = selected(self, egraph, extractor, time_limit, budget, ties, carried, stop_gap, model_, hands)
        if budget is not None:
            print(f"budgeted {extractor} call (limit {budget.limit:,}, {len(budget.groups)} cuts):", flush=True)
            for i, hand in enumerate(hands):
                print(f"  start {i} ({hand.extractor}): fits the constraints {budget.fits(hand.choice)}, "
                      f"{told(egraph, hand)}", flush=True)
            for i, pick in enumerate(steady_picks(self.decoder, egraph, carried, lambda g: extract(g, "greedy-dag"))):
                print(f"  greedy-dag's steady pick {i} of this graph: {told(egraph, pick)}", flush=True)
            print(f"  returned ({found.extractor}, {found.status}, stopped by {found.stopped_by}): "
                  f"{told(egraph, found)}", flush=True)
        return found

    type(explored)._selected = watched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", default="70B")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=128, help="micro-batches per update")
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--stages", type=int, default=8, help="stages the pipeline has (boundary pricing)")
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--time-limit", type=float, default=None, help="default: the tree's LAYER_TIME_LIMIT, else 10")
    parser.add_argument("--extractor", default="ilp", help="plan_pipeline's default: ilp")
    parser.add_argument("--leaner", action="store_true", help="then the first leaner plan (Explored.leaner_plans), "
                        "as plan_pipeline extracts it where the fastest does not fit a stage")
    parser.add_argument("--leaner-extractor", default="ilp", help="the leaner plan's extractor (plan_pipeline's: ilp)")
    parser.add_argument("--starts", action="store_true", help="with --leaner: print each budgeted ILP call's warm "
                        "starts and result (ILP objective, plan_cost per update, peak; this tree only)")
    parser.add_argument("--save", help="write the plan here (Plan.save)")
    parser.add_argument("--price", help="price this saved plan instead of planning")
    parser.add_argument("--hand", action="store_true", help="price the layer's hand plans (training.plans.baselines) "
                        "instead of planning")
    args = parser.parse_args()
    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.pipeline import planner

    print(f"tapestry from {tapestry.__file__}", flush=True)
    model = DefaultCostModel(load_profile(PROFILE))
    if args.price:
        from tapestry.plan import Plan

        plan = Plan.load(args.price, check=False)
        print(f"{args.price} (digest {digest(plan)}, cost as saved {plan.cost * 1e3:.2f} ms) priced by this tree: "
              f"{describe(plan, model, args.micro_batches)}", flush=True)
        return
    from tapestry.optimizer import explore

    mesh = tapestry.Mesh(*(int(n) for n in args.mesh.split("x")))
    graph = layer_graph(args.width, args.seq, args.kv_heads, args.micro_batch)
    if args.hand:
        from tapestry.training.plans import baselines

        for name, plan in baselines(graph, mesh).items():
            print(f"hand plan {name}: {describe(plan, model, args.micro_batches)}", flush=True)
        return
    time_limit = args.time_limit if args.time_limit is not None else getattr(planner, "LAYER_TIME_LIMIT", 10.0)
    ranking = model
    if hasattr(planner, "BoundaryPriced") or hasattr(planner, "exposed_share"):  # stage hops priced (pipe64c on)
        link = model.profile.axis_links((args.stages, *mesh.shape))[0]
        tried = planner.configurations(args.stages, args.micro_batches, args.layers, planner.SCHEDULES,
                                       planner.CHUNKS)
        ranking = planner.BoundaryPriced.of(model, graph, link, planner.exposed_share(tried, args.layers,
                                                                                      args.micro_batches))
    started = time.process_time()
    explored = explore(graph, mesh, budget=tapestry.Budget())
    print(f"explore: {time.process_time() - started:.1f} CPU s", flush=True)
    extract = explored.extract
    per_step = "micro_batches" in inspect.signature(extract).parameters
    started = time.process_time()
    found = extract(ranking, args.extractor, time_limit, **({"micro_batches": args.micro_batches} if per_step else {}))
    notes = found.plan.notes
    print(f"extract ({'per update of ' + str(args.micro_batches) if per_step else 'one micro-batch'}, time limit "
          f"{time_limit} s): {time.process_time() - started:.1f} CPU s, extractor {notes.get('extractor')}, "
          f"stopped by {notes.get('extractor_stopped_by')}, plan.cost {found.plan.cost * 1e3:.2f} ms, "
          f"peak {found.peak_memory:,} bytes, digest {digest(found.plan)}", flush=True)
    print(f"layer: {describe(found.plan, model, args.micro_batches)}", flush=True)
    if args.save:
        found.plan.save(args.save)
    if args.leaner and hasattr(explored, "leaner_plans"):
        if args.starts:
            watch_starts(explored, model, args.micro_batches)
        started = time.process_time()
        leaner = next(explored.leaner_plans(found, ranking, args.leaner_extractor, time_limit, args.micro_batches),
                      None)
        print(f"leaner plan 1 (under {found.peak_memory - 1:,} bytes): {time.process_time() - started:.1f} CPU s"
              + ("" if leaner is None else f", peak {leaner.peak_memory:,} bytes, extractor "
                 f"{leaner.plan.notes.get('extractor')}, digest {digest(leaner.plan)}; "
                 f"{describe(leaner.plan, model, args.micro_batches)}"), flush=True)


if __name__ == "__main__":
    main()
