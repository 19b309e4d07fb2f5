"""One training step of a tiny zoo model, imported, against torch's own step (tests/test_training_zoo.py,
benchmarks/zoo_training.py).

The import's new parameters are compared with torch's float32 step (`error`). The tolerance is float32 rounding,
measured per model: how far torch's float32 step is from its float64 step (`noise`). The imported step rounds
otherwise (other summation orders), but a wrong gradient misses by a share of the whole update, far more. So each
parameter passes within ROUNDINGS times torch's own rounding (plus a few ulps of the weight, which storing the new
weight costs). The rounding is measured with the capture's exact rewrites in force (importer/rewrites.py), on
what the import computes: the same function, and the one whose float64 step is finite where the original's is not
(transformers' Longformer gives NaN gradients in float64: its padded rows' scores are all -inf, finfo.min added
twice).
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tapestry.importer.rewrites import exact_rewrites
from tapestry.training import Training

ROUNDINGS = 8.0  # how many times torch's own float32 rounding a parameter may miss the float64 step by
ULPS = 4  # and how many float32 ulps of the new weight
TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


@dataclass(frozen=True)
class Case:
    """A zoo model trained on `loss(module, *inputs)`: its forward's kwargs tensors passed by position."""

    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    loss: Callable[..., torch.Tensor]


def case_of(module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Case:
    """A zoo family's (module, args, kwargs) as a training case. The loss weighs every floating-point output
    element by a fixed ramp from -1 to 1 (a plain sum would give a layer norm's output no gradient: it sums to a
    constant), so every parameter that reaches an output gets a gradient; those that reach none are frozen."""
    tensor_keys = tuple(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    fixed = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    count = len(args)

    def loss(module: torch.nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
        out = module(*inputs[:count], **dict(zip(tensor_keys, inputs[count:])), **fixed)
        total = torch.zeros(())
        for leaf in torch.utils._pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                ramp = torch.linspace(-1, 1, leaf.numel(), dtype=leaf.dtype).reshape(leaf.shape)
                total = total + (leaf * ramp).sum() / leaf.numel() ** 0.5
        return total

    inputs = (*args, *(kwargs[k] for k in tensor_keys))
    _freeze_unreached(module, loss, inputs)
    return Case(module, inputs, loss)


def _freeze_unreached(module: torch.nn.Module, loss: Callable[..., torch.Tensor], inputs: tuple[Any, ...]) -> None:
    """Parameters the loss never reads (wav2vec2's `masked_spec_embed` with no masking in eval mode) get no
    gradient, and torch.optim leaves them alone: frozen (requires_grad=False), as the import asks of them."""
    reference = copy.deepcopy(module)
    loss(reference, *inputs).backward()
    unread = {path for path, p in reference.named_parameters() if p.requires_grad and p.grad is None}
    for path, p in module.named_parameters():
        if path in unread:
            p.requires_grad_(False)


def torch_step(case: Case, training: Training, dtype: torch.dtype) -> tuple[float, dict[str, np.ndarray]]:
    """torch.optim's step on a copy of the model in `dtype`: (loss, new parameters by path, as float64). Raises
    where torch's step is not finite (its float64 one, for some models)."""
    module = copy.deepcopy(case.module).to(dtype)
    inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in case.inputs)
    options = {"lr": training.lr, "weight_decay": training.weight_decay}
    if training.optimizer == "sgd":
        options.update(momentum=training.momentum, dampening=training.dampening, nesterov=training.nesterov)
    else:
        options.update(betas=training.betas, eps=training.eps, amsgrad=training.amsgrad)
    trained = [p for p in module.parameters() if p.requires_grad]
    optimizer = TORCH[training.optimizer](trained, **options, maximize=training.maximize)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # tensors the model makes itself too (XGLM's `torch.full((), finfo(dtype).min)`)
    try:
        loss = case.loss(module, *inputs)
    finally:
        torch.set_default_dtype(default)
    loss.backward()
    if training.max_norm is not None:
        torch.nn.utils.clip_grad_norm_(trained, training.max_norm)
    optimizer.step()
    new = {path: p.detach().double().numpy() for path, p in module.named_parameters() if p.requires_grad}
    broken = [path for path, value in new.items() if not np.isfinite(value).all()]
    if broken or not np.isfinite(loss.item()):
        raise ValueError(f"torch's {dtype} step of {type(case.module).__name__} is not finite (loss {loss.item()}; "
                         f"{len(broken)} parameters, first {broken[:2]})")
    return loss.item(), new


@dataclass(frozen=True)
class ParameterCheck:
    """One parameter after the step: the import's largest miss of torch's float32 step (`error`), torch's own
    float32 rounding (`noise`: its float32 step's miss of its float64 one), the largest element of torch's update,
    and the bound `error` must stay within."""

    path: str
    error: float
    noise: float
    update: float
    bound: float

    @property
    def passed(self) -> bool:
        return self.error <= self.bound

    @property
    def relative(self) -> float:
        """The miss as a share of the update (inf where the update is 0 and the miss is not)."""
        return self.error / self.update if self.update else (0.0 if self.error == 0 else float("inf"))


def check_step(case: Case, training: Training, ours: Mapping[str, np.ndarray]) -> list[ParameterCheck]:
    """Every trained parameter of `ours` (the import's new parameters by path) against torch's float32 step. A
    parameter missing from `ours`, or one `ours` has and torch does not train, raises. (Not the loss: one number
    gives no measure of its rounding, where a parameter's many elements do; a wrong loss moves the gradients.)"""
    _, want = torch_step(case, training, torch.float32)
    with exact_rewrites(import_modules=False):
        _, single = torch_step(case, training, torch.float32)
        _, exact = torch_step(case, training, torch.float64)
    if set(ours) != set(want):
        raise ValueError(f"the import trains {sorted(set(ours) - set(want))} that torch does not and not "
                         f"{sorted(set(want) - set(ours))} that torch does")
    before = {path: p.detach().double().numpy() for path, p in case.module.named_parameters()}
    return [_check(path, np.asarray(ours[path], np.float64), value, single[path], exact[path], before[path])
            for path, value in want.items()]


def _check(path: str, got: np.ndarray, want: np.ndarray, single: np.ndarray, exact: np.ndarray,
           before: np.ndarray) -> ParameterCheck:
    """`got` against torch's float32 `want`; the bound from torch's rounding (`single` against `exact`)."""
    if got.shape != want.shape:
        raise ValueError(f"{path}: the import's value has shape {got.shape}, torch's {want.shape}")
    error = float(np.abs(got - want).max(initial=0)) if np.isfinite(got).all() else float("inf")
    noise = float(np.abs(single - exact).max(initial=0))
    ulp = float(np.spacing(np.float32(np.abs(want).max(initial=0))))
    return ParameterCheck(path, error, noise, float(np.abs(want - before).max(initial=0)),
                          ROUNDINGS * noise + ULPS * ulp)
