"""TASO's 133 generated substitutions, instantiated with concrete shapes as pairs of Tapestry graphs.

The substitutions come verbatim from Tensat's text files (`tensat/README.md` says where from). Each becomes
two graphs over the same inputs: the left-hand sides as outputs of one, the right-hand sides of the other (two
outputs for the 13 two-output substitutions). Shapes: an input is a matrix (MATRIX) or, where an op makes
it 4-D (conv2d, a 4-D concat, or an elementwise op beside one), an activation or filter (IMAGE); all are square,
so every op of every substitution type-checks. Tensat's ops map to kernels: matmul, add, mul, relu, concat,
conv2d (SAME padding is padding 1 for the 3x3 filters; groups, as in TASO, are the input's channels over the
filter's; activation RELU is a relu after it: Tapestry has no fused conv_relu), and split_0/split_1 are slices
at the seam of the concat inside the split.

`wrong_variant` makes a deliberately wrong substitution from a right one, for the other half of the test:
`tapestry.equivalent` must prove none of them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tapestry.egraph.sexp import Atom, SExp, SList, parse
from tapestry.graph import Graph, Value

DATA = Path(__file__).resolve().parent / "tensat"
MATRIX = (4, 4)
IMAGE = (2, 2, 3, 3)  # N, C, H, W of activations and O, C, KH, KW of filters: one shape serves as both


@dataclass(frozen=True)
class Substitution:
    """One TASO substitution: `lhs` and `rhs` are its sides as terms in Tensat's language, one per output."""

    name: str  # file:line
    lhs: tuple[SExp, ...]
    rhs: tuple[SExp, ...]

    @property
    def variables(self) -> list[str]:
        found: dict[str, None] = {}
        for term in (*self.lhs, *self.rhs):
            for atom in _atoms(term):
                if atom.startswith("?"):
                    found[atom] = None
        return sorted(found, key=lambda v: int(v.rsplit("_", 1)[1]))

    def graphs(self) -> tuple[Graph, Graph]:
        """The left- and right-hand sides as graphs with the same inputs and outputs out0 (, out1)."""
        ranks = _ranks((*self.lhs, *self.rhs))
        return _graph(self, self.lhs, ranks), _graph(self, self.rhs, ranks)

    def __str__(self) -> str:
        return " ; ".join(map(str, self.lhs)) + " => " + " ; ".join(map(str, self.rhs))


def _atoms(term: SExp) -> list[str]:
    return [term.text] if isinstance(term, Atom) else [a for item in term.items for a in _atoms(item)]


def _side(text: str) -> SExp:
    (term,) = parse(text)
    return term


def substitutions(data: Path = DATA) -> list[Substitution]:
    """The 120 single-output substitutions, then the 13 two-output ones."""
    found = []
    single = (data / "converted.txt").read_text().splitlines()
    for n, line in enumerate(single, start=1):
        lhs, rhs = line.split("=>")
        found.append(Substitution(f"converted.txt:{n}", (_side(lhs),), (_side(rhs),)))
    multi = (data / "converted_multi.txt").read_text().splitlines()
    for n in range(0, len(multi), 2):
        (l0, r0), (l1, r1) = (multi[n].split("=>"), multi[n + 1].split("=>"))
        found.append(Substitution(f"converted_multi.txt:{n + 1}", (_side(l0), _side(l1)), (_side(r0), _side(r1))))
    return found


def _ranks(terms: Sequence[SExp]) -> dict[str, int]:
    """Each variable's rank, from the ops around it; 2 (a matrix) where nothing says otherwise."""
    ranks: dict[str, int] = {}

    def visit(term: SExp, rank: int | None) -> int | None:
        if isinstance(term, Atom):
            if rank is not None and term.text.startswith("?"):
                ranks[term.text] = rank
            return ranks.get(term.text)
        head, args = term.head, term.items[1:]
        if head == "matmul":
            visit(args[1], 2), visit(args[2], 2)
            return 2
        if head == "conv2d":
            visit(args[4], 4), visit(args[5], 4)
            return 4
        if head == "concat":
            n = int(str(args[1]))
            visit(args[2], n), visit(args[3], n)
            return n
        if head in ("split", "split_0", "split_1"):
            return visit(args[-1], rank)
        found = [visit(a, rank) for a in args]  # elementwise: operands share the result's rank
        known = rank or next((r for r in found if r is not None), None)
        if known is not None and rank is None:
            for a in args:
                visit(a, known)
        return known

    for _ in range(3):  # a rank learnt in one term reaches elementwise siblings in another
        for term in terms:
            visit(term, None)
    return ranks


def _graph(sub: Substitution, sides: Sequence[SExp], ranks: dict[str, int]) -> Graph:
    g = Graph()
    values = {v: g.input(v.lstrip("?"), IMAGE if ranks.get(v) == 4 else MATRIX) for v in sub.variables}
    for n, term in enumerate(sides):
        g.output(f"out{n}", _emit(g, term, values))
    return g


def _ints(items: Sequence[SExp]) -> list[int]:
    return [int(str(i)) for i in items]


def _emit(g: Graph, term: SExp, values: dict[str, Value]) -> Value:
    if isinstance(term, Atom):
        return values[term.text]
    head, args = term.head, term.items[1:]
    if head == "matmul":  # (matmul ACT a b)
        (act,), a, b = _ints(args[:1]), *args[1:]
        return _activation(g, g.matmul(_emit(g, a, values), _emit(g, b, values)), act)
    if head in ("ewadd", "ewmul"):
        a, b = (_emit(g, t, values) for t in args)
        return g.add(a, b) if head == "ewadd" else g.mul(a, b)
    if head == "relu":
        return g.relu(_emit(g, args[0], values))
    if head == "concat":  # (concat AXIS NDIM a b)
        axis, _ = _ints(args[:2])
        return g.concat(_emit(g, args[2], values), _emit(g, args[3], values), axis=axis)
    if head == "conv2d":  # (conv2d SX SY PAD ACT x w), SAME padding
        sx, sy, pad, act = _ints(args[:4])
        if sx != sy or pad != 0:
            raise ValueError(f"{term}: only equal strides and SAME padding occur in TASO's substitutions")
        x, w = _emit(g, args[4], values), _emit(g, args[5], values)
        conv = g.conv2d(x, w, stride=sx, padding=IMAGE[-1] // 2, groups=x.shape[1] // w.shape[1])
        return _activation(g, conv, act)
    if head in ("split_0", "split_1"):  # a half of (split AXIS t), cut where t's concat joins its operands
        split = args[0]
        assert isinstance(split, SList) and split.head == "split", split
        axis = int(str(split.items[1]))
        whole = _emit(g, split.items[2], values)
        seam = _emit(g, _first_concat(split.items[2]).items[3], values).shape[axis]
        start, stop = (0, seam) if head == "split_0" else (seam, whole.shape[axis])
        return g.slice(whole, axis=axis, start=start, stop=stop)
    raise ValueError(f"{term}: {head!r} is not an op of TASO's substitutions")


def _activation(g: Graph, value: Value, act: int) -> Value:
    if act not in (0, 2):
        raise ValueError(f"activation {act}: only NONE (0) and RELU (2) occur in TASO's substitutions")
    return g.relu(value) if act == 2 else value


def _first_concat(term: SExp) -> SList:
    """The concat a split cuts: the first one found depth first."""
    for sub in _walk(term):
        if sub.head == "concat":
            return sub
    raise ValueError(f"{term}: a split of a term with no concat")


def _walk(term: SExp) -> Iterator[SList]:
    if isinstance(term, SList):
        yield term
        for item in term.items[1:]:
            yield from _walk(item)


# -- deliberately wrong variants ---------------------------------------------------------------------

_SWAPS = {"ewadd": "ewmul", "ewmul": "ewadd"}


def wrong_variant(sub: Substitution) -> Substitution | None:
    """`sub` with its first right-hand side broken in the first way that applies: the operands of a matmul or a
    conv swapped, or add and mul exchanged, or a concat's operands swapped. None when no edit applies. Whether
    the variant is really wrong is for the caller to check numerically (a swap can be harmless)."""
    for edit in (_swap_operands("matmul", 2), _swap_operands("conv2d", 5), _exchange_ew, _swap_operands("concat", 3)):
        broken = edit(sub.rhs[0])
        if broken is not None:
            return Substitution(sub.name + " (wrong)", sub.lhs, (broken, *sub.rhs[1:]))
    return None


def _edit_first(term: SExp, here: Callable[[SList], SExp | None]) -> SExp | None:
    """`term` with its first subterm (pre-order) that `here` rewrites rewritten; None when `here` applies nowhere."""
    if not isinstance(term, SList):
        return None
    changed = here(term)
    if changed is not None:
        return changed
    items = list(term.items)
    for n, item in enumerate(items[1:], start=1):
        inner = _edit_first(item, here)
        if inner is not None:
            items[n] = inner
            return SList(tuple(items), term.line)
    return None


def _swap_operands(op: str, first: int) -> Callable[[SExp], SExp | None]:
    def swap(term: SList) -> SExp | None:
        items = list(term.items)
        if term.head != op or items[first] == items[first + 1]:
            return None
        items[first], items[first + 1] = items[first + 1], items[first]
        return SList(tuple(items), term.line)

    return lambda term: _edit_first(term, swap)


def _exchange_ew(term: SExp) -> SExp | None:
    def exchange(t: SList) -> SExp | None:
        return SList((Atom(_SWAPS[t.head], t.line), *t.items[1:]), t.line) if t.head in _SWAPS else None

    return _edit_first(term, exchange)
