"""Where a cluster case's communication goes (issue 24, topology): each collective of a plan by kind, the mesh
axes it crosses (and so its link: NVLink in a node, InfiniBand across, `Profile.axis_links`), the kernel that
makes its value and the ones that read it, for the search's plan and the hand plans of benchmarks/cluster.py.

One case of benchmarks/cluster.py (`build`: transformers' model at a real width, on meta, one Adam step), priced
with its profile (gpu-h100-cluster). `--data-first` overrides generation's order for the experiment of issue
24's item 2: `always` puts the candidates that split only the token ids' dims over the outer axes first on every
mesh (`partition.generation_order` with `data` from `Generator.data_dims`), `never` on none; the default keeps
the optimizer's own rule. Prints; writes nothing.

    python benchmarks/cluster_links.py --model Mixtral --mesh 8x8             # search and hand plans
    python benchmarks/cluster_links.py --model 7B --mesh 8x8 --no-hand --data-first always
    python benchmarks/cluster_links.py --model Mixtral --mesh 8x8 --no-hand --budget 60  # a larger search budget
"""
from __future__ import annotations

import argparse
import math
import time
from collections import Counter, defaultdict
from typing import Any

from cluster import EXPERT_WEIGHTS, PROFILE, Case, build, degrees, tensor_parallel_dims

TOP = 12  # collectives listed per plan, dearest first


def routes(plan: Any, model: Any) -> dict[tuple[str, ...], tuple[float, int]]:
    """Seconds and count per (what, kind, links, producer, readers): each priced Reshard, and each exchange step's
    all-to-alls (`Compute.exchange`)."""
    from tapestry.cost.comm import moves
    from tapestry.plan.plan import Compute, Reshard

    mesh = plan.mesh
    links = model.profile.axis_links(mesh.shape)
    names = {link: name for name, link in zip(("nvlink", "infiniband"), sorted(set(links), key=lambda k: -k.beta))}
    readers: dict[str, set[str]] = defaultdict(set)
    for step in plan.steps:
        if isinstance(step, Compute):
            for arg in step.args:
                readers[arg].add(step.kernel)
    found: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0.0, 0])
    for step in plan.steps:
        if isinstance(step, Reshard):
            seconds = model.step_cost(step, mesh)
            if not seconds:
                continue
            moved = moves(step.src_layout, step.layout, step.shape, mesh)
            source = plan.by_id[step.src]
            key = ("reshard", moved.kind, _links(moved.axes, links, names),
                   source.kernel if isinstance(source, Compute) else "input", ",".join(sorted(readers[step.out])))
        elif isinstance(step, Compute) and step.exchange:
            seconds = model.comm.exchange_time(step, mesh)
            key = ("exchange", "all_to_all", _links(step.exchange, links, names), step.kernel, "")
        else:
            continue
        found[key][0] += seconds
        found[key][1] += 1
    return {key: (s, n) for key, (s, n) in found.items()}


def exchanges(plan: Any) -> Counter[tuple[str, tuple[int, ...]]]:
    """How many exchange steps (`Compute.exchange`) of each kernel run over each set of mesh axes."""
    from tapestry.plan.plan import Compute

    return Counter((step.kernel, step.exchange) for step in plan.steps if isinstance(step, Compute) and step.exchange)


def _links(axes: tuple[int, ...], links: tuple[Any, ...], names: dict[Any, str]) -> str:
    return "+".join(sorted({names[links[a]] for a in axes})) + f" {axes}"


def show(name: str, plan: Any, model: Any) -> None:
    from tapestry.cost import plan_cost

    found = routes(plan, model)
    by_link: dict[str, float] = defaultdict(float)
    for key, (seconds, _) in found.items():
        by_link["infiniband" if "infiniband" in key[2] else "nvlink"] += seconds
    print(f"\n{name} on {'x'.join(map(str, plan.mesh.shape))}: {plan_cost(plan, model) * 1e3:.2f} ms; communication "
          + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(by_link.items())))
    print("| ms | count | what | kind | links (axes) | made by | read by |\n|---:|---:|---|---|---|---|---|")
    for key in sorted(found, key=lambda k: -found[k][0])[:TOP]:
        print(f"| {found[key][0] * 1e3:.3f} | {found[key][1]} | " + " | ".join(key) + " |")


def hand(imported: Any, case: Case) -> dict[str, Any]:
    """benchmarks/cluster.py's hand plans a MoE or dense step can take on the case's mesh (DPxTP, DPxEP on the
    2-D recipe's mesh, EP on the mesh itself where the experts split over its devices)."""
    import tapestry
    from tapestry.training.plans import data_expert_parallel, data_tensor_parallel, expert_parallel

    graph, arguments = imported.graph, imported.translation.user_inputs
    hidden = tensor_parallel_dims([n.name for n in graph.inputs])
    experts = {n.name: 0 for n in graph.inputs if n.name.endswith(EXPERT_WEIGHTS) and not n.name.startswith("adam.")}
    outer = tapestry.Mesh(math.prod(case.shape[:-1]), case.shape[-1])
    makers = {"DPxTP": lambda: data_tensor_parallel(graph, outer, arguments, hidden)}
    if experts:
        attention = {name: dim for name, dim in hidden.items() if name not in experts}
        makers["DPxEP"] = lambda: data_expert_parallel(graph, outer, arguments, attention, experts)
        makers["EP"] = lambda: expert_parallel(graph, tapestry.Mesh(*case.shape), arguments, experts)
    found = {}
    for name, make in makers.items():
        try:
            found[name] = make()
        except ValueError as err:  # e.g. 8 experts over 64 devices
            print(f"{name}: {str(err).splitlines()[0]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Mixtral")
    parser.add_argument("--arch", default="hf", choices=("hf", "block"))
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--no-hand", action="store_true")
    parser.add_argument("--no-search", action="store_true")
    parser.add_argument("--data-first", choices=("default", "always", "never"), default="default")
    parser.add_argument("--budget", type=float, default=30.0, help="the search's Budget.seconds (the default)")
    args = parser.parse_args()

    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.egraph import generate
    from tapestry.egraph.driver import Budget
    from tapestry.sharding import partition

    if args.data_first == "always":
        generate.DATA_FIRST_DEVICES = partition.NODES_FIRST_DEVICES = 0
    elif args.data_first == "never":
        generate.DATA_FIRST_DEVICES = 2**62
    case = Case(args.model, args.layers, "training", args.mesh, 8, 2048, arch=args.arch)
    imported = build(case)
    model = DefaultCostModel(load_profile(PROFILE))
    for name, plan in ({} if args.no_hand else hand(imported, case)).items():
        show(name, plan, model)
    if not args.no_search:
        cpu = time.process_time()
        result = tapestry.optimize(imported.graph, tapestry.Mesh(*case.shape), cost_model=model,
                                   budget=Budget(seconds=args.budget))
        print(f"\nsearch (data first: {args.data_first}, budget {args.budget:g} CPU s): "
              f"{time.process_time() - cpu:.0f} CPU s, {result.status}, {result.selection.extractor}, "
              f"{degrees(result.plan, imported.translation.user_inputs)}")
        print("exchanges (kernel, mesh axes): " + ", ".join(
            f"{kernel} {axes} x{n}" for (kernel, axes), n in sorted(exchanges(result.plan).items())))
        show("search", result.plan, model)


if __name__ == "__main__":
    main()
