"""A plan: the distributed program extraction chose, as SPMD steps over a mesh.

Every step is self-contained (it carries its kernel, blocks, shapes and
layouts), so a cost model can price a step alone and a validator can check it
alone. Steps are in execution order; values are named by the step that makes them.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tapestry.graph import Graph, GraphError, check_name, graph_from_json, graph_to_json
from tapestry.kernels import Params, Shape, Signature, get_kernel
from tapestry.sharding import Block, Layout, Mesh
from tapestry.sharding.partition import Partition, needed_layout, output_layout
from tapestry.zspace import ZRange
from tapestry.zspace.zrange import as_point

FORMAT = "tapestry.plan/1"


@functools.lru_cache(maxsize=1 << 14)
def _bound(kernel: str, shapes: tuple[Shape, ...], params: Params, in_dtypes: tuple[str, ...]) -> Signature:
    """One Signature per distinct binding, shared by every step that runs it (the steps of identical layers differ
    only in their origin): its cost formulas are compiled once."""
    return get_kernel(kernel).bind(shapes, dict(params), in_dtypes or None)


@dataclass(frozen=True)
class Place:
    """Program input `input`, supplied to each device as its block of `layout`."""

    out: str
    input: str
    shape: Shape
    layout: Layout


@dataclass(frozen=True)
class Compute:
    """Each device runs `kernel` over its index block (None: it idles)."""

    out: str
    kernel: str
    params: Params
    args: tuple[str, ...]
    input_shapes: tuple[Shape, ...]
    arg_layouts: tuple[Layout, ...]
    blocks: tuple[Block, ...]
    layout: Layout
    origin: str = ""  # the logical node (and the rules that made it), for explanations
    input_dtypes: tuple[str, ...] = ()  # () means float32 throughout (plans saved before dtypes)
    # Mesh axes splitting the kernel's rows and experts together (expert parallel, `Kernel.exchange`): along them
    # each device computes its experts for the rows of the whole axis, rows moved by all-to-all (plan.exchange).
    exchange: tuple[int, ...] = ()
    # Mesh axes splitting the kernel's queries and keys together (ring attention, `Kernel.ring`): along them each
    # device holds its key block and meets the others' as they pass round the ring (plan.ring).
    ring: tuple[int, ...] = ()
    # Devices the exchange trades among along its one axis, where fewer than the axis: runs of as many consecutive
    # devices (sharding.partition.exchange_groups; the axis of 8 viewed as 2 x 4); 0: the whole exchange axes.
    exchange_group: int = 0

    @classmethod
    def running(cls, sig: Signature, part: Partition, origin: str = "") -> Compute:
        """`sig` over `part`, each device reading exactly the argument cells its block needs.

        Both routes to a plan (build_plan, the e-graph's Run nodes) start here, so they cannot drift apart;
        `out` and `args` stay "?" until the caller names them (dataclasses.replace)."""
        n = len(sig.input_shapes)
        needs = tuple(needed_layout(sig, i, part) for i in range(n))
        return cls("?", sig.kernel.name, sig.params, ("?",) * n, sig.input_shapes, needs, part.blocks,
                   output_layout(sig, part), origin, sig.input_dtypes, part.exchange, part.ring, part.exchange_group)

    @cached_property
    def signature(self) -> Signature:
        return _bound(self.kernel, self.input_shapes, self.params, self.input_dtypes)

    @property
    def shape(self) -> Shape:
        return self.signature.output_shape

    @property
    def binding(self) -> tuple:
        """What the step computes but its names and blocks: a key for the steps alike but for their names (an
        expanded plan's later copies), to which a cache adds the blocks as it compares them."""
        return self.numbered_binding(lambda layout: layout)

    def numbered_binding(self, number: Callable[[Layout], Any]) -> tuple:
        """`binding` with its layouts as their numbers (sharding.layout.ValueNumbers: equal for equal layouts),
        equal exactly where `binding` is, without comparing a layout's blocks (512 on 8x8x8) each time it is asked."""
        return (self.kernel, self.params, self.input_shapes, self.input_dtypes, tuple(map(number, self.arg_layouts)),
                number(self.layout), self.exchange, self.ring, self.exchange_group)


@dataclass(frozen=True)
class Reshard:
    """Move or reduce value `src` (of `dtype`, which prices the bytes moved) from `src_layout` into `layout`."""

    out: str
    src: str
    shape: Shape
    src_layout: Layout
    layout: Layout
    dtype: str = "float32"


Step = Place | Compute | Reshard


@dataclass(frozen=True)
class Plan:
    mesh: Mesh
    graph: Graph
    steps: tuple[Step, ...]
    outputs: Mapping[str, str]
    cost: float | None = None
    notes: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.graph.check_plannable()
        for name in self.outputs:
            check_name(name, "plan output")

    @cached_property
    def by_id(self) -> dict[str, Step]:
        return {s.out: s for s in self.steps}

    @cached_property
    def prepared(self) -> frozenset[str]:
        """The Compute and Reshard steps (by value) computed from static inputs and constants alone, transitively
        (`Graph.fixed`): the same in every run, so a serving loop runs them once at load time and the cost model
        prices them 0 per run (TASO's and Tensat's weight-only subgraphs). `run_plan` and a persistent
        ParallelProgram run them once, as setup."""
        fixed, made = self.graph.fixed, set()
        for step in self.steps:
            if isinstance(step, Place):
                if step.input in fixed:
                    made.add(step.out)
            elif all(a in made for a in (step.args if isinstance(step, Compute) else (step.src,))):
                made.add(step.out)
        return frozenset(v for v in made if not isinstance(self.by_id[v], Place))

    def layout_of(self, value: str) -> Layout:
        return self.by_id[value].layout

    @cached_property
    def dtypes(self) -> dict[str, str]:
        """Each value's dtype name: an input's from the graph, a result's from its kernel, a move keeps it."""
        found: dict[str, str] = {}
        for step in self.steps:
            if isinstance(step, Place):
                found[step.out] = self.graph[step.input].dtype
            elif isinstance(step, Reshard):
                found[step.out] = found[step.src]
            else:
                found[step.out] = step.signature.dtype
        return found

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "mesh": self.mesh.to_json(),
            "graph": graph_to_json(self.graph),
            "steps": [_step_to_json(s) for s in self.steps],
            "outputs": dict(self.outputs),
            "cost": self.cost,
            "notes": dict(self.notes),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "<json>") -> Plan:
        """A plan from its JSON form; a malformed document is a ValueError naming the source and the part at
        fault (an edited file is checked again by `validate_plan`, which `tapestry explain` and `run` call)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: not a plan: the top level is a JSON {type(data).__name__}, expected an "
                             f"object with \"format\": {FORMAT!r}")
        if data.get("format") != FORMAT:
            raise ValueError(f"{source}: not a plan (format {data.get('format')!r}, expected {FORMAT!r})")
        where = "mesh"
        try:
            mesh = Mesh(*data["mesh"])
            where = "graph"
            graph = graph_from_json(data["graph"], source)
            where, steps = "steps", []
            for k, step in enumerate(data["steps"]):
                where = f"steps[{k}]"
                steps.append(_step_from_json(step))
            where = "outputs"
            outputs = dict(data["outputs"])
            where = "notes"
            notes = dict(data.get("notes", {}))
        except GraphError:
            raise
        except KeyError as err:
            raise ValueError(f"{source}: {where}: missing key {err}") from None
        except (TypeError, ValueError, AttributeError, IndexError) as err:
            raise ValueError(f"{source}: {where}: {err}") from None
        try:
            return cls(mesh=mesh, graph=graph, steps=tuple(steps), outputs=outputs, cost=data.get("cost"), notes=notes)
        except GraphError as err:
            raise GraphError(f"{source}: {err}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, check: bool = True) -> Plan:
        """The plan saved at `path`; with `check`, checked as `validate_loaded` does (its steps, then its meaning
        against its graph), so an edited file is refused here, naming itself and the step at fault."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:  # a truncated or hand-broken file
            raise ValueError(f"{path}:{err.lineno}:{err.colno}: not valid JSON: {err.msg}") from None
        plan = cls.from_json(data, str(path))
        if check:
            from tapestry.plan.validate import validate_loaded  # validate builds on this module

            validate_loaded(plan, str(path))
        return plan


def output_gathers(plan: Plan, names: Collection[str] | None = None, everywhere: bool = False) -> list[Reshard]:
    """The reshards the runtime adds after the plan: each distinct value of outputs `names` (default: all) to one
    whole block on rank 0, or with `everywhere` on every rank (replicated: a persistent program hands each rank
    its outputs). Not plan steps, so `plan_cost` leaves them out; `cost.run_costs` prices them with the plan."""
    gathers: dict[str, Reshard] = {}
    for name, value in plan.outputs.items():
        if value not in gathers and (names is None or name in names):
            step = plan.by_id[value]
            where = Layout.replicated(step.shape, plan.mesh) if everywhere else _on_rank0(step.shape, plan.mesh)
            gathers[value] = Reshard(delivered(value, everywhere), value, step.shape, step.layout, where,
                                     plan.dtypes[value])
    return list(gathers.values())


def steady_violations(plan: Plan, carried: Mapping[str, str]) -> list[str]:
    """Each carried output (output -> the input it becomes next run) the plan delivers in another layout than its
    input was placed in, one line each: a plan with none is steady (its state stays where it is, run after run)."""
    placed = {s.input: s.layout for s in plan.steps if isinstance(s, Place)}
    return [f"output {out!r} comes out as {plan.layout_of(plan.outputs[out])}, input {name!r} is placed as "
            f"{placed[name]}" for out, name in carried.items()
            if name in placed and plan.layout_of(plan.outputs[out]) != placed[name]]


def delivered(value: str, everywhere: bool = False) -> str:
    """The name of the buffer that holds the whole of `value` after `output_gathers`."""
    return f"{value}@all" if everywhere else f"{value}@0"


def _on_rank0(shape: Shape, mesh: Mesh) -> Layout:
    return Layout((ZRange.from_shape(shape), *(None,) * (mesh.size - 1)))


def _blocks_json(blocks: tuple[Block, ...]) -> list[str | None]:
    return [None if b is None else str(b) for b in blocks]


def _blocks_parse(items: list[str | None]) -> tuple[Block, ...]:
    return tuple(None if b is None else ZRange.parse(b) for b in items)


def _step_to_json(step: Step) -> dict[str, Any]:
    if isinstance(step, Place):
        return {"kind": "place", "out": step.out, "input": step.input, "shape": list(step.shape),
                "layout": step.layout.to_json()}
    if isinstance(step, Reshard):
        return {"kind": "reshard", "out": step.out, "src": step.src, "shape": list(step.shape),
                "src_layout": step.src_layout.to_json(), "layout": step.layout.to_json(), "dtype": step.dtype}
    return {
        "kind": "compute", "out": step.out, "kernel": step.kernel,
        "params": {k: list(v) if isinstance(v, tuple) else v for k, v in step.params},
        "args": list(step.args), "input_shapes": [list(s) for s in step.input_shapes],
        "arg_layouts": [a.to_json() for a in step.arg_layouts], "blocks": _blocks_json(step.blocks),
        "layout": step.layout.to_json(), "origin": step.origin, "input_dtypes": list(step.input_dtypes),
        **({"exchange": list(step.exchange)} if step.exchange else {}),
        **({"ring": list(step.ring)} if step.ring else {}),
        **({"exchange_group": step.exchange_group} if step.exchange_group else {}),
    }


def _step_from_json(data: Mapping[str, Any]) -> Step:
    kind = data["kind"]
    if kind == "place":
        return Place(data["out"], data["input"], as_point(data["shape"]), Layout.from_json(data["layout"]))
    if kind == "reshard":
        return Reshard(data["out"], data["src"], as_point(data["shape"]), Layout.from_json(data["src_layout"]),
                       Layout.from_json(data["layout"]), data.get("dtype", "float32"))
    if kind == "compute":
        params = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in data["params"].items()))
        return Compute(
            data["out"], data["kernel"], params, tuple(data["args"]), tuple(as_point(s) for s in data["input_shapes"]),
            tuple(Layout.from_json(a) for a in data["arg_layouts"]), _blocks_parse(data["blocks"]),
            Layout.from_json(data["layout"]), data.get("origin", ""), tuple(data.get("input_dtypes", ())),
            tuple(data.get("exchange", ())), tuple(data.get("ring", ())), int(data.get("exchange_group", 0)),
        )
    raise ValueError(f"unknown plan step kind {kind!r}")
