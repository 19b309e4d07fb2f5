"""Training steps as one program: loss, every parameter's gradient and the optimizer update.

    imported = tapestry.from_torch(model, (x, y), training=tapestry.Training(loss=fn, optimizer="adam", lr=1e-3))
    values = imported.outputs(tapestry.evaluate(imported.graph, imported.inputs(x, y)))
    values["loss"], values["parameters"]["0.weight"], values["optimizer_state"]["m"]["0.weight"]

How the backward is captured, and why: `make_fx` traces one function that calls the module (through
`torch.func.functional_call`), `torch.autograd.grad`, and the update, with torch's core ATen decompositions
(EasyDist's route; autoparallel traces the same joint graph through AOTAutograd). The decompositions turn the
backward ops of layer norm, softmax, gelu and the losses into the elementwise ops and reductions Tapestry
already shards, so backward needs no kernels of its own, and a weight gradient is a matmul that reduces over
the batch: split by batch, its result is a partial sum, and the e-graph's all-reduce or reduce-scatter is data
parallelism's gradient reduction. torch.export cannot capture `torch.autograd.grad` inside `forward`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

OPTIMIZERS = ("sgd", "adam")
ADAM_SLOTS = ("m", "v")  # Adam's state per parameter: first and second moments
STEP = "adam.step"


def state_name(slot: str, path: str) -> str:
    return f"adam.{slot}.{path}"


def updated(name: str) -> str:
    """The output that carries input `name` after the step."""
    return f"new.{name}"


@dataclass(frozen=True)
class Training:
    """One optimizer step: `loss(module, *args)` returns the scalar loss."""

    loss: Callable[..., torch.Tensor]
    optimizer: str = "sgd"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)  # adam
    eps: float = 1e-8  # adam

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")

    @property
    def slots(self) -> tuple[str, ...]:
        """Optimizer state per parameter (Adam's moments m and v; SGD keeps none)."""
        return ADAM_SLOTS if self.optimizer == "adam" else ()

    def update(self, params: list[torch.Tensor], grads: list[torch.Tensor], state: Mapping[str, list[torch.Tensor]],
               step: torch.Tensor | None) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]], Any]:
        """New parameters, state and step, in torch ops (traced with the rest). Adam is torch.optim.Adam's
        update, bias corrections included."""
        if self.optimizer == "sgd":
            return [p - self.lr * g for p, g in zip(params, grads)], {}, None
        b1, b2 = self.betas
        step = step + 1
        m = [b1 * m + (1 - b1) * g for m, g in zip(state["m"], grads)]
        v = [b2 * v + (1 - b2) * g * g for v, g in zip(state["v"], grads)]
        correction1, correction2 = 1 - b1**step, 1 - b2**step
        new = [p - (self.lr / correction1) * m_ / (torch.sqrt(v_) / torch.sqrt(correction2) + self.eps)
               for p, m_, v_ in zip(params, m, v)]
        return new, {"m": m, "v": v}, step
