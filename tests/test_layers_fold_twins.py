"""A folded training step on a mesh its batch does not divide (tiny LLaMA, batch 2, on 2x2x2): copy 0's backward reads
copy 1's input gradient in layouts the prefix never reads copy 0's in, so the e-graph held layouts of one twin that
the other lacked, and a twin pair one side of which could never be chosen stayed selectable on the other, where the
greedy fallback chose it and `Layered.mirror` then chose its partner: "class ... is reachable but has no chosen
node" from `explore(llama_step(3), Mesh(2, 2, 2), layers=True).extract(model)`."""
from __future__ import annotations

import pytest
from test_layers_fold import llama_step

from tapestry.cost import DefaultCostModel
from tapestry.cost.profile import load_profile
from tapestry.extract.tree import tree_choice
from tapestry.optimizer import Explored, explore
from tapestry.sharding import Mesh

# one explore of a 3-layer step on 8 devices (~40 s on 2 cores): make test-all; make test keeps the folded steps of
# tests/test_layers_fold.py, whose meshes the batch divides
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def explored() -> Explored:
    return explore(llama_step(3), Mesh(2, 2, 2), layers=True)


def test_each_value_of_copy_0_is_held_in_the_layouts_of_its_twin_in_copy_1(explored):
    layered = explored.layered
    layouts: dict[str, set[str]] = {}
    for c, value in layered.decoder.class_value.items():
        layouts.setdefault(value, set()).add(layered.decoder.class_layout[c])
    pairs = [(layered.classes[chain[0]], layered.classes[chain[1]]) for chain in layered.folded.layers.chains]
    assert pairs
    assert all(layouts[a] == layouts[b] for a, b in pairs)


def test_a_twin_pair_is_selectable_on_both_sides_or_on_neither(explored):
    model = DefaultCostModel(load_profile("gpu-h100-nccl"))
    egraph = explored.decoder.extraction_graph(list(explored.roots), model, explored.priced_moves,
                                               drop_dominated=False)
    tied = explored.layered.costs(egraph)
    tree = tree_choice(tied)

    def usable(n: int) -> bool:
        return tied.selectable(n) and all(tree.extractable(d) for d in tied.child_sets[n])

    assert all(usable(n) == usable(t) for n, t in explored.layered.ties())
