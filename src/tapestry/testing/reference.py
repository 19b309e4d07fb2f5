"""What a parallel training step is checked against: the same steps in torch, on this process."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def torch_losses(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[..., torch.Tensor], batches: Iterable[tuple[torch.Tensor, ...]]) -> list[float]:
    """One optimizer step per batch, `loss_fn(module(batch[0]), *batch[1:])` as `parallelize_step` computes it;
    the loss before each update."""
    losses = []
    for x, *rest in batches:
        optimizer.zero_grad()
        loss = loss_fn(module(x), *rest)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
