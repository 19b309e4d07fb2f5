"""What the ILP's phases count against what they cost: the calibration of extract/work.py's rates.

    python benchmarks/extract_work.py [--layered] [--cluster MODEL MODE MESH] [--time-limit 10]

`--layered` (the default): greedy-dag's local search run to its end on `layered` test graphs (tests/extract_helpers),
its tries (greedy_dag.TRIES_PER_SECOND) against its CPU seconds. `--cluster`: one case of benchmarks/cluster.py
(e.g. `Mixtral training 8`, 2 layers, no hand plans) planned in this process, and for each of its extractions the
CPU seconds of each ILP phase (warm start, contracted LP, LP pass and its separation rounds, CP-SAT's parts)
against the seconds of work it charged (`work.Meter`), and the result. One JSON line per graph or phase. CPU
seconds are this process's (time.process_time); the load changes them, not the work.
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from tapestry.extract import ilp, separation  # noqa: E402
from tapestry.extract.greedy_dag import TRIES_PER_SECOND, greedy_choice, improve  # noqa: E402
from tapestry.extract.selection import finalize  # noqa: E402
from tapestry.extract.tree import solvable_tree  # noqa: E402
from tapestry.extract.work import Meter  # noqa: E402

LAYERED = ((300, 12, 0), (60, 4, 1), (16, 8, 0))  # values, layouts, seed
PHASES = {"warm_start": lambda a: a[2], "contracted_bound": lambda a: a[4].meter, "relax": lambda a: a[4].meter,
          "solve_parts": lambda a: a[6].meter}


def layered_tries() -> None:
    from extract_helpers import layered

    for values, layouts, seed in LAYERED:
        egraph = layered(values, layouts, seed)
        tree = solvable_tree(egraph)
        greedy = greedy_choice(egraph)
        start = finalize(egraph, greedy, tree, "greedy-dag", 0.0).choice
        full = [start.get(c, g if g >= 0 else t) for c, (g, t) in enumerate(zip(greedy, tree.node))]
        meter = Meter(1e9)
        cpu = time.process_time()
        improve(egraph, full, tree, meter.until(1e9))
        spent = time.process_time() - cpu
        tries = round(meter.spent * TRIES_PER_SECOND)
        print(json.dumps({"graph": f"layered({values}, {layouts}, seed={seed})", "nodes": egraph.num_nodes,
                          "tries": tries, "cpu_s": round(spent, 3), "tries_per_cpu_s": round(tries / spent)}))


def wrap_phases() -> None:
    """Each ILP phase prints its CPU seconds and the work it charged."""
    for name, meter_of in PHASES.items():
        function = getattr(ilp, name)

        def wrapped(*args: Any, _function: Any = function, _name: str = name, _meter_of: Any = meter_of,
                    **kwargs: Any) -> Any:
            meter = _meter_of(args)
            cpu, work = time.process_time(), meter.spent
            try:
                return _function(*args, **kwargs)
            finally:
                print(json.dumps({"phase": _name, "cpu_s": round(time.process_time() - cpu, 3),
                                  "work_s": round(meter.spent - work, 3), "safety_net": meter.fired}), flush=True)
        setattr(ilp, name, wrapped)
    separate = separation.PathGraphs.separate

    def separated(graphs: Any, values: Any, deadline: Any) -> Any:
        cpu, work = time.process_time(), deadline.meter.spent
        try:
            return separate(graphs, values, deadline)
        finally:
            print(json.dumps({"phase": "separate", "cpu_s": round(time.process_time() - cpu, 3),
                              "work_s": round(deadline.meter.spent - work, 3),
                              "path_edges": sum(len(f.edges) for batch, _ in graphs.batches for f in batch.flows),
                              "flow_entries": sum(b.graph.nnz + b.capacity.nnz for b, _ in graphs.batches)}),
                  flush=True)
    separation.PathGraphs.separate = separated
    extract_ilp = ilp.extract_ilp

    def reported(egraph: Any, time_limit: float = 60.0, *args: Any, **kwargs: Any) -> Any:
        selection = extract_ilp(egraph, time_limit, *args, **kwargs)
        print(json.dumps({"extraction": egraph.num_nodes, "cpu_s": round(selection.seconds, 3),
                          "status": selection.status, "gap": selection.gap, "stopped_by": selection.stopped_by}),
              flush=True)
        return selection
    ilp.extract_ilp = reported
    import tapestry.extract as extract_package
    extract_package.extract_ilp = reported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layered", action="store_true", help="greedy-dag's tries on layered graphs (default)")
    parser.add_argument("--cluster", nargs=3, metavar=("MODEL", "MODE", "MESH"), help="a cluster.py case's phases")
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    if args.layered or not args.cluster:
        layered_tries()
    if args.cluster:
        import cluster

        wrap_phases()
        model, mode, mesh = args.cluster
        rows: queue.Queue[dict[str, Any]] = queue.Queue()
        cluster.run_case(cluster.Case(model=model, layers=2, mode=mode, mesh=mesh, batch=8, seq=2048), 30.0,
                         args.time_limit, rows, hand=False)
        row = rows.get()
        print(json.dumps({key: row.get(key) for key in ("optimize_cpu_s", "status", "gap", "seconds", "peak_memory",
                                                        "error")}))


if __name__ == "__main__":
    main()
