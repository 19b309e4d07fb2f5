"""Repeated layers of an imported graph, found before saturation, and the graph folded to two of them.

A model's layers are `m` copies of one block: `Layers.chains[i]` is one node of the block in every copy (its name
in copy 0, 1, ..., m-1), and copy k's nodes read copy k-1's (forward), copy k+1's (backward) or values outside
the copies (the prefix before them, the suffix after, and what every copy shares: rotary tables, Adam's step).

Detection: the inputs seed it. Names that differ only in one number (`model.layers.3.mlp.up_proj.weight`,
`adam.m.model.layers.3...`) over a run 0..m-1 are the copies' inputs; copy k's input maps to copy k+1's (the
shift). Then, in graph order, an op reading a shifted value maps to the op that reads the shifted values in the
same places, with the same kernel, parameters and type (among identical ones, the same rank in graph order); a
value it reads that the shift does not know yet pairs with what its image reads there (a per-layer mask, the
first layer's input, what the last layer's backward reads from the suffix). The shift, cut into chains, gives
one chain per node of the block; a chain one longer has an entry or exit at one end, left out by kind (the first
layer's input is not made like a layer's output) or else by the copy of the nearest seed (the final norm reads
the last layer as each layer's norm reads the one before). The chains are then checked to be a shift
(`_check`): every node of copy k has an image in copy k+1 that reads the images of what it reads. Whatever the
names say, only a checked shift is used, so a wrong guess costs a missed fold, never a wrong plan.

`fold` keeps the prefix, copies 0 and 1 and the suffix: copy 1 stands for copies 1..m-1 (the suffix reads it
where it read the last copy; copy 1 reads, where it read copy 2, what the last copy reads there).
"""
from __future__ import annotations

import heapq
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any
from dataclasses import dataclass

from tapestry.graph.graph import Graph, Node

MIN_COPIES = 3  # the fold models two copies, so fewer save nothing


@dataclass(frozen=True)
class Layers:
    """`chains[i][k]`: node i of the block in copy k; `outputs[j][k]`: the j-th per-copy output of copy k."""

    chains: tuple[tuple[str, ...], ...]
    outputs: tuple[tuple[str, ...], ...]

    @property
    def copies(self) -> int:
        return len(self.chains[0])

    def copy_of(self) -> dict[str, int]:
        return {name: k for chain in self.chains for k, name in enumerate(chain)}


@dataclass(frozen=True)
class Folded:
    """The folded graph, and where it reads differently from the whole one: `exits` maps a copy-1 value to what
    copy 1 reads in its place where copy 0 reads it (the value the last copy reads from the suffix)."""

    graph: Graph
    layers: Layers
    exits: Mapping[str, str]

    @property
    def twins(self) -> list[tuple[str, str]]:
        """Each layer value's copy 0 and copy 1 in the folded graph."""
        return [(chain[0], chain[1]) for chain in self.layers.chains]


def find_layers(graph: Graph) -> Layers | None:
    """The graph's repeated layers, or None when no run of MIN_COPIES or more checks out as a shift."""
    found = _seeds(graph)
    if found is None:
        return None
    seeds, shift = found
    count = 1 + max(seeds.values())
    shift = _propagate(graph, shift, {name for name, k in seeds.items() if k == count - 1})
    targets = set(shift.values())
    chains = [_chain(shift, start) for start in shift if start not in targets]
    copy: dict[str, int] = {}  # the copy each node of a placed chain is in
    for chain in chains:
        if len(chain) == count:
            copy.update((name, k) for k, name in enumerate(chain))
    for chain in chains:  # an entry before copy 0 or an exit after the last copy, where a seed tells which
        seed = next((j for j, name in enumerate(chain) if name in seeds), None)
        if len(chain) == count + 1 and seed is not None:
            copy.update((name, k) for k, name in enumerate(chain[seed - seeds[chain[seed]]:][:count]))
    nearest = _nearest_seed(graph, seeds, upstream=True), _nearest_seed(graph, seeds, upstream=False)
    for chain in chains:  # the others by the copy of the nearest seed (a layer's norm reads the layer before it,
        if len(chain) == count + 1 and chain[0] not in copy and chain[-1] not in copy:  # but its own weight)
            for near in nearest:  # a value is of the layer whose weights made it, else of the nearest layer
                votes = [sum(near.get(name) == k for k, name in enumerate(option))
                         for option in (chain[1:], chain[:-1])]
                if votes[0] != votes[1]:
                    break
            if _kind(graph[chain[0]]) != _kind(graph[chain[1]]):  # the first layer's input: not of a copy
                votes = [1, 0]
            elif _kind(graph[chain[-1]]) != _kind(graph[chain[-2]]):
                votes = [0, 1]
            if votes[0] != votes[1]:
                copy.update((name, k) for k, name in enumerate(chain[1:] if votes[0] > votes[1] else chain[:-1]))
    chains = [chain for chain in ([c for c in chains if len(c) == count]
                                  + [[n for n in c if n in copy] for c in chains if len(c) == count + 1])
              if len(chain) == count and [copy[n] for n in chain] == list(range(count))]
    index = {name: i for i, name in enumerate(n.name for n in graph)}
    chains.sort(key=lambda chain: index[chain[0]])
    layers = Layers(tuple(chains), _output_chains(graph, chains))
    return layers if _check(graph, layers) is None else None


def fold(graph: Graph, layers: Layers) -> Folded | None:
    """The graph with copies 2..m-1 left out (module docstring); None where something outside the copies reads
    a middle copy, or the reads cannot be redirected."""
    copy_of, m = layers.copy_of(), layers.copies
    position = {chain[k]: (i, k) for i, chain in enumerate(layers.chains) for k in range(m)}
    exits: dict[str, str] = {}
    dropped = {o for chain in layers.outputs for o in chain[2:]}
    reads: dict[str, list[str]] = {}  # kept node -> what it reads in the fold
    for node in graph:
        k = copy_of.get(node.name)
        if k is not None and k >= 2:
            continue
        args = reads[node.name] = []
        for p, a in enumerate(node.args):
            j = copy_of.get(a)
            if j is None or j == 0 or j == 1 and k is not None:
                args.append(a)
            elif k is None and j == m - 1:  # the suffix reads copy 1 where it read the last copy
                args.append(layers.chains[position[a][0]][1])
            elif k == 1 and j == 2:  # copy 1 reads what the last copy reads where copy 1 read copy 2
                last = graph[layers.chains[position[node.name][0]][m - 1]].args[p]
                if last in copy_of:
                    return None
                exits[layers.chains[position[a][0]][1]] = last
                args.append(last)
            else:
                return None
    order = _graph_order(graph, reads)
    if len(order) < len(reads):  # the redirected reads made a cycle
        return None
    folded = Graph()
    for name in order:  # a redirected read can be made after its reader in the whole graph
        node = graph[name]
        if node.is_input:
            folded.input(name, node.shape, node.dtype, static=name in graph.static)
        else:
            folded.op(node.op, *reads[name], name=name, **dict(node.params))
    copy_outputs = {o for chain in layers.outputs for o in chain}
    for name, target in graph.outputs.items():
        if name in dropped:
            continue
        if name not in copy_outputs and copy_of.get(target) == m - 1:  # read from the last copy: from copy 1
            target = layers.chains[position[target][0]][1]
        folded.output(name, target)
    kept = {n.name for n in folded}
    for out, into in graph.carried.items():
        if out in folded.outputs:
            folded.carry(out, into)
    folded.constants.update((k, v) for k, v in graph.constants.items() if k in kept)
    folded.examples.update((k, v) for k, v in graph.examples.items() if k in kept)
    folded.nonnegative.update(n for n in graph.nonnegative if n in kept)
    return Folded(folded, layers, exits)


def _graph_order(graph: Graph, reads: Mapping[str, list[str]]) -> list[str]:
    """The nodes of `reads`, each after what it reads, else in the graph's order."""
    index = {node.name: i for i, node in enumerate(graph)}
    return ranked_order(reads, {name: index[name] for name in reads})


def ranked_order(reads: Mapping[Any, Iterable[Any]], rank: Mapping[Any, Any]) -> list[Any]:
    """The keys of `reads`, each after the keys it reads, else the lowest `rank` first (a key reading itself, or
    in a cycle, is left out)."""
    waiting = {k: len(set(args)) for k, args in reads.items()}
    readers: dict[Any, list[Any]] = {}
    for k, args in reads.items():
        for a in set(args):
            readers.setdefault(a, []).append(k)
    ready = [(rank[k], k) for k, left in waiting.items() if left == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(k)
        for reader in readers.get(k, ()):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, (rank[reader], reader))
    return order


def _seeds(graph: Graph) -> tuple[dict[str, int], dict[str, str]] | None:
    """(input -> its copy, input -> the same input one copy on), by names that differ in one number over a run
    0..m-1 (m >= 3), the run with the most copies (then the most inputs) winning."""
    runs: dict[tuple[str, int], dict[int, str]] = {}
    for node in graph.inputs:
        if node.name in graph.constants:
            continue
        parts = re.split(r"(\d+)", node.name)
        for i in range(1, len(parts), 2):
            template = "".join(parts[:i]) + "#" + "".join(parts[i + 1:])
            runs.setdefault((template, i), {})[int(parts[i])] = node.name
    spans = Counter()
    for numbers in runs.values():
        if len(numbers) >= MIN_COPIES and sorted(numbers) == list(range(min(numbers), min(numbers) + len(numbers))):
            spans[(min(numbers), len(numbers))] += len(numbers)
    if not spans:
        return None
    (first, count), _ = max(spans.items(), key=lambda item: (item[0][1], item[1], -item[0][0]))
    copy: dict[str, int] = {}
    shift: dict[str, str] = {}
    for numbers in runs.values():
        if sorted(numbers) == list(range(first, first + count)) and len(
                {(graph[name].shape, graph[name].dtype) for name in numbers.values()}) == 1 \
                and not copy.keys() & set(numbers.values()):
            copy.update((name, k - first) for k, name in numbers.items())
            shift.update((numbers[k], numbers[k + 1]) for k in range(first, first + count - 1))
    return (copy, shift) if shift else None


def _propagate(graph: Graph, seeds: Mapping[str, str], last: set[str]) -> dict[str, str]:
    """The shift grown from the seeds' over the ops (module docstring); the last copy's inputs (`last`) have
    no image (the final norm's weight is not a fifth layer's)."""
    shift = dict(seeds)
    image_of = {b: a for a, b in shift.items()}
    journal: list[str] = []  # what `pair` added to the shift, in order: a failed try undoes what it added since
    users = graph.users()
    rank: dict[str, int] = {}
    same: Counter = Counter()
    for node in graph.ops:
        key = (node.op, node.params, node.shape, node.dtype, node.args)
        rank[node.name] = same[key]
        same[key] += 1

    def kind(name: str) -> tuple:
        return _kind(graph[name])

    def pair(a: str, b: str, deep: bool = True) -> bool:
        """Make b the image of a, and (`deep`) their arguments' images where they differ; False if that
        contradicts the shift. Arguments of unlike nodes are not paired: an entry (the first layer's input and
        what the second reads there) or an exit (what the last layer reads from the suffix)."""
        stack = [(a, b)]
        made: list[str] = []
        while stack:
            x, y = stack.pop()
            if shift.get(x, y) != y or image_of.get(y, x) != x or x in last:
                for z in made:
                    del image_of[shift.pop(z)]
                return deep and pair(a, b, deep=False)
            if x in shift or x == y:
                continue
            shift[x], image_of[y] = y, x
            made.append(x)
            if deep and _kind(graph[x]) == _kind(graph[y]) and graph[x].is_input == graph[y].is_input:
                stack += [(u, v) for u, v in zip(graph[x].args, graph[y].args) if u != v]
        journal.extend(made)
        return True

    for node in graph.ops:
        if node.name in shift:
            continue
        known = [p for p, a in enumerate(node.args) if a in shift]
        if not known:
            continue
        me = (node.op, node.params, node.shape, node.dtype, len(node.args))
        found = [u for u in users[shift[node.args[known[0]]]] if kind(u) == me
                 and all(graph[u].args[p] == shift[node.args[p]] for p in known)]
        shared = [u for u in found if all(graph[u].args[p] == a for p, a in enumerate(node.args) if p not in known)]
        alike = [u for u in found if all(kind(graph[u].args[p]) == kind(a) for p, a in enumerate(node.args))]
        found = shared or alike or found  # a value every copy reads stays itself; else like pairs with like
        for u in found:
            peers = [v for v in found if graph[v].args == graph[u].args]  # identical ops: the same rank's
            if len(peers) > rank[node.name] and peers[rank[node.name]] != u or u in image_of:
                continue
            mark = len(journal)  # undone by the journal, not by a copy of the whole shift per try (quadratic)
            if all(pair(a, b) for p, (a, b) in enumerate(zip(node.args, graph[u].args)) if p not in known):
                shift[node.name], image_of[u] = u, node.name
                break
            for z in journal[mark:]:
                del image_of[shift.pop(z)]
            del journal[mark:]
    return shift


def _kind(node: Node) -> tuple:
    return node.op, node.params, node.shape, node.dtype, len(node.args)


def _nearest_seed(graph: Graph, seeds: Mapping[str, int], upstream: bool) -> dict[str, int]:
    """Each node's nearest seed's copy (breadth first, in graph order), among what it is computed from
    (`upstream`), or over arguments and readers alike."""
    users = graph.users()
    found = dict(seeds)
    frontier = list(seeds)
    while frontier:
        reached = []
        for name in frontier:
            for other in (users[name] if upstream else (*graph[name].args, *users[name])):
                if other not in found:
                    found[other] = found[name]
                    reached.append(other)
        frontier = reached
    return found


def _chain(shift: Mapping[str, str], start: str) -> list[str]:
    chain = [start]
    while chain[-1] in shift and len(chain) <= len(shift):
        chain.append(shift[chain[-1]])
    return chain


def _output_chains(graph: Graph, chains: list[tuple[str, ...]]) -> tuple[tuple[str, ...], ...]:
    """The outputs of copy 0's values, each with the output of the same place in every later copy."""
    named: dict[str, list[str]] = {}
    for name, target in graph.outputs.items():
        named.setdefault(target, []).append(name)
    found = []
    for chain in chains:
        per_copy = [named.get(v, []) for v in chain]
        if len({len(names) for names in per_copy}) == 1:
            found += [tuple(names[j] for names in per_copy) for j in range(len(per_copy[0]))]
    return tuple(found)


def _check(graph: Graph, layers: Layers) -> str | None:
    """Whether the chains are a shift: copy k+1's node does what copy k's does, to the shifted arguments (a
    value outside the copies stays, but for copy 0's entry reads and the last copy's exit reads); inputs alike
    in shape, dtype and kind; outputs and carried pairs shifted alike; outside nodes read copy 0 or the last."""
    copy_of, m = layers.copy_of(), layers.copies
    if m < MIN_COPIES:
        return f"{m} copies"
    at = {name: (i, k) for i, chain in enumerate(layers.chains) for k, name in enumerate(chain)}
    entry: dict[str, str] = {}
    for chain in layers.chains:
        for k in range(m - 1):
            x, y = graph[chain[k]], graph[chain[k + 1]]
            if (x.op, x.params, x.shape, x.dtype, len(x.args)) != (y.op, y.params, y.shape, y.dtype, len(y.args)):
                return f"{x.name} and {y.name} differ"
            if x.is_input and ((x.name in graph.static) != (y.name in graph.static)
                               or (x.name in graph.constants) != (y.name in graph.constants)
                               or (x.name in graph.nonnegative) != (y.name in graph.nonnegative)):
                return f"inputs {x.name} and {y.name} differ in kind"
            for a, b in zip(x.args, y.args):
                if a in copy_of:
                    i, j = at[a]
                    if j + 1 < m and b != layers.chains[i][j + 1] or j + 1 == m and b in copy_of:
                        return f"{x.name} reads {a}, {y.name} reads {b}"
                elif b != a and not (k == 0 and copy_of.get(b) == 0 and entry.setdefault(a, b) == b):
                    return f"{x.name} reads {a} from outside, {y.name} reads {b}"
    for node in graph.ops:
        if node.name not in copy_of and any(0 < copy_of.get(a, 0) < m - 1 for a in node.args):
            return f"{node.name}, outside the copies, reads a middle copy"
    copy_outputs = {o: k for chain in layers.outputs for k, o in enumerate(chain)}
    for name, target in graph.outputs.items():
        if name not in copy_outputs and 0 < copy_of.get(target, 0) < m - 1:
            return f"output {name} is a middle copy's value"
    for chain in layers.outputs:
        for k in range(m - 1):
            into = graph.carried.get(chain[k])
            nxt = graph.carried.get(chain[k + 1])
            if (into is None) != (nxt is None) or into is not None and (
                    copy_of.get(into) != k or layers.chains[at[into][0]][k + 1] != nxt):
                return f"outputs {chain[k]} and {chain[k + 1]} are carried unlike"
    return None
