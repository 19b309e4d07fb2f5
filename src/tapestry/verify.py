"""Do computed outputs mean what the graph means? One comparison for `tapestry run --verify`, for optimize()'s own
check of the plan it chose, and for tests.

Errors are relative to the reference's largest finite magnitude, so near-zero cells do not dominate, with a
tolerance per dtype: the loosest of the float dtypes the output is computed through (a float32 cast of a bfloat16
matmul carries bfloat16's rounding). NaN is a value like any other: a NaN where the reference has one agrees, a NaN
anywhere else (or a number where the reference has NaN) does not, and equal infinities agree.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tapestry import dtypes
from tapestry.graph import Graph
from tapestry.kernels import Shape, Signature
from tapestry.plan.plan import Compute, Place, Plan
from tapestry.zspace import ZRange

# Relative to the largest magnitude. float32: deep or softmax-heavy graphs reach 1e-4 on partial sums.
TOLERANCE = {"float64": 1e-9, "float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
CHECK_CELLS = 1 << 20  # optimize() simulates the whole plan on graphs holding at most this many cells in all
SAMPLES = 4  # above that, output cells checked per output (the first, the last, and random ones)
SAMPLE_WORK = 1 << 25  # most index points (about multiply-adds) one sampled cell may need, graph and plan together


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


@dataclass(frozen=True)
class _Op:
    name: str
    sig: Signature
    args: tuple[str, ...]


@dataclass(frozen=True)
class _Program:
    """Ops over the graph's inputs: a graph, or a plan read logically (a reshard is its source, a place its input);
    what the meaning checks walk."""

    inputs: Mapping[str, tuple[Shape, str]]  # name -> (shape, dtype)
    ops: tuple[_Op, ...]
    outputs: Mapping[str, str]

    @classmethod
    def of_graph(cls, graph: Graph) -> _Program:
        ops = tuple(_Op(n.name, graph.signature(n.name), n.args) for n in graph.ops)
        return cls({n.name: (n.shape, n.dtype) for n in graph.inputs}, ops, dict(graph.outputs))

    @classmethod
    def of_plan(cls, plan: Plan) -> _Program:
        alias: dict[str, str] = {}
        ops = []
        for step in plan.steps:
            if isinstance(step, Place):
                alias[step.out] = step.input
            elif isinstance(step, Compute):
                ops.append(_Op(step.out, step.signature, tuple(alias[a] for a in step.args)))
                alias[step.out] = step.out
            else:
                alias[step.out] = alias[step.src]
        graph = plan.graph
        return cls({n.name: (n.shape, n.dtype) for n in graph.inputs}, tuple(ops),
                   {name: alias[v] for name, v in plan.outputs.items()})

    def dtypes_upstream(self, value: str) -> set[str]:
        """The dtypes of `value` and of every value it is computed from."""
        by_name = {op.name: op for op in self.ops}
        found, todo, seen = set(), [value], set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in by_name:
                found.add(by_name[name].sig.dtype)
                todo += by_name[name].args
            else:
                found.add(self.inputs[name][1])
        return found


def precision(upstream: set[str], dtype: str) -> str:
    """The dtype whose tolerance judges an output of `dtype` computed through values of the `upstream` dtypes:
    exact for ints and bools; for floats the loosest float upstream (half-precision partial sums or inputs)."""
    if not dtypes.is_float(dtype):
        return dtype
    return max((d for d in upstream | {dtype} if dtypes.is_float(d)), key=lambda d: TOLERANCE[d])


def compare(outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], graph: Graph,
            plan: Plan | None = None) -> dict[str, Error]:
    """Each output's error; an output missing from `outputs` is an error naming it. The tolerance follows the
    precision the graph (and `plan`, if given) compute each output in."""
    missing = sorted(set(reference) - set(outputs))
    if missing:
        raise ValueError(f"outputs {missing} were not computed")
    judged = _precisions(graph, plan)
    return {name: error(outputs[name], want, judged[name]) for name, want in reference.items()}


def _precisions(graph: Graph, plan: Plan | None) -> dict[str, str]:
    programs = [_Program.of_graph(graph)] + ([_Program.of_plan(plan)] if plan is not None else [])
    return {name: precision(set().union(*(p.dtypes_upstream(p.outputs[name]) for p in programs)),
                            graph[target].dtype) for name, target in graph.outputs.items()}


def cells(graph: Graph) -> int:
    """Cells in all the graph's values (Python ints: no overflow on huge shapes)."""
    return sum(math.prod(node.shape) for node in graph.nodes)


def check_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """What the meaning check runs on: the graph's constants and example values as they are, random draws for the
    rest (tapestry.random_inputs)."""
    from tapestry.evaluator import random_inputs

    return random_inputs(graph, seed)


def check_meaning(plan: Plan, seed: int = 0) -> None:
    """Simulate `plan` device by device on the check inputs and compare with the reference evaluator; raise
    PlanMeaningError naming each output that differs, and the first step that computes a value the graph does
    not. Cheap on small graphs; the caller decides which."""
    from tapestry.evaluator import evaluate
    from tapestry.plan.simulate import simulate

    inputs = check_inputs(plan.graph, seed)
    errors = compare(simulate(plan, inputs), evaluate(plan.graph, inputs), plan.graph, plan)
    if not all(err.ok for err in errors.values()):
        _raise_wrong(errors, "", first_strange_step(plan, inputs))


def _raise_wrong(errors: Mapping[str, Error], how: str, step: str | None = None) -> None:
    wrong = [f"output {name!r}: {err} (tolerance {err.tolerance:g})" for name, err in errors.items() if not err.ok]
    if wrong:
        at = f"; the first step computing a value the graph does not: {step}" if step else ""
        raise PlanMeaningError(f"the plan does not compute its graph{how} (a wrong rule? run `tapestry "
                               "check-rules`; an edited plan?): " + "; ".join(wrong) + at)


def first_strange_step(plan: Plan, inputs: Mapping[str, np.ndarray]) -> str | None:
    """The first compute step, in plan order, whose value equals (to tolerance) none of the graph's values though
    all its arguments do: where a plan that computes something else most likely goes wrong (a rewritten plan can
    hold values the graph lacks, so this names a suspect, not a proof)."""
    graph = plan.graph
    by_shape: dict[tuple[Shape, str], list[np.ndarray]] = {}
    for name, array in _values(_Program.of_graph(graph), inputs).items():
        by_shape.setdefault((array.shape, graph[name].dtype), []).append(array)
    program = _Program.of_plan(plan)
    known = set(program.inputs)
    values = _values(program, inputs)
    for op in program.ops:
        if not all(a in known for a in op.args):
            continue
        judged, got = precision(program.dtypes_upstream(op.name), op.sig.dtype), values[op.name]
        if any(error(got, want, judged).ok for want in by_shape.get((got.shape, op.sig.dtype), [])):
            known.add(op.name)
        else:
            return f"step {op.name} (compute {op.sig.kernel.name})"
    return None


def _values(program: _Program, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every value of `program`, each op run whole (as tapestry.evaluate runs them)."""
    from tapestry.evaluator import run_sharded

    values = {name: dtypes.cast(inputs[name], dtype) for name, (_, dtype) in program.inputs.items()}
    for op in program.ops:
        values[op.name] = run_sharded(op.sig, [values[a] for a in op.args], [op.sig.index])
    return values


def meaning_check(plan: Plan, seed: int = 0) -> str:
    """Check `plan`'s meaning as far as is affordable, raising PlanMeaningError if it is wrong; returns how it was
    checked. Small graphs are simulated whole (`check_meaning`). Larger ones are checked on sampled output cells
    (`check_sampled`): validate_plan has already proved that the devices together run the plan's ops exactly
    (every read held, every move possible, partials reduced), so what remains is whether those ops compute the
    graph, and a wrong rule changes the cells it touches. A plan too large for even one sampled cell is said to be
    unchecked, with a warning."""
    if cells(plan.graph) <= CHECK_CELLS:
        check_meaning(plan, seed)
        return "simulated on every device"
    checked = check_sampled(plan, seed, SAMPLES, SAMPLE_WORK)
    if checked:
        return f"sampled: {checked} line(s) or cell(s) of each output computed by the plan's ops and by the graph"
    note = (f"NOT CHECKED: the graph holds {cells(plan.graph):,} cells, and no sampled output cell can be "
            f"computed within {SAMPLE_WORK:,} index points")
    warnings.warn(f"the plan's meaning was {note}", stacklevel=3)
    return note


def check_sampled(plan: Plan, seed: int = 0, samples: int = SAMPLES, work: int = SAMPLE_WORK) -> int:
    """Compute `samples` lines of cells of every output (`_sample_cells`), each from only the cells it depends
    on, by the plan's ops and by the graph's, on the same random inputs; PlanMeaningError if they differ.
    A line needing more than `work` index points shrinks to its first cell (a matmul's cell needs one column of
    the weight, its line all of it); a cell needing more is skipped. Returns how many samples were checked."""
    graph = plan.graph
    programs = (_Program.of_plan(plan), _Program.of_graph(graph))
    rng = np.random.default_rng(seed)
    got: dict[str, list[np.ndarray]] = {name: [] for name in graph.outputs}
    want: dict[str, list[np.ndarray]] = {name: [] for name in graph.outputs}
    checked = 0
    for k in range(samples):
        cell = {name: _sample_cells(graph[t].shape, k, rng) for name, t in graph.outputs.items()}
        needs = _needs(programs, cell, work)
        if needs is None:
            cell = {name: ZRange(box.start, [s + 1 for s in box.start]) for name, box in cell.items()}
            needs = _needs(programs, cell, work)
            if needs is None:
                continue
        read = {n.name: ZRange.bounding([r[n.name] for _, r in needs if n.name in r]) for n in graph.inputs
                if any(n.name in r for _, r in needs)}
        inputs = _sample_inputs(graph, read, seed + k)
        values = [_forward(p, index, inputs, cell) for p, (index, _) in zip(programs, needs)]
        for name in graph.outputs:
            got[name].append(values[0][name])
            want[name].append(values[1][name])
        checked += 1
    if checked:
        judged = _precisions(graph, plan)
        _raise_wrong({name: error(np.concatenate(got[name]), np.concatenate(want[name]), judged[name])
                      for name in got},
                     f" (at {checked} sampled line(s) or cell(s) of each output)")
    return checked


def _work(needs: list[tuple[dict[str, ZRange], dict[str, ZRange]]]) -> int:
    """Index points run and input cells drawn, over the programs' `_backward` answers."""
    return sum(b.size for index, read in needs for b in (*index.values(), *read.values()))


def _needs(programs: Sequence[_Program], cells_: Mapping[str, ZRange], work: int
           ) -> list[tuple[dict[str, ZRange], dict[str, ZRange]]] | None:
    """Each program's `_backward` answer for `cells_`, or None where they need more than `work` (`_work`): told as
    soon as the index points alone pass what is left of it. Every line and cell of the folded 7B training step needs
    more, and its check walked every op of both programs eight times to find that out (docs/benchmarks.md, "Where
    the folded step's CPU seconds go")."""
    needs = []
    for program in programs:
        found = _backward(program, cells_, work - _work(needs))
        if found is None:
            return None
        needs.append(found)
    return needs if _work(needs) <= work else None


def _sample_cells(shape: Shape, k: int, rng: np.random.Generator) -> ZRange:
    """Sample k of an output: a whole line along its last dim (a wrong rule may change only some values: a
    relu dropped changes only the negative ones), at the first index of the other dims, at the last, then at
    random ones."""
    point = [0] * len(shape) if k == 0 else [n - 1 for n in shape] if k == 1 else [int(rng.integers(n)) for n in shape]
    return ZRange([*point[:-1], 0][: len(shape)], [p + 1 for p in point[:-1]] + list(shape[-1:]))


def _widen(boxes: dict[str, ZRange], name: str, box: ZRange) -> None:
    boxes[name] = box if name not in boxes else ZRange.bounding([boxes[name], box])


def _backward(program: _Program, cells_: Mapping[str, ZRange], points: float = math.inf
              ) -> tuple[dict[str, ZRange], dict[str, ZRange]] | None:
    """The index block each op must run to make the output cells `cells_` (from the outputs back), and the box
    of each input they read; None once the blocks hold more than `points` index points."""
    need: dict[str, ZRange] = {}
    for name, box in cells_.items():
        _widen(need, program.outputs[name], box)
    index: dict[str, ZRange] = {}
    for op in reversed(program.ops):
        if op.name not in need:
            continue
        block = index[op.name] = _preimage(op.sig, need[op.name])
        points -= block.size
        if points < 0:
            return None
        for arg, projection, shape in zip(op.args, op.sig.projections, op.sig.input_shapes):
            inside = ZRange.from_shape(shape).intersection(projection.apply(block))
            if inside is not None and not inside.is_empty:
                _widen(need, arg, inside)
    return index, {name: box for name, box in need.items() if name in program.inputs}


def _preimage(sig: Signature, box: ZRange) -> ZRange:
    """The bounding box of the index points that write any cell of `box` (all of a reduction: it is summed).
    Rows that read one index dim each bound it directly (index point i writes a*i + b + [0, n)); islpy answers
    the rest."""
    lo, hi = list(sig.index.start), list(sig.index.end)
    projection = sig.output
    for row, b, n, start, end in zip(projection.matrix, projection.offset, projection.shape, box.start, box.end):
        read = [(c, a) for c, a in enumerate(row) if a]
        if len(read) > 1 or (read and read[0][1] < 0):
            return _preimage_isl(sig, box)
        if read:
            (c, a), = read
            lo[c] = max(lo[c], -((b + n - 1 - start) // a))  # a*i + b + n - 1 >= start
            hi[c] = min(hi[c], (end - 1 - b) // a + 1)  # a*i + b <= end - 1
    if any(l >= h for l, h in zip(lo, hi)):
        raise AssertionError(f"{sig.kernel.name}: no index point writes {box} of its output {sig.output_shape}")
    return ZRange(lo, hi)


def _preimage_isl(sig: Signature, box: ZRange) -> ZRange:
    from tapestry import zspace

    points = zspace.to_isl_map(sig.output).intersect_range(zspace.to_isl_set(box)).domain()
    found = zspace.bounding_box(points.intersect(zspace.to_isl_set(sig.index)))
    if found is None:
        raise AssertionError(f"{sig.kernel.name}: no index point writes {box} of its output {sig.output_shape}")
    return found


def _sample_inputs(graph: Graph, boxes: Mapping[str, ZRange], seed: int) -> dict[str, tuple[ZRange, np.ndarray]]:
    """Each input's values in its box: constants and example values as they are, random draws for the rest."""
    from tapestry.evaluator import index_bound

    given = {**graph.examples, **graph.constants}
    found = {}
    for k, node in enumerate(graph.inputs):
        if node.name not in boxes:
            continue
        box = boxes[node.name]
        if node.name in given:
            array = dtypes.cast(np.asarray(given[node.name])[box.slices()], node.dtype)
        else:
            rng = np.random.default_rng([seed, k])
            array = dtypes.random_array(rng, box.shape, node.dtype, index_bound(graph, node.name),
                                        node.name in graph.nonnegative)
        found[node.name] = (box, array)
    return found


def _forward(program: _Program, index: Mapping[str, ZRange], inputs: Mapping[str, tuple[ZRange, np.ndarray]],
             cells_: Mapping[str, ZRange]) -> dict[str, np.ndarray]:
    """Run each op on its index block only, reading the blocks computed before it; the values of `cells_`."""
    held = dict(inputs)
    for op in program.ops:
        if op.name not in index:
            continue
        block = index[op.name]
        in_dtypes = op.sig.input_dtypes or ("float32",) * len(op.args)
        args = [_read(held, arg, projection.apply(block), shape, dtype)
                for arg, projection, shape, dtype in zip(op.args, op.sig.projections, op.sig.input_shapes, in_dtypes)]
        held[op.name] = (op.sig.output.apply(block), op.sig.compute(args, block))
    found = {}
    for name, cell in cells_.items():
        box, array = held[program.outputs[name]]
        found[name] = np.asarray(array[cell.relative_to(box)]).reshape(-1)
    return found


def _read(held: Mapping[str, tuple[ZRange, np.ndarray]], name: str, region: ZRange, shape: Shape, dtype: str
          ) -> np.ndarray:
    """`region` of value `name` from its computed block; zeros outside the tensor."""
    out = np.zeros(region.shape, dtype=dtypes.to_numpy(dtype))
    inside = ZRange.from_shape(shape).intersection(region)
    if inside is None or inside.is_empty:
        return out
    box, array = held[name]
    if not box.contains(inside):
        raise AssertionError(f"sampled check: {name!r} was computed on {box}, but {inside} is read")
    out[inside.relative_to(region)] = array[inside.relative_to(box)]
    return out
