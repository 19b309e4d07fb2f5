"""Generation: name new logical classes between rule rounds, then add the distributed layer once.

A pass (`refresh`) reads a serialization of the e-graph, gives every logical
class a handle `(Id n)` (so later commands can refer to it without rebuilding
terms), infers each class's shape from the kernel registry, records
`Rank`/`Dim`/`Dtype` facts for rule guards, and queues each logical node it has
not seen before. When the rules are done, `distribute` inserts the queued
nodes' distributed members, under a count of runs and of e-nodes (the clock a safety net only): first every
node's replicated run (so a plan always exists) and the runs of the seed plans (the hand plans the optimizer
prices its plan against: so each lies in the e-graph whatever the budget cuts), then the sharded ones in rounds
over all nodes.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tapestry.clock import SAFETY_NET_STOP, clock
from tapestry.egraph.distributed import Interner, runs_for
from tapestry.egraph.rules import Rule
from tapestry.egraph.schema import constructors, decode_param, encode_param, run_name
from tapestry.egraph.session import CHUNK, Session, add, call, lit, set_value, union
from tapestry.dtypes import is_float
from tapestry.graph import Graph
from tapestry.kernels import KernelError, Params, Shape, Signature
from tapestry.plan import Compute, Plan
from tapestry.sharding import Mesh
from tapestry.sharding.partition import DATA_FIRST_DEVICES

ENODES_PER_RUN = 4  # at most, in practice: the Run, and the new At e-nodes of its result and arguments
NodeKey = tuple[str, Params, tuple[int, ...]]  # constructor, params, canonical handles of the args
Runs = tuple[str, Params, tuple[Shape, ...], tuple[str, ...]]  # what a step runs: kernel, params, input shapes, dtypes


def seed_steps(plans: Sequence[Plan]) -> dict[Runs, list[Compute]]:
    """The plans' distinct Compute steps, without value names or origin, by what they run: what `distribute`
    inserts for every node that runs the same (`_seed_runs`)."""
    found: dict[Runs, dict[Compute, None]] = defaultdict(dict)
    for plan in plans:
        for step in plan.steps:
            if isinstance(step, Compute):
                bare = replace(step, out="?", args=("?",) * len(step.args), origin="")
                found[(step.kernel, step.params, step.input_shapes, step.input_dtypes)][bare] = None
    return {runs: list(steps) for runs, steps in found.items()}


@dataclass
class LogicalNode:
    eclass: str
    ctor: str
    args: tuple[str, ...]  # child T classes
    params: Params
    input_name: str | None = None


@dataclass(frozen=True)
class Queued:
    """A logical node named and bound, waiting for its distributed members."""

    key: NodeKey
    sig: Signature
    args: tuple[int, ...]  # argument handles (canonical when queued; merges may follow)
    out: int


@dataclass(frozen=True)
class GenerationStats:
    """What `distribute` did, and what its budget left out."""

    seconds: float
    nodes: int  # logical nodes distributed
    runs: int  # Run members inserted
    runs_left_out: int  # sharded runs the budget left out (every node keeps its replicated run)
    stopped_by: str  # "" when complete, else "runs", "layout pairs", "nodes" or driver's SAFETY_NET_STOP
    enodes: int
    eclasses: int  # logical classes plus (class, layout) pairs
    layout_pairs: int = 0  # ordered pairs of one value's layouts, summed: the reshards decode may make
    pairs_capped: bool = False  # stopped by layout pairs: more pairs than pricing prices (max_pairs)


@dataclass
class View:
    """The logical layer of one serialization, plus what Python knows of each class."""

    nodes: list[LogicalNode]
    handles: dict[str, list[int]]  # class -> its Id handles
    at_classes: dict[str, tuple[str, str]] = field(default_factory=dict)  # D class -> (T class, layout key)
    size: int = 0


def read_view(data: dict[str, Any]) -> View:
    raw = data["nodes"]
    table = constructors()
    nodes, handles = [], defaultdict(list)

    def literal(node_id: str) -> str:
        return raw[node_id]["op"]

    for spec in raw.values():
        op, eclass, kids = spec["op"], spec["eclass"], spec["children"]
        if op == "Id":
            handles[eclass].append(int(literal(kids[0])))
        elif op == "Input":
            nodes.append(LogicalNode(eclass, op, (), (), literal(kids[0]).strip('"')))
        elif op in table:
            ctor = table[op]
            n = len(ctor.kernel.inputs)
            params = tuple(
                (p, decode_param(ctor.kernel.params[p], literal(k))) for p, k in zip(ctor.params, kids[n:])
            )
            nodes.append(LogicalNode(eclass, op, tuple(raw[k]["eclass"] for k in kids[:n]), params))
    view = View(nodes, dict(handles), size=len(raw))
    for spec in raw.values():
        if spec["op"] == "At":
            t_node, layout = spec["children"]
            view.at_classes[spec["eclass"]] = (raw[t_node]["eclass"], literal(layout).strip('"'))
    return view


def _provenance(ctor: str, fired: Sequence[Rule], iteration: int) -> str:
    """The rules of the last round whose right-hand side builds `ctor`: the ones that made this node."""
    makers = [r.short for r in fired if ctor in r.builds]
    return f"made by {' or '.join(makers)} in round {iteration}" if makers else ""


class Generator:
    """Python's side of the e-graph: handles, shapes, provenance and the distributed layer."""

    def __init__(self, session: Session, graph: Graph, mesh: Mesh) -> None:
        self.session, self.graph, self.mesh = session, graph, mesh
        self.interner = Interner(mesh)
        self.parent: dict[int, int] = {}  # union-find over handles
        self.shapes: dict[int, Shape] = {}
        self.dtypes: dict[int, str] = {}
        self.origins: dict[NodeKey, str] = {}
        self.generated: set[NodeKey] = set()
        self.layouts: dict[int, dict[str, None]] = defaultdict(dict)  # canonical handle -> layouts it occurs in, in
        # the order made (a set of strings would order Place/Deliver members by the hash seed)
        self.layout_pairs = 0  # ordered pairs of one value's layouts: the reshards decode may make and price
        self.linked: set[tuple[int, str, str]] = set()  # places and delivers inserted
        self.input_handles: dict[int, str] = {}
        self.handles: dict[str, int] = {}  # graph value -> its handle, as encoded
        self.output_handles: dict[str, int] = {}
        self.ill_typed: dict[str, str] = {}
        self.queued: list[Queued] = []
        self.seed_names: dict[Compute, str] = {}  # a seed step (`seed_steps`) -> the name its runs are priced as
        self._next = 0

    # -- handles --------------------------------------------------------------------------------
    def find(self, h: int) -> int:
        while self.parent.get(h, h) != h:
            h = self.parent[h]
        return h

    def _merge(self, hs: list[int]) -> int:
        root = min(self.find(h) for h in hs)
        for h in hs:
            r = self.find(h)
            if r != root:
                self.parent[r] = root
                self.layouts[root].update(self.layouts.pop(r, {}))
        return root

    def _fresh(self) -> int:
        self._next += 1
        return self._next - 1

    # -- encoding the program -------------------------------------------------------------------
    def encode(self) -> None:
        """The block graph, as one `union (Id n) term` per node, sent in bulk."""
        handle: dict[str, int] = {}
        commands = []
        for node in self.graph:
            h = self._fresh()
            handle[node.name] = h
            if node.is_input:
                term = call("Input", lit(node.name))
                self.input_handles[h] = node.name
            else:
                ctor = next(c for c in constructors().values() if c.kernel.name == node.op)
                params = dict(node.params)
                term = call(ctor.name, *(call("Id", lit(handle[a])) for a in node.args),
                            *(self._param_term(params[p]) for p in ctor.params))
                key = (ctor.name, tuple(sorted(node.params)), tuple(handle[a] for a in node.args))
                self.origins[key] = f"graph op {node.name}"
            commands.append(union(call("Id", lit(h)), term))
            self.shapes[h], self.dtypes[h] = node.shape, node.dtype
            commands += self._shape_facts(h, node.shape, node.dtype)
        self.output_handles = {out: handle[target] for out, target in self.graph.outputs.items()}
        self.handles = handle
        self.session.insert(commands)

    @staticmethod
    def _param_term(value: Any) -> Any:
        return lit(encode_param(value))

    @staticmethod
    def _shape_facts(h: int, shape: Shape, dtype: str) -> list[Any]:
        facts = [set_value("Rank", [call("Id", lit(h))], lit(len(shape))),
                 set_value("Dtype", [call("Id", lit(h))], lit(dtype)),
                 set_value("Shape", [call("Id", lit(h))], lit(",".join(map(str, shape))))]
        facts += [set_value("Dim", [call("Id", lit(h)), lit(i)], lit(n)) for i, n in enumerate(shape)]
        return facts

    # -- one pass -------------------------------------------------------------------------------
    def refresh(self, fired: Sequence[Rule] = (), iteration: int = 0) -> tuple[View, int]:
        """Serialize, name and type the new logical nodes' classes, queue the nodes for `distribute`. Returns the
        view and how many logical nodes were new (0 at a fixpoint)."""
        view = read_view(self.session.serialize())
        class_handle = {c: self._merge(hs) for c, hs in view.handles.items()}
        commands: list[Any] = []
        new_nodes = 0
        pending = list(view.nodes)
        while pending:  # name classes whose children are named, until nothing changes
            waiting = []
            for node in pending:
                if node.ctor == "Input":
                    continue
                if not all(a in class_handle for a in node.args):
                    waiting.append(node)
                    continue
                key = self._key(node, class_handle)
                if key in self.generated:
                    continue
                self.generated.add(key)
                sig = self._bind(node, class_handle)
                if sig is None:
                    continue
                if node.eclass not in class_handle:
                    h = self._fresh()
                    class_handle[node.eclass] = h
                    self.shapes[h], self.dtypes[h] = sig.output_shape, sig.dtype
                    commands.append(union(call("Id", lit(h)), self._term(node, class_handle)))
                    commands += self._shape_facts(h, sig.output_shape, sig.dtype)
                new_nodes += 1
                self.origins.setdefault(key, _provenance(node.ctor, fired, iteration))
                self.queued.append(Queued(key, sig, key[2], self.find(class_handle[node.eclass])))
            if len(waiting) == len(pending):
                break
            pending = waiting
        self.session.insert(commands)
        return view, new_nodes

    def _key(self, node: LogicalNode, class_handle: dict[str, int]) -> NodeKey:
        return (node.ctor, node.params, tuple(self.find(class_handle[a]) for a in node.args))

    def _term(self, node: LogicalNode, class_handle: dict[str, int]) -> Any:
        params = dict(node.params)
        ctor = constructors()[node.ctor]
        return call(node.ctor, *(call("Id", lit(class_handle[a])) for a in node.args),
                    *(self._param_term(params[p]) for p in ctor.params))

    def _bind(self, node: LogicalNode, class_handle: dict[str, int]) -> Signature | None:
        """The node's kernel bound to its argument classes' shapes; None (recorded) if they do not fit."""
        kernel = constructors()[node.ctor].kernel
        args = [self.find(class_handle[a]) for a in node.args]
        try:
            return kernel.bind([self.shapes[a] for a in args], dict(node.params), [self.dtypes[a] for a in args])
        except KernelError as err:
            self.ill_typed[f"{node.ctor}{node.params}"] = str(err)
            return None

    # -- the distributed layer ------------------------------------------------------------------
    def distribute(self, deadline: float = float("inf"), max_nodes: int | None = None,
                   max_pairs: float = math.inf, max_runs: float = math.inf,
                   seeds: Sequence[Plan] = (), twins: Sequence[tuple[str, str]] = ()) -> GenerationStats:
        """Insert the queued nodes' Run members, and Place/Deliver members for inputs and outputs.

        Every node's replicated run goes in first, whatever the budget, so a plan always exists, and every step
        of the plans `seeds` (hand plans, of this graph or of its linears expanded) that a node runs, so each
        lies in the e-graph, its layouts in round -1 (`Interner.rounds`) with the replicated ones: their moves
        are made and priced whatever the counts (decode). Then the sharded runs, in rounds: round k adds every
        node's k-th candidate (`generation_order`: round 0 splits one dim,
        mostly the batch, over every mesh axis), until `max_runs` sharded runs, `max_nodes` e-nodes, the values'
        layouts making `max_pairs` ordered pairs (reshards to make and price; docs/cost-models.md, "Budgets", has
        the case), or, a safety net only, `deadline` (a `clock()` time: CPU seconds). A stop thus leaves every
        node similar choices, which fit together, rather
        than some nodes all of theirs and the rest none. Each pair of graph values `twins` (a folded graph's
        copies 0 and 1 of one layer value) is then held in the layouts of both (`_alike`)."""
        started = clock()
        todo = self._dequeue()
        self.layout_pairs = sum(len(held) * (len(held) - 1) for held in self.layouts.values())
        steps = seed_steps(seeds)
        mandatory = [command for item in todo for command in self._runs(item, sharded=False)
                     + self._seed_runs(item, steps)]
        runs = len(mandatory)
        self.session.insert(mandatory + self._links())
        size = self.session.size()  # exact after each insert
        limit = math.inf if max_nodes is None else max_nodes
        data = self.data_dims(todo) if self.mesh.size > DATA_FIRST_DEVICES else [None] * len(todo)
        counts = [self.interner.count(item.sig, True, dims) for item, dims in zip(todo, data)]
        stopped_by, sharded_runs, batch = "", 0, []
        for rank in range(max(counts, default=0)):
            for item, count, dims in zip(todo, counts, data):
                if rank >= count:
                    continue
                if len(batch) >= CHUNK or size + ENODES_PER_RUN * len(batch) >= limit:  # near the limit: measure
                    self.session.insert(batch)
                    batch = []
                    size = self.session.size()
                if sharded_runs >= max_runs:
                    stopped_by = "runs"
                elif self.layout_pairs >= max_pairs:
                    stopped_by = "layout pairs"
                elif size >= limit:
                    stopped_by = "nodes"
                elif clock() >= deadline:
                    stopped_by = SAFETY_NET_STOP
                if stopped_by:
                    break
                batch += self._runs(item, sharded=True, rank=rank, data=dims)
                sharded_runs += 1
            if stopped_by:
                break
        self.session.insert(batch + self._alike(twins) + self._links())
        return GenerationStats(clock() - started, len(todo), runs + sharded_runs,
                               sum(counts) - sharded_runs, stopped_by,
                               self.session.size(), len(self.layouts) + sum(map(len, self.layouts.values())),
                               self.layout_pairs, stopped_by == "layout pairs")

    def _dequeue(self) -> list[Queued]:
        """The queued nodes, once each under the handles' latest merges; a node whose class a rule equated with a
        differently typed one is recorded as ill-typed and dropped."""
        todo, seen = [], set()
        for item in self.queued:
            args, out = tuple(self.find(a) for a in item.args), self.find(item.out)
            key = (item.key[0], item.key[1], args)
            if key in seen:
                continue
            seen.add(key)
            sig = item.sig
            if (sig.output_shape, sig.dtype) != (self.shapes[out], self.dtypes[out]):
                self.ill_typed[f"{key[0]}{key[1]}"] = (
                    f"type {sig.dtype}{list(sig.output_shape)} differs from its class's "
                    f"{self.dtypes[out]}{list(self.shapes[out])}: a rule equated them"
                )
                continue
            todo.append(Queued(item.key, sig, args, out))
        self.queued = []
        return todo

    def data_dims(self, todo: Sequence[Queued]) -> list[frozenset[int] | None]:
        """Per node, the index dims that come from the step's token ids: those reading a dim of a batch argument
        (an input neither carried state nor fixed: every dim of it), or a dim of a value that such an index dim
        made, to a fixpoint (rules' nodes come in no particular order). A weight's summed gradient and the
        optimizer's update have none: past DATA_FIRST_DEVICES devices their candidates split nothing across the
        nodes first (`generation_order`), as DP over the nodes runs them. None for every node where a batch
        argument is floats: its features are dims of the batch too, which kernels that read a dim whole (an
        attention's head dim) do not pass on, so the weights would come out batch-free in part."""
        carried, fixed = set(self.graph.carried.values()), self.graph.fixed
        batch = [h for h, name in self.input_handles.items()
                 if self.shapes[h] and name not in carried and name not in fixed]
        if any(is_float(self.dtypes[h]) for h in batch):
            return [None] * len(todo)
        held: dict[int, set[int]] = {self.find(h): set(range(len(self.shapes[h]))) for h in batch}
        found = [frozenset[int]()] * len(todo)
        changed = True
        while changed:
            changed = False
            for n, item in enumerate(todo):
                sig = item.sig
                dims = frozenset(i for h, projection in zip(item.args, sig.projections) for t in held.get(h, ())
                                 for i, c in enumerate(projection.matrix[t]) if c)
                made = {t for t, row in enumerate(sig.output.matrix) if any(row[i] for i in dims)}
                found[n] = dims
                if not made <= held.setdefault(item.out, set()):
                    held[item.out] |= made
                    changed = True
        return found

    def _origin(self, item: Queued) -> str:
        return f"{item.sig.kernel.name} {self.origins.get(item.key, '')}".strip()

    def _runs(self, item: Queued, sharded: bool, rank: int | None = None,
              data: frozenset[int] | None = None) -> list[Any]:
        """One `(At out L) = (Run<Kernel> (At arg L_i)... key)` union per sharded partition (only the rank-th,
        if given, in the order for the index dims `data` from the batch), or for the replicated one."""
        return self._unions(item, runs_for(item.sig, self.interner, self._origin(item), sharded, rank, data))

    def _seed_runs(self, item: Queued, steps: dict[Runs, list[Compute]]) -> list[Any]:
        """The unions of the seed steps (`seed_steps`) that run what `item` runs, their layouts in round -1."""
        sig, found = item.sig, []
        for step in steps.get((sig.kernel.name, sig.params, sig.input_shapes, sig.input_dtypes), ()):
            key = self.interner.run(replace(step, origin=f"{self._origin(item)} [seed]"))
            self.interner.priced_as[key] = self.seed_names.setdefault(step, f"s{len(self.seed_names)}")  # priced once
            out = self.interner.layout(sig.output_shape, step.layout)
            args = tuple(self.interner.layout(shape, layout) for shape, layout in zip(sig.input_shapes,
                                                                                     step.arg_layouts))
            for layout in (out, *args):
                self.interner.rounds[layout] = -1
            found.append((out, args, key))
        return self._unions(item, found)

    def _unions(self, item: Queued, runs: Sequence[tuple[str, tuple[str, ...], str]]) -> list[Any]:
        """The `(At out L) = (Run<Kernel> (At arg L_i)... key)` unions of `runs` (out layout, arg layouts, key)."""
        kernel = item.sig.kernel
        commands = []
        for out_layout, arg_layouts, run_key in runs:
            self._hold(item.out, out_layout)
            args = []
            for h, layout in zip(item.args, arg_layouts):
                self._hold(h, layout)
                args.append(call("At", call("Id", lit(h)), lit(layout)))
            commands.append(union(call("At", call("Id", lit(item.out)), lit(out_layout)),
                                  call(run_name(kernel.name), *args, lit(run_key))))
        return commands

    def _alike(self, twins: Sequence[tuple[str, str]]) -> list[Any]:
        """Each value of a pair of `twins` made in the layouts of the other too (reshards make it there): a value
        is held in the layouts its runs and its readers' runs use, and twins have different readers (copy 0's
        input gradient is read by the prefix, copy 1's by copy 0), so a layout of one could have no twin class in
        the other, and a periodic plan reading it none (egraph.layered)."""
        commands = []
        for pair in twins:
            a, b = (self.find(self.handles[name]) for name in pair)
            for h, other in ((a, b), (b, a)):
                for layout in [key for key in self.layouts[other] if key not in self.layouts[h]]:
                    self._hold(h, layout)
                    commands.append(add(call("At", call("Id", lit(h)), lit(layout))))
        return commands

    def _hold(self, h: int, layout: str) -> None:
        """Record that value `h` occurs in `layout`, counting the layout pairs a reshard may join."""
        held = self.layouts[h]
        if layout not in held:
            self.layout_pairs += 2 * len(held)
            held[layout] = None

    def _links(self) -> list[Any]:
        """Place members for inputs, Deliver members for outputs (reshards are made by decode, outside egglog)."""
        commands = []
        inputs = {self.find(h): name for h, name in self.input_handles.items()}
        outputs: dict[int, list[str]] = defaultdict(list)
        for name, out in self.output_handles.items():
            outputs[self.find(out)].append(name)
        for h, layouts in self.layouts.items():
            at = lambda key: call("At", call("Id", lit(h)), lit(key))  # noqa: E731
            if h in inputs:  # placed in any plain layout; a weight may also be held split and gathered on use
                for key in layouts:
                    if (h, "place", key) not in self.linked and not self.interner.layouts[key][1].partial:
                        self.linked.add((h, "place", key))
                        commands.append(union(at(key), call("Place", lit(inputs[h]), lit(key))))
            for name in outputs.get(h, ()):
                for key in layouts:
                    if (h, name, key) not in self.linked and self.interner.whole(key):
                        self.linked.add((h, name, key))
                        commands.append(union(call("Result", lit(name)), call("Deliver", lit(name), at(key))))
        return commands
