"""What a training plan does with each carried tensor: the names DP, ZeRO-3/FSDP and TP, read off a plan.

The optimizer never chooses a strategy by name; it chooses a layout per weight and per step. These names are
for tests, benchmarks and people: they describe the layouts found.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tapestry.kernels import get_kernel
from tapestry.plan import Compute, Place, Plan, Reshard
from tapestry.sharding import Layout

REPLICATED = "replicated"  # whole on every device between steps: data parallel's weights, replicated state
GATHERED = "sharded, gathered on use"  # ZeRO-3 / FSDP
IN_PLACE = "sharded, computed in place"  # tensor parallel (or sharded optimizer state, ZeRO-1)


@dataclass(frozen=True)
class Storage:
    """How one carried input lives between steps and is read during one."""

    input: str
    layout: Layout  # as placed, and (steady state) as delivered
    read_whole: bool  # some kernel reads all of it (or of a view of it) on every device: data parallel, ZeRO-3

    @property
    def replicated(self) -> bool:
        return all(b == self.layout.blocks[0] for b in self.layout.blocks)

    @property
    def strategy(self) -> str:
        if self.replicated:
            return REPLICATED
        return GATHERED if self.read_whole else IN_PLACE


def storage(plan: Plan, inputs: Mapping[str, str] | None = None) -> dict[str, Storage]:
    """Per carried input (default the plan's graph's: output -> input), its layout and how kernels read it."""
    carried = set((plan.graph.carried if inputs is None else inputs).values())
    source: dict[str, str] = {}  # value -> the carried input it is a (moved) copy of
    whole: set[str] = set()
    found: dict[str, Layout] = {}
    for step in plan.steps:
        if isinstance(step, Place) and step.input in carried:
            source[step.out], found[step.input] = step.input, step.layout
        elif isinstance(step, Reshard) and step.src in source:
            source[step.out] = source[step.src]
        elif isinstance(step, Compute) and get_kernel(step.kernel).is_view:
            if step.args[0] in source:  # a transpose or reshape of a weight is the weight
                source[step.out] = source[step.args[0]]
        elif isinstance(step, Compute):
            for arg, layout in zip(step.args, step.arg_layouts):
                if arg in source and all(b is not None and b.size == _size(step, arg) for b in layout.blocks):
                    whole.add(source[arg])
    return {name: Storage(name, layout, name in whole) for name, layout in found.items()}


def gradient_reductions(plan: Plan) -> int:
    """Reshards that sum partial values: data parallel's gradient all-reduce or reduce-scatter among them."""
    return sum(isinstance(s, Reshard) and s.src_layout.partial for s in plan.steps)


def _size(step: Compute, arg: str) -> int:
    return math.prod(step.input_shapes[step.args.index(arg)])
