"""What extraction minimises for a training step: which e-nodes are gradient reductions, backward compute and
the update (`overlap_split`), and the time per update of a step run as micro-batches (`StepObjective`)."""
from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from tapestry.cost import CostModel, peak_memory
from tapestry.cost.breakdown import PhaseTimes, phase_times
from tapestry.cost.model import from_costs, step_costs
from tapestry.cost.overlap import forward_outputs, overlap, upstream
from tapestry.egraph.decode import Decoder, DNode
from tapestry.plan import Plan

Split = tuple[frozenset[int], frozenset[int], frozenset[int]]  # reductions, backward, update (e-node indices)
# Plan times this close (a share of the larger) are equal: the same plan priced through sums in another order
EQUAL_TIME = 1e-9
T = TypeVar("T")


def overlap_split(decoder: Decoder, carried: Mapping[str, str], outputs: Mapping[str, str],
                  update_inputs: Collection[str] = (), accumulated: bool = False) -> Split:
    """cost.overlap's reductions and backward compute as far as the e-graph tells (a class some forward node
    could read is never credited): Reshard nodes out of a partial layout, and Run nodes those wait for. With
    `accumulated`, as cost.breakdown.phase_times splits a step run as micro-batches: the reductions only of
    values every Run reading them updates (weight gradients), and the update's nodes (third; else empty):
    those of classes downstream of the optimizer state and `update_inputs` (the learning rate), off the forward
    path. `carried` is the step's output -> input, `outputs` its output names -> root classes."""
    if not carried:
        return frozenset(), frozenset(), frozenset()
    made: dict[str, list[DNode]] = {}
    for node in decoder.nodes:
        made.setdefault(node.eclass, []).append(node)

    def children(c: str) -> Iterator[str]:
        return (d for node in made.get(c, ()) for d in node.children)

    forward = upstream(forward_outputs(outputs, carried), children)
    layouts = decoder.interner.layouts
    reductions = [n for n, node in enumerate(decoder.nodes) if node.op == "Reshard"
                  and node.eclass not in forward and layouts[decoder.class_layout[node.children[0]]][1].partial]
    update: set[str] = set()
    if accumulated:
        reductions, update = _weight_gradients(decoder, reductions, forward, {*carried.values(), *update_inputs})
    waited_for = upstream((decoder.nodes[n].children[0] for n in reductions), children) - forward
    backward = frozenset(n for n, node in enumerate(decoder.nodes) if node.eclass in waited_for
                         and node.op not in ("Place", "Reshard", "Deliver"))
    return frozenset(reductions), backward, frozenset(n for n, node in enumerate(decoder.nodes)
                                                      if node.eclass in update)


def _weight_gradients(decoder: Decoder, reductions: list[int], forward: set[str],
                      sources: set[str]) -> tuple[list[int], set[str]]:
    """The `reductions` of weight gradients (values only the update's Runs read), and the update's classes:
    those downstream of the placed `sources`, off the `forward` path."""
    update = {node.eclass for node in decoder.nodes if node.op == "Place" and node.key in sources
              and node.eclass not in forward}
    readers: dict[str, list[DNode]] = {}
    for node in decoder.nodes:
        for c in node.children:
            readers.setdefault(c, []).append(node)
    stack = list(update)
    while stack:
        for node in readers.get(stack.pop(), ()):
            if node.eclass not in update and node.eclass not in forward:
                update.add(node.eclass)
                stack.append(node.eclass)
    value = decoder.class_value
    runs_of: dict[str, set[str]] = {}  # a logical value -> the classes of the Runs reading any of its layouts
    for node in decoder.nodes:
        if node.op not in ("Place", "Reshard", "Deliver"):
            for c in node.children:
                if c in value:
                    runs_of.setdefault(value[c], set()).add(node.eclass)
    weight_gradients = {v for v, runs in runs_of.items() if runs <= update}
    return [n for n in reductions if value.get(decoder.nodes[n].eclass) in weight_gradients], update


def unless_unselectable(cost: float, weight: float) -> float:
    """`cost` weighted, an unselectable node (an unpriced reshard: inf) kept so (inf * 0 is NaN)."""
    return cost if math.isinf(cost) else cost * weight


@dataclass
class StepObjective:
    """What the kept plan minimises: its time per run, or per update of `micro_batches` runs (each plan's
    phases priced once), and the node weights that price an e-node for that count."""

    model: CostModel
    micro_batches: int
    split: Split  # `overlap_split`'s, accumulated where micro_batches > 1
    update_inputs: tuple[str, ...] = ()
    _times: dict[int, tuple[Plan, PhaseTimes]] = field(default_factory=dict, repr=False)  # by id(plan)
    _peaks: dict[int, tuple[Plan, list[int]]] = field(default_factory=dict, repr=False)  # by id(plan)

    def __call__(self, plan: Plan) -> float:
        if self.micro_batches == 1:
            return plan.cost
        return self._phases(plan).accumulated(self.micro_batches)

    def better(self, plan: Plan, than: Plan) -> bool:
        """Whether `plan` is kept over `than`: faster by this objective, or as fast (within EQUAL_TIME) and with a
        lower peak (`cost.peak_memory`, on its fullest device). Equal-time plans come from the extraction's fits
        (the overlap sweep, fused prices) in no meaningful order; the leaner is worth keeping, whatever the order."""
        mine, theirs = self(plan), self(than)
        if abs(mine - theirs) > EQUAL_TIME * max(abs(mine), abs(theirs)):
            return mine < theirs
        if plan.steps == than.steps:  # one plan found twice (a refit that chose the same): one peak, not better
            return False
        return max(self._peak(plan)) < max(self._peak(than))

    def least(self, found: Sequence[tuple[Plan, T]]) -> tuple[Plan, T]:
        """Of (plan, what came with it) pairs, the one whose plan no other is `better` than (the first of equals)."""
        kept = found[0]
        for candidate in found[1:]:
            if self.better(candidate[0], kept[0]):
                kept = candidate
        return kept

    def _peak(self, plan: Plan) -> list[int]:
        if id(plan) not in self._peaks:  # the plan is kept with its peaks, so its id is not reused
            self._peaks[id(plan)] = (plan, peak_memory(plan))
        return self._peaks[id(plan)][1]

    def _phases(self, plan: Plan) -> PhaseTimes:
        if id(plan) not in self._times:  # the plan is kept with its times, so its id is not reused
            self._times[id(plan)] = (plan, phase_times(plan, self.model, self.update_inputs))
        return self._times[id(plan)][1]

    def exposed(self, plan: Plan) -> bool:
        """Whether the plan's backward is shorter than the gradient reductions it hides."""
        if self.micro_batches == 1:
            found = overlap(plan, from_costs(step_costs(plan, self.model)))
            return found.reductions > found.backward * (1 + 1e-9)
        return self._phases(plan).reduce > 0

    def node_weight(self, n: int, weight: float | None) -> float:
        """Runs per update node n is priced for, with `weight` of each reduction hidden and 1 - weight of each
        backward Run (None: nothing hidden): the last micro-batch's backward hides, the others' do not."""
        reductions, backward, update = self.split
        runs = float(self.micro_batches)
        if n in reductions:
            return 1.0 if weight is None else 1 - weight
        if n in update:
            return 1.0
        if n in backward:
            return runs if weight is None else runs - 1 + weight
        return runs
