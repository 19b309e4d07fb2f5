"""What presolve's big-linear-overlap search (`cpsat.FIND_BIG_LINEAR_OVERLAP`) costs and changes, per CP-SAT run.

    python benchmarks/cpsat_overlap.py [--model Mixtral] [--mode training] [--mesh 8] [--min-variables 1000]

Plans one `benchmarks/cluster.py` case in this process (no hand plans) as the tree's `cpsat` sets it, keeping
each CP-SAT model of at least `--min-variables` variables as solved (the warm start's ceiling included). Each is
solved again with the same parameters but `find_big_linear_overlap` flipped. Prints one JSON line per model: each
run's status, objective, deterministic time, CPU seconds (time.process_time) and a digest of its whole solution
(every variable's value), so "the same solution" is checked variable for variable; then the case's plan.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import sys
import time
from typing import Any

from ortools.sat.python import cp_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster  # noqa: E402


def summary(solver: cp_model.CpSolver, status: Any, cpu: float) -> dict[str, Any]:
    response = solver.response_proto
    return {"status": solver.status_name(status), "objective": solver.objective_value,
            "deterministic": round(response.deterministic_time, 3), "cpu_s": round(cpu, 2),
            "solution": hashlib.md5(str(list(response.solution)).encode()).hexdigest()[:12]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Mixtral")
    parser.add_argument("--mode", default="training")
    parser.add_argument("--mesh", default="8")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--min-variables", type=int, default=1000)
    args = parser.parse_args()
    kept: list[tuple[cp_model.CpModel, Any, dict[str, Any]]] = []

    class Kept(cp_model.CpSolver):
        def solve(self, model: cp_model.CpModel, *rest: Any) -> Any:
            cpu = time.process_time()
            status = super().solve(model, *rest)
            if len(model.proto.variables) >= args.min_variables:
                kept.append((model, self.parameters, summary(self, status, time.process_time() - cpu)))
            return status

    plain = cp_model.CpSolver
    cp_model.CpSolver = Kept  # type: ignore[misc]  # what cpsat's `cp_model.CpSolver()` makes while planning
    case = cluster.Case(model=args.model, layers=args.layers, mode=args.mode, mesh=args.mesh, batch=8, seq=2048)
    rows: queue.Queue = queue.Queue()
    cluster.run_case(case, 30.0, 10.0, rows, hand=False)
    row = rows.get()
    cp_model.CpSolver = plain  # type: ignore[misc]
    for i, (model, parameters, as_run) in enumerate(kept):
        solver = plain()
        solver.parameters.copy_from(parameters)
        solver.parameters.find_big_linear_overlap = not parameters.find_big_linear_overlap
        cpu = time.process_time()
        status = solver.solve(model)
        flipped = summary(solver, status, time.process_time() - cpu)
        print(json.dumps({"run": i + 1, "variables": len(model.proto.variables),
                          "overlap_search": {str(parameters.find_big_linear_overlap): as_run,
                                             str(solver.parameters.find_big_linear_overlap): flipped}}), flush=True)
    print(json.dumps({key: row.get(key) for key in ("seconds", "peak_memory", "optimize_cpu_s", "status", "gap",
                                                    "degrees", "load", "error")}), flush=True)


if __name__ == "__main__":
    main()
