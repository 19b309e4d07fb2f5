"""Hypothesis strategies shared by the reshard tests (test_reshard_pricing, test_mesh_symmetry): layouts of a
shape on a mesh, split, replicated or arbitrary boxes; and each stride-th pair of a list of layouts (`pairs`, for
`sweeps.strided`)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import strategies as st

from tapestry.sharding import Layout, Mesh
from tapestry.zspace import ZRange


@st.composite
def layouts(draw: st.DrawFn, shape: tuple[int, ...], mesh: Mesh) -> Layout:
    """A split (even or not, some axes replicated), replicated or arbitrary layout; some devices may idle."""
    kind = draw(st.sampled_from(["split", "replicated", "boxes"]))
    if kind == "split":
        dims = tuple(draw(st.sampled_from([None, *range(len(shape))])) for _ in mesh.shape)
        blocks = Layout.split(shape, mesh, dims).blocks
    elif kind == "replicated":
        blocks = Layout.replicated(shape, mesh).blocks
    else:
        blocks = tuple(draw(boxes(shape)) for _ in mesh.devices)
    idle = draw(st.lists(st.booleans(), min_size=mesh.size, max_size=mesh.size))
    if draw(st.booleans()):
        blocks = tuple(None if off else b for b, off in zip(blocks, idle))
    return Layout(blocks, partial=draw(st.booleans()) and draw(st.booleans()))


@st.composite
def boxes(draw: st.DrawFn, shape: tuple[int, ...]) -> ZRange | None:
    if draw(st.integers(0, 5)) == 0:
        return None
    bounds = [sorted(draw(st.tuples(st.integers(0, n), st.integers(0, n)))) for n in shape]
    return ZRange(tuple(lo for lo, _ in bounds), tuple(hi for _, hi in bounds))


def pairs(sources: Sequence[Layout], destinations: Sequence[Layout], every: int = 1) -> list[tuple[Layout, Layout]]:
    """Every (source, destination) pair, or each `every`-th of them in order. With `every` coprime to the number
    of destinations and at most both counts, each layout is still a source (a row of m >= every pairs holds a
    multiple of every) and a destination (the Chinese remainder theorem finds one below m * every): checked."""
    picked = list(itertools.product(sources, destinations))[::every]
    if {s for s, _ in picked} != set(sources) or {d for _, d in picked} != set(destinations):
        raise ValueError(f"a stride of {every} over {len(sources)} x {len(destinations)} pairs leaves a layout out: "
                         "pick one coprime to the number of destinations")
    return picked
