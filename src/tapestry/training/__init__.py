"""Training steps as one program: loss, every parameter's gradient and the optimizer update.

    imported = tapestry.from_torch(model, (x, y), training=tapestry.Training(loss=fn, optimizer="adamw", lr=1e-3))
    values = imported.outputs(tapestry.evaluate(imported.graph, imported.inputs(x, y, lr=schedule(0))))
    values["loss"], values["parameters"]["0.weight"], values["optimizer_state"]["m"]["0.weight"]

How the backward is captured, and why: `make_fx` traces one function that calls the module (through
`torch.func.functional_call`), `torch.autograd.grad`, and the update, with torch's core ATen decompositions
(EasyDist's route; autoparallel traces the same joint graph through AOTAutograd). The decompositions turn the
backward ops of layer norm, softmax, gelu and the losses into the elementwise ops and reductions Tapestry
already shards, so backward needs no kernels of its own, and a weight gradient is a matmul that reduces over
the batch: split by batch, its result is a partial sum, and the e-graph's all-reduce or reduce-scatter is data
parallelism's gradient reduction. torch.export cannot capture `torch.autograd.grad` inside `forward`.

The optimizers are torch.optim's SGD, Adam and AdamW, computed as torch computes them (the per-tensor,
non-foreach path), traced into the step. The learning rate (`LR`) and the step count are inputs of the graph,
so a schedule changes them per call without re-importing or re-planning.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

OPTIMIZERS = ("sgd", "adam", "adamw")
ADAM_SLOTS = ("m", "v")  # Adam's state per parameter: first and second moments
STEP = "adam.step"
LR = "lr"  # the learning rate: a float64 scalar input of every training step (torch.optim's Python float)
TORCH_OPTIMIZERS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
# each state slot by the name torch.optim's state_dict gives it
TORCH_STATE = {"m": "exp_avg", "v": "exp_avg_sq", "max_v": "max_exp_avg_sq", "momentum": "momentum_buffer"}
# torch.optim's switches among implementations of the same update: accepted and ignored
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def state_name(slot: str, path: str, family: str = "adam") -> str:
    """The graph input of optimizer state `slot` of parameter `path` (`adam.m.0.weight`, `sgd.momentum.0.bias`)."""
    return f"{family}.{slot}.{path}"


def updated(name: str) -> str:
    """The output that carries input `name` after the step."""
    return f"new.{name}"


@dataclass(frozen=True)
class Training:
    """One optimizer step: `loss(module, *args)` returns the scalar loss; the update is torch.optim's `optimizer`
    with these hyperparameters (torch's names and defaults; weight_decay=None is the optimizer's own default:
    0.01 for AdamW, 0 otherwise). `lr` is the default of the step's learning-rate input. `max_norm` clips the
    gradients by their global 2-norm first, as torch.nn.utils.clip_grad_norm_ does."""

    loss: Callable[..., torch.Tensor]
    optimizer: str = "sgd"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)  # adam, adamw
    eps: float = 1e-8  # adam, adamw
    weight_decay: float | None = None
    amsgrad: bool = False  # adam, adamw
    momentum: float = 0.0  # sgd
    dampening: float = 0.0  # sgd
    nesterov: bool = False  # sgd
    maximize: bool = False
    max_norm: float | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", 0.01 if self.optimizer == "adamw" else 0.0)
        object.__setattr__(self, "lr", float(self.lr))
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        for name in ("lr", "eps", "weight_decay", "momentum"):
            if getattr(self, name) < 0:
                raise ValueError(f"Training: invalid {name} {getattr(self, name)} (must be >= 0, as torch.optim)")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"Training: invalid betas {self.betas} (each in [0, 1), as torch.optim)")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Training: nesterov momentum requires a momentum and zero dampening (as torch.optim.SGD)")
        if self.max_norm is not None and self.max_norm <= 0:
            raise ValueError(f"Training: max_norm must be positive, got {self.max_norm}")
        sgd_only = {"momentum": 0.0, "dampening": 0.0, "nesterov": False}
        adam_only = {"betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False}
        foreign = sgd_only if self.optimizer != "sgd" else adam_only
        for name, default in foreign.items():
            if getattr(self, name) != default:
                raise ValueError(f"Training: {name} is not an option of {self.optimizer}")

    @classmethod
    def from_torch_optimizer(cls, optimizer: type[torch.optim.Optimizer], loss: Callable[..., torch.Tensor],
                             max_norm: float | None = None, **options: Any) -> Training:
        """`Training.from_torch_optimizer(torch.optim.AdamW, loss, lr=1e-3, weight_decay=0.01)`: the class and
        keyword arguments as torch.optim takes them, torch's defaults for the rest."""
        if optimizer not in TORCH_OPTIMIZERS:
            known = ", ".join(f"torch.optim.{c.__name__}" for c in TORCH_OPTIMIZERS)
            raise ValueError(f"optimizer {getattr(optimizer, '__name__', optimizer)!r} is not one of {known}")
        name = TORCH_OPTIMIZERS[optimizer]
        try:
            bound = inspect.signature(optimizer).bind(None, **options)
        except TypeError as err:
            raise ValueError(f"torch.optim.{optimizer.__name__}: {err}") from None
        bound.apply_defaults()
        given = {k: v for k, v in bound.arguments.items() if k != "params"}
        if given.pop("decoupled_weight_decay", False):  # torch.optim.Adam(decoupled_weight_decay=True) is AdamW
            name = "adamw"
        for switch in IMPLEMENTATION:
            given.pop(switch, None)
        lr = given.pop("lr")
        fields = {k: (float(v) if k in ("momentum", "dampening", "eps", "weight_decay") else v)
                  for k, v in given.items()}
        return cls(loss=loss, optimizer=name, lr=float(lr), max_norm=max_norm, **fields)

    @property
    def family(self) -> str:
        """The prefix of the optimizer state's input names: Adam and AdamW keep the same state."""
        return "sgd" if self.optimizer == "sgd" else "adam"

    @property
    def slots(self) -> tuple[str, ...]:
        """Optimizer state per parameter: Adam's moments m and v (and the running maximum of v under amsgrad),
        SGD's momentum buffer (none without momentum)."""
        if self.optimizer == "sgd":
            return ("momentum",) if self.momentum else ()
        return (*ADAM_SLOTS, "max_v") if self.amsgrad else ADAM_SLOTS

    @property
    def step_input(self) -> str | None:
        """The step count's input (a float32 scalar, steps taken before this one), for optimizers that keep state."""
        return f"{self.family}.step" if self.slots else None

    def update(self, params: list[torch.Tensor], grads: list[torch.Tensor], state: Mapping[str, list[torch.Tensor]],
               step: torch.Tensor | None, lr: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]],
                                                                     torch.Tensor | None]:
        """New parameters, state and step count, in torch ops (traced with the rest): torch.optim's update,
        for the learning rate `lr` and the count `step` (both tensors, inputs of the step)."""
        if self.max_norm is not None:
            grads = clip_grad_norm(grads, self.max_norm)
        if self.maximize:
            grads = [-g for g in grads]
        if self.optimizer == "sgd":
            return self._sgd(params, grads, state, step, lr)
        return self._adam(params, grads, state, step, lr)

    def _sgd(self, params: list[torch.Tensor], grads: list[torch.Tensor], state: Mapping[str, list[torch.Tensor]],
             step: torch.Tensor | None, lr: torch.Tensor) -> tuple[list[torch.Tensor], dict, torch.Tensor | None]:
        lr = lr.to(torch.float32)
        if self.weight_decay:
            grads = [g + self.weight_decay * p for g, p in zip(grads, params)]
        if not self.momentum:
            return [p - lr * g for p, g in zip(params, grads)], {}, None
        # torch sets the buffer to the gradient at the first step, whatever the dampening: the buffer is zero
        # then, so the gradient's weight is 1 at step 0 and 1 - dampening after
        weight = 1 - self.dampening * torch.clamp(step, max=1.0)
        buffers = [self.momentum * b + weight * g for b, g in zip(state["momentum"], grads)]
        directions = [g + self.momentum * b for g, b in zip(grads, buffers)] if self.nesterov else buffers
        return [p - lr * d for p, d in zip(params, directions)], {"momentum": buffers}, step + 1

    def _adam(self, params: list[torch.Tensor], grads: list[torch.Tensor], state: Mapping[str, list[torch.Tensor]],
              step: torch.Tensor, lr: torch.Tensor) -> tuple[list[torch.Tensor], dict, torch.Tensor]:
        """torch.optim.Adam's per-tensor update, rounded as torch rounds it where it counts. Adam moves an element
        by about lr whatever its gradient's size, so a parameter one float32 ulp off, made at every step, is
        amplified by ReLU units on the edge of firing into loss differences of 1e-4 over 50 steps
        (docs/training.md). So the scalars (1 - lr * weight_decay, lr / bias_correction1, the square root of
        bias_correction2) are computed in float64 and rounded to float32 once, as torch computes them from its
        Python floats, and the last operation is addcdiv_'s `p + (-step_size * m) / denom`. The moments are
        torch's formulas in float32 (torch's CPU lerp_ and addcmul_ fuse a multiply-add, so m and v may differ in
        the last bit): that moves the update by ~1e-7 of lr, far below a parameter's ulp, like the reassociated
        gradient sums of any parallel plan."""
        b1, b2 = self.betas
        lr64, step = lr.to(torch.float64), step + 1
        step64 = step.to(torch.float64)
        if self.optimizer == "adamw":
            params = [p * (1 - lr64 * self.weight_decay).to(torch.float32) for p in params]
        elif self.weight_decay:
            grads = [g + _float32(self.weight_decay) * p for g, p in zip(grads, params)]
        m = [m + _float32(1 - b1) * (g - m) for m, g in zip(state["m"], grads)]  # m.lerp_(g, 1 - b1)
        v = [v * _float32(b2) + _float32(1 - b2) * g * g for v, g in zip(state["v"], grads)]  # addcmul_
        new_state = {"m": m, "v": v}
        if self.amsgrad:
            v = new_state["max_v"] = [torch.maximum(top, v_) for top, v_ in zip(state["max_v"], v)]
        step_size = (-lr64 / (1 - b1**step64)).to(torch.float32)
        correction2_sqrt = torch.sqrt(1 - b2**step64).to(torch.float32)
        eps = _float32(self.eps)
        # p.addcdiv_(m, denom, value=-step_size): p + (value * m) / denom
        new = [p + (step_size * m_) / (torch.sqrt(v_) / correction2_sqrt + eps) for p, m_, v_ in zip(params, m, v)]
        return new, new_state, step


def _float32(value: float) -> float:
    """A Python float rounded to float32 once, as torch's kernels round a Python scalar operand."""
    return float(np.float32(value))


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """torch.nn.utils.clip_grad_norm_ (2-norm over all gradients together; 1e-6 added, as torch does)."""
    total = torch.sqrt(sum((g * g).sum() for g in grads))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return [g * scale for g in grads]
