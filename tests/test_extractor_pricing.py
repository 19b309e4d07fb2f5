"""Extraction prices the moves it chooses (egraph.extractor_pricing): the reshard floors never exceed a price, a
floored move a priced route beats is dropped, and the plans are those of pricing every move."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_helpers import layouts
from sweeps import draws

from tapestry.cost import DefaultCostModel, default_cost_model, load_profile
from tapestry.egraph.extractor_pricing import FloorPriced
from tapestry.extract import Selection
from tapestry.graph import Graph
from tapestry.models import mlp
from tapestry.optimizer import explore
from tapestry.plan.plan import Reshard
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.comm import CommError

PROFILES = [load_profile(name) for name in ("cpu-gloo", "gpu-h100-nccl")]  # one link; two links (hierarchical)


def _price(model: DefaultCostModel, step: Reshard, mesh: Mesh) -> float | None:
    try:
        return model.step_cost(step, mesh)
    except CommError:
        return None


@draws(100, 600)
def test_a_reshard_floor_is_never_above_its_price(examples: int) -> None:
    """On random pairs (uneven and arbitrary boxes, idle devices, partial sums) of 1-3-D shapes on 1-3-D meshes,
    under a profile of one link and one of two (hierarchical collectives)."""
    @settings(max_examples=examples, deadline=None)
    @given(data=st.data(), mesh=st.sampled_from([Mesh(4), Mesh(2, 2), Mesh(2, 4), Mesh(2, 2, 2)]),
           shape=st.lists(st.integers(1, 8), min_size=1, max_size=3).map(tuple),
           dtype=st.sampled_from(["float32", "bfloat16"]), profile=st.sampled_from(PROFILES))
    def check(data, mesh, shape, dtype, profile) -> None:
        step = Reshard("y", "x", shape, data.draw(layouts(shape, mesh)), data.draw(layouts(shape, mesh)), dtype)
        model = DefaultCostModel(profile)
        price = _price(model, step, mesh)
        if price is not None:
            assert model.reshard_floors([step], mesh)[0] <= price * (1 + 1e-9)

    check()


@pytest.mark.parametrize("mesh", [Mesh(4), Mesh(2, 2), Mesh(2, 2, 2)], ids=str)
@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_the_floors_of_every_pair_of_splits_are_below_their_prices_and_above_zero_where_cells_move(mesh, profile):
    """Every pair of even splits (a dim over several axes too) of a 3-D shape, found at once: none above its
    price, and none zero where a device lacks cells (a floor of zero would make every move look free)."""
    shape = (8, 4, 4)
    splits = list(dict.fromkeys(Layout.split(shape, mesh, dims)
                                for dims in itertools.product([None, 0, 1, 2], repeat=mesh.ndim)))
    steps = [Reshard("y", "x", shape, a, b, "float32") for a, b in itertools.permutations(splits, 2)]
    model = DefaultCostModel(profile)
    floors = model.reshard_floors(steps, mesh)
    prices = [model.step_cost(step, mesh) for step in steps]
    assert all(f <= p * (1 + 1e-9) for f, p in zip(floors, prices))
    moving = [f for f, s in zip(floors, steps) if any(
        d is not None and (o is None or not o.contains(d)) for o, d in zip(s.src_layout.blocks, s.layout.blocks))]
    assert moving and all(f > 0 for f in moving)


@dataclass(frozen=True)
class _ZeroFloors(DefaultCostModel):
    """Floors of 0: still lower bounds, but extraction takes moves for free, so it runs again on their prices (and
    after `extractor_pricing.ROUNDS`, on every price)."""

    def reshard_floors(self, steps, mesh) -> np.ndarray:
        return np.zeros(len(steps))


@dataclass(frozen=True)
class _HighFloors(DefaultCostModel):
    """Floors above every price: no lower bound."""

    def reshard_floors(self, steps, mesh) -> np.ndarray:
        return 1.0 + super().reshard_floors(steps, mesh)


def _sliced() -> Graph:
    """Slices of a product (footprints, what one reader reads) and a transpose: moves of many kinds."""
    graph = Graph()
    graph.input("x", (16, 16))
    graph.input("w", (16, 32))
    h = graph.op("matmul", "x", "w", name="h")
    a = graph.op("slice", h, axis=1, start=0, stop=16, name="a")
    b = graph.op("slice", h, axis=1, start=16, stop=32, name="b")
    graph.output("y", graph.op("matmul", graph.relu(a, name="r"), graph.op("transpose", b, perm=(1, 0), name="t"),
                               name="y"))
    return graph


@pytest.mark.parametrize(("graph", "mesh", "model"), [
    (mlp(2, 64, 64), Mesh(2, 2), default_cost_model()), (_sliced(), Mesh(2, 2), default_cost_model()),
    (mlp(2, 64, 64), Mesh(4), default_cost_model()), (_sliced(), Mesh(2, 2), _ZeroFloors(load_profile("cpu-gloo"))),
    (_sliced(), Mesh(4), _ZeroFloors(load_profile("cpu-gloo")))],
    ids=["mlp-2x2", "sliced-2x2", "mlp-4", "sliced-2x2-zero-floors", "sliced-4-zero-floors"])
def test_extraction_on_floors_plans_what_pricing_every_move_plans_and_prices_fewer(graph, mesh, model, monkeypatch):
    """The proven optimum's cost (these graphs are small: the ILP proves its plan) with and without the floors,
    with moves left at their floor (fails without the cut: `moves_floored` 0); under floors of 0 extraction runs
    again, and still finds the same optimum."""
    explored = explore(graph, mesh)
    made, again = [], []
    real_init, real_repriced = FloorPriced.__init__, FloorPriced.repriced

    def init(self, *args, **kwargs):
        made.append(self)
        real_init(self, *args, **kwargs)

    def repriced(self, egraph, selection):
        found = real_repriced(self, egraph, selection)
        again.append(found is not None)
        return found

    monkeypatch.setattr(FloorPriced, "__init__", init)
    monkeypatch.setattr(FloorPriced, "repriced", repriced)
    lazy = explored.extract(model)
    pricing = explored.decoder.pricing
    monkeypatch.setattr(FloorPriced, "made", classmethod(lambda cls, *args: None))
    eager = explored.extract(model)
    assert made and lazy.selection.status == eager.selection.status == "optimal"
    assert lazy.plan.cost == pytest.approx(eager.plan.cost, rel=1e-9)
    assert again[-1] is False
    if isinstance(model, _ZeroFloors):
        assert any(again)
    else:
        assert pricing.moves_floored > 0 and pricing.steps < explored.decoder.pricing.steps


def test_a_price_below_its_floor_is_an_error() -> None:
    """Floors that are no lower bound would make the extractor's bound wrong: repricing a selection that uses a
    floored move says so."""
    explored = explore(_sliced(), Mesh(2, 2))
    floored = FloorPriced(explored.decoder, explored.roots, _HighFloors(load_profile("cpu-gloo")))
    node = next(iter(floored.key_of))
    chosen = Selection({floored.graph.node_class[node]: node}, 0.0, "test", 0.0)
    with pytest.raises(ValueError, match="below its floor"):
        floored.repriced(floored.graph, chosen)


def test_after_its_rounds_every_move_is_priced_and_the_optimum_stands(monkeypatch) -> None:
    """With one round on floors of 0, the second extraction runs on every price: nothing is left at its floor,
    and the plan is the proven optimum of pricing every move (fails if the rounds never end in full pricing)."""
    from tapestry.egraph import extractor_pricing

    monkeypatch.setattr(extractor_pricing, "ROUNDS", 1)
    explored = explore(_sliced(), Mesh(2, 2))
    lazy = explored.extract(_ZeroFloors(load_profile("cpu-gloo")))
    assert explored.decoder.pricing.moves_floored == 0 and explored.decoder.pricing.moves > 0
    monkeypatch.setattr(FloorPriced, "made", classmethod(lambda cls, *args: None))
    eager = explored.extract(_ZeroFloors(load_profile("cpu-gloo")))
    assert lazy.selection.status == eager.selection.status == "optimal"
    assert lazy.plan.cost == pytest.approx(eager.plan.cost, rel=1e-9)
