"""Generate the distributed layer from kernel signatures, for every logical e-node.

For each logical node and each candidate partition of its index space, the
class `(At out L_out)` gets the member `(Run<Kernel> (At arg_i L_i)... key)`,
where L_i is the layout giving each device exactly what its block reads.
Every class gets `Reshard` members between the layouts it occurs in, input
classes get `Place` members, and output classes `Deliver` members in each
plain layout. Keys name interned Python records (Compute steps, layouts), so the
cost model and the decoder see what each e-node means.
"""
from __future__ import annotations

from collections.abc import Iterable

from tapestry.kernels import Shape, Signature
from tapestry.plan import Compute
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.comm import CommError, transfers
from tapestry.sharding.partition import candidate_partitions, partition_issues


class Interner:
    """Stable short names for layouts and runs, so e-nodes stay small and costs stay local."""

    def __init__(self) -> None:
        self.layouts: dict[str, tuple[Shape, Layout]] = {}
        self._layout_keys: dict[tuple[Shape, Layout], str] = {}
        self.runs: dict[str, Compute] = {}  # the step each Run e-node is, its value names "?"
        self._run_keys: dict[Compute, str] = {}
        self.movable: dict[tuple[str, str], bool] = {}  # can a reshard turn one layout into the other

    def layout(self, shape: Shape, layout: Layout) -> str:
        key = (shape, layout)
        if key not in self._layout_keys:
            name = f"L{len(self._layout_keys)}"
            self._layout_keys[key] = name
            self.layouts[name] = key
        return self._layout_keys[key]

    def run(self, step: Compute) -> str:
        if step not in self._run_keys:
            name = f"p{len(self._run_keys)}"
            self._run_keys[step] = name
            self.runs[name] = step
        return self._run_keys[step]


def runs_for(sig: Signature, mesh: Mesh, interner: Interner, origin: str) -> list[tuple[str, tuple[str, ...], str]]:
    """(out layout, arg layouts, run key) for every candidate partition of one logical node."""
    found = []
    for part in candidate_partitions(sig, mesh):
        issues = partition_issues(sig, part.blocks)  # islpy: a partition of the index space, partials sound
        if issues:
            raise AssertionError(f"generated an illegal partition of {sig}: {'; '.join(issues)}")
        step = Compute.running(sig, part, f"{origin} [{part.name(sig)}]")
        out = interner.layout(sig.output_shape, step.layout)
        args = tuple(interner.layout(shape, layout) for shape, layout in zip(sig.input_shapes, step.arg_layouts))
        found.append((out, args, interner.run(step)))
    return found


def reshard_pairs(layouts: Iterable[str], interner: Interner) -> list[tuple[str, str]]:
    """Ordered pairs (from, to) of one value's layouts that a reshard can connect."""
    keys = sorted(set(layouts))
    pairs = []
    for src in keys:
        for dst in keys:
            if src != dst and not interner.layouts[dst][1].partial and _movable(src, dst, interner):
                pairs.append((src, dst))
    return pairs


def _movable(src: str, dst: str, interner: Interner) -> bool:
    if (src, dst) not in interner.movable:
        try:
            transfers(interner.layouts[src][1], interner.layouts[dst][1])
            interner.movable[(src, dst)] = True
        except CommError:
            interner.movable[(src, dst)] = False
    return interner.movable[(src, dst)]
