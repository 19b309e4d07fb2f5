"""Do computed outputs mean what the graph means? One comparison for `tapestry run --verify`, for optimize()'s own
check of the plan it chose, and for tests.

Errors are relative to the reference's largest finite magnitude, so near-zero cells do not dominate, with a
tolerance per dtype. NaN is a value like any other: a NaN where the reference has one agrees, a NaN anywhere else
(or a number where the reference has NaN) does not, and equal infinities agree.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from tapestry.graph import Graph
from tapestry.plan.plan import Plan

# Relative to the largest magnitude. float32: deep or softmax-heavy graphs reach 1e-4 on partial sums.
TOLERANCE = {"float64": 1e-9, "float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
CHECK_CELLS = 1 << 20  # optimize() checks a plan's meaning on graphs holding at most this many cells in all


class PlanMeaningError(RuntimeError):
    """A plan whose outputs differ from the reference evaluator's: a wrong rule, or a bug in planning."""


@dataclass(frozen=True)
class Error:
    max_abs: float
    max_rel: float
    nan_mismatches: int  # cells NaN on one side only
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.nan_mismatches == 0 and self.max_rel <= self.tolerance

    def __str__(self) -> str:
        nans = f", {self.nan_mismatches} cell(s) NaN on one side only" if self.nan_mismatches else ""
        return f"max abs err {self.max_abs:.3e}, max rel err {self.max_rel:.3e}{nans}"


def error(got: np.ndarray, want: np.ndarray, dtype: str) -> Error:
    """How far `got` is from the reference `want`, judged at `dtype`'s tolerance (exact for ints and bools)."""
    tolerance = TOLERANCE.get(dtype, 0.0)
    if np.shape(got) != np.shape(want):
        raise ValueError(f"shape {list(np.shape(got))} differs from the reference's {list(np.shape(want))}")
    got, want = np.atleast_1d(np.asarray(got, dtype=np.float64)), np.atleast_1d(np.asarray(want, dtype=np.float64))
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    with np.errstate(invalid="ignore"):  # inf - inf
        diff = np.abs(got - want)
    diff[(got == want) | nan_got | nan_want] = 0.0  # equal infinities agree; NaNs are counted as mismatches instead
    diff[np.isnan(diff)] = np.inf  # inf against -inf
    max_abs = float(diff.max(initial=0.0))
    finite = np.abs(want[np.isfinite(want)])
    scale = max(float(finite.max(initial=0.0)), float(np.finfo(np.float32).tiny))
    return Error(max_abs, max_abs / scale, int((nan_got != nan_want).sum()), tolerance)


def compare(outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], graph: Graph
            ) -> dict[str, Error]:
    """Each output's error; an output missing from `outputs` is an error naming it."""
    missing = sorted(set(reference) - set(outputs))
    if missing:
        raise ValueError(f"outputs {missing} were not computed")
    return {name: error(outputs[name], want, graph[graph.outputs[name]].dtype) for name, want in reference.items()}


def cells(graph: Graph) -> int:
    return sum(int(np.prod(node.shape, dtype=np.int64)) for node in graph.nodes)


def check_meaning(plan: Plan, seed: int = 0) -> None:
    """Simulate `plan` device by device on random inputs and compare with the reference evaluator; raise
    PlanMeaningError naming each output that differs. Cheap on small graphs; the caller decides which."""
    from tapestry.evaluator import evaluate, random_inputs
    from tapestry.plan.simulate import simulate

    inputs = random_inputs(plan.graph, seed)
    errors = compare(simulate(plan, inputs), evaluate(plan.graph, inputs), plan.graph)
    wrong = [f"output {name!r}: {err} (tolerance {err.tolerance:g})" for name, err in errors.items() if not err.ok]
    if wrong:
        raise PlanMeaningError(
            "the chosen plan does not compute the graph (a wrong rule? run `tapestry check-rules`): " + "; ".join(wrong))
