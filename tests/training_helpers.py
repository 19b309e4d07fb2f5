"""Builders shared by the training-strategy tests: one Adam step of linear -> relu -> linear, and the names and
cost model its hand-built plans are made and priced with."""
from __future__ import annotations

import torch

import tapestry
from tapestry.cost import DefaultCostModel, load_profile

GPU = DefaultCostModel(load_profile("gpu-h100-nccl"))
ARGUMENTS = ("arg0", "arg1")  # the step's batch inputs (x, y), split by data parallel and ZeRO-3
HIDDEN = {"0.weight": 0, "0.bias": 0, "2.weight": 1}  # Megatron: column-parallel, then row-parallel


def mse(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(module(x), y)


def adam_step(dim: int, hidden: int, batch: int) -> tuple[tapestry.TorchImport, int]:
    """An Adam step of linear(dim, hidden) -> relu -> linear(hidden, dim) at `batch` rows, and its parameter
    count (seeded: the same weights and inputs every call)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim))
    args = (torch.randn(batch, dim), torch.randn(batch, dim))
    imported = tapestry.from_torch(model, args, training=tapestry.Training(loss=mse, optimizer="adam"), verbose=False)
    return imported, sum(p.numel() for p in model.parameters())
