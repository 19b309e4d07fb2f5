"""Random block graphs over the whole kernel registry, and random plans of them, for end-to-end property tests.

Each op is drawn from every kernel with its own sampler, so a kernel added to the registry is tested without
editing this file. An op reads earlier values where they fit (the last value first, so chains and DAGs both
occur), else fresh inputs of the sampled shapes. `RandomCost` prices every step at random, so extraction
picks plans the default cost model never would on small shapes: partial sums, halos and reshards.
"""
from __future__ import annotations

import itertools
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st

from tapestry.graph import Graph, Value
from tapestry.kernels import KERNELS, DimKind, Kernel, KernelError, Shape
from tapestry.plan.plan import Compute, Plan, Reshard, Step
from tapestry.sharding import Mesh
from tapestry.sharding.comm import transfers

# Kernels for unknown ops of an imported program have no reference implementation of their own.
GENERATED = tuple(sorted(name for name in KERNELS if not name.startswith("opaque")))
_FRESH_DTYPES = ("float32", "bool", "int64")  # tried in turn for fresh inputs until the op binds


def _binds(kernel: Kernel, shapes: Sequence[Shape], params: dict, in_dtypes: Sequence[str]) -> bool:
    """The op binds and no input or output has a zero-size dim: plans refuse zero-size tensors by design
    (`Graph.check_plannable`; a slice's params drawn for one shape clip to nothing on an earlier, smaller value),
    so a program holding one tests nothing a plan does. test_robustness runs every kernel on zero-size inputs."""
    try:
        return all(0 not in s for s in (*shapes, kernel.bind(shapes, params, in_dtypes).output_shape))
    except (KernelError, ValueError, IndexError, ArithmeticError):
        return False


def _operands(draw: st.DrawFn, kernel: Kernel, sampled: tuple[Shape, ...], params: dict, values: list[Value],
              kinds: Sequence[str]) -> list[Value | tuple[Shape, str]] | None:
    """Per slot an earlier value, or (shape, dtype) of a fresh input (the sampler's dtype kind first); None when
    nothing binds."""
    options: list[list[Value | Shape]] = []
    for slot, shape in enumerate(sampled):
        earlier = [v for v in values if v.shape == shape]
        if slot == 0 and values:
            earlier = [values[-1], draw(st.sampled_from(values)), *earlier]
        options.append([*dict.fromkeys(earlier), shape] if draw(st.integers(0, 5)) else [shape])
    for choice in itertools.islice(itertools.product(*options), 16):
        shapes = [c.shape if isinstance(c, Value) else c for c in choice]
        fresh = [k for k, c in enumerate(choice) if not isinstance(c, Value)]
        preferred = tuple("float32" if kinds[k] == "float" else kinds[k] for k in fresh) if kinds else ()
        for fill in dict.fromkeys([preferred, *itertools.product(_FRESH_DTYPES, repeat=len(fresh))]):
            if len(fill) != len(fresh):
                continue
            in_dtypes = [c.dtype if isinstance(c, Value) else "" for c in choice]
            for k, d in zip(fresh, fill):
                in_dtypes[k] = d
            if _binds(kernel, shapes, params, in_dtypes):
                return [c if isinstance(c, Value) else (c, d) for c, d in zip(choice, in_dtypes)]
            if len(fresh) > 2 and fill[0] != "float32":
                break  # many fresh slots: all-float first, then one pass per first dtype is enough
    return None


@st.composite
def block_graphs(draw: st.DrawFn, max_ops: int = 6, kernels: Sequence[str] = GENERATED, first: str | None = None
                 ) -> Graph:
    """1 to `max_ops` ops drawn from `kernels` (the first one `first`, when given, retried until it binds);
    the last value, and sometimes another, are outputs."""
    g = Graph()
    values: list[Value] = []
    fresh = itertools.count()
    ops = draw(st.integers(1, max_ops))
    while len(values) < ops:
        name = first if first is not None and not values else draw(st.sampled_from(list(kernels)))
        kernel = KERNELS[name]
        sampled, params, *kinds = kernel.sample(draw)  # kinds: per input, "float" or a dtype, where the sampler says
        operands = _operands(draw, kernel, tuple(map(tuple, sampled)), params, values, kinds[0] if kinds else ())
        if operands is None:
            ops -= name != first or bool(values)
            continue
        args = [o if isinstance(o, Value) else g.input(f"in{next(fresh)}", *o) for o in operands]
        values.append(g.op(name, *args, **params))
    if not values:
        values.append(g.relu(g.input("x", (draw(st.integers(1, 6)),))))
    g.output("out", values[-1])
    if len(values) > 1 and draw(st.booleans()):
        g.output("side", draw(st.sampled_from(values[:-1])))
    return g


@dataclass(frozen=True)
class RandomCost:
    """Each step costs a pseudo-random amount fixed by `seed` and the step's content, ten times less when it
    moves data or splits work, a hundred times less when it makes partial sums: extraction then picks plans of
    every shape the e-graph holds, and often the communication a real model avoids on small shapes."""

    seed: int

    def step_cost(self, step: Step, mesh: Mesh) -> float:
        key = repr((self.seed, type(step).__name__, step.layout, getattr(step, "blocks", None),
                    getattr(step, "kernel", None), getattr(step, "src_layout", None)))
        cost = 1e-6 * (1 + zlib.crc32(key.encode()) % 1000)
        split = isinstance(step, Compute) and len({b for b in step.blocks if b is not None}) > 1
        if step.layout.partial:  # the rarest shape (few kernels are additive): the cheapest
            return cost / 100
        return cost / 10 if isinstance(step, Reshard) or split else cost


FEATURES = ("partial", "halo", "reshard", "multi-device")


def features(plan: Plan) -> set[str]:
    """What a plan exercises: partial sums, halo reads (overlapping input blocks of a windowed split),
    reshards that move data, and work on more than one device."""
    found = set()
    for step in plan.steps:
        if step.layout.partial:
            found.add("partial")
        if isinstance(step, Reshard) and transfers(step.src_layout, step.layout):
            found.add("reshard")
        if isinstance(step, Compute):
            if len({b for b in step.blocks if b is not None}) > 1:
                found.add("multi-device")
            if _halo(step):
                found.add("halo")
    return found


def _halo(step: Compute) -> bool:
    sig = step.signature
    windowed = sig.dims_of(DimKind.WINDOWED)
    split = any(b is not None and b.shape[d] != sig.index.shape[d] for b in step.blocks for d in windowed)
    if not split:
        return False
    for layout in step.arg_layouts:
        held = [b for b in layout.blocks if b is not None]
        if any(a != b and a.intersection(b) is not None and not a.intersection(b).is_empty
               for a, b in itertools.combinations(held, 2)):
            return True
    return False


@dataclass
class Coverage:
    """Shares of plans with each feature, and the kernels the plans computed with."""

    plans: int = 0
    counts: Counter = field(default_factory=Counter)
    kernels: set[str] = field(default_factory=set)

    def add(self, plan: Plan) -> None:
        self.plans += 1
        self.counts.update(features(plan))
        self.kernels |= {s.kernel for s in plan.steps if isinstance(s, Compute)}
        self.kernels |= {node.op for node in plan.graph.ops}

    def share(self, feature: str) -> float:
        return self.counts[feature] / max(self.plans, 1)

    def report(self) -> str:
        shares = ", ".join(f"{f} {self.share(f):.0%}" for f in FEATURES)
        return f"{self.plans} plans: {shares}; {len(self.kernels)} of {len(GENERATED)} kernels"
