"""Build a plan from a chosen partition per op: the hand-written route to a plan.

Extraction makes plans from the e-graph; this builder makes the same kind of
plan from explicit choices, for baselines (one device, data parallel, ...) and tests.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from tapestry.graph import Graph, Node
from tapestry.plan.plan import Compute, Place, Plan, Reshard, Step
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.comm import can_move
from tapestry.sharding.partition import AxisChoice, Partition, make_partition


Dim = int | str  # an index dim, by position or name
Axis = Dim | None | Sequence[tuple[Dim, int]]  # one dim, none, or (dim, parts) pairs: a factorization


def _split(graph: Graph, op: str, mesh: Mesh, axes: tuple[Axis, ...] | None) -> Partition:
    sig = graph.signature(op)
    try:
        return make_partition(sig, mesh, tuple(_choice(sig.dims, a) for a in axes or (None,) * mesh.ndim))
    except ValueError as err:
        raise ValueError(f"build_plan: op {op!r}: {err}") from None


def _choice(dims: tuple[str, ...], axis: Axis) -> AxisChoice:
    if axis is None or isinstance(axis, (int, str)):
        return None if axis is None else _position(dims, axis)
    return tuple((_position(dims, d), parts) for d, parts in axis)


def _position(dims: tuple[str, ...], dim: Dim) -> int:
    if not isinstance(dim, str):
        return dim
    if dim not in dims:
        raise ValueError(f"no index dim {dim!r}; its index dims are {', '.join(dims)}")
    return dims.index(dim)


class _Values:
    """Each logical value's distributed copies, by layout, in the order made."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.copies: dict[str, dict[Layout, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}

    def add(self, logical: str, step: Step) -> str:
        self.steps.append(step)
        self.copies.setdefault(logical, {})[step.layout] = step.out
        return step.out

    def fresh(self) -> str:
        return f"v{len(self.steps)}"

    def get(self, logical: str, layout: Layout) -> str:
        """The value `logical` in `layout`, resharding the most recent copy that holds what `layout` needs (a
        copy made for a reader of a slice, like rotary's half of each head, may hold only that slice)."""
        copies = self.copies[logical]
        if layout in copies:
            return copies[layout]
        src_layout, src = next(((held, name) for held, name in reversed(copies.items()) if can_move(held, layout)),
                               next(reversed(copies.items())))  # none: the most recent, and validation says why
        return self.add(logical, Reshard(self.fresh(), src, self.shapes[logical], src_layout, layout,
                                         self.dtypes[logical]))


def build_plan(
    graph: Graph,
    mesh: Mesh,
    axes: Mapping[str, tuple[Axis, ...]] | None = None,
    partitions: Mapping[str, Partition] | None = None,
    stored: Mapping[str, Layout] | None = None,
) -> Plan:
    """Ops take `partitions[op]`, else the split `axes[op]` (per mesh axis: an index dim, by position or by
    name as in `{"q": ("out",)}`; None; or several dims at once, `{"mm": ((("batch0", 4), ("m", 2)),)}`
    splitting batch 4 ways and m 2 ways over one 8-device axis), else run replicated. Inputs are placed in their
    `stored` layout where given (each reader needing another gets a reshard of it, a reader of that layout the
    placed block itself), else as their first user needs them; partial outputs are all-reduced."""
    axes, partitions = axes or {}, partitions or {}
    unknown = sorted((set(axes) | set(partitions)) - {n.name for n in graph.ops})
    if unknown:
        raise ValueError(f"build_plan: {', '.join(map(repr, unknown))} is no op of the graph; its ops are "
                         f"{', '.join(n.name for n in graph.ops)}")
    values = _Values()
    chosen = {n.name: partitions.get(n.name) or _split(graph, n.name, mesh, axes.get(n.name)) for n in graph.ops}
    for node in graph.inputs:
        values.shapes[node.name], values.dtypes[node.name] = node.shape, node.dtype
        if stored and node.name in stored:
            values.add(node.name, Place(values.fresh(), node.name, node.shape, stored[node.name]))
    runs: dict[tuple[Any, ...], Compute] = {}  # a model's repeated layers run few distinct steps: each made once
    for node in graph.ops:
        sig = graph.signature(node.name)
        key = (sig.kernel.name, sig.input_shapes, sig.params, sig.input_dtypes, chosen[node.name])
        if key not in runs:
            runs[key] = Compute.running(sig, chosen[node.name])
        step = runs[key]
        args = []
        for arg, need in zip(node.args, step.arg_layouts):
            if arg not in values.copies:
                values.add(arg, Place(values.fresh(), arg, graph[arg].shape, need))
            args.append(values.get(arg, need))
        values.shapes[node.name], values.dtypes[node.name] = sig.output_shape, sig.dtype
        values.add(node.name, replace(step, out=values.fresh(), args=tuple(args), origin=node.name))
    outputs = {}
    for name, target in graph.outputs.items():
        layout = next(reversed(values.copies[target]))
        if layout.partial:
            layout = Layout.replicated(values.shapes[target], mesh)
        outputs[name] = values.get(target, layout)
    return Plan(mesh, graph, tuple(values.steps), outputs)


def expand_linears(graph: Graph) -> Graph:
    """The same program with every linear as matmul then add (named as the linear): what a row-parallel
    hand plan needs, since linear's contraction dim is no index dim (the e-graph makes the same rewrite).
    Constants and carried outputs are kept."""

    def expand(g: Graph, node: Node) -> bool:
        if node.op != "linear":
            return False
        x, w, b = node.args
        g.op("add", g.op("matmul", x, w, name=f"{node.name}_mm"), b, name=node.name)
        return True

    return _rebuilt(graph, expand)


def take_rows_of(graph: Graph) -> Graph:
    """The same program with every take of a 2-D table's rows by a 1-D index as take_rows (named as the take):
    what an expert-parallel hand plan needs to move a MoE's tokens by all-to-all (rules/experts.egg makes the
    same rewrite)."""

    def rows(g: Graph, node: Node) -> bool:
        if node.op != "take" or len(node.args) != 2:
            return False
        table, idx = (graph[a].shape for a in node.args)
        if len(table) != 2 or len(idx) != 1 or dict(node.params).get("axis", 0) % 2 != 0:
            return False
        g.op("take_rows", *node.args, rows=table[0], name=node.name)
        return True

    return _rebuilt(graph, rows)


def _rebuilt(graph: Graph, rewrite: Callable[[Graph, Node], bool]) -> Graph:
    """A copy of `graph`, each op given to `rewrite` first (True: it added the op's replacement to the copy, under
    the op's name). Constants and carried outputs are kept."""
    g = Graph()
    for node in graph.nodes:
        if node.is_input:
            g.input(node.name, node.shape, node.dtype)
        elif not rewrite(g, node):
            g.op(node.op, *node.args, name=node.name, **dict(node.params))
    for name, value in graph.outputs.items():
        g.output(name, value)
    g.constants.update(graph.constants)
    for output, input_name in graph.carried.items():
        g.carry(output, input_name)
    return g
