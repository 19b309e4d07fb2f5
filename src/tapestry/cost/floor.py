"""A floor under the time of every plan of a graph on a mesh: the whole space, not only the plans a search made.

An extractor's gap (`Selection.gap`) bounds only the e-graph it was given: where a budget cut saturation, or the
extractor is greedy, it says nothing of the plans never generated (issue 24). `step_floor` needs only the graph,
the mesh and the cost model, and no plan `DefaultCostModel` prices (`plan_cost`) costs less:

- Communication is left out: a plan's time is its steps' sum less the overlap credit (`cost.overlap`), which hides
  at most the gradient reductions themselves, so every Reshard nets to 0 or more and no compute is ever hidden.
- A plan computes every value it keeps (its devices' index blocks cover the op's index space, a partial sum's
  split included) and the FLOPs of a block are `flops_per_point` times its extents (times a `work` share that adds
  up over blocks): the devices' FLOPs add up to at least the op's, so the slowest device does at least 1/n of them
  (n devices); a matmul's bytes (its operands' and result's footprints) likewise. An op is charged
  max(FLOPs / n / peak, bytes / n / bandwidth) + one launch, times the profile's oversubscription.
- Fusion (`cost.fusion`) prices a group of fusible kernels (elementwise, reductions, shapes, views) as one kernel
  that may write no intermediate and launches once: their FLOPs and launches are charged 0 here (at a GPU's peak a
  rounding error; a rule such as relu(relu(x)) = relu(x) can remove them), only the bytes a group must move across
  its edge (`_boundary_bytes`): a value one makes that a library kernel reads or the plan delivers is written, and a
  value a library kernel makes that one reads is read, once each, spread over the devices. Matmuls, attention,
  gathers and the other library kernels are never fused with each other, so each keeps its launch.
- Only what the outputs depend on is computed (a plan runs no dead op).
- Prepared steps (computed from static inputs and constants alone, `Graph.fixed`) cost nothing per run: 0 here.
- The e-graph makes each distinct value once: ops of the graph that compute the same term (the training capture's
  recomputed forward values) are counted once.
- Rewrites (the shipped rules/*.egg, as `load_rules()` loads them by default) that change a library kernel's
  FLOPs: 2-D matmul associativity (a chain's bracketing; a weight-only product is then prepared), left
  distributivity (a @ b + a @ c: one matmul of a @ (b + c)) and a matmul of an expanded operand (expand(x @ w)):
  every matmul such a rule can match, looking through views, is charged 0. Fusing an activation or bias into a
  linear kernel keeps its FLOPs and its one launch (and such a fusible op moves no bytes here, nor a concat a
  slice rule can drop). Other rule files (the opt-in TASO algebra, a merged GEMM's
  one launch for two) are not covered: the optimizer reports no floor under them (`egraph.rules.only_builtin`).

Not covered: cost models other than DefaultCostModel (None), pipelined steps (`plan_pipeline`: a floor per stage
count is benchmarks/stage_floor.py's), and memory budgets (a budget that forces communication raises every plan's
time; the floor ignores it). docs/cost-models.md, "The whole-space floor".
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tapestry import dtypes
from tapestry.cost import DefaultCostModel
from tapestry.cost.fusion import FUSIBLE, footprint
from tapestry.cost.model import CostModel
from tapestry.cost.overlap import upstream
from tapestry.cost.profile import DeviceProfile
from tapestry.cost.roofline import compute_dtype
from tapestry.graph import Graph
from tapestry.kernels import Signature
from tapestry.sharding import Mesh

# What the matmul rules read (a linear as x @ w + b)
MATMULS = frozenset({"matmul", "linear", "linear_relu", "linear_gelu"})
SAME_SIZE_VIEWS = frozenset({"reshape", "transpose"})
FOLDED = frozenset({"relu", "gelu", "add"})  # fusion.egg folds these into a linear or convolution
FOLDS_INTO = frozenset({"tapestry.kernels.matmul", "tapestry.kernels.linear", "tapestry.kernels.conv"})
BYTES_KERNELS = frozenset({"tapestry.kernels.matmul", "tapestry.kernels.linear"})  # blocks always cover: bytes count


def gap_to_floor(cost: float, floor: float | None) -> float | None:
    """(cost - floor) / cost: how far a plan may be above the best plan of the whole space, at most."""
    if floor is None or cost <= 0.0:
        return None
    return (cost - floor) / cost  # below 0 only if the floor is wrong: not clipped, so that tests see it


def gaps_note(gap: float | None, floor_gap: float | None, why: str = "") -> str:
    """", gap x% within the space searched; y% to the whole-space floor", as far as each is known (explain); "no
    bound within the space searched (`why`)" where none is known (egraph.plan_bound), not a gap of 100%."""
    none = "no bound within the space searched" + (f" ({why})" if why else "")
    parts = [none if gap is None else f"gap {gap:.2%} within the space searched",
             *([] if floor_gap is None else [f"{floor_gap:.2%} to the whole-space floor"])]
    return ", " + "; ".join(parts)


@dataclass(frozen=True)
class FloorParts:
    """`step_floor`'s two parts, in seconds: the library kernels' and the fusion groups' (their boundary bytes:
    what the fusible steps of every plan cost together at least, whatever else it runs; egraph.plan_bound adds it
    to a bound that prices them 0)."""

    library: float
    fusion: float

    @property
    def total(self) -> float:
        return self.library + self.fusion


def step_floor(graph: Graph, mesh: Mesh, model: CostModel) -> float | None:
    """Seconds no plan of `graph` on `mesh` is priced below by `model` under the shipped rules (module docstring;
    a caller with other rule files has no floor: `egraph.rules.only_builtin`); None for a model other than
    DefaultCostModel itself (a subclass may price steps otherwise)."""
    parts = floor_parts(graph, mesh, model)
    return None if parts is None else parts.total


def floor_parts(graph: Graph, mesh: Mesh, model: CostModel) -> FloorParts | None:
    """`step_floor` in its two parts (`FloorParts`); None where it is None."""
    if type(model) is not DefaultCostModel:
        return None
    device = model.profile.device
    terms = _distinct_ops(graph)
    free = _rewritable(graph, terms) | _static(graph, terms)
    devices = mesh.size
    needed = upstream((terms[v] for v in graph.outputs.values()), lambda v: (terms[a] for a in graph[v].args))
    ops = [n for n in dict.fromkeys(terms.values()) if not graph[n].is_input and n not in free and n in needed]
    library = sum(op_floor(graph.signature(name), devices, device) for name in ops if _kind(graph, name) == "library")
    fusion = _boundary_bytes(graph, terms, ops) / devices / device.mem_bandwidth
    scale = device.oversubscription(devices)
    return FloorParts(library * scale, fusion * scale)


def op_floor(sig: Signature, devices: int, device: DeviceProfile) -> float:
    """The least a Compute of `sig` spread over `devices` devices is priced (Roofline.shard_time, before
    oversubscription): its FLOPs (and, for matmuls, bytes) an even share per device, plus one launch."""
    flops, nbytes = sig.cost(sig.index)
    seconds = flops / devices / device.peak(compute_dtype(sig))
    if sig.kernel.signature.__module__ in BYTES_KERNELS:
        seconds = max(seconds, nbytes / devices / device.mem_bandwidth)
    return seconds + device.launch_overhead


def _kind(graph: Graph, name: str) -> str:
    """"view", "fusible" (cost.fusion's FUSIBLE modules) or "library" (a kernel no fusion group takes in)."""
    kernel = graph.signature(name).kernel
    return "view" if kernel.is_view else "fusible" if kernel.signature.__module__ in FUSIBLE else "library"


def _boundary_bytes(graph: Graph, terms: Mapping[str, str], ops: list[str]) -> float:
    """Bytes fusion groups must move across their edge (module docstring), summed over `ops` (the distinct, needed,
    per-run ops): each value a fusible op makes that a library kernel reads or the plan delivers (written once: it
    leaves the group), and each value a library kernel makes that a fusible op reads (read once, at the largest
    such read), looking through reshapes and transposes. Left out where a shipped fusion rule can fold the
    fusible op into the library kernel (relu, gelu or a bias add of a matmul, linear or convolution's result) or a
    slice rule can drop it (a concat)."""

    def source(value: str) -> str:
        while not graph[value].is_input and graph[value].op in SAME_SIZE_VIEWS:
            value = terms[graph[value].args[0]]
        return value

    def kept_fusible(name: str) -> bool:
        return _kind(graph, name) == "fusible" and graph[name].op != "concat" and not _foldable(graph, terms, name)

    readers: dict[str, list[tuple[str, int]]] = {}  # value -> (op, argument slot), through size-keeping views
    for name in ops:
        for slot, arg in enumerate(graph[name].args):
            readers.setdefault(source(terms[arg]), []).append((name, slot))
    delivered = {source(terms[v]) for v in graph.outputs.values()}
    total = 0.0
    for value in ops:
        uses = readers.get(value, [])
        if kept_fusible(value) and (value in delivered or any(_kind(graph, r) == "library" for r, _ in uses)):
            node = graph[value]
            total += math.prod(node.shape) * dtypes.itemsize(node.dtype)
        elif _kind(graph, value) == "library":
            total += max((_read_bytes(graph.signature(r), slot) for r, slot in uses if kept_fusible(r)), default=0.0)
    return total


def _foldable(graph: Graph, terms: Mapping[str, str], name: str) -> bool:
    """Whether fusion.egg can fold fusible op `name` into the library kernel whose result it reads."""
    node = graph[name]
    return node.op in FOLDED and any(not graph[terms[a]].is_input and graph.signature(terms[a]).kernel.signature
                                     .__module__ in FOLDS_INTO for a in node.args)


def _read_bytes(sig: Signature, slot: int) -> float:
    """Bytes the whole op reads of its argument `slot` (its footprint, cost.fusion)."""
    return footprint(sig.projections[slot], sig.index) * dtypes.itemsize(sig.input_dtypes[slot])


def _distinct_ops(graph: Graph) -> dict[str, str]:
    """Each node -> the first node computing the same term (op, params, dtype and arguments, as terms): what the
    e-graph makes one class of."""
    first: dict[tuple, str] = {}
    terms: dict[str, str] = {}
    for node in graph:
        if node.is_input:
            terms[node.name] = node.name
            continue
        key = (node.op, tuple(terms[a] for a in node.args), node.params, node.dtype)
        terms[node.name] = first.setdefault(key, node.name)
    return terms


def _static(graph: Graph, terms: Mapping[str, str]) -> set[str]:
    """The ops computed from static inputs and constants alone (`Graph.fixed`; ops of no argument too): prepared
    once, priced 0 per run (Decoder.static_classes)."""
    static: set[str] = set(graph.fixed)
    for node in graph:
        if not node.is_input and all(terms[a] in static for a in node.args):
            static.add(node.name)
    return static - graph.fixed


def _rewritable(graph: Graph, terms: Mapping[str, str]) -> set[str]:
    """The matmuls a shipped rule can replace by fewer FLOPs (module docstring), looking through views."""

    def source(value: str) -> tuple[str, bool]:
        """The value under `value`'s views, and whether an expand is among them."""
        expanded = False
        node = graph[terms[value]]
        while not node.is_input and graph.signature(node.name).kernel.is_view:
            expanded |= node.op == "expand"
            node = graph[terms[node.args[0]]]
        return node.name, expanded

    def flat(name: str) -> bool:
        sig = graph.signature(name)
        return graph[name].op in MATMULS and len(sig.input_shapes[0]) == 2 and len(sig.input_shapes[1]) == 2

    found: set[str] = set()
    for name in dict.fromkeys(terms.values()):
        node = graph[name]
        if node.is_input:
            continue
        if node.op in MATMULS:
            sources = [source(a) for a in node.args[:2]]
            if sources[0][1] or sources[1][1]:
                found.add(name)  # expand(x) @ w = expand(x @ w)
            if flat(name):
                for src, _ in sources:
                    if not graph[src].is_input and graph[src].op in MATMULS and flat(src):
                        found.update((name, src))  # associativity
        elif node.op == "add" and len(node.args) == 2:
            (p, _), (q, _) = source(node.args[0]), source(node.args[1])
            if p != q and all(not graph[v].is_input and graph[v].op in MATMULS and flat(v) for v in (p, q)) \
                    and source(graph[p].args[0])[0] == source(graph[q].args[0])[0]:
                found.update((p, q))  # a @ b + a @ c = a @ (b + c)
    return found
