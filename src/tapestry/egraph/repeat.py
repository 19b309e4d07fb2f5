"""Find the repeated layers of a distributed e-graph, so extraction can solve one layer and reuse it (as Alpa
clusters a model's identical layers).

The logical values are put in a canonical order: post-order from the outputs, each value's producers taken by
kernel and their arguments in argument order. A value's token says what produces it and where its arguments
sit, as distances back in that order (a placed input by its layouts instead), so it does not depend on which
layer the value is in. A stack of identical layers then reads as a token sequence with a period; the longest
stretch of it is the repeated region, cut into copies of one period each. Copy k's classes (value, layout)
line up with copy k+1's. A value outside the copies that copy 0 reads (the first layer's input, a constant the
layers share) is paired with what copy 1 reads in its place.

Detection is only a proposal: `tapestry.extract.periodic` checks every class and node it ties, and a wrong
pairing only makes the periodic plan dearer, never invalid.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tapestry.egraph.decode import Decoder, DNode
from tapestry.extract.periodic import MIN_COPIES, Repeated


def find_repetition(decoder: Decoder, roots: Sequence[str]) -> Repeated | None:
    """The repeated block with the most copies' worth of values, or None when nothing repeats MIN_COPIES times."""
    producers: dict[str, list[DNode]] = {}
    for node in decoder.nodes:
        if node.op not in ("Reshard", "Deliver"):
            producers.setdefault(node.value, []).append(node)
    for made in producers.values():
        made.sort(key=lambda n: (n.op, _identity(decoder, n)))
    value = decoder.class_value
    delivered = {n.eclass: n.children[0] for n in decoder.nodes if n.op == "Deliver"}
    order = _post_order([value[delivered[r]] for r in roots if r in delivered], producers, value)
    position = {v: i for i, v in enumerate(order)}
    leaves = {v for v in order if all(n.op == "Place" for n in producers[v])}
    static = {value[c] for c in decoder.static_classes if c in value} - leaves
    shape = _Shapes(producers, value, leaves, static, decoder)
    tokens = np.array([hash(_token(v, producers, value, position, shape, decoder)) for v in order], dtype=np.int64)
    found = _period(tokens)
    if found is None:
        return None
    start, period, count = found
    layouts: dict[str, dict[str, str]] = {}
    for c, v in value.items():
        layouts.setdefault(v, {})[decoder.class_layout[c]] = c
    values = [order[start + k * period:start + (k + 1) * period] for k in range(count)]
    copies: list[list[str]] = [[] for _ in range(count)]
    for i in range(period):
        per_copy = [layouts.get(values[k][i], {}) for k in range(count)]
        for layout in sorted(set.intersection(*(set(p) for p in per_copy))):
            for k in range(count):
                copies[k].append(per_copy[k][layout])
    inside = set(order[start:start + count * period])
    entry = _entry(values[0], values[1], inside, producers, value, layouts, decoder)
    return Repeated(tuple(map(tuple, copies)), entry)


def _identity(decoder: Decoder, node: DNode) -> str:
    """What a node computes, the same in every layer: a Run's candidate (kernel, partition), a Place's layout."""
    return decoder.interner.priced_as.get(node.key, node.key) if node.op != "Place" else node.layout


def _args(node: DNode, value: dict[str, str]) -> tuple[str, ...]:
    return tuple(value[c] for c in node.children)


def _post_order(tops: Sequence[str], producers: dict[str, list[DNode]], value: dict[str, str]) -> list[str]:
    """Values children first, from each top in turn, arguments in order (explicit stack: stacks are deep)."""
    order: list[str] = []
    seen: set[str] = set()
    for top in tops:
        if top in seen:
            continue
        seen.add(top)
        stack = [(top, iter([a for n in producers.get(top, ()) for a in _args(n, value)]))]
        while stack:
            v, pending = stack[-1]
            for arg in pending:
                if arg not in seen:
                    seen.add(arg)
                    stack.append((arg, iter([a for n in producers.get(arg, ()) for a in _args(n, value)])))
                    break
            else:
                stack.pop()
                order.append(v)
    return order


class _Shapes:
    """What a placed input or a value made from static inputs alone (`Decoder.static_classes`: a rotary table,
    a prepared weight) is, wherever it sits: its layouts, or its producers with their arguments' shapes in turn.
    Such values are read by every layer (transformers' LLaMA computes its rotary tables once, before the first
    layer): as distances back, each layer's reads differed and no period was found."""

    def __init__(self, producers: dict[str, list[DNode]], value: dict[str, str], leaves: set[str],
                 static: set[str], decoder: Decoder) -> None:
        self.producers, self.value, self.leaves, self.static, self.decoder = producers, value, leaves, static, decoder
        self.known: dict[str, object] = {}

    def __contains__(self, v: str) -> bool:
        return v in self.leaves or v in self.static

    def __call__(self, v: str) -> object:
        """Arguments first, by an explicit stack (a static chain can run deeper than Python's: WavLM's position
        bias); an argument met again on its own path (a cycle of the e-graph) reads as "cycle"."""
        stack, on_path = [v], {v}
        while v not in self.known:
            top = stack[-1]
            pending = next((a for a in self._reads(top) if a not in self.known and a not in on_path), None)
            if pending is not None:
                stack.append(pending)
                on_path.add(pending)
                continue
            stack.pop()
            on_path.discard(top)
            self.known[top] = self._what(top)
        return self.known[v]

    def _reads(self, v: str) -> list[str]:
        if v in self.leaves:
            return []
        return [a for n in self.producers[v] for a in _args(n, self.value) if a in self]

    def _what(self, v: str) -> object:
        if v in self.leaves:
            return ("placed", tuple(n.layout for n in self.producers[v]))
        return ("static", hash(tuple(sorted(
            {(n.op, _identity(self.decoder, n), tuple(self.known.get(a, "cycle") if a in self else "made"
                                                     for a in _args(n, self.value)))
             for n in self.producers[v]}, key=repr))))


def _token(v: str, producers: dict[str, list[DNode]], value: dict[str, str], position: dict[str, int],
           shape: _Shapes, decoder: Decoder) -> tuple:
    """What makes `v` and not where it is: its producers, each argument a distance back (a placed input or a
    static value: what it is, so a per-layer weight and a shared constant read alike)."""
    def arg(a: str) -> object:
        return shape(a) if a in shape else position[v] - position[a]
    return tuple(sorted({(n.op, _identity(decoder, n), tuple(arg(a) for a in _args(n, value)))
                         for n in producers[v]}, key=repr))


def _period(tokens: np.ndarray) -> tuple[int, int, int] | None:
    """(start, period, copies) of the longest stretch where tokens repeat with one period, the shortest such
    period; None below MIN_COPIES copies."""
    best: tuple[int, int, int] | None = None
    n = len(tokens)
    for period in range(1, n // MIN_COPIES + 1):
        same = np.concatenate(([False], tokens[:-period] == tokens[period:], [False]))
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if not len(edges):
            continue
        starts, ends = edges[::2], edges[1::2]
        longest = int(np.argmax(ends - starts))
        count = (int(ends[longest] - starts[longest]) + period) // period
        if count >= MIN_COPIES and (best is None or count * period > best[1] * best[2]):
            best = (int(starts[longest]), period, count)
    return best


def _entry(first: Sequence[str], second: Sequence[str], inside: set[str], producers: dict[str, list[DNode]],
           value: dict[str, str], layouts: dict[str, dict[str, str]], decoder: Decoder) -> dict[str, str]:
    """Classes outside the copies that copy 0 reads -> what copy 1 reads in their place (argument by argument
    of the producers that match); a value paired two ways is left out."""
    pairs: dict[str, str | None] = {}
    for v, w in zip(first, second):
        theirs = {(n.op, _identity(decoder, n)): n for n in producers[w]}
        for node in producers[v]:
            match = theirs.get((node.op, _identity(decoder, node)))
            if match is None:
                continue
            for a, b in zip(_args(node, value), _args(match, value)):
                if a not in inside and pairs.setdefault(a, b) != b:
                    pairs[a] = None
    entry = {}
    for a, b in pairs.items():
        if b is not None:
            entry.update((c, layouts[b][layout]) for layout, c in layouts[a].items() if layout in layouts.get(b, {}))
    return entry
