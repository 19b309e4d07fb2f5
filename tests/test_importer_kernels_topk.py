"""topk(sorted=False), whose order torch leaves unspecified: the sorted kernel where the program reads nothing of
that order (k=1; only its indices read, by scatters of one value along its dim), opaque where it reads the order;
DeepSeek-V3's MoE block, whose router chooses its experts unsorted, imported through its rewrite (its expert choice
sorted, which its sum over the choices allows) with no op opaque, and sharded on four devices like eager."""
from __future__ import annotations

import pytest
import torch
from test_importer_kernels import assert_same, eager, imported_and_planned_on_four

from tapestry.evaluator import evaluate
from tapestry.importer import from_torch
from tapestry.importer.errors import TorchImportError
from tapestry.importer.rewrites import exact_rewrites

transformers = pytest.importorskip("transformers")
deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

X = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))


def test_cpu_torchs_unsorted_order_is_not_the_sorted_one_on_the_tests_input():
    """What makes the tests below able to fail: a kernel that read the order would differ from eager here."""
    assert not torch.equal(torch.topk(X, 3, sorted=False)[1], torch.topk(X, 3)[1])


class UnreadOrder(torch.nn.Module):
    """k=1's value and position; a mask of the top 3 by scatter_ (DeepSeek-V3's group choice); the mask of the
    bottom 2 by a functional scatter of a negative dim."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        best = torch.topk(x, 1, dim=-1, sorted=False)
        top = torch.zeros_like(x).scatter_(1, torch.topk(x, 3, dim=1, sorted=False)[1], 1.0)
        bottom = torch.scatter(torch.ones_like(x), -1, torch.topk(x, 2, largest=False, sorted=False).indices, 0.5)
        return best.values, best.indices, x * top, x * bottom


def test_an_unsorted_topk_whose_order_nothing_reads_is_the_sorted_kernel_whole_and_on_four_devices():
    imp = imported_and_planned_on_four(UnreadOrder(), (X,), sharded="topk")
    assert sum(imp.coverage["aten.topk.default"].values()) == 3


class ReadOrder(torch.nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, indices = torch.topk(x, 3, sorted=False)
        return {"values": lambda: values,
                "gathered by the indices": lambda: torch.gather(x, 1, indices),
                "indices out": lambda: indices.float(),
                "scattered along another dim": lambda: torch.zeros(8, 8).scatter(0, indices, 1.0),
                "scattered and read": lambda: torch.zeros_like(x).scatter(1, indices, 1.0) + indices.sum()}[self.form]()


@pytest.mark.parametrize("form", ["values", "gathered by the indices", "indices out", "scattered along another dim",
                                  "scattered and read"])
def test_an_unsorted_topk_whose_order_is_read_stays_opaque_and_matches_eager(form):
    imp = from_torch(ReadOrder(form), (X,), verbose=False)
    assert "aten.topk.default" in imp.opaque
    assert any("sorted=False with its order read" in why for why in imp.translation.declined["aten.topk.default"])
    assert_same(imp.outputs(evaluate(imp.graph, imp.inputs(X))), eager(ReadOrder(form), (X,)))


def deepseek_moe(choices: int, groups: int, groups_chosen: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(hidden_size=16, moe_intermediate_size=16, n_routed_experts=8,
                                           num_experts_per_tok=choices, n_shared_experts=1, n_group=groups,
                                           topk_group=groups_chosen)
    module = deepseek.DeepseekV3MoE(config).eval()
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    torch.nn.init.normal_(module.gate.e_score_correction_bias, std=0.1)
    return module


ROUTERS = [(2, 1, 1), (3, 2, 1), (3, 4, 2)]  # (experts per token, groups, groups chosen)


@pytest.mark.parametrize("router", ROUTERS, ids=[f"top {k}, {g} of {n} groups" for k, n, g in ROUTERS])
def test_deepseek_v3s_moe_under_its_rewrite_computes_what_eager_computes(router):
    """The rewrite (expert choice sorted, experts by block) against transformers' own forward, whose expert
    choice is unsorted: the same, up to the order of a k-term float sum."""
    module, hidden = deepseek_moe(*router), torch.randn(2, 5, 16)
    with torch.no_grad():
        want = module(hidden)
        with exact_rewrites():
            got = module(hidden)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_deepseek_v3s_moe_imports_without_an_opaque_op_and_its_plan_on_four_devices_matches_eager():
    """Its two unsorted topks: the group choice by the converter (k=1 here, a scatter's mask in general), the expert
    choice sorted by the rewrite; so its plan splits."""
    module = deepseek_moe(2, 2, 1)
    imported_and_planned_on_four(module, (torch.randn(4, 4, 16),), sharded="grouped_mm")


def test_a_deepseek_v3_router_with_its_own_forward_is_refused_naming_it():
    module = deepseek_moe(2, 1, 1)

    class OwnRouter(deepseek.DeepseekV3TopkRouter):
        def forward(self, hidden_states):  # noqa: ANN001, ANN202
            return super().forward(hidden_states)

    module.gate.__class__ = OwnRouter
    with pytest.raises(TorchImportError, match="OwnRouter with its own forward"):
        from_torch(module, (torch.randn(2, 3, 16),), verbose=False)
