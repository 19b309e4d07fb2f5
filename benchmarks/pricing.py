"""CPU seconds of pricing the reshards of one saturated model, on its own, so two trees can be compared on the
same reshards and their prices checked bit for bit.

    .venv/bin/python benchmarks/pricing.py record --model llama --mesh 2x2 OUT.pkl   # explore, keep the reshards
    PYTHONPATH=OLD/src .venv/bin/python benchmarks/pricing.py replay OUT.pkl --save OLD.prices
    PYTHONPATH=src     .venv/bin/python benchmarks/pricing.py replay OUT.pkl --compare OLD.prices

`record` saturates the importer zoo's tiny model (as benchmarks/phases.py does), prices its extraction graph with
the default cost model and pickles every Reshard step that `AlphaBeta.reshard_time` was asked for, in order.
`replay` prices them again in a fresh process (cold caches, as extraction does), prints one JSON line with the CPU
seconds (time.process_time: a loaded machine inflates it far less than wall time) and, with --compare, how many
prices differ from a saved run's (they must not: plans depend on them). `--repeat N` prices them N times in one
process, each pass from cold caches (pricing's functools caches cleared) with the collector off as in `optimize`,
and prints the least CPU: on a shared machine the least of a few passes moves less with the load than one run.
`--calls` adds one more pass from cold caches under cProfile and prints its count of Python function calls
(`python_calls`), which no load moves: a change too small to show in CPU seconds at load 10 shows there.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pickle
import pstats
import time


def record(model: str, mesh_text: str, out: str) -> None:
    from tapestry.cost import comm
    from tapestry.egraph.driver import Budget
    from tapestry.importer import from_torch
    from tapestry.importer.zoo import EXTRA, FAMILIES
    from tapestry.optimizer import default_cost_model, explore
    from tapestry.sharding import Mesh

    mesh = Mesh.parse(mesh_text)
    module, args, kwargs = {**EXTRA, **FAMILIES}[model].build()  # as benchmarks/phases.py names them
    explored = explore(from_torch(module, args, kwargs, verbose=False).graph, mesh, None, Budget(seconds=30))
    steps = []
    priced = comm.AlphaBeta.reshard_time

    def recorded(self, step, mesh):  # noqa: ANN001, ANN202
        steps.append(step)
        return priced(self, step, mesh)

    comm.AlphaBeta.reshard_time = recorded
    explored.decoder.extraction_graph(list(explored.roots), default_cost_model())
    with open(out, "wb") as f:
        pickle.dump((steps, mesh, default_cost_model()), f)
    print(json.dumps({"model": model, "mesh": mesh_text, "reshards": len(steps), "out": out}))


def replay(path: str, save: str | None, compare: str | None, repeat: int = 1, calls: bool = False) -> None:
    with open(path, "rb") as f:
        steps, mesh, model = pickle.load(f)
    if repeat > 1:  # as `optimize` prices: the collector off; each pass from cold caches, the least CPU kept
        gc.disable()
    seconds = []
    for _ in range(repeat):
        for cached in _caches():
            cached.cache_clear()
        start = time.process_time()
        prices = [model.step_cost(step, mesh) for step in steps]
        seconds.append(time.process_time() - start)
    result = {"reshards": len(steps), "cpu_s": round(min(seconds), 3)}
    if repeat > 1:
        result["cpu_s_each"] = [round(s, 3) for s in seconds]
    if calls:
        for cached in _caches():
            cached.cache_clear()
        profile = cProfile.Profile()
        profile.runcall(lambda: [model.step_cost(step, mesh) for step in steps])
        result["python_calls"] = pstats.Stats(profile).total_calls
    if save:
        with open(save, "wb") as f:
            pickle.dump(prices, f)
    if compare:
        with open(compare, "rb") as f:
            expected = pickle.load(f)
        result["differing_prices"] = sum(a != b for a, b in zip(expected, prices, strict=True))
    print(json.dumps(result))


def _caches() -> list:
    """The functools caches of pricing's modules (tapestry.sharding, .cost, .zspace), each once."""
    import importlib
    import pkgutil

    import tapestry.cost
    import tapestry.sharding
    import tapestry.zspace

    found = {}
    for package in (tapestry.sharding, tapestry.cost, tapestry.zspace):
        for info in pkgutil.iter_modules(package.__path__):
            for value in vars(importlib.import_module(f"{package.__name__}.{info.name}")).values():
                if hasattr(value, "cache_clear") and getattr(value, "__module__", "").startswith("tapestry"):
                    found[id(value)] = value
    return list(found.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--model", default="llama")
    rec.add_argument("--mesh", default="2x2")
    rec.add_argument("out")
    rep = sub.add_parser("replay")
    rep.add_argument("path")
    rep.add_argument("--save")
    rep.add_argument("--compare")
    rep.add_argument("--repeat", type=int, default=1, help="passes from cold caches, collector off; the least CPU")
    rep.add_argument("--calls", action="store_true", help="count one cold pass's Python function calls (cProfile)")
    args = parser.parse_args()
    if args.command == "record":
        record(args.model, args.mesh, args.out)
    else:
        replay(args.path, args.save, args.compare, args.repeat, args.calls)


if __name__ == "__main__":
    main()
