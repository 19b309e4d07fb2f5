"""The greedy fallback's periodic candidates for a folded training step, each priced as its expanded plan (issue 24).

The 7B-width `LlamaForCausalLM` (benchmarks/cluster.py's case), one Adam step, folded (`layers=True`) on Mesh(8, 8)
with the gpu-h100-cluster profile, extracted under the plain sum of node costs (the fit `Explored.extract` makes
for a folded step): the free greedy-dag choice, each copy's choice mirrored onto the other (`Layered.mirror`)
with its broken carried pairs mended (`pins.steady_repaired`), and the choices under the pins the fallback tries
(`pins.placed_layouts`, `pins.delivered_layouts`, each aligned to one copy), mirrored each way. Per candidate: its
objective (ms), steady pairs broken, whether copy 1 repeats copy 0 (`holds`), and the expanded plan's plan_cost.

    python benchmarks/folded_candidates.py --layers 4
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import cluster  # noqa: E402

import tapestry  # noqa: E402
from tapestry import optimizer  # noqa: E402
from tapestry.cost import DefaultCostModel, load_profile, plan_cost  # noqa: E402
from tapestry.egraph.pins import (  # noqa: E402
    delivered_layouts,
    pin_layouts,
    placed_layouts,
    steady_repaired,
    steady_ties,
)
from tapestry.extract import Selection, extract  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    model = DefaultCostModel(load_profile(cluster.PROFILE))
    imported = cluster.build(cluster.Case("7B", args.layers, "training", "8x8", 8, 2048))
    cpu = time.process_time()
    explored = optimizer.explore(imported.graph, tapestry.Mesh(8, 8), layers=True)
    layered, decoder = explored.layered, explored.decoder
    assert layered is not None
    carried = {out: name for out, name in explored.whole.carried.items() if out in explored.graph.outputs}
    priced = decoder.extraction_graph(list(explored.roots), model, explored.priced_moves)
    egraph, steady = steady_ties(decoder, priced, carried)
    egraph = layered.costs(egraph)
    print(f"explore and pricing: {time.process_time() - cpu:.1f} CPU s", flush=True)

    def line(what: str, selection: Selection) -> str:
        chosen = set(selection.choice.values())
        broken = sum((a in chosen) != (b in chosen) for a, b in steady)
        ms = plan_cost(explored._lean.decode(egraph, selection)[0], model) * 1e3 if layered.holds(selection) else None
        return (f"{what}: objective {selection.dag_cost * 1e3:.3f}, {broken} steady pairs broken, holds "
                f"{layered.holds(selection)}" + ("" if ms is None or broken else f", plan {ms:.2f} ms"))

    free = extract(egraph, "greedy-dag")
    print(line("free", free), flush=True)
    for source in (0, 1):
        mirrored = layered.mirror(egraph, free, source)
        print(line(f"  copy {source} for both", mirrored), flush=True)
        repaired = steady_repaired(decoder, egraph, mirrored.choice, carried)
        if repaired is not None:
            print(line("    mended", layered.mirror(egraph, replace(mirrored, choice=repaired), source)), flush=True)
    for name, pins in (("placed", placed_layouts(decoder, free, carried)),
                       ("delivered", delivered_layouts(decoder, free, carried))):
        for aligned in (1, 0):
            pinned = extract(pin_layouts(decoder, egraph, layered.aligned(pins, aligned), carried), "greedy-dag")
            print(line(f"{name} pins aligned to copy {aligned}", pinned), flush=True)
            for source in (0, 1):
                print(line(f"  copy {source} for both", layered.mirror(egraph, pinned, source)), flush=True)
    print(f"total: {time.process_time() - cpu:.1f} CPU s")


if __name__ == "__main__":
    main()
