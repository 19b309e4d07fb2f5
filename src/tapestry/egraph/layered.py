"""One layer planned for all: the folded graph's e-graph (prefix, copies 0 and 1, suffix; graph.layers) extracted
as a periodic problem, and its plan expanded onto every copy of the whole graph.

Copy 1 stands for copies 1..m-1: its nodes cost m-1 times theirs, and each node of copy 0 is tied to its twin in
copy 1 (same step, reading the twins of what it reads), so both copies choose alike and the copy-to-copy layouts
are chosen once (as extract.periodic folds an e-graph, but before saturation, so generation and pricing see two
layers whatever the depth). The expanded plan runs copy 1's steps once per later copy, each reading its own
copy's values; it is a plan of the whole graph, validated like any. It is the best periodic plan the extractor
finds: a plan whose layers differ can be cheaper, so nothing is proven over all plans.

Only what graph.layers placed in a copy is tied: an e-class whose graph values are in copy 0 alone (or 1 alone).
A class made by a rule from a copy's values (no graph value of its own), or shared by values of different
copies, may not read a copy: such nodes are left unselectable (their graph op's own runs remain).
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from tapestry.clock import clock
from tapestry.egraph.decode import Decoder, DNode
from tapestry.extract import EGraph, Selection
from tapestry.extract.selection import finalize
from tapestry.extract.tree import TreeChoice, solvable_tree, tree_choice
from tapestry.graph import Graph
from tapestry.graph.layers import Folded, ranked_order
from tapestry.plan import Place, Plan, Reshard, Step


def value_classes(data: Mapping[str, Any], graph: Graph) -> dict[str, str]:
    """Graph value name -> its logical e-class: the generator encodes node k of the graph as `Id k`."""
    names = [node.name for node in graph]
    raw = data["nodes"]
    found = {}
    for spec in raw.values():
        if spec["op"] == "Id":
            handle = int(raw[spec["children"][0]]["op"])
            if handle < len(names):
                found[names[handle]] = spec["eclass"]
    return found


def by_first(pairs: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
    """Node -> the places of the pairs (n, twin) whose n it is: what `grown` looks up as a node is chosen."""
    found: dict[int, list[int]] = {}
    for i, (n, _) in enumerate(pairs):
        found.setdefault(n, []).append(i)
    return found


def grown(egraph: EGraph, choice: Mapping[int, int], pairs: Sequence[tuple[int, int]],
          index: Mapping[int, Sequence[int]] | None = None) -> dict[int, int]:
    """`choice` (class -> node) with, for each pair (n, twin) whose n is chosen, `twin` chosen for its class where
    that is unchosen and every class it reads is chosen: the fixed point of sweeping `pairs` in order until
    nothing grows, each twin added at the sweep and place such sweeps add it (so where two twins could take one
    class, the same one does, and the dict's order is theirs). One pass: a pair is queued, by (sweep, place), when
    the last class it waits for is chosen; sweeping did that ~90,000 pairs at a time on the 7B fold. Only the pairs
    of chosen nodes are visited (`index`: `by_first(pairs)`, which the caller can keep), each from when its n is
    chosen: visiting every pair took 0.33 s a call there, 37.5 of the extraction's 135.8 CPU s (docs/benchmarks.md,
    "Growing the mirrored choice from the chosen nodes only")."""
    index = by_first(pairs) if index is None else index
    kept = dict(choice)
    node_class, child_sets = egraph.node_class, egraph.child_sets
    waiting: dict[int, list[int]] = {}  # class -> the pairs (their n chosen) waiting for it to be chosen
    unmet: dict[int, int] = {}  # pair -> the classes its twin reads that are not chosen yet
    queue: list[tuple[int, int]] = []

    def reading(n: int, sweep: int, at: int) -> None:
        """n chosen (by pair `at` in `sweep`): its pairs wait for what their twins read, or are queued, reached
        later in this sweep or in the next (a pair whose twin's class is chosen already would add nothing)."""
        for j in index.get(n, ()):
            twin = pairs[j][1]
            if node_class[twin] in kept:
                continue
            needs = [d for d in child_sets[twin] if d not in kept]
            if needs:
                unmet[j] = len(needs)
                for d in needs:
                    waiting.setdefault(d, []).append(j)
            else:
                heapq.heappush(queue, (sweep if j > at else sweep + 1, j))

    for n in choice.values():
        reading(n, 0, -1)
    while queue:
        sweep, i = heapq.heappop(queue)
        twin = pairs[i][1]
        c = node_class[twin]
        if c in kept:
            continue
        kept[c] = twin
        for j in waiting.pop(c, ()):
            unmet[j] -= 1
            if unmet[j] == 0:
                heapq.heappush(queue, (sweep if j > i else sweep + 1, j))
        reading(twin, sweep, i)
    return kept


def with_reads(egraph: EGraph, choice: Mapping[int, int], pairs: Sequence[tuple[int, int]],
               tree: TreeChoice, index: Mapping[int, Sequence[int]] | None = None) -> dict[int, int]:
    """`choice` with, for each pair (n, twin) whose n is chosen and twin's class is not, the unchosen classes the
    twin reads chosen by their tree choice (and what that reads, likewise), where each has one: acyclic, as a
    chosen node reads only chosen classes and the tree's choices only classes finalized before theirs. The pairs
    are taken in order, as a sweep of them would, but only those of chosen nodes are visited (`index`:
    `by_first(pairs)`), each from when its n is chosen: a sweep of every pair was 2.5 of the 7B fold's 4.2 CPU s of
    mirroring (docs/benchmarks.md, "Mirroring from the chosen nodes' pairs")."""
    index = by_first(pairs) if index is None else index
    kept = dict(choice)
    node_class, child_sets = egraph.node_class, egraph.child_sets
    queue = [j for n in kept.values() for j in index.get(n, ())]
    heapq.heapify(queue)
    while queue:
        i = heapq.heappop(queue)
        n, twin = pairs[i]
        if kept.get(node_class[n]) != n or node_class[twin] in kept:
            continue
        stack = [d for d in child_sets[twin] if d not in kept]
        if not tree.all_extractable(stack):
            continue
        while stack:
            d = stack.pop()
            if d not in kept:
                kept[d] = chose = tree.node[d]
                for j in index.get(chose, ()):  # a later pair of the node chosen now: visited in its turn
                    if j > i:
                        heapq.heappush(queue, j)
                stack += [e for e in child_sets[chose] if e not in kept]
    return kept


def twins_alike(egraph: EGraph, pairs: Sequence[tuple[int, int]]) -> EGraph:
    """`egraph` with both nodes of a pair unselectable where either cannot be chosen (unselectable, or reading a
    class with no finite acyclic choice), to the fixed point. A tie makes the pair's nodes chosen together, so
    such a pair is out of every periodic selection; left selectable on one side, a tie-blind extractor (the
    greedy fallback) chose it there and `mirror` then chose its partner, whose class had nothing to read: the
    generation makes a copy's layouts from what reads them, so copy 1 can hold a layout whose copy-0 twin class
    is absent (on Mesh(2, 2, 2), copy 0's backward reading copy 1's gradient in a layout the prefix never reads)."""
    costs = list(egraph.node_cost)
    while True:
        priced = egraph.with_costs(costs)  # the last one's tree choice kept with it: its extractions start there
        tree, child_sets, selectable = priced.priced("tree", tree_choice), priced.child_sets, priced.selectable_nodes

        def usable(n: int) -> bool:
            return selectable[n] and tree.all_extractable(child_sets[n])

        dropped = [b for pair in pairs for a, b in (pair, pair[::-1]) if selectable[b] and not usable(a)]
        if not dropped:
            return priced
        for n in dropped:
            costs[n] = math.inf


@dataclass(frozen=True)
class Layered:
    """The folded graph's decoder and how its classes sit in the copies."""

    full: Graph
    folded: Folded
    decoder: Decoder
    classes: Mapping[str, str]  # folded graph value -> logical class

    @property
    def copies(self) -> int:
        return self.folded.layers.copies

    @cached_property
    def _names(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for name, c in self.classes.items():
            found.setdefault(c, []).append(name)
        return found

    @cached_property
    def copy_of(self) -> dict[str, int | None]:
        """Logical class -> 0 or 1 where all its graph values are in that copy, None where it is outside (or
        mixed, or made by a rule: `_free`)."""
        where = {name: k for chain in self.folded.layers.chains for k, name in enumerate(chain[:2])}
        found: dict[str, int | None] = {}
        for c in set(self.decoder.class_value.values()):
            copies = {where.get(n) for n in self._names.get(c, ())}
            found[c] = copies.pop() if len(copies) == 1 else None
        return found

    @cached_property
    def _free(self) -> frozenset[str]:
        """Logical classes outside the copies that may read them: made of graph values all outside."""
        where = {name for chain in self.folded.layers.chains for name in chain[:2]}
        return frozenset(c for c, names in self._names.items() if not any(n in where for n in names))

    @cached_property
    def _image(self) -> dict[str, str | None]:
        """Logical class read by copy 0 -> what copy 1 reads in its place (None where its values disagree)."""
        graph = self.folded.graph
        names: dict[str, str] = {}
        for chain in self.folded.layers.chains:
            x, y = graph[chain[0]], graph[chain[1]]
            names[x.name] = y.name
            names.update(zip(x.args, y.args))
        found: dict[str, str | None] = {}
        for a, b in names.items():
            ca, cb = self.classes.get(a), self.classes.get(b)
            if ca is not None and cb is not None:
                found[ca] = cb if found.get(ca, cb) == cb else None
        return found

    @cached_property
    def _at(self) -> dict[tuple[str, str], str]:
        return {(v, self.decoder.class_layout[c]): c for c, v in self.decoder.class_value.items()}

    def _class_image(self, c: str) -> str | None:
        value = self.decoder.class_value.get(c)
        if value is None:
            return None
        image = self._image.get(value, value if self.copy_of.get(value) is None else None)
        return None if image is None else self._at.get((image, self.decoder.class_layout[c]))

    def _identity(self, node: DNode) -> tuple:
        key = node.layout if node.op == "Place" else self.decoder.interner.priced_as.get(node.key, node.key)
        return node.op, key

    @cached_property
    def twins(self) -> dict[int, int]:
        """Node of copy 0 -> its twin in copy 1."""
        nodes = self.decoder.nodes
        index: dict[tuple, int] = {}
        for n, node in enumerate(nodes):
            if node.value and self.copy_of.get(node.value) == 1:
                index.setdefault((node.eclass, self._identity(node), node.children), n)
        outputs = {chain[0]: chain[1] for chain in self.folded.layers.outputs}
        delivers = {(node.key, node.children): n for n, node in enumerate(nodes) if node.op == "Deliver"}
        found: dict[int, int] = {}
        taken: set[int] = set()  # found's values (a scan of them per node took 200 profiled s on the 7B fold)
        for n, node in enumerate(nodes):
            if node.op == "Deliver" and node.key in outputs:  # copy 1's output delivered as copy 0's
                twin = delivers.get((outputs[node.key], (self._class_image(node.children[0]),)))
                if twin is not None:
                    found[n] = twin
                    taken.add(twin)
            elif node.value and self.copy_of.get(node.value) == 0:
                c = self._class_image(node.eclass)
                children = tuple(self._class_image(d) for d in node.children)
                twin = index.get((c, self._identity(node), children))
                if twin is not None and None not in children and twin not in taken:
                    found[n] = twin
                    taken.add(twin)
        return found

    def mirror(self, egraph: EGraph, selection: Selection, source: int = 0) -> Selection:
        """`selection` with copy 1 choosing the twins of copy 0's choices (`source` 1: copy 0 the twins of copy
        1's, which were chosen at m-1 times their cost): periodic, whatever chose the source copy (the warm start
        of the tied ILP, and the fallback where it found no selection keeping the ties in time)."""
        choice = [-1] * egraph.num_classes
        for c, n in selection.choice.items():
            choice[c] = n
        for n, twin in self.twins.items():
            if source == 0 and choice[egraph.node_class[n]] == n:
                choice[egraph.node_class[twin]] = twin
            elif source == 1 and choice[egraph.node_class[twin]] == twin:
                choice[egraph.node_class[n]] = n
        found = finalize(egraph, choice, solvable_tree(egraph), selection.extractor,
                         clock() - selection.seconds)
        # copy 0's output in a layout copy 1 reads has a twin only copy 2 would read, unreachable in the fold: kept
        # in the choice (children first, so no cycle) for the expansion's later copies; likewise copy 0 keeps the
        # twin of what copy 1 alone runs (its output in a layout only the suffix reads), so every tie holds both
        # ways where the classes allow, as the ILP's ties ask of its warm start
        # where a twin reads a class nothing chose (copy 1's input gradient made in the layout the prefix reads
        # copy 0's in reads the suffix's gradient in a layout nothing else reads), its tree choice is taken there
        pairs, index = self._pairs
        kept, tree = grown(egraph, found.choice, pairs, index), solvable_tree(egraph)
        while True:
            filled = with_reads(egraph, kept, pairs, tree, index)
            if len(filled) == len(kept):
                return replace(found, choice=kept)
            kept = grown(egraph, filled, pairs, index)

    @cached_property
    def _pairs(self) -> tuple[list[tuple[int, int]], dict[int, list[int]]]:
        """The twin pairs both ways (copy 0 -> 1, then 1 -> 0), and `by_first` of them: `mirror` grows by them."""
        pairs = [*self.twins.items(), *((t, n) for n, t in self.twins.items())]
        return pairs, by_first(pairs)

    def aligned(self, pins: Mapping[str, str], source: int) -> dict[str, str]:
        """`pins` (input -> layout key) with each input of the other copy pinned where its twin in copy `source`
        is: pins a periodic plan can keep (the fallback's, where the free choice placed the copies' weights
        apart)."""
        found = dict(pins)
        for chain in self.folded.layers.chains:
            if chain[source] in pins and chain[1 - source] in pins:
                found[chain[1 - source]] = pins[chain[source]]
        return found

    def holds(self, selection: Selection) -> bool:
        """Whether copy 1 runs the twin of every node copy 0 runs (it may run more: what only the suffix reads
        of the last copy)."""
        chosen = set(selection.choice.values())
        return all(twin in chosen for n, twin in self.twins.items() if n in chosen)

    def runs(self, n: int) -> int:
        """How many times the expanded plan runs node `n`'s step: once per copy 1..m-1 for a node of copy 1, else
        once."""
        node = self.decoder.nodes[n]
        return self.copies - 1 if node.value and self.copy_of.get(node.value) == 1 else 1

    def ties(self) -> list[tuple[int, int]]:
        return sorted(self.twins.items())

    def costs(self, egraph: EGraph) -> EGraph:
        """Copy 1's nodes at m-1 times their cost; a node of a copy without a twin, or of a class outside the
        copies that reads one but is not made of outside graph values, unselectable; and both nodes of a pair
        where either can never be chosen (`twins_alike`)."""
        twins, paired = self.twins, set(self.twins.values())
        costs = list(egraph.node_cost)
        for n, node in enumerate(self.decoder.nodes):
            where = self.copy_of.get(node.value) if node.value else None
            if where == 0 and n not in twins or where == 1 and n not in paired:
                costs[n] = math.inf
            elif where == 1:
                costs[n] = costs[n] * (self.copies - 1) if not math.isinf(costs[n]) else costs[n]
            elif where is None and node.value and node.value not in self._free and any(
                    self.copy_of.get(self.decoder.class_value.get(d, "")) is not None for d in node.children):
                costs[n] = math.inf
        return twins_alike(egraph.with_costs(costs), self.ties())

    def resident(self, resident: Mapping[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
        """DeviceBudget.resident with copy 1's placed inputs held m-1 times."""
        m = self.copies
        return {n: tuple(b * (m - 1) for b in held) if self.copy_of.get(self.decoder.nodes[n].value) == 1
                else held for n, held in resident.items()}

    def expand(self, egraph: EGraph, selection: Selection, root_names: Mapping[str, str],
               notes: Mapping[str, Any]) -> tuple[Plan, list[int]]:
        """The folded selection run on every copy: copy 1's steps once per copy 1..m-1, each reading its own
        copy's values (and copy k+1's where copy 0 reads copy 1); with the node each step comes from."""
        m, decoder, layers, nodes = self.copies, self.decoder, self.folded.layers, self.decoder.nodes
        emitted = self._emitted(egraph, selection)
        made: dict[str, int] = {}  # e-class -> folded step
        picked: list[int] = []  # folded step -> node
        for c, n in emitted:
            if nodes[n].op == "Deliver":
                made[c] = made[nodes[n].children[0]]
            else:
                made[c] = len(picked)
                picked.append(n)
        reads = [[made[d] for d in nodes[n].children] for n in picked]
        region = [self.copy_of.get(nodes[n].value) if nodes[n].value else None for n in picked]
        back = {t: n for n, t in self.twins.items()}
        twin_step = {i: made[nodes[back[n]].eclass] for i, n in enumerate(picked)
                     if region[i] == 1 and n in back and nodes[back[n]].eclass in made}
        one_on = {j: i for i, j in twin_step.items()}  # copy 0's step -> the copy 1 step repeating it

        def source(i: int, k: int | None, j: int, p: int) -> tuple[int, int | None]:
            """What instance k of folded step i reads where the folded step reads step j (argument p)."""
            if region[j] == 1:
                return (j, k) if region[i] == 1 else (j, 1) if region[i] == 0 else (j, m - 1)
            if region[j] == 0:
                return (one_on[j], k - 1) if region[i] == 1 and k is not None and k > 1 else (j, 0)
            if region[i] == 1 and k is not None and k < m - 1:
                if i not in twin_step:  # only the last copy's reader makes it: the plan's checks judge the rest
                    return j, None
                twin_read = reads[twin_step[i]][p]
                if region[twin_read] == 1:  # copy 0 reads copy 1 here: copy k reads copy k+1
                    return twin_read, k + 1
            return j, None

        instances = [(i, k) for i in range(len(picked))
                     for k in (range(1, m) if region[i] == 1 else [0 if region[i] == 0 else None])]
        args = {(i, k): [source(i, k, j, p) for p, j in enumerate(reads[i])] for i, k in instances}
        rename = {chain[1]: chain for chain in layers.chains}
        index = {node.name: k for k, node in enumerate(self.full)}

        def graph_index(i: int, k: int | None) -> int:
            names = self._names.get(nodes[picked[i]].value, ())
            if region[i] == 1:
                names = [rename[n][k] for n in names if n in rename]  # type: ignore[index]
            return min((index[n] for n in names), default=-1)

        order = self._topological(instances, args, {at: graph_index(*at) for at in instances})
        out = {at: f"v{t}" for t, at in enumerate(order)}
        steps = []
        origins: dict[tuple[str, int], str] = {}  # (copy 1's origin, k) -> copy k's: each made once

        def copy_origin(k: int) -> Callable[[str], str]:
            def renamed(origin: str) -> str:
                if (origin, k) not in origins:
                    origins[origin, k] = self._renamed_origin(origin, k, rename)
                return origins[origin, k]
            return renamed

        for i, k in order:
            node, reads = nodes[picked[i]], tuple(out[a] for a in args[(i, k)])
            if region[i] == 1 and node.op not in ("Place", "Reshard"):  # a Run of copy k: renamed as it is made
                steps.append(decoder.step(node, out[(i, k)], reads, copy_origin(k)))  # type: ignore[arg-type]
            else:
                step = decoder.step(node, out[(i, k)], reads)
                steps.append(self._renamed(step, k if region[i] == 1 else None, rename))  # type: ignore[arg-type]
        copy_outputs = {o: (chain, k) for chain in layers.outputs for k, o in enumerate(chain)}
        folded_out = {root_names[egraph.class_ids[r]]: made[egraph.class_ids[r]] for r in egraph.roots}
        outputs = {}
        for name in self.full.outputs:
            chain, k = copy_outputs.get(name, (None, None))
            j = folded_out[chain[min(k, 1)] if chain is not None else name]
            outputs[name] = out[(j, (k if k is not None else m - 1) if region[j] == 1
                                 else 0 if region[j] == 0 else None)]
        plan = Plan(decoder.mesh, self.full, tuple(steps), outputs, selection.dag_cost, dict(notes))
        return plan, [picked[i] for i, _ in order]

    def _emitted(self, egraph: EGraph, selection: Selection) -> list[tuple[str, int]]:
        """decoder.emitted, and the twins of what it emits in the other copy (a twin nothing reachable reads, as
        the last copy's output in a layout only the copies read, is still run by every copy but the last)."""
        nodes = self.decoder.nodes
        other = self.twins
        class_index = {c: i for i, c in enumerate(egraph.class_ids)}
        roots = list(egraph.roots)
        while True:
            emitted = self.decoder.emitted(replace(egraph, roots=tuple(roots)), selection)
            have = {c for c, _ in emitted}
            missing = [nodes[other[n]].eclass for _, n in emitted if n in other and nodes[other[n]].eclass not in have]
            if not missing:
                return emitted
            roots += [class_index[c] for c in dict.fromkeys(missing)]

    @staticmethod
    def _topological(instances: Sequence[tuple[int, int | None]], reads: Mapping[tuple, list[tuple]],
                     key: Mapping[tuple, int]) -> list[tuple[int, int | None]]:
        """The steps, each after what it reads, else in graph order (a step of no graph value: after its reads)."""
        rank = {at: (key[at], at[0], -1 if at[1] is None else at[1]) for at in instances}
        order = ranked_order({at: reads[at] for at in instances}, rank)
        if len(order) != len(instances):
            raise AssertionError("the expanded plan's steps read in a cycle")
        return order

    @staticmethod
    def _renamed(step: Step, k: int | None, rename: Mapping[str, tuple[str, ...]]) -> Step:
        """Copy 1's Place or Reshard as copy k's: a Place's input copy k's (a Run's origin is renamed as
        `decoder.step` makes it, `_renamed_origin`: one copy of the step, not two)."""
        if k is None or isinstance(step, Reshard):
            return step
        if isinstance(step, Place):
            return replace(step, input=rename[step.input][k])
        raise AssertionError(f"Layered._renamed: a Run's step {step.out} is renamed as decoder.step makes it")

    @staticmethod
    def _renamed_origin(origin: str, k: int, rename: Mapping[str, tuple[str, ...]]) -> str:
        """Copy 1's origin as copy k's: each graph op it names, copy k's."""
        return " ".join(rename[w][k] if w in rename else w for w in origin.split(" "))
