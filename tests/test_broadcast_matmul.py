"""A matmul of a broadcast operand (XLNet's positional embedding, expanded over the batch, times a projection):
the importer keeps a constant's broadcast as an `expand` of its distinct cells, and substitution.egg's rule lets the
plan run the smaller matmul and expand its result, the batch times fewer multiply-adds."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_importer_kernels import assert_same, eager

import tapestry
from tapestry.evaluator import evaluate
from tapestry.graph import Graph
from tapestry.importer import from_torch
from tapestry.importer import translate
from tapestry.importer.translate import _distinct_cells
from tapestry.plan import Compute
from tapestry.plan.simulate import simulate


def broadcast_matmul() -> Graph:
    g = Graph()
    x, w = g.input("x", (16, 1, 64)), g.input("w", (64, 64))
    g.output("y", g.relu(g.matmul(g.expand(x, shape=(16, 32, 64)), w)))
    return g


def test_a_matmul_of_an_expanded_input_runs_as_the_smaller_matmul_expanded_on_one_and_four_devices():
    graph = broadcast_matmul()
    inputs = tapestry.random_inputs(graph)
    for mesh in (tapestry.Mesh(1), tapestry.Mesh(4)):
        plan = tapestry.optimize(graph, mesh).plan
        matmuls = [s for s in plan.steps if isinstance(s, Compute) and s.kernel == "matmul"]
        assert [s.input_shapes[0] for s in matmuls] == [(16, 1, 64)], plan
        np.testing.assert_allclose(simulate(plan, inputs)["y"], evaluate(graph, inputs)["y"], rtol=1e-5, atol=1e-5)


class PositionalProjection(torch.nn.Module):
    """XLNet's `einsum("ibh,hnd->ibnd", pos_emb, r)` with pos_emb a constant expanded over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.r = torch.nn.Parameter(torch.randn(8, 2, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        position = torch.arange(6, 0, -1.0)[:, None] * torch.arange(1, 9.0)[None, :]
        pos_emb = torch.cat([position.sin(), position.cos()], -1)[:, None, :8].expand(-1, x.shape[1], -1)
        return torch.einsum("ibh,hnd->ibnd", pos_emb, self.r) + x[..., None, None]


def test_a_constant_broadcast_over_the_batch_is_imported_as_its_distinct_cells_expanded_and_matches_eager():
    x = torch.randn(6, 3)
    imp = from_torch(PositionalProjection(), (x,), verbose=False)
    expands = [op for op in imp.graph.ops if op.op == "expand" and op.args[0] in imp.graph.constants]
    assert [imp.graph.constants[op.args[0]].shape for op in expands] == [(6, 1, 8)]
    assert_same(imp.outputs(evaluate(imp.graph, imp.inputs(x))), eager(PositionalProjection(), (x,)))


def test_only_dims_alike_bit_for_bit_are_cut():
    """-0.0 equals 0.0 and NaN never equals itself: neither is a repeated cell."""
    signed = torch.tensor([[0.0, 1.0], [-0.0, 1.0]])
    assert _distinct_cells(signed).shape == (2, 2)
    assert _distinct_cells(torch.tensor([[float("nan"), 1.0]] * 3)).shape == (3, 2)
    assert torch.equal(_distinct_cells(torch.tensor([[2.0, 5.0]] * 4)), torch.tensor([[2.0, 5.0]]))


def test_integer_constants_are_left_whole_as_no_rule_reads_their_expand_and_bool_masks_are_cut():
    """The positions a causal mask compares (arange over the batch): their expands only cost the search (the 70B
    step on 8x8x8, docs/benchmarks.md); a mask repeated over the batch is still one copy expanded."""
    for tensor in (torch.arange(6).expand(4, 6).contiguous(), torch.arange(6, dtype=torch.int32).expand(4, 6) + 0):
        assert _distinct_cells(tensor) is tensor
    assert _distinct_cells(torch.ones(3, 5, dtype=torch.bool)).shape == (1, 1)


class CausalIds(torch.nn.Module):
    """A causal mask from positions repeated over the batch, folded into constants by the capture."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        return x.masked_fill(positions[:, None, :] > positions[:, :, None], 0.0)


def test_a_causal_masks_positions_are_imported_whole_and_match_eager(monkeypatch: pytest.MonkeyPatch):
    """The mask itself too large to fold (as a 2048-token sequence's is): the positions are what is folded."""
    monkeypatch.setattr(translate, "FOLD_CELLS", 8)
    x = torch.randn(2, 4, 4)
    imp = from_torch(CausalIds(), (x,), verbose=False)
    assert any(op.op == "gt" for op in imp.graph.ops)
    integer = {name: value.shape for name, value in imp.graph.constants.items() if value.dtype.kind in "iu"}
    assert not any(op.op == "expand" and op.args[0] in integer for op in imp.graph.ops), integer
    assert_same(imp.outputs(evaluate(imp.graph, imp.inputs(x))), eager(CausalIds(), (x,)))


def test_a_constant_without_data_is_left_whole_for_the_importer_to_name():
    for tensor in (torch.empty(4, 3, device="meta"), torch.empty(4, 3, device="meta").expand(2, 4, 3)):
        assert _distinct_cells(tensor) is tensor
