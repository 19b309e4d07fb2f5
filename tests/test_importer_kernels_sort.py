"""An unstable sort (torch's default, or stable=False), whose order of ties torch leaves to its algorithm: the
stable kernel where the program reads nothing of that order (only the values; the indices only by scatters of one
value along the sorted dim), opaque where it reads the indices; each matching eager on rows of many ties."""
from __future__ import annotations

import pytest
import torch
from test_importer_kernels import assert_same, eager, imported_and_planned_on_four

from tapestry.evaluator import evaluate
from tapestry.importer import from_torch

X = torch.randint(0, 3, (4, 24), generator=torch.Generator().manual_seed(0)).float()  # 24 > 16: CPU's vector sort


def test_cpu_torchs_unstable_sort_orders_the_tests_ties_otherwise_than_the_stable_kernel():
    """What makes the tests below able to fail: a kernel that read the order of ties would differ from eager."""
    stable = torch.sort(X, stable=True).indices
    assert not torch.equal(torch.sort(X).indices, stable)
    assert not torch.equal(torch.sort(X, stable=False).indices, stable)
    assert not torch.equal(torch.argsort(X, descending=True), torch.argsort(X, descending=True, stable=True))


class UnreadTies(torch.nn.Module):
    """The values of a default and of a stable=False sort; the indices only as a mask of a scatter along the dim."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mask = torch.zeros_like(x).scatter(1, torch.sort(x, dim=1, stable=False).indices, 1.0)
        return torch.sort(x).values * 2, torch.sort(x, dim=-1, descending=True, stable=False)[0], x * mask


def test_an_unstable_sort_whose_ties_order_nothing_reads_is_the_stable_kernel_whole_and_on_four_devices():
    imp = imported_and_planned_on_four(UnreadTies(), (X,), sharded="topk")
    assert sum(imp.coverage["aten.sort.default"].values()) + sum(imp.coverage["aten.sort.stable"].values()) == 3


class ReadTies(torch.nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return {"sort's indices": lambda: torch.sort(x, dim=-1)[1].float(),
                "stable=False indices": lambda: torch.sort(x, stable=False).indices * 2,
                "argsort": lambda: torch.argsort(x, descending=True),
                "gathered by the indices": lambda: torch.gather(x.flip(1), 1, torch.sort(x)[1])}[self.form]()


@pytest.mark.parametrize("form", ["sort's indices", "stable=False indices", "argsort", "gathered by the indices"])
def test_an_unstable_sort_whose_indices_are_read_stays_opaque_and_matches_eager(form):
    imp = from_torch(ReadTies(form), (X,), verbose=False)
    op = "aten.argsort.default" if form == "argsort" else next(o for o in imp.opaque if o.startswith("aten.sort"))
    assert op in imp.opaque
    assert any("unstable sort" in why for why in imp.translation.declined[op])
    assert_same(imp.outputs(evaluate(imp.graph, imp.inputs(X))), eager(ReadTies(form), (X,)))


def test_a_stable_sorts_indices_are_the_kernel():
    class Stable(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.sort(x, stable=True).indices, torch.argsort(x, descending=True, stable=True)

    imp = from_torch(Stable(), (X,), verbose=False)
    assert not imp.opaque
    assert_same(imp.outputs(evaluate(imp.graph, imp.inputs(X))), eager(Stable(), (X,)))
