"""From the e-graph to an extractable graph with costs, and from a selection back to a plan.

Only the distributed layer is extracted: Run and Place e-nodes (whose
children are distributed classes), Deliver nodes under each output's root, and
Reshard nodes between the layouts of each value. `At` and `Result` only name
classes, so they are never candidates. Each node's cost is local (its layouts
are part of its class), so plan cost is a sum (less a training step's overlap
credit, cost.overlap, which Explored.extract handles).

Reshards are not e-nodes of egglog's e-graph: no rule reads them, and a value
in k layouts has k(k-1) of them (most of a 2x4 transformer's distributed layer).
They are made here, from the `At` classes each logical class has at the end.
Pricing is memoised per distinct step (a Compute without its origin, a Reshard
by its layout pair, shape and dtype): identical layers cost one pricing.

A Run or Reshard whose children are all static-derived classes (made from
static inputs and constants alone: `Decoder.static_classes`) is a one-time
preparation, priced 0 per run, as TASO and Tensat price weight-only subgraphs:
a merged GEMM's weight concat is then free (`Plan.prepared` names such steps).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tapestry.clock import SAFETY_NET_STOP, clock
from tapestry.egraph.distributed import Interner, reshard_pairs
from tapestry.egraph.schema import run_constructors
from tapestry.extract import EGraph as ExtractGraph
from tapestry.extract import Selection
from tapestry.graph import Graph
from tapestry.kernels import get_kernel
from tapestry.plan import Compute, Place, Plan, Reshard, Step
from tapestry.sharding import Layout, Mesh


@dataclass(frozen=True)
class PricingStats:
    """What `Decoder.serialized` priced: distinct steps, and the reshards its budget (a count of distinct moves,
    `Decoder.priced`) left unpriced: as e-nodes, and as distinct moves out of how many."""

    seconds: float
    steps: int
    reshards_unpriced: int
    reshards_dominated: int = 0  # left out because a two-step route is strictly cheaper
    runs_dominated: int = 0  # left out because a kept run of the same op plus moves costs no more
    moves_unpriced: int = 0  # distinct moves (layout pair, dtype) of those reshards
    moves: int = 0  # distinct moves the budget counts (all but those out of a replicated layout)
    moves_floored: int = 0  # of those, left at their floor: extraction never chose them (egraph.extractor_pricing)
MIN_PLUS_ROWS = 64  # rows of a value's move matrix per min-plus step (rows x layouts x layouts floats)


def dominated_moves(moves: Mapping[tuple[str, str], float], value: Mapping[str, str]) -> set[tuple[str, str]]:
    """The moves (from class, to class) -> cost that some two-step route through a third class beats strictly.

    Leaving them out keeps the cheapest route between every pair: an edge of a cheapest path is never
    beaten strictly by a two-step route (that would make a cheaper path), so every cheapest path survives
    whole. A plan that used a dropped move can use the cheaper route instead, whose middle value it may even
    share. Ties are kept (dropping both of two equal routes could drop them all). Moves join the layouts of one
    value (`value`: each class's), so each value's cheapest two-step routes are one min-plus product of its
    matrix of moves (a 2x2x2 mesh's stack has ~150 layouts of a value, 200,000 moves)."""
    values: dict[str, list[tuple[str, str, float]]] = {}
    for (src, dst), c in moves.items():
        if c < math.inf:
            values.setdefault(value[dst], []).append((src, dst, c))
    dropped = set()
    for edges in values.values():
        index: dict[str, int] = {}
        rows = [index.setdefault(src, len(index)) for src, _, _ in edges]
        columns = [index.setdefault(dst, len(index)) for _, dst, _ in edges]
        direct = np.full((len(index), len(index)), np.inf)
        direct[rows, columns] = [c for _, _, c in edges]
        best = np.empty_like(direct)
        for start in range(0, len(index), MIN_PLUS_ROWS):  # rows x layouts x layouts at a time
            part = direct[start:start + MIN_PLUS_ROWS]
            best[start:start + MIN_PLUS_ROWS] = (part[:, :, None] + direct[None, :, :]).min(axis=1)
        beaten = best[rows, columns] < direct[rows, columns] * (1 - 1e-9)
        dropped.update((src, dst) for (src, dst, _), drop in zip(edges, beaten.tolist()) if drop)
    return dropped


Candidate = tuple[int, float, str, tuple[str, ...]]  # (node, cost, out class, arg classes) of one Run node


def dominated_runs(ops: Iterable[Sequence[Candidate]], moves: Mapping[tuple[str, str], float]) -> set[int]:
    """The Run nodes that another kept Run of the same op, reached and left by moves, computes for no more.

    `ops` holds, per logical op (one out value from one tuple of argument values), its candidate Runs; `moves`
    the reshard costs (from class, to class; infinite or absent: no such move). Run P (out class C, args A_i)
    is dropped when a kept Run P' of the op (out C', args A_i') has cost(P') + the moves A_i -> A_i' + the
    move C' -> C (each where the classes differ) <= cost(P). Each op's Runs are taken by (cost, node), and P is
    compared only with the
    Runs kept before it: those cost no more, and a dominator is never dropped later.

    Why the optimum survives: take a cheapest acyclic choice S (a node per needed class) using P for C, and
    let D be the classes whose choice in S reaches C (C included). If C' is chosen in S outside D, choose the
    move C' -> C for C: no cycle (C' never reached C), and cost(move) <= cost(P). Otherwise choose P' for C'
    (the move C' -> C for C, if C' != C) and, for each A_i' != A_i not chosen in S outside D, the move
    A_i -> A_i'; every other class keeps its choice. A_i is outside D (P read it), and so is everything a class
    outside D reaches, so the new choices reach only each other and classes outside D, whose choices are
    unchanged: no cycle. The cost added is at most cost(P') and those moves, and P's cost goes: the total
    does not rise, and one dropped Run fewer is used, so repeating ends in a cheapest choice with none.
    It counts on plan cost being the sum of node costs and on any choice being allowed: not under a memory
    budget (the moved-to layouts are held too), steady-state ties (a tied Place that only P read would no
    longer be chosen) or the overlap credit of a training step (cost.overlap: P' may hide less)."""
    dropped: set[int] = set()
    for op in ops:
        kept: list[Candidate] = []
        for node, cost, out, args in sorted(op, key=lambda c: (c[1], c[0])):
            for _, total, other_out, other_args in kept:
                for a, b in zip(args, other_args):
                    if a != b:
                        total += moves.get((a, b), math.inf)
                        if total > cost:
                            break
                if other_out != out:
                    total += moves.get((other_out, out), math.inf)
                if total <= cost:
                    dropped.add(node)
                    break
            else:
                kept.append((node, cost, out, args))
    return dropped


def moved_cells(pairs: Sequence[tuple[str, str]], layouts: Mapping[str, tuple[Any, Layout]]) -> np.ndarray:
    """Per (from, to) pair of layout keys, the cells devices need and do not hold: each device's block of `to`
    less what its own block of `from` covers (all of it from a partial source). An estimate of a move's cost
    (no collectives, no links), made for all pairs at once, to order pricing by."""
    if not pairs:
        return np.zeros(0, np.int64)
    keys = sorted({k for pair in pairs for k in pair})
    index = {k: i for i, k in enumerate(keys)}
    ndim = max(layouts[k][1].bounds[0].shape[1] for k in keys)
    devices = len(layouts[keys[0]][1].blocks)
    starts = np.zeros((len(keys), devices, ndim), np.int64)
    ends = np.ones((len(keys), devices, ndim), np.int64)  # padded dims span [0, 1): they scale nothing
    held, partial = np.zeros((len(keys), devices), bool), np.zeros(len(keys), bool)
    for i, k in enumerate(keys):
        layout = layouts[k][1]
        start, end, holds = layout.bounds
        starts[i, :, :start.shape[1]], ends[i, :, :end.shape[1]], held[i] = start, end, holds
        partial[i] = layout.partial
    src, dst = (np.array([index[pair[j]] for pair in pairs]) for j in (0, 1))
    need = np.where(held[dst], np.prod(ends[dst] - starts[dst], axis=2), 0)
    overlap = np.prod(np.clip(np.minimum(ends[src], ends[dst]) - np.maximum(starts[src], starts[dst]), 0, None),
                      axis=2)
    kept = np.where(held[src] & ~partial[src][:, None], np.minimum(overlap, need), 0)
    return (need - kept).sum(axis=1)


def pricing_order(moved: np.ndarray, targets: Sequence[str], rounds: Sequence[int] | None = None) -> list[int]:
    """Indices of moves (cells moved, `moved_cells`, the class each moves into and, if given, the generation round
    of each: the later of its two layouts' first rounds, `Interner.rounds`) by round, then in class rounds:
    class round k has each class's k-th cheapest move into it by cells moved, and within one fewer cells first.

    Generation rounds first: a move between the layouts of each op's first candidates (batch over every axis,
    a node's tensor parallel, experts over an axis) before one into a layout only a late, exotic candidate
    reads: on 64 devices pricing stops after a few thousand of tens of thousands of moves, and those it priced
    first decide the plan (docs/cost-models.md, "Budgets"). Class rounds then leave every layout of every value
    its cheapest way in (a weight's all-gather, a gradient's all-reduce). Ordered by cells alone, the moves of
    small values came first and those of large ones (a 7B layer's weight gradients, all of whose moves reduce
    all their cells) never: a 64-device budget left them unpriced, and with them every plan that splits the
    batch; by each value's cheapest moves, a weight's all-gathers (its moves of most cells) never came, and FSDP
    with them."""
    rank: dict[str, int] = {}
    class_rounds = np.zeros(len(targets), np.int64)
    for j in np.argsort(moved, kind="stable").tolist():
        class_rounds[j] = rank[targets[j]] = rank.get(targets[j], -1) + 1
    generation = np.zeros(len(targets), np.int64) if rounds is None else np.asarray(rounds, np.int64)
    return np.lexsort((moved, class_rounds, generation)).tolist()


def _is_replicated(interner: Interner, key: str) -> bool:
    """Whether layout `key` is the replicated one (answered once per key, in `Interner.replicated_keys`: asked for
    every reshard)."""
    known = interner.replicated_keys
    if key not in known:
        shape, layout = interner.layouts[key]
        known[key] = not layout.partial and layout == Layout.replicated(shape, interner.mesh)
    return known[key]


@dataclass(frozen=True)
class DNode:
    """A distributed e-node, as the decoder needs it."""

    id: str
    op: str
    eclass: str
    children: tuple[str, ...]  # distributed child classes
    key: str  # run key, target layout key, or input name
    layout: str  # layout key of the node's own class ("" for Deliver)
    value: str = ""  # logical class of the node's own class ("" for Deliver)


@dataclass(frozen=True)
class ReshardCut:
    """What making reshards left out: how many values keep only their moves out of a replicated layout, and what
    stopped it ("" when nothing was left out; "reshards": its count; else the clock's SAFETY_NET_STOP)."""

    values: int = 0
    stopped_by: str = ""


def distributed_nodes(data: Mapping[str, Any], interner: Interner, deadline: float = math.inf,
                      max_reshards: float = math.inf) -> tuple[list[DNode], list[str], dict[str, str], ReshardCut]:
    """(nodes, root classes in output order, output name per root class, what the budget cut).

    Reshards out of a replicated layout (local slices: what the replicated plan needs) and between the layouts
    of round -1 (`Interner.rounds`: the replicated runs' and the seed plans', so each seed plan's moves) are made
    for every value; the other moves value by value until `max_reshards` of them are made or, a safety net
    only, `deadline` (a `clock()` time: CPU seconds): a count, so the moves made do not depend on the load. None
    leaves a footprint: a
    layout that no Run or Place computes and that holds only part of the tensor (what one reader reads: GPT-NeoX's
    fused QKV value has 275, 25 for each of its eleven slices). Such a layout can move only into layouts inside
    the part it holds, and every layout it could feed has its own move from the computed layout the footprint came
    from (`reshard_pairs` pairs a source with every layout it holds all of), priced on its own (the straight move
    may cost more or less than the two: the six families of issue 25 kept their plans). Layouts that hold the
    whole tensor keep their moves out: they link a value's layouts into one component, which the ILP's contracted
    bound needs (without them LLaMA's bound on 2x2 fell from 0.25% to 2.9% below its plan).
    """
    raw = data["nodes"]
    runs = run_constructors()
    at: dict[str, str] = {}
    value_of: dict[str, str] = {}  # At class -> its logical class
    value_layouts: dict[str, dict[str, str]] = {}  # logical class -> layout key -> its At class
    for spec in raw.values():
        if spec["op"] == "At":
            at[spec["eclass"]] = layout = raw[spec["children"][1]]["op"].strip('"')
            value_of[spec["eclass"]] = value = raw[spec["children"][0]]["eclass"]
            value_layouts.setdefault(value, {})[layout] = spec["eclass"]
    nodes, roots = [], {}
    for nid, spec in raw.items():
        op, kids, eclass = spec["op"], spec["children"], spec["eclass"]
        lit = lambda i: raw[kids[i]]["op"].strip('"')  # noqa: E731
        if op in runs:
            nodes.append(DNode(nid, op, eclass, tuple(raw[k]["eclass"] for k in kids[:-1]), lit(-1), at[eclass],
                               value_of[eclass]))
        elif op == "Place":
            nodes.append(DNode(nid, op, eclass, (), lit(0), lit(1), value_of[eclass]))
        elif op == "Deliver":
            nodes.append(DNode(nid, op, eclass, (raw[kids[1]]["eclass"],), lit(0), ""))
        elif op == "Result":
            roots[eclass] = lit(0)
    made: set[tuple[str, str]] = set()
    computed = {n.eclass for n in nodes if n.op != "Deliver"}  # the classes a Run or Place computes

    def move(value: str, classes: dict[str, str], src: str, dst: str) -> None:
        if (classes[src], classes[dst]) not in made:
            made.add((classes[src], classes[dst]))
            nodes.append(DNode(f"Reshard-{len(nodes)}", "Reshard", classes[dst], (classes[src],), dst, dst, value))

    for value, classes in value_layouts.items():
        for src in classes:
            if _is_replicated(interner, src):
                for dst in classes:
                    if dst != src and not interner.layouts[dst][1].partial:
                        move(value, classes, src, dst)
        seeded = [key for key in classes if interner.seeded(key)]
        for src, dst in reshard_pairs(seeded, interner) if len(seeded) > 1 else ():
            if classes[src] in computed or interner.whole(src):
                move(value, classes, src, dst)
    cut, stopped_by, always = 0, "", len(made)
    for value, classes in value_layouts.items():
        if not stopped_by:
            stopped_by = "reshards" if len(made) - always >= max_reshards else \
                SAFETY_NET_STOP if clock() > deadline else ""
        if stopped_by:
            cut += 1
            continue
        for src, dst in reshard_pairs(classes, interner):
            if classes[src] in computed or interner.whole(src):
                move(value, classes, src, dst)
    return nodes, list(roots), roots, ReshardCut(cut, stopped_by if cut else "")


class Decoder:
    """Turns distributed e-nodes into plan steps (for costs) and selections into plans."""

    def __init__(self, nodes: list[DNode], interner: Interner, mesh: Mesh, input_dtypes: Mapping[str, str],
                 fixed_inputs: frozenset[str] = frozenset()) -> None:
        self.nodes = nodes
        self.interner = interner
        self.mesh = mesh
        self.class_layout = {n.eclass: n.layout for n in nodes if n.layout}
        self.class_value = {n.eclass: n.value for n in nodes if n.value}
        self.class_dtype = self._dtypes(input_dtypes)
        self.static_classes = self._static_classes(fixed_inputs)
        self.pricing: PricingStats | None = None  # of the last `priced`
        self._extraction_graphs: dict[Any, tuple[ExtractGraph, PricingStats | None]] = {}

    def _static_classes(self, fixed_inputs: frozenset[str]) -> frozenset[str]:
        """The distributed classes some node computes from static inputs and constants alone (`Graph.fixed`):
        a Place of one, or a Run or Reshard whose children are all such classes (to a fixpoint)."""
        found = {n.eclass for n in self.nodes if n.op == "Place" and n.key in fixed_inputs}
        if not found:
            return frozenset()
        # a worklist: each node waits for its distinct children, and a class found wakes the nodes reading it
        # (sweeping every node to a fixpoint was 1.4 s of a 2-layer LLaMA's 68,760 nodes on 2x2)
        waiting: dict[int, int] = {}
        readers: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            if n.op not in ("Place", "Deliver") and n.eclass not in found:
                children = set(n.children)
                waiting[i] = len(children)
                for c in children:
                    readers.setdefault(c, []).append(i)
        ready = list(found)
        ready.extend(self.nodes[i].eclass for i, left in waiting.items() if left == 0)
        while ready:
            c = ready.pop()
            for i in readers.pop(c, ()):
                waiting[i] -= 1
                if waiting[i] == 0:
                    ready.append(self.nodes[i].eclass)
            found.add(c)
        return frozenset(found)

    def prepared(self, node: DNode) -> bool:
        """Whether `node` is a Run or Reshard made from static-derived classes only: done once, free per run."""
        return node.op not in ("Place", "Deliver") and self.static_classes.issuperset(node.children)  # per node priced

    def views(self, node: DNode) -> bool:
        """Whether `node` runs an `always_view` kernel: its result shares its argument's storage (cost.memory)."""
        return (node.op not in ("Place", "Reshard", "Deliver")
                and get_kernel(self.interner.runs[node.key].kernel).always_view)

    def step(self, node: DNode, out: str = "?", args: tuple[str, ...] = (),
             origin: Callable[[str], str] | None = None) -> Step | None:
        """`node`'s step, named `out` and reading `args`; a Run's origin made `origin(its own)` where given (an
        expanded plan's later copy: one copy of the step, not two)."""
        if node.op == "Place":
            shape, layout = self.interner.layouts[node.layout]
            return Place(out, node.key, shape, layout)
        if node.op == "Reshard":
            shape, layout = self.interner.layouts[node.key]
            src = self.interner.layouts[self.class_layout[node.children[0]]][1]
            return Reshard(out, args[0] if args else "?", shape, src, layout, self.class_dtype[node.eclass])
        if node.op == "Deliver":
            return None
        run = self.interner.runs[node.key]
        if origin is not None:
            return replace(run, out=out, args=args or run.args, origin=origin(run.origin))
        return replace(run, out=out, args=args or run.args)

    def _dtypes(self, input_dtypes: Mapping[str, str]) -> dict[str, str]:
        """The dtype of each class: a placed input's, a kernel's result, or a move's source's."""
        found = {n.eclass: self.interner.runs[n.key].signature.dtype for n in self.nodes
                 if n.op not in ("Place", "Reshard", "Deliver")}
        found.update((n.eclass, input_dtypes[n.key]) for n in self.nodes if n.op == "Place")
        moves = [n for n in self.nodes if n.op == "Reshard"]
        while moves:
            left = [n for n in moves if n.children[0] not in found]
            found.update((n.eclass, found[n.children[0]]) for n in moves if n.children[0] in found)
            if len(left) == len(moves):
                break
            moves = left
        return found

    def serialized(self, roots: list[str], cost: Any, reshards: float = math.inf,
                   drop_dominated: bool = False) -> dict[str, Any]:
        """The distributed layer with costs (`priced`), as egraph-serialize JSON (what `tapestry extract` reads)."""
        first = {}
        for n in self.nodes:
            first.setdefault(n.eclass, n.id)
        costs = self.priced(cost, reshards, drop_dominated)
        nodes = {node.id: {"op": node.op, "eclass": node.eclass, "children": [first[c] for c in node.children],
                           "cost": c} for node, c in zip(self.nodes, costs)}
        return {"nodes": nodes, "root_eclasses": roots, "class_data": {}}

    def priced(self, cost: Any, reshards: float = math.inf, drop_dominated: bool = False) -> list[float]:
        """Each node's cost under the cost model `cost`.

        Each distinct step is priced once. Runs, Places, reshards out of a replicated layout (local slicing,
        which the replicated plan needs) and those between the seed plans' layouts (`_seeded`) are always
        priced; of the other reshards, `reshards` distinct moves (a
        count, not seconds: the same call prices the same moves, and so gives the same plan, at any load), those
        between the layouts of each op's first candidates first, then in rounds of each class's next cheapest
        move into it by cells moved (`pricing_order`), so a stop leaves every layout its cheapest ways in rather
        than some values all of their moves. Reshards left unpriced
        cost infinity, so extraction leaves them out and a plan still exists. With `drop_dominated`,
        so do reshards a two-step route is strictly cheaper than (`dominated_moves`), and then Runs that a kept
        Run of the same op and the moves left cost no more than (`dominated_runs`): sound when plan time is
        the sum of node costs, not under a memory budget (the routes hold more layouts), steady-state ties or
        a training step's overlap credit. `self.pricing` says what was priced."""
        started = clock()
        costs, prices, optional = self.always_priced(cost)
        keys = list(optional)
        if reshards < len(keys):  # what a stop leaves out: moves into late candidates', each class's dearest
            moved = moved_cells([(src, dst) for src, dst, _ in keys], self.interner.layouts)
            rounds = self.interner.rounds
            late = max(rounds.values(), default=0) + 1  # a layout no run holds (none should): last
            keys = [keys[j] for j in pricing_order(moved, [self.nodes[optional[key][0]].eclass for key in keys],
                                                   [max(rounds.get(src, late), rounds.get(dst, late))
                                                    for src, dst, _ in keys])]
        kept = keys[:max(0, int(min(reshards, len(keys))))]
        for key in kept:
            prices[key] = price = self.price(cost, self.nodes[optional[key][0]])
            for i in optional[key]:
                costs[i] = price
        unpriced = sum(len(optional[key]) for key in keys[len(kept):])
        moves = {(n.children[0], n.eclass): i for i, n in enumerate(self.nodes) if n.op == "Reshard"}
        dropped, runs = set(), set()
        if drop_dominated:
            dropped = dominated_moves({pair: costs[i] for pair, i in moves.items()}, self.class_value)
            for pair in dropped:
                costs[moves[pair]] = math.inf
            runs = dominated_runs(self.ops(costs), {pair: costs[i] for pair, i in moves.items()})  # less `dropped`
            for i in runs:
                costs[i] = math.inf
        self.pricing = PricingStats(clock() - started, len(prices), unpriced, len(dropped), len(runs),
                                    len(keys) - len(kept), len(keys))
        return costs

    def always_priced(self, cost: Any) -> tuple[list[float], dict[Any, float], dict[Any, list[int]]]:
        """(each node's cost, infinite where not priced; the prices by price key; the other reshards' nodes by
        price key): Runs, Places, reshards out of a replicated layout and between the seed plans' layouts priced,
        Delivers and prepared nodes free, the other reshards (`priced`'s optional ones) left."""
        prices: dict[Any, float] = {}
        costs = [math.inf] * len(self.nodes)
        optional: dict[Any, list[int]] = {}
        for i, node in enumerate(self.nodes):
            if node.op == "Deliver" or self.prepared(node):
                costs[i] = 0.0
                continue
            key = self.price_key(node)
            if self.optional(node):
                optional.setdefault(key, []).append(i)
                continue
            if key not in prices:
                prices[key] = self.price(cost, node)
            costs[i] = prices[key]
        return costs, prices, optional

    def optional(self, node: DNode) -> bool:
        """Whether `node` is a reshard priced on demand: not out of a replicated layout, not between seed plans'
        layouts (a pricing budget may leave it unpriced; `extractor_pricing` leaves it at its floor)."""
        return node.op == "Reshard" and not self._from_replicated(node) and not self._seeded(node)

    def price(self, cost: Any, node: DNode) -> float:
        """`node`'s step priced under the cost model `cost`."""
        return float(cost.step_cost(self.priced_step(node), self.mesh))

    def extraction_graph(self, roots: list[str], cost: Any, reshards: float = math.inf,
                         drop_dominated: bool = False) -> ExtractGraph:
        """What `serialized` writes, made directly: the JSON round trip took 17 s of a 4-layer stack's 40 s of
        pricing on a 2x2x2 mesh (1.1 million nodes). Made once per cost model (a hashable one) and arguments:
        a pipeline's layer is extracted several times under one model (its fastest plan, then leaner ones)."""
        try:
            key: Any = (tuple(roots), cost, reshards, drop_dominated)
            hash(key)
        except TypeError:  # a model that cannot be a key is priced every time
            key = None
        if key in self._extraction_graphs:
            made, self.pricing = self._extraction_graphs[key]
            return made
        costs = self.priced(cost, reshards, drop_dominated)
        made = self.graph(costs, roots)
        if key is not None:
            self._extraction_graphs[key] = (made, self.pricing)
        return made

    def graph(self, costs: Sequence[float], roots: Sequence[str]) -> ExtractGraph:
        """The extraction graph of these nodes at `costs` (node by node)."""
        nodes = self.nodes
        return ExtractGraph.from_columns([n.id for n in nodes], [n.op for n in nodes], [n.eclass for n in nodes],
                                         costs, [n.children for n in nodes], roots)

    def ops(self, costs: Sequence[float]) -> Iterable[list[Candidate]]:
        """The Run nodes grouped by logical op (out value, argument values), for `dominated_runs`; an op that
        reads its own value (a cycle of the e-graph) is left out."""
        ops: dict[tuple[str, tuple[str, ...]], list[Candidate]] = {}
        value = self.class_value
        for i, node in enumerate(self.nodes):
            if node.op not in ("Place", "Reshard", "Deliver"):
                args = tuple(value.get(c, "") for c in node.children)
                if node.value not in args and "" not in args:
                    ops.setdefault((node.value, args), []).append((i, costs[i], node.eclass, node.children))
        return ops.values()

    def _from_replicated(self, node: DNode) -> bool:
        return _is_replicated(self.interner, self.class_layout[node.children[0]])

    def _seeded(self, node: DNode) -> bool:
        """Whether a reshard moves between two layouts of round -1 (a seed plan's, `Generator.distribute`): priced
        whatever the count, so every seed plan lies in the extraction graph."""
        return self.interner.seeded(self.class_layout[node.children[0]]) and self.interner.seeded(node.key)

    def price_key(self, node: DNode) -> Any:
        """Equal for steps any cost model prices alike: a Run's step without its origin, a Reshard's layout pair
        and dtype (layout keys name (shape, layout) pairs)."""
        if node.op == "Reshard":
            return (self.class_layout[node.children[0]], node.key, self.class_dtype[node.eclass])
        if node.op == "Place":
            return (node.op, node.key, node.layout)
        return self.interner.priced_as[node.key]

    def priced_step(self, node: DNode) -> Step:
        step = self.step(node)
        return replace(step, origin="") if isinstance(step, Compute) else step  # type: ignore[return-value]

    def emitted(self, egraph: ExtractGraph, selection: Selection) -> list[tuple[str, int]]:
        """The chosen (e-class, node) pairs children first, from each root in turn, each once: the order `plan`
        makes its steps in. Post-order with an explicit stack: a 10,000-op chain is as deep."""
        chosen = {egraph.class_ids[c]: n for c, n in selection.choice.items()}
        order: list[tuple[str, int]] = []
        done: set[str] = set()
        for root in egraph.roots:
            stack = [egraph.class_ids[root]]
            while stack:
                eclass = stack[-1]
                if eclass in done:
                    stack.pop()
                    continue
                pending = [c for c in self.nodes[chosen[eclass]].children if c not in done]
                if pending:
                    stack.extend(reversed(pending))
                    continue
                stack.pop()
                done.add(eclass)
                order.append((eclass, chosen[eclass]))
        return order

    def step_nodes(self, egraph: ExtractGraph, selection: Selection) -> list[int]:
        """The node each step of `plan(egraph, selection, ...)` comes from, by step index."""
        return [n for _, n in self.emitted(egraph, selection) if self.nodes[n].op != "Deliver"]

    def plan(self, egraph: ExtractGraph, selection: Selection, graph: Graph, root_names: dict[str, str]) -> Plan:
        steps: list[Step] = []
        value: dict[str, str] = {}
        for eclass, n in self.emitted(egraph, selection):
            node = self.nodes[n]
            args = tuple(value[c] for c in node.children)
            if node.op == "Deliver":
                value[eclass] = args[0]
            else:
                value[eclass] = out = f"v{len(steps)}"
                steps.append(self.step(node, out, args))  # type: ignore[arg-type]
        outputs = {root_names[egraph.class_ids[r]]: value[egraph.class_ids[r]] for r in egraph.roots}
        ordered = {name: outputs[name] for name in graph.outputs}
        plan = Plan(self.mesh, graph, tuple(steps), ordered, cost=selection.dag_cost, notes=self.notes(selection))
        return replace(plan, notes={**plan.notes, "prepared": len(plan.prepared)}) if plan.prepared else plan

    @staticmethod
    def notes(selection: Selection) -> dict[str, Any]:
        """What a plan's notes say of the selection it was decoded from."""
        return {"extractor": selection.extractor, "extract_seconds": round(selection.seconds, 3),
                "status": selection.status, "gap": selection.gap}
