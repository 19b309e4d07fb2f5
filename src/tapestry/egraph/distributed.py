"""Generate the distributed layer from kernel signatures, for every logical e-node.

For each logical node and each candidate partition of its index space, the
class `(At out L_out)` gets the member `(Run<Kernel> (At arg_i L_i)... key)`,
where L_i is the layout giving each device exactly what its block reads.
Input classes get `Place` members, and output classes `Deliver` members in each plain layout. Reshards between the
layouts a value occurs in are made by `egraph.decode`, outside egglog (`reshard_pairs` says which). Keys name interned
Python records (Compute steps, layouts), so the cost model and the decoder see what each e-node means.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np

from tapestry import zspace
from tapestry.kernels import Shape, Signature
from tapestry.plan import Compute
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.comm import movable
from tapestry.sharding.partition import (
    Candidate, Partition, candidates, exchanged_blocks, generation_order, partition_issues, replicated_candidate,
)
from tapestry.zspace import ZRange


class Interner:
    """Stable short names for layouts and runs, so e-nodes stay small and costs stay local; and each distinct
    signature's candidate steps, made once (identical layers share them)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.layouts: dict[str, tuple[Shape, Layout]] = {}
        self._layout_keys: dict[tuple[Shape, Layout], str] = {}
        self.runs: dict[str, Compute] = {}  # the step each Run e-node is, its value names "?"
        self._run_keys: dict[Compute, str] = {}
        self.priced_as: dict[str, str] = {}  # run key -> its candidate's name: runs that differ only in origin
        self.replicated_keys: dict[str, bool] = {}  # layout key -> is it the replicated layout (egraph.decode)
        self._whole: dict[str, bool] = {}
        self._parts: dict[tuple[Any, ...], list[Candidate]] = {}
        self.pairs: dict[tuple[str, ...], list[tuple[str, str]]] = {}  # a set of layout keys -> `reshard_pairs`
        self.rounds: dict[str, int] = {}  # layout key -> the first generation round a run reads or writes it in
        self._candidates: dict[tuple[Any, ...], list[tuple[str, Partition, Compute, str, tuple[str, ...]]]] = {}
        self._candidate_count = 0

    def layout(self, shape: Shape, layout: Layout) -> str:
        key = (shape, layout)
        if key not in self._layout_keys:
            name = f"L{len(self._layout_keys)}"
            self._layout_keys[key] = name
            self.layouts[name] = key
        return self._layout_keys[key]

    def seeded(self, key: str) -> bool:
        """Whether layout `key` is of round -1: a replicated run's or a seed plan's (`Generator.distribute`), whose
        moves are made and priced whatever the counts."""
        return self.rounds.get(key, 0) < 0

    def whole(self, key: str) -> bool:
        """Whether layout `key` is plain and its blocks together hold the whole tensor: what an output may be
        delivered in (an argument's layout holds only what its reader reads, e.g. the row a select takes)."""
        if key not in self._whole:
            shape, layout = self.layouts[key]
            held = [b for b in layout.blocks if b is not None]
            self._whole[key] = not layout.partial and bool(held) and zspace.covers(held, ZRange.from_shape(shape))
        return self._whole[key]

    def run(self, step: Compute) -> str:
        if step not in self._run_keys:
            name = f"p{len(self._run_keys)}"
            self._run_keys[step] = name
            self.runs[name] = step
        return self._run_keys[step]

    def count(self, sig: Signature, sharded: bool, data: frozenset[int] | None = None) -> int:
        return len(self._partitions(sig, sharded, data)[1])

    def candidates(self, sig: Signature, sharded: bool, first: int | None = None,
                   data: frozenset[int] | None = None) -> list[tuple[str, Partition, Compute, str, tuple[str, ...]]]:
        """(name, partition, step without origin, out layout, arg layouts) for every sharded candidate partition
        of `sig` (only the `first` ones, in `generation_order` with the index dims `data` from the batch, if
        given), or else for its replicated one; each made and checked with islpy once per distinct signature,
        and only when first asked for, so a budget-stopped generation pays for the candidates it inserts."""
        key, parts = self._partitions(sig, sharded, data)
        found = self._candidates.setdefault(key, [])
        for candidate in parts[len(found):len(parts) if first is None else first]:
            part = candidate.partition(sig, self.mesh)
            # islpy: a partition of the index space (an exchange's rows with all their experts), partials sound
            issues = partition_issues(sig, exchanged_blocks(sig, part.blocks, part.exchange, self.mesh,
                                                                part.exchange_group))
            if issues:
                raise AssertionError(f"generated an illegal partition of {sig}: {'; '.join(issues)}")
            step = Compute.running(sig, part)
            out = self.layout(sig.output_shape, step.layout)
            args = tuple(self.layout(shape, layout) for shape, layout in zip(sig.input_shapes, step.arg_layouts))
            found.append((f"c{self._candidate_count}", part, step, out, args))
            self._candidate_count += 1
        return found if first is None else found[:first]

    def _partitions(self, sig: Signature, sharded: bool, data: frozenset[int] | None = None
                    ) -> tuple[tuple[Any, ...], list[Candidate]]:
        key = (sig.kernel.name, sig.input_shapes, sig.params, sig.input_dtypes, sharded, data)
        if key not in self._parts:
            self._parts[key] = (generation_order((p for p in candidates(sig, self.mesh) if any(p.axes)), self.mesh,
                                                 data)
                                if sharded else [replicated_candidate(sig, self.mesh)])
        return key, self._parts[key]


def runs_for(sig: Signature, interner: Interner, origin: str, sharded: bool, rank: int | None = None,
             data: frozenset[int] | None = None) -> list[tuple[str, tuple[str, ...], str]]:
    """(out layout, arg layouts, run key) for each candidate partition of one logical node: the sharded ones (only
    the rank-th, if given, in the order for the index dims `data` from the batch), or else the replicated one. Each
    layout's first generation round (`Interner.rounds`: the candidate's rank in `generation_order`, -1 for the
    replicated run) orders pricing (`decode.pricing_order`)."""
    found = []
    candidates = interner.candidates(sig, sharded, None if rank is None else rank + 1, data)
    first = 0 if rank is None else rank
    for n, (name, part, step, out, args) in enumerate(candidates[first:], first):
        key = interner.run(replace(step, origin=f"{origin} [{part.name(sig)}]"))
        interner.priced_as[key] = name
        for layout in (out, *args):
            interner.rounds[layout] = min(interner.rounds.get(layout, n), n if sharded else -1)
        found.append((out, args, key))
    return found


def reshard_pairs(layouts: Iterable[str], interner: Interner) -> list[tuple[str, str]]:
    """Ordered pairs (from, to) of one value's layouts that a reshard can connect; found once per set of
    layouts (identical layers' values have the same set: this took 7 of a 2x2x2 12-layer stack's 30 s)."""
    keys = tuple(sorted(set(layouts)))
    if keys not in interner.pairs:
        ok = movable([interner.layouts[key][1] for key in keys])
        interner.pairs[keys] = [(keys[i], keys[j]) for i, j in zip(*np.nonzero(ok)) if i != j]
    return interner.pairs[keys]
