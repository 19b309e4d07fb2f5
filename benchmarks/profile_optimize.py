"""Where an optimizer call's CPU seconds go, phase by phase, around any benchmark script that plans.

    python benchmarks/profile_optimize.py [--reshards N] [--cprofile PREFIX] [--model llama] [--mesh 2x2] \
        [-- SCRIPT.py ARGS...]

Runs SCRIPT (default: `tapestry.optimize` of an Adam training step of the importer zoo's `--model`, a 2-layer
decoder, on `--mesh`) with the optimizer's phases wrapped: each `explore` (saturation), each `Explored.extract`
(pricing and extraction) and `Explored.pareto` (a sweep of extractions), and within extraction
`Decoder.extraction_graph` (pricing the reshards into the extraction graph; or, where moves wait for extraction,
`FloorPriced` made and each `FloorPriced.repriced`), each CP-SAT run of the ILP
extractor (`cp_sat`: `extract.cpsat._solve_part`, one per part of each fit) and, for a training step,
`Explored._against_baselines` (`hand_plans`: the hand plans built, priced and embedded as the extracted plan's
floor). Prints one JSON line per process that planned (a script's `spawn`ed children too, as benchmarks/cluster.py
runs its cases): per phase the calls' count and CPU and wall seconds, and each call's CPU seconds with its mesh
(a CP-SAT run: its part's class count).
With `--reshards N`, every reshard that pricing prices (`AlphaBeta._priced`, once per orbit) is timed, and the N
slowest are listed with their shape, dtype and layouts. With `--cprofile PREFIX`, each `Explored.extract` runs under
cProfile timing CPU seconds, its stats written to PREFIX.<pid>.<call> (read with pstats); saturation is left
unprofiled, since its budget is CPU seconds and a profiled run would explore less. With `--profile-function
MODULE:ATTRIBUTE` (repeatable, with `--cprofile`), each call of those functions runs under cProfile instead (stats to
PREFIX.<attribute>.<pid>.<call>): a phase of a long run profiled alone. With `--fold-phases`, a folded
step's extraction phases (FOLD_PHASES: greedy extractions, tree choices, mirrors, pricing candidates, the kept plan's
checks) are timed too, each inclusive, for a split without cProfile's cost; `--phase MODULE:ATTRIBUTE` times any
other function so (plan_pipeline's stage plans, its configurations). The wrappers add a few
microseconds per call and measure CPU with time.process_time (this process's threads), which a loaded machine
inflates far less than wall time; a phase's seconds include the phases called inside it.

Examples (docs/benchmarks.md cites these):

    python benchmarks/profile_optimize.py --reshards 5 -- benchmarks/cluster.py --arch block --modes training \\
        --meshes 8x8x8 --full-layers 0 --no-write --no-hand
    python benchmarks/profile_optimize.py -- benchmarks/pipeline.py --width 7B --layers 32 --seq 2048 \\
        --global-batch 2048 --micro-batches 8 --no-write
"""
from __future__ import annotations

import argparse
import atexit
import cProfile
import functools
import heapq
import inspect
import itertools
import json
import multiprocessing.process
import os
import runpy
import sys
import time
from collections import defaultdict
from typing import Any

_calls: dict[str, list[dict[str, Any]]] = defaultdict(list)
_reshards: list[tuple[float, int, str]] = []  # a min-heap of the slowest (cpu_s, order, what)
_priced = {"count": 0, "cpu_s": 0.0}


def _timed(phase: str, function: Any, mesh_of: Any) -> Any:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _calls[phase].append({"mesh": str(mesh_of(args, kwargs)), "cpu_s": time.process_time() - cpu,
                                  "wall_s": time.perf_counter() - wall})
    return timed


def _timed_reshard(function: Any, keep: int) -> Any:
    @functools.wraps(function)
    def timed(self: Any, step: Any, mesh: Any, *rest: Any) -> Any:
        cpu = time.process_time()
        try:
            return function(self, step, mesh, *rest)
        finally:
            spent = time.process_time() - cpu
            _priced["count"] += 1
            _priced["cpu_s"] += spent
            entry = (spent, _priced["count"], f"{step.dtype} {tuple(step.shape)} {step.src_layout} -> {step.layout}"
                                              f" on {tuple(mesh.shape)}")
            if len(_reshards) < keep:
                heapq.heappush(_reshards, entry)
            elif keep:
                heapq.heappushpop(_reshards, entry)
    return timed


def _profiled(function: Any, prefix: str) -> Any:
    """`function` run under cProfile, each call's stats written to prefix.<pid>.<call>."""
    made = itertools.count(1)

    @functools.wraps(function)
    def profiled(*args: Any, **kwargs: Any) -> Any:
        profiler = cProfile.Profile(time.process_time)
        try:
            return profiler.runcall(function, *args, **kwargs)
        finally:
            profiler.dump_stats(f"{prefix}.{os.getpid()}.{next(made)}")
    return profiled


# --fold-phases: a folded step's extraction phases, each "module:attribute" (a function looked up by that module's
# global name, or a Class.method), timed as a phase of its own (inclusive: a phase's seconds include those it calls)
FOLD_PHASES = (
    "tapestry.optimizer:extract", "tapestry.extract.tree:tree_choice", "tapestry.optimizer:pin_layouts",
    "tapestry.optimizer:periodic_selections", "tapestry.egraph.layered:Layered.mirror",
    "tapestry.egraph.layered:grown", "tapestry.egraph.layered:with_reads", "tapestry.egraph.layered:finalize",
    "tapestry.egraph.pins:steady_repaired", "tapestry.egraph.layered:Layered.costs",
    "tapestry.egraph.folded_candidates:FoldedCandidates.folded_time",
    "tapestry.egraph.folded_candidates:FoldedCandidates.expanded_time",
    "tapestry.egraph.folded_candidates:FoldedCandidates.decode", "tapestry.optimizer:Explored._verified",
    "tapestry.optimizer:validate_plan", "tapestry.optimizer:meaning_check",
    "tapestry.egraph.objective:StepObjective.exposed", "tapestry.egraph.objective:StepObjective.better",
    # under a memory budget: the budgeted fallback, its peaks (each candidate lowered and walked in two step
    # orders) and prices, the plan fitted without the budget, the budget's bounds (70B on 8x8x8: 159 of its 342
    # CPU s of extraction were in none of the phases above, docs/benchmarks.md "## Cluster")
    "tapestry.egraph.folded_candidates:FoldedCandidates.within_budget", "tapestry.optimizer:Explored._unbound",
    "tapestry.egraph.folded_candidates:leaner", "tapestry.egraph.lean_plans:leaner",
    "tapestry.egraph.folded_candidates:plan_cost", "tapestry.egraph.lean_plans:plan_cost",
    "tapestry.egraph.lean_plans:chosen_floor", "tapestry.optimizer:device_budget",
    "tapestry.extract.constraints:DeviceBudget.fits", "tapestry.egraph.folded_candidates:embedded_plans",
    "tapestry.optimizer:embedded_plans", "tapestry.egraph.folded_candidates:held_at_peak")


def _wrap_phases(names: tuple[str, ...], profiled: tuple[str, ...] = (), prefix: str | None = None) -> None:
    """Each of `names` ("module:attribute", FOLD_PHASES' form) timed as the phase "module.attribute" (the module's
    last name: "optimizer.extract" is greedy-dag's, where the phase "extract" is `Explored.extract`); each of
    `profiled` (the same form) run under cProfile, its stats to prefix.<pid>.<call> (inside its phase's timing)."""
    import importlib

    for name in profiled:
        module_name, attribute = name.split(":")
        owner: Any = importlib.import_module(module_name)
        *path, last = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        wrapped = _profiled(getattr(owner, last), f"{prefix}.{attribute}")
        setattr(owner, last, staticmethod(wrapped) if isinstance(inspect.getattr_static(owner, last), staticmethod)
                else wrapped)
    for name in names:
        module_name, attribute = name.split(":")
        owner: Any = importlib.import_module(module_name)
        *path, last = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        timed = _timed(f"{module_name.rsplit('.', 1)[-1]}.{attribute}", getattr(owner, last), lambda a, k: "")
        setattr(owner, last, staticmethod(timed) if isinstance(inspect.getattr_static(owner, last), staticmethod)
                else timed)


def install(reshards: int, cprofile: str | None = None, phases: tuple[str, ...] = (),
            profiled: tuple[str, ...] = ()) -> None:
    """Wrap the optimizer's phases (before the script imports `explore` by name), with `reshards` pricing, and with
    `cprofile` extraction under cProfile (or, where `profiled` names functions, "module:attribute", those instead);
    `phases` ("module:attribute") timed too."""
    from tapestry import optimizer
    from tapestry.cost import comm
    from tapestry.egraph.decode import Decoder
    from tapestry.extract import cpsat

    optimizer.explore = _timed("explore", optimizer.explore,
                               lambda a, k: k.get("mesh", a[1] if len(a) > 1 else 1))
    extract = optimizer.Explored.extract if cprofile is None or profiled else _profiled(optimizer.Explored.extract,
                                                                                        cprofile)
    optimizer.Explored.extract = _timed("extract", extract, lambda a, k: a[0].mesh)
    optimizer.Explored.pareto = _timed("pareto", optimizer.Explored.pareto, lambda a, k: a[0].mesh)
    Decoder.extraction_graph = _timed("pricing", Decoder.extraction_graph, lambda a, k: a[0].mesh)
    try:  # pricing on extraction's demand (trees before it have none): its first graph and each repricing
        from tapestry.egraph.extractor_pricing import FloorPriced
    except ImportError:
        pass
    else:
        FloorPriced.__init__ = _timed("pricing", FloorPriced.__init__, lambda a, k: a[1].mesh)
        FloorPriced.repriced = _timed("pricing", FloorPriced.repriced, lambda a, k: a[0].decoder.mesh)
    cpsat._solve_part = _timed("cp_sat", cpsat._solve_part, lambda a, k: f"{len(a[2])} classes")
    optimizer.Explored._against_baselines = _timed("hand_plans", optimizer.Explored._against_baselines,
                                                   lambda a, k: a[0].mesh)
    if reshards >= 0:
        comm.AlphaBeta._priced = _timed_reshard(comm.AlphaBeta._priced, reshards)
    _wrap_phases(phases, profiled, cprofile)
    atexit.register(report)


def report() -> None:
    if not _calls:
        return
    out: dict[str, Any] = {"pid": os.getpid(), "cpu_s": round(time.process_time(), 2)}
    for phase, calls in _calls.items():
        out[phase] = {"calls": len(calls), "cpu_s": round(sum(c["cpu_s"] for c in calls), 3),
                      "wall_s": round(sum(c["wall_s"] for c in calls), 3),
                      "each": [[c["mesh"], round(c["cpu_s"], 3)] for c in calls]}
    if _priced["count"]:
        out["reshards_priced"] = {"count": _priced["count"], "cpu_s": round(_priced["cpu_s"], 3),
                                  "slowest": [[round(s, 3), what] for s, _, what in sorted(_reshards, reverse=True)]}
    print(json.dumps(out), flush=True)


def _in_child(reshards: int, cprofile: str | None, phases: tuple[str, ...], profiled: tuple[str, ...], target: Any,
              *args: Any, **kwargs: Any) -> Any:
    """A spawned child's target, run with the phases wrapped; its report printed when it exits."""
    install(reshards, cprofile, phases, profiled)
    try:
        return target(*args, **kwargs)
    finally:
        report()
        _calls.clear()


def _follow_children(reshards: int, cprofile: str | None, phases: tuple[str, ...], profiled: tuple[str, ...]) -> None:
    """Spawned children (cluster.py runs each case in one) get the same wrappers: their target is wrapped in
    `_in_child`, pickled by this module's importable name (benchmarks/ is on the children's sys.path)."""
    start = multiprocessing.process.BaseProcess.start

    def started(self: Any) -> None:
        if self._target is not None:
            import profile_optimize

            self._target = functools.partial(profile_optimize._in_child, reshards, cprofile, phases, profiled,
                                             self._target)
        start(self)
    multiprocessing.process.BaseProcess.start = started


def tiny(family: str = "llama", mesh: str = "2x2") -> Any:
    """The default script: an Adam step of the importer zoo's `family` (its 2-layer decoder), planned on `mesh`."""
    import tapestry
    from tapestry.importer.zoo import FAMILIES

    module, (ids,), _ = FAMILIES[family].build()
    training = tapestry.Training(loss=lambda m, i: m(input_ids=i, use_cache=False)[0].square().mean(),
                                 optimizer="adam", lr=1e-4)
    imported = tapestry.from_torch(module, (ids,), training=training, verbose=False)
    return tapestry.optimize(imported.graph, tapestry.Mesh.parse(mesh))


def main() -> None:
    argv = sys.argv[1:]
    script = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reshards", type=int, default=-1, help="time pricing each reshard; list the N slowest")
    parser.add_argument("--cprofile", metavar="PREFIX", help="run each extraction under cProfile, its stats to "
                        "PREFIX.<pid>.<call>")
    parser.add_argument("--profile-function", action="append", default=[], metavar="MODULE:ATTRIBUTE",
                        help="with --cprofile, profile this function (each call) instead of each extraction; "
                        "repeatable (e.g. tapestry.egraph.folded_candidates:leaner, tapestry.optimizer:validate_plan)")
    parser.add_argument("--fold-phases", action="store_true", help="time a folded step's extraction phases too "
                        "(FOLD_PHASES: greedy extractions, tree choices, mirrors, candidates' prices, the checks)")
    parser.add_argument("--phase", action="append", default=[], metavar="MODULE:ATTRIBUTE",
                        help="time this function's calls as a phase of its own (repeatable; e.g. "
                        "tapestry.pipeline.planner:_stage_plan, tapestry.pipeline.planner:best_configuration)")
    parser.add_argument("--model", default="llama", help="the default case's zoo family (a decoder)")
    parser.add_argument("--mesh", default="2x2", help="the default case's mesh")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    phases = (FOLD_PHASES if args.fold_phases else ()) + tuple(args.phase)
    profiled = tuple(args.profile_function)
    if profiled and args.cprofile is None:
        parser.error("--profile-function needs --cprofile PREFIX")
    install(args.reshards, args.cprofile, phases, profiled)
    if not script:
        tiny(args.model, args.mesh)
        return
    _follow_children(args.reshards, args.cprofile, phases, profiled)
    sys.argv = script
    runpy.run_path(script[0], run_name="__main__")


if __name__ == "__main__":
    main()
