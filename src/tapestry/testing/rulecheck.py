"""`check_rule`: property-test a rewrite rule on random well-typed inputs.

A rule is sound when both sides compute the same tensor for every input the
left-hand side accepts. Hypothesis draws those inputs, and shrinks a failure to
small shapes, so a wrong rule is reported with a counterexample a person can
read, and the file:line to fix.

Well-typed shapes are rare under plain rejection (matmul needs b[-2] == a[-1]),
so shapes are built bottom-up: an op whose operands are all fresh variables
starts from its kernel's own sampler; a fresh operand next to known ones picks
from candidates derived from the shapes already known (copies, suffixes, one
dim replaced by a known size or 1), filtered by the guards and, for the last
fresh operand, by the kernel itself. What remains is left to `assume`.

Each tensor variable also gets a dtype: its kernel sampler's kind first (float64
for "float", so failures shrink towards float64), then any dtype the kernel
accepts, mixed ones included. Both sides must give the same result dtype, and
values within the tolerance (`tapestry.verify`) of the least precise float among
the result and the inputs, so a rule that drops a rounding cast, like
(Cast (Cast x "float16") "float32") -> x, fails. A right-hand side that does not
type-check at the drawn dtypes, but does at float64, is no counterexample: the
e-graph drops such a node.
"""
from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from hypothesis import HealthCheck, Phase, assume, find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample, Unsatisfiable
from hypothesis.reporting import with_reporter

from tapestry.egraph.rules import ARITH_OPS, Output, Rule, RuleFile, variables
from tapestry.egraph.schema import Constructor, constructors, decode_param
from tapestry.egraph.sexp import Atom, SExp, SList
from tapestry import dtypes
from tapestry.evaluator import evaluate, random_inputs
from tapestry.graph import Graph, GraphError, Value
from tapestry.kernels import KERNELS, KernelError, ParamValue, Shape
from tapestry.verify import TOLERANCE, error

MAX_RANK = 6  # kernel samplers stop at rank 3; a rule wrong only at rank 4 or 5 must still be drawn
MAX_CELLS = 4096  # per drawn tensor, so large sizes and high ranks stay cheap to evaluate
# Sizes past the kernel samplers' 7: a few larger ones, so a rule wrong only for big dims can fail.
LARGE_SIZES = st.one_of(st.integers(8, 16), st.sampled_from([24, 32, 64]))
LEAD_SIZES = st.integers(1, 4)
# Kernel signatures reject shapes with KernelError, but a few index a tuple or
# divide by a rank first; to a candidate filter they all mean "does not bind".
_ILL_TYPED = (KernelError, ValueError, IndexError, ArithmeticError)


class Uncheckable(ValueError):
    """A rule that uses something the checker cannot turn into a graph (e.g. Input or Id)."""


@dataclass(frozen=True)
class RuleVerdict:
    rule: Rule
    passed: bool
    examples_run: int
    counterexample: str | None = None


@dataclass(frozen=True)
class Case:
    """One drawn instance of a rule: a shape per tensor variable, a value per param variable, a data seed."""

    shapes: Mapping[str, Shape]
    params: Mapping[str, ParamValue]
    seed: int
    types: Mapping[str, str] = field(default_factory=dict)  # per tensor variable; float64 where absent

    def __str__(self) -> str:
        parts = [f"{v}{list(s)}" + ("" if _dtype(self.types, v) == "float64" else f" {self.types[v]}")
                 for v, s in sorted(self.shapes.items())]
        parts += [f"{v}={p!r}" for v, p in sorted(self.params.items())]
        return ", ".join(parts) + f", data seed {self.seed}"


# -- guards ----------------------------------------------------------------------------------------


class _Undefined(Exception):
    """A guard term egglog would have no value for (Dim out of range, division by zero): no match."""


class _TypesPending(Exception):
    """A guard on (Dtype t) asked before the dtypes are drawn."""


def _trunc_div(a: int, b: int) -> int:
    if b == 0:
        raise _Undefined
    return abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)


def _trunc_rem(a: int, b: int) -> int:
    return a - b * _trunc_div(a, b)


_COMPARE: dict[str, Callable[[int, int], bool]] = {
    "=": operator.eq, "!=": operator.ne, "<": operator.lt, ">": operator.gt, "<=": operator.le, ">=": operator.ge,
}
_ARITH: dict[str, Callable[[int, int], int]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": _trunc_div, "%": _trunc_rem, "min": min, "max": max,
}


def _guard_value(expr: SExp, shapes: Mapping[str, Shape], params: Mapping[str, ParamValue],
                 types: Mapping[str, str] | None = None) -> int | bool | str:
    """i64 semantics, as egglog evaluates a :when clause (i64 arithmetic truncates like Rust); (Dtype t) is
    t's dtype name, known once `types` are drawn."""
    if isinstance(expr, Atom):
        if expr.text.startswith('"'):
            return expr.text.strip('"')
        return int(params[expr.text]) if variables(expr) else int(expr.text)
    head, args = expr.head, expr.items[1:]
    if head == "Dtype":
        if types is None:
            raise _TypesPending
        return term_type(args[0], shapes, params, types)[1]
    if head == "Rank":
        return len(term_shape(args[0], shapes, params))
    if head == "Shape":
        return ",".join(map(str, term_shape(args[0], shapes, params)))
    if head == "Dim":
        shape, index = term_shape(args[0], shapes, params), _guard_value(args[1], shapes, params, types)
        if not 0 <= index < len(shape):
            raise _Undefined
        return shape[index]
    values = [_guard_value(a, shapes, params, types) for a in args]
    if head in _COMPARE:
        return _COMPARE[head](*values)
    return functools.reduce(_ARITH[head], values)


def holds(guard: SList, shapes: Mapping[str, Shape], params: Mapping[str, ParamValue],
          types: Mapping[str, str] | None = None) -> bool:
    """Whether the guard holds; one on dtypes holds until `types` are given (they are drawn after shapes)."""
    try:
        return bool(_guard_value(guard, shapes, params, types))
    except _TypesPending:
        return True
    except (_Undefined, *_ILL_TYPED):
        return False


# -- terms -----------------------------------------------------------------------------------------


def _constructor(term: SList) -> Constructor:
    found = constructors().get(term.head or "")
    if found is None:
        raise Uncheckable(f"{term.head} is not a kernel, so {term} cannot be evaluated")
    return found


def _split(term: SList) -> tuple[Constructor, tuple[SExp, ...], tuple[SExp, ...]]:
    ctor = _constructor(term)
    n = len(ctor.kernel.inputs)
    return ctor, term.items[1 : 1 + n], term.items[1 + n :]


def _param(ctor: Constructor, name: str, arg: SExp, params: Mapping[str, ParamValue]) -> ParamValue:
    if isinstance(arg, SList):
        if arg.head not in ARITH_OPS:
            raise Uncheckable(f"param {name} of {ctor.name} is a computed term {arg}; use a literal, a variable "
                              "or integer arithmetic on them")
        return _guard_value(arg, {}, params)
    return params[arg.text] if variables(arg) else decode_param(ctor.kernel.params[name], arg.text)


def _params(ctor: Constructor, args: Sequence[SExp], params: Mapping[str, ParamValue]) -> dict[str, ParamValue]:
    return {name: _param(ctor, name, arg, params) for name, arg in zip(ctor.params, args)}


def _dtype(types: Mapping[str, str] | None, var: str) -> str:
    return (types or {}).get(var, "float64")


def term_type(term: SExp, shapes: Mapping[str, Shape], params: Mapping[str, ParamValue],
              types: Mapping[str, str] | None = None) -> tuple[Shape, str]:
    """The shape and dtype `term` has; raises KernelError (or KeyError: unbound) when it has none."""
    if isinstance(term, Atom):
        return shapes[term.text], _dtype(types, term.text)
    ctor, tensors, args = _split(term)
    operands = [term_type(t, shapes, params, types) for t in tensors]
    found = _bound(ctor.kernel.name, tuple(s for s, _ in operands), tuple(_params(ctor, args, params).items()),
                   tuple(d for _, d in operands))
    if isinstance(found, Exception):
        raise found.with_traceback(None)
    return found


@functools.lru_cache(maxsize=1 << 16)
def _bound(kernel: str, shapes: tuple[Shape, ...], params: tuple[tuple[str, ParamValue], ...],
           in_dtypes: tuple[str, ...]) -> tuple[Shape, str] | Exception:
    """The kernel's result type for these operands, or the error its bind raised: a draw asks for the same
    binds over and over (each guard and candidate re-types the term), and a conv's bind builds its projections."""
    try:
        sig = KERNELS[kernel].bind(list(shapes), dict(params), list(in_dtypes))
    except _ILL_TYPED as err:
        return err
    return sig.output_shape, sig.dtype


def term_shape(term: SExp, shapes: Mapping[str, Shape], params: Mapping[str, ParamValue],
               types: Mapping[str, str] | None = None) -> Shape:
    return term_type(term, shapes, params, types)[0]


def _binds(term: SList, shapes: Mapping[str, Shape], params: Mapping[str, ParamValue],
           types: Mapping[str, str] | None = None) -> bool:
    try:
        term_type(term, shapes, params, types)
        return True
    except _ILL_TYPED:
        return False


# -- drawing well-typed cases ----------------------------------------------------------------------


@dataclass(frozen=True)
class Extra:
    """What widens one draw past the kernel samplers: leading dims (up to MAX_RANK) and sizes to swap in
    (a large one, and the constants the guards compare with, so a guard like (> (Dim x 0) 10) can hold)."""

    lead: Shape
    sizes: tuple[int, ...]


def _shape_candidates(seeds: Sequence[Shape], extra: Extra) -> list[Shape]:
    """Shapes an operand plausibly has next to `seeds`: each seed, its suffixes, each seed with leading dims
    added up to MAX_RANK, and one dim swapped for a known or extra size; none over MAX_CELLS cells."""
    pool = sorted({1, *extra.sizes, *(d for s in seeds for d in s)})
    found: dict[Shape, None] = {}
    for seed in seeds:
        for k in range(len(seed) + 1):
            found[seed[k:]] = None
        for k in range(1, MAX_RANK - len(seed) + 1):
            found[(*extra.lead[:k], *seed)] = None
        for i, size in itertools.product(range(len(seed)), pool):
            found[(*seed[:i], size, *seed[i + 1 :])] = None
    return [shape for shape in found if np.prod(shape, dtype=np.int64) <= MAX_CELLS]


def _guard_constants(guards: Sequence[SList]) -> set[int]:
    """Sizes the guards mention, and their neighbours: where a guard's truth changes."""
    found: set[int] = set()
    for guard in guards:
        for atom in _atoms(guard):
            if atom.lstrip("-").isdigit():
                found |= {int(atom) - 1, int(atom), int(atom) + 1}
    return {n for n in found if 1 <= n <= 64}


def _atoms(expr: SExp) -> list[str]:
    return [expr.text] if isinstance(expr, Atom) else [a for item in expr.items for a in _atoms(item)]


def _with_unit_dims(shape: Shape) -> list[Shape]:
    """`shape` with size-1 dims inserted anywhere, up to MAX_RANK: the reshapes that only add broadcast axes,
    like a per-channel bias b[K] reshaped to [K,1,1] to add to a conv's [N,K,H,W]."""
    found: list[Shape] = []
    for rank in range(len(shape) + 1, MAX_RANK + 1):
        for places in itertools.combinations(range(rank), len(shape)):
            dims = [1] * rank
            for place, size in zip(places, shape):
                dims[place] = size
            found.append(tuple(dims))
    return found


def _param_candidates(sampled: ParamValue, default: ParamValue, seeds: Sequence[Shape]) -> list[ParamValue]:
    """The sampler's value first; then both flags (bools), axes (ints) or permutations, known shapes and those
    shapes with size-1 dims added (tuples), up to the seeds' rank. A flag never gets an axis (1 == True to a dict:
    keepdim drew the int 1, which its kernel rejects, and such draws were lost)."""
    rank = max((len(s) for s in seeds), default=0)
    if isinstance(default, bool):
        more: list[ParamValue] = [False, True]
    elif isinstance(default, tuple):
        more = [(), *itertools.permutations(range(min(rank, 4))), *seeds,
                *(s for seed in seeds for s in _with_unit_dims(seed))]
    else:
        more = list(range(-rank, rank))
    return list(dict.fromkeys([sampled, default, *more]))


@st.composite
def cases(draw: st.DrawFn, lhs: SList | Sequence[SList], guards: Sequence[SList],
          sizes: Sequence[tuple[str, SList]] = ()) -> Case:
    """A well-typed instance of `lhs` (one term, or the patterns of a multi-output rule, drawn in turn over
    shared variables) on which every guard holds; `sizes` are variables read off the drawn shapes, integers like
    n = (Dim w 1) or a shape like sh = (Shape a) (an int tuple param, as egglog's comma string)."""
    terms = [lhs] if isinstance(lhs, SList) else list(lhs)
    shapes: dict[str, Shape] = {}
    params: dict[str, ParamValue] = {}
    types: dict[str, str] = {}
    lead = tuple(draw(st.lists(LEAD_SIZES, min_size=MAX_RANK, max_size=MAX_RANK)))
    extra = Extra(lead, (draw(LARGE_SIZES), *sorted(_guard_constants(guards))))
    for term in terms:
        _draw_term(draw, term, guards, shapes, params, types, extra)
    for var, size in sizes:
        try:
            params[var] = (term_shape(size.items[1], shapes, params) if size.head == "Shape"
                           else int(_guard_value(size, shapes, params)))
        except (_Undefined, *_ILL_TYPED):
            assume(False)
    assume(all(holds(g, shapes, params) for g in guards))
    types = _draw_types(draw, terms, guards, shapes, params, types)
    assume(all(holds(g, shapes, params, types) for g in guards))
    return Case(shapes, params, draw(st.integers(0, 2**32 - 1)), types)


def _all_bind(terms: Sequence[SList], shapes: Mapping[str, Shape], params: Mapping[str, ParamValue],
              types: Mapping[str, str]) -> bool:
    return all(_binds(t, shapes, params, types) for t in terms)


def _draw_types(draw: st.DrawFn, terms: Sequence[SList], guards: Sequence[SList], shapes: Mapping[str, Shape],
                params: Mapping[str, ParamValue], preferred: Mapping[str, str]) -> dict[str, str]:
    """A dtype per tensor variable, in turn, among those under which the terms still bind when the variables not
    yet drawn keep their preferred dtype or all take the same one (so float16 throughout stays reachable for
    kernels whose float operands must agree), and under which each guard on dtypes over the variables drawn so
    far holds. The preferred dtype comes first: failures shrink towards it."""
    types = dict(preferred)
    order = list(preferred)
    on_dtypes = [g for g in guards if "Dtype" in _atoms(g)]
    for n, var in enumerate(order):
        rest = order[n + 1 :]
        decided = [g for g in on_dtypes if var in variables(g) and not variables(g) & set(rest)]

        def fits(dtype: str) -> bool:
            if not all(holds(g, shapes, params, {**types, var: dtype}) for g in decided):
                return False
            return _all_bind(terms, shapes, params, {**types, var: dtype}) or _all_bind(
                terms, shapes, params, {**types, var: dtype, **dict.fromkeys(rest, dtype)})

        kept = [d for d in dict.fromkeys([preferred[var], *dtypes.DTYPES]) if fits(d)]
        assume(kept)
        types[var] = draw(st.sampled_from(kept))
    assume(_all_bind(terms, shapes, params, types))
    return types


def _draw_term(
    draw: st.DrawFn,
    term: SList,
    guards: Sequence[SList],
    shapes: dict[str, Shape],
    params: dict[str, ParamValue],
    types: dict[str, str],
    extra: Extra,
    hint: Shape | None = None,
) -> None:
    """Bind the fresh variables of `term` (inner terms first) so that it type-checks, each tensor variable at
    the dtype its kernel's sampler gives that operand (float64 for "float"), recorded in `types`. `hint` is a
    shape the enclosing kernel's sampler gave this term's place: a seed for its operands when this term's
    kernel keeps its operands' shape (an add), so an inner add can be drawn 4-D for the conv around it; for
    other kernels (a conv inside an add) it would only crowd out well-typed candidates."""
    ctor, tensors, args = _split(term)
    sample_shapes, sample_params, *kinds = ctor.kernel.sample(draw)
    if hint is not None and not _keeps_shape(ctor, sample_shapes, sample_params):
        hint = None
    for position, inner in enumerate(tensors):
        if isinstance(inner, SList):
            _draw_term(draw, inner, guards, shapes, params, types, extra, sample_shapes[position])
    fresh_tensors: dict[str, int] = {}  # variable -> its first operand position
    for position, t in enumerate(tensors):
        if isinstance(t, Atom) and t.text not in shapes:
            fresh_tensors.setdefault(t.text, position)
    fresh_params = {a.text: name for name, a in zip(ctor.params, args) if isinstance(a, Atom) and variables(a)}
    fresh_params = {var: name for var, name in fresh_params.items() if var not in params}
    last = len(fresh_tensors) + len(fresh_params) - 1
    for n, (var, position) in enumerate(fresh_tensors.items()):
        kind = kinds[0][position] if kinds else "float"
        types[var] = "float64" if kind == "float" else kind
        known = [term_shape(t, shapes, params, types) for t in tensors if isinstance(t, SList)]
        seeds = list(dict.fromkeys([sample_shapes[position], *known, *shapes.values(), *([hint] if hint else [])]))
        shapes[var] = _pick(draw, _shape_candidates(seeds, extra), var, lambda s: ({**shapes, var: s}, params),
                            guards, term, n == last, types)
    for n, (var, name) in enumerate(fresh_params.items(), start=len(fresh_tensors)):
        default = ctor.kernel.params[name]
        seeds = [term_shape(t, shapes, params, types) for t in tensors]
        options = _param_candidates(sample_params.get(name, default), default, seeds)
        params[var] = _pick(draw, options, var, lambda p: (shapes, {**params, var: p}), guards, term, n == last,
                            types)
    assume(_binds(term, shapes, params, types))


def _keeps_shape(ctor: Constructor, sample_shapes: Sequence[Shape], sample_params: Mapping[str, ParamValue]) -> bool:
    """Whether the kernel's sampled operands all have its output's shape (elementwise ops)."""
    try:
        out = ctor.kernel.bind(list(sample_shapes), dict(sample_params)).output_shape
    except _ILL_TYPED:
        return False
    return all(tuple(s) == out for s in sample_shapes)


Binding = tuple[Mapping[str, Shape], Mapping[str, ParamValue]]


def _pick(
    draw: st.DrawFn,
    options: Sequence[Shape | ParamValue],
    var: str,
    trial: Callable[[Shape | ParamValue], Binding],
    guards: Sequence[SList],
    term: SList,
    last: bool,
    types: Mapping[str, str],
) -> Shape | ParamValue:
    """One of `options` for `var` under which every decidable guard holds and, once `var` is the last
    fresh variable of `term`, `term` binds: filtering instead of rejecting keeps most draws valid. Half the
    time the kernel sampler's own value (options[0]) when it fits: samplers give operands that fit each other,
    which a uniform pick among widened shapes rarely does for a conv's input, filters and params."""

    on_var = [(g, variables(g)) for g in guards if var in variables(g)]

    def fits(value: Shape | ParamValue) -> bool:
        shapes, params = trial(value)
        decidable = [g for g, needs in on_var if needs <= {*shapes, *params}]
        return all(holds(g, shapes, params) for g in decidable) and (not last or _binds(term, shapes, params, types))

    kept = [o for o in options if fits(o)]
    assume(kept)
    if kept[0] == options[0] and draw(st.booleans()):
        return kept[0]
    return draw(st.sampled_from(kept))


# -- checking --------------------------------------------------------------------------------------


def _emit(g: Graph, term: SExp, case: Case) -> Value | str:
    if isinstance(term, Atom):
        return term.text
    ctor, tensors, args = _split(term)
    return g.op(ctor.kernel.name, *(_emit(g, t, case) for t in tensors), **_params(ctor, args, case.params))


def _graph(sides: Mapping[str, SExp], case: Case) -> Graph:
    """One side of a rule as a graph with an output per rule output: variables are inputs of their drawn
    dtypes, literals (and arithmetic on size variables) are kernel params."""
    g = Graph()
    for var, shape in sorted(case.shapes.items()):
        g.input(var, shape, _dtype(case.types, var))
    for name, term in sides.items():
        g.output(name, _emit(g, term, case))
    return g


def _graph_or_none(sides: Mapping[str, SExp], case: Case) -> Graph | None:
    try:
        return _graph(sides, case)
    except GraphError:
        return None


def checked_outputs(rule: Rule) -> tuple[Output, ...]:
    """The outputs a rule unions with something: a multi-output rule's pattern without a union is context."""
    return tuple(o for o in rule.outputs if not (isinstance(o.rhs, Atom) and o.rhs.text == o.name))


_TYPE_FUNCTIONS = ("Rank", "Dim", "Dtype", "Shape")


def _compares_classes(guard: SExp, names: set[str]) -> bool:
    """Whether `guard` uses an output as an e-class (as in (!= a b)), not inside Rank, Dim, Dtype or Shape."""
    if isinstance(guard, Atom):
        return guard.text in names
    return guard.head not in _TYPE_FUNCTIONS and any(_compares_classes(i, names) for i in guard.items[1:])


def _substitute(term: SExp, terms: Mapping[str, SExp]) -> SExp:
    if isinstance(term, Atom):
        return terms.get(term.text, term)
    return SList(tuple(_substitute(i, terms) for i in term.items), term.line)


def _value_guards(rule: Rule) -> tuple[SList, ...]:
    """Guards on types, with each output read as its pattern ((Rank a) is the rank of a's term); a guard on
    output e-classes, like (!= a b), only narrows the matches, so it is not drawn."""
    patterns = {o.name: o.lhs for o in rule.outputs if o.name}
    return tuple(_substitute(g, patterns) for g in rule.guards  # type: ignore[misc]
                 if not _compares_classes(g, set(patterns)))


def disagreement(rule: Rule, case: Case) -> str | None:
    """Why the rule's two sides differ on `case` (shape, dtype, or values beyond the result dtype's
    tolerance) at some output, or None when they agree. Both sides read the same inputs, drawn for the
    left-hand sides."""
    outputs = checked_outputs(rule)
    label = {o.name or "out": f"output {o.name}: " if len(rule.outputs) > 1 else "" for o in outputs}
    left = _graph({o.name or "out": o.lhs for o in outputs}, case)
    inputs = random_inputs(left, case.seed)
    expected_all = evaluate(left, inputs)
    rights = {o.name or "out": o.rhs for o in outputs}
    try:
        right = _graph(rights, case)
    except GraphError as err:
        if case.types and _graph_or_none(rights, replace(case, types={})) is not None:
            return None  # ill-typed only at these dtypes: the e-graph drops such a node (egraph/generate.py)
        return f"the right-hand side does not type-check: {err}"
    got_all = evaluate(right, inputs)
    for name, expected in expected_all.items():
        why = _differs(left, right, name, got_all[name], expected, case)
        if why is not None:
            return None if _rounding_only(rule, case) else label[name] + why
    return None


HALF = ("float16", "bfloat16")


def _rounding_only(rule: Rule, case: Case) -> bool:
    """Whether the sides agree once every half-precision input is float64. Half precision's error is relative to
    the terms a value is summed from, not to the value: a·b + a·c against a·(b + c), with b + c cancelling in
    bfloat16, differed by 5% of the output (test_rulecheck has the case); that is rounding, not the rule."""
    if not any(t in HALF for t in case.types.values()):
        return False
    wide = replace(case, types={v: "float64" if t in HALF else t for v, t in case.types.items()})
    return disagreement(rule, wide) is None


def _differs(left: Graph, right: Graph, name: str, got: np.ndarray, expected: np.ndarray, case: Case) -> str | None:
    if got.shape != expected.shape:
        return f"the left-hand side has shape {list(expected.shape)}, the right-hand side {list(got.shape)}"
    want_dtype, got_dtype = left[left.outputs[name]].dtype, right[right.outputs[name]].dtype
    if got_dtype != want_dtype:
        return f"the left-hand side gives {want_dtype}, the right-hand side {got_dtype}"
    # A rewrite may move where a value is rounded to the narrowest float among its inputs (matmul distributed over
    # a float64 + float32 add rounds a·c to float32), so values are compared at that float's tolerance.
    loosest = max([want_dtype, *(_dtype(case.types, v) for v in case.shapes)], key=lambda d: TOLERANCE.get(d, 0.0))
    if error(got, expected, loosest).ok:
        return None
    wide_got, wide_want = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.where(np.isnan(wide_got) != np.isnan(wide_want), np.inf, np.abs(wide_got - wide_want))
    diff[np.isnan(diff)] = 0.0
    at = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.ndim else ()
    return (f"values differ beyond {loosest}'s tolerance: at {list(map(int, at))} the left-hand side gives "
            f"{wide_want[at]:.6g}, the right {wide_got[at]:.6g}")


def _directions(rule: Rule) -> list[tuple[str, Rule]]:
    """A birewrite is two rules; each direction must hold on its own left-hand side's inputs."""
    forward = [("", rule)]
    if rule.form != "birewrite":
        return forward
    return [*forward, ("right-to-left: ", replace(rule, outputs=(Output(rule.rhs, rule.lhs),)))]  # type: ignore[arg-type]


def _drawn_for(rule: Rule) -> st.SearchStrategy[Case]:
    if rule.form != "rule":
        return cases(rule.lhs, _value_guards(rule))
    patterns = {o.name: o.lhs for o in rule.outputs}
    sizes = tuple((var, _substitute(term, patterns)) for var, term in rule.sizes)
    return cases(tuple(patterns.values()), _value_guards(rule), sizes)


def check_rule(rule: Rule, max_examples: int = 100, shrink: bool = True) -> RuleVerdict:
    """Search for inputs on which `rule` changes the value; report the shrunk one with the rule's file:line.
    Each direction of a birewrite needs examples of its own: one never tested fails, as "untested".
    `shrink=False` reports the first failing input as drawn: for a test that asks only whether and where a rule
    fails (shrinking a conv counterexample redraws well-typed convs: 8 CPU s against 0.2)."""
    if max_examples < 1:
        raise ValueError(f"max_examples must be at least 1, got {max_examples}")
    run = 0

    def wrong(case: Case) -> bool:
        nonlocal run
        run += 1
        return disagreement(direction, case) is not None

    config = settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                      print_blob=False, phases=[p for p in Phase if shrink or p is not Phase.shrink])
    for label, direction in _directions(rule):
        before = run
        try:
            with with_reporter(lambda text: None):  # hypothesis' own hints (@seed, blobs) mean nothing to a rule author
                case = find(_drawn_for(direction), wrong, settings=config)
        except (NoSuchExample, Unsatisfiable):
            if run == before:
                side = label.rstrip(": ") or ("left-to-right" if rule.form == "birewrite" else "")
                return RuleVerdict(rule, False, run, f"{rule.where}: {side + ' untested: ' if side else ''}"
                                   "no well-typed input satisfying the guards was found")
            continue
        except Uncheckable as err:
            return RuleVerdict(rule, False, run, f"{rule.where}: cannot be checked: {err}")
        return RuleVerdict(rule, False, run, f"{rule.where}: {label}{case}: {disagreement(direction, case)}")
    return RuleVerdict(rule, True, run)


def check_rules(files: Sequence[RuleFile], max_examples: int = 100) -> list[RuleVerdict]:
    return [check_rule(rule, max_examples) for f in files for rule in f.rules]
