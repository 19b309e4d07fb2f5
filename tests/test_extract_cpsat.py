"""CP-SAT as the ILP runs it (extract/cpsat.py): one thread, which runs the subsolvers `PORTFOLIO` names and no
other, so docs/extraction.md's account of its workers holds."""
from __future__ import annotations

from typing import Any

import pytest
from ortools.sat.python import cp_model

from extract_helpers import layered
from tapestry.extract import cpsat, ilp
from tapestry.extract.cpsat import PORTFOLIO
from tapestry.extract.constraints import DeviceBudget
from tapestry.extract.ilp import extract_ilp
from tapestry.extract.relax import Relaxation


def test_one_thread_runs_the_portfolio_named_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """With num_workers 1, CP-SAT runs only the first subsolver it is given ("1 full problem subsolver: [max_lp]"
    where "max_lp", "core" and "default_lp" were named)."""
    lines: list[str] = []
    solve = cp_model.CpSolver.solve

    def logged(self: cp_model.CpSolver, model: cp_model.CpModel, *args: Any) -> Any:
        self.parameters.log_search_progress = True
        self.log_callback = lines.append
        return solve(self, model, *args)

    monkeypatch.setattr(cp_model.CpSolver, "solve", logged)
    monkeypatch.setattr(ilp, "LP_NODES_PER_SECOND", 0)  # CP-SAT alone
    extract_ilp(layered(40, 4, seed=1), 0.1)
    full = [line.strip() for line in lines if "full problem subsolver" in line]
    plural = "s" if len(PORTFOLIO) > 1 else ""
    assert full and set(full) == {f"{len(PORTFOLIO)} full problem subsolver{plural}: [{', '.join(PORTFOLIO)}]"}


def test_presolve_does_not_search_the_ceiling_row_for_overlaps_and_the_selection_is_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm start's ceiling is one linear row over every objective term; presolve's search for big linear rows
    overlapping at-most-ones spent half of each CP-SAT run's deterministic time on Mixtral's training step on 8
    devices and changed no solution there (docs/benchmarks.md, "Presolve's overlap search"): it is off, and with it
    on the ILP returns the same selection."""
    steps: list[str] = []
    solve = cp_model.CpSolver.solve

    def logged(self: cp_model.CpSolver, model: cp_model.CpModel, *args: Any) -> Any:
        self.parameters.log_search_progress = True
        self.parameters.log_to_stdout = False
        self.log_callback = lambda line: steps.extend(part for part in line.split() if part.startswith("[Find"))
        return solve(self, model, *args)

    monkeypatch.setattr(cp_model.CpSolver, "solve", logged)
    monkeypatch.setattr(ilp, "LP_NODES_PER_SECOND", 0)  # CP-SAT alone, from the greedy warm start as its ceiling
    egraph = layered(40, 4, seed=1)
    selection = extract_ilp(egraph, 10)
    assert selection.status == "optimal" and "[FindBigAtMostOneAndLinearOverlap]" not in steps
    monkeypatch.setattr(cpsat, "FIND_BIG_LINEAR_OVERLAP", True)
    steps.clear()
    searched = extract_ilp(egraph, 10)
    assert "[FindBigAtMostOneAndLinearOverlap]" in steps
    assert searched.choice == selection.choice and searched.dag_cost == selection.dag_cost


def test_a_run_tighter_than_one_that_found_nothing_is_not_made_unless_switched_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NOT exact (`cpsat.SKIP_TIGHTER`, documented as such): where CP-SAT found no selection within its work under
    the warm start's ceiling, a run of the same model with constraints as tight or tighter (a lower limit; the same
    limit with a cut group more; any budget after none) keeps the warm start unmade and returns what the looser
    one returned; a looser run (a higher limit, no budget) is made. Switched off, every run is made."""
    resident: dict[int, tuple[int, ...]] = {}
    transient: dict[int, tuple[int, ...]] = {}
    egraph = layered(12, 3, seed=4)
    group = {next(n for n in range(egraph.num_nodes) if egraph.node_cost[n] > 0): 1}

    def budget(limit: int, *groups: dict[int, int]) -> DeviceBudget:
        return DeviceBudget(limit, resident, transient, groups)

    calls = [budget(100), budget(50), budget(50, group), budget(200), None, budget(300)]
    for skip, made in ((True, [100, 200, None]), (False, [100, 50, 50, 200, None, 300])):
        runs: list[int | None] = []

        def nothing(*args: Any, **_: Any) -> tuple[None, float, bool, float, str]:
            runs.append(None if args[9] is None else args[9].limit)  # found nothing within its work
            return None, 0.0, False, 0.3, "work"

        monkeypatch.setattr(cpsat, "_solve_part", nothing)
        monkeypatch.setattr(cpsat, "SKIP_TIGHTER", skip)
        monkeypatch.setattr(ilp, "relax", lambda *_, **__: Relaxation((), 0.0, 0))  # no LP: CP-SAT is asked
        graph = layered(12, 3, seed=4)  # nothing kept from the other pass
        found = [extract_ilp(graph, 1.0, limit) for limit in calls]
        assert [r for i, r in enumerate(runs) if r is not None or i == 0 or runs[i - 1] is not None] == made
        assert {(s.dag_cost, s.status, s.stopped_by, tuple(sorted(s.choice.items()))) for s in found} == {
            (found[0].dag_cost, "feasible", "work", tuple(sorted(found[0].choice.items())))}
