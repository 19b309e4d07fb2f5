"""One training step of a tiny zoo model, imported, against torch's own step (tests/test_training_zoo.py,
benchmarks/zoo_training.py).

The import's new parameters are compared with torch's float32 step, element by element. The import rounds
otherwise than torch (other summation orders), so the bound is float32 rounding carried through the optimizer:
the gradient's rounding (torch's float32 gradient's largest miss of its float64 one over the parameter, `G`, on
every row some term reaches) may be ROUNDINGS times larger in the import, and each element's bound is how far
torch's own update moves when its gradient moves that far (the float64 step at gradients shifted by
-ROUNDINGS*G..+G and -G..+ROUNDINGS*G). SGD's update moves by lr times the shift; Adam's first step,
lr * g / (|g| + eps), by lr * eps / (|g| + eps)**2 times it: thousands of times more where |g| is a few eps,
nothing where |g| >> eps. Each element's step is a monotone function of its own gradient (SGD, momentum, Adam and
AdamW from fresh state), so those shifted steps bound it. To that come the update's own float32 arithmetic
(ROUNDINGS times torch's, measured) and a few ulps of the new weight (storing it). A wrong gradient misses by far
more: a swapped sign, or a share of the parameter's gradient norm (tests/test_training_zoo.py's mutants). The
rounding is measured with the capture's exact rewrites in force (importer/rewrites.py), on what the import
computes: the same function, and the one whose float64 step is finite where the original's is not (transformers'
Longformer gives NaN gradients in float64: its padded rows' scores are all -inf, finfo.min added twice).
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

ROUNDINGS = 8.0  # how many times torch's own float32 rounding (of a gradient, of the update) the import's may be
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


def torch_gradients(case: Case, dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and every trained parameter's gradient (by path) of a copy of the model in `dtype`."""
    module = copy.deepcopy(case.module).to(dtype)
    inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in case.inputs)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # tensors the model makes itself too (XGLM's `torch.full((), finfo(dtype).min)`)
    try:
        loss = case.loss(module, *inputs)
    finally:
        torch.set_default_dtype(default)
    loss.backward()
    gradients = {path: p.grad for path, p in module.named_parameters() if p.requires_grad}
    missing = [path for path, grad in gradients.items() if grad is None]
    if missing:
        raise ValueError(f"{type(case.module).__name__}: trained parameters {missing[:3]} got no gradient")
    return loss.item(), gradients


def optimizer_step(case: Case, training: Training, gradients: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """torch.optim's first step from the model's parameters with these gradients (in their dtype): the new
    parameters by path, as float64. Raises where one is not finite."""
    dtype = next(iter(gradients.values())).dtype
    module = copy.deepcopy(case.module).to(dtype)
    trained = {path: p for path, p in module.named_parameters() if p.requires_grad}
    if set(trained) != set(gradients):
        raise ValueError(f"optimizer_step: gradients for {sorted(set(gradients) ^ set(trained))[:3]} do not match "
                         f"the trained parameters of {type(case.module).__name__}")
    for path, p in trained.items():
        p.grad = gradients[path].to(dtype).clone()
    options = {"lr": training.lr, "weight_decay": training.weight_decay}
    if training.optimizer == "sgd":
        options.update(momentum=training.momentum, dampening=training.dampening, nesterov=training.nesterov)
    else:
        options.update(betas=training.betas, eps=training.eps, amsgrad=training.amsgrad)
    optimizer = TORCH[training.optimizer](list(trained.values()), **options, maximize=training.maximize)
    if training.max_norm is not None:
        torch.nn.utils.clip_grad_norm_(list(trained.values()), training.max_norm)
    optimizer.step()
    new = {path: p.detach().double().numpy() for path, p in trained.items()}
    broken = [path for path, value in new.items() if not np.isfinite(value).all()]
    if broken:
        raise ValueError(f"torch's {dtype} step of {type(case.module).__name__} is not finite ({len(broken)} "
                         f"parameters, first {broken[:2]})")
    return new


def torch_step(case: Case, training: Training, dtype: torch.dtype) -> tuple[float, dict[str, np.ndarray]]:
    """torch.optim's step on a copy of the model in `dtype`: (loss, new parameters by path, as float64). Raises
    where torch's step is not finite (its float64 one, for some models)."""
    loss, gradients = torch_gradients(case, dtype)
    if not np.isfinite(loss):
        raise ValueError(f"torch's {dtype} step of {type(case.module).__name__} is not finite (loss {loss})")
    return loss, optimizer_step(case, training, gradients)


@dataclass(frozen=True)
class ParameterCheck:
    """One parameter after the step: the import's largest miss of torch's float32 step (`error`), the largest
    element of torch's update, and the element worst against its own bound: its miss over its bound (`ratio`,
    <= 1 passes) and that bound."""

    path: str
    error: float
    update: float
    ratio: float
    bound: float

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0

    @property
    def relative(self) -> float:
        """The miss as a share of the update (inf where the update is 0 and the miss is not)."""
        return self.error / self.update if self.update else (0.0 if self.error == 0 else float("inf"))


@dataclass(frozen=True)
class Reference:
    """torch's float32 step of a case (`want`) and each element's bound on another float32 step's miss of it."""

    before: dict[str, np.ndarray]
    want: dict[str, np.ndarray]
    bounds: dict[str, np.ndarray]


def reference(case: Case, training: Training) -> Reference:
    """torch's float32 step and its elementwise bounds (the module docstring says how). The gradient's rounding
    `G` is torch float32's largest miss of float64 over the parameter, with the capture's rewrites and without,
    and at least an ulp of the gradient the optimizer reads (stored in float32); 0 on rows no term reaches."""
    if training.max_norm is not None:
        raise ValueError("check_step bounds each element's step as a function of its own gradient; max_norm's "
                         "clipping couples every gradient, which the bound does not carry: check without it")
    _, plain = torch_gradients(case, torch.float32)
    want = optimizer_step(case, training, plain)
    with exact_rewrites(import_modules=False):
        _, single = torch_gradients(case, torch.float32)
        _, exact = torch_gradients(case, torch.float64)
    before = {path: p.detach().double().numpy() for path, p in case.module.named_parameters()}
    rounding = {path: gradient_rounding(g, (plain[path], single[path]), before[path], training.weight_decay)
                for path, g in exact.items()}

    shifted = {by: optimizer_step(case, training, {path: g + by * rounding[path] for path, g in exact.items()})
               for by in (ROUNDINGS, 1.0, -1.0, -ROUNDINGS)}
    arithmetic = optimizer_step(case, training, {path: g.float() for path, g in exact.items()})
    exact_step = optimizer_step(case, training, exact)
    bounds = {}
    for path, value in want.items():  # the import's gradient up to ROUNDINGS * G off, torch's up to G, either way
        spread = np.maximum(np.abs(shifted[ROUNDINGS][path] - shifted[-1.0][path]),
                            np.abs(shifted[1.0][path] - shifted[-ROUNDINGS][path]))
        own = float(np.abs(arithmetic[path] - exact_step[path]).max(initial=0))
        ulp = float(np.spacing(np.float32(np.abs(value).max(initial=0))))
        bounds[path] = spread + ROUNDINGS * own + ULPS * ulp
    return Reference(before, want, bounds)


def gradient_rounding(exact: torch.Tensor, singles: tuple[torch.Tensor, ...], before: np.ndarray,
                       weight_decay: float) -> torch.Tensor:
    """How far each element of a float32 gradient of this parameter may be from the float64 one: the largest
    miss over the parameter, as torch rounds it, where any term reaches the element; none on a row (the slice
    along the last dimension) whose gradient is exactly zero in float64 and in each float32: no term reaches it
    (an embedding's unused rows, a masked position), where a wrong gradient would move Adam's step by up to lr,
    unseen under the parameter's rounding. A row, not an element: a gradient that is rounding alone (an attention
    key's bias, which softmax ignores) can round to exactly zero in torch's summation order and not in another."""
    if not exact.numel():
        return torch.zeros_like(exact)
    miss = max(float((s.double() - exact).abs().max()) for s in singles)
    read = float(exact.abs().max()) + weight_decay * float(np.abs(before).max(initial=0))
    nonzero = (exact != 0) | torch.stack([s != 0 for s in singles]).any(0)
    reached = nonzero.any(-1, keepdim=True).expand_as(exact) if exact.dim() else nonzero
    return max(miss, float(np.spacing(np.float32(read)))) * reached.double()


def check_step(case: Case, training: Training, ours: Mapping[str, np.ndarray],
               against: Reference | None = None) -> list[ParameterCheck]:
    """Every trained parameter of `ours` (the import's new parameters by path) against torch's float32 step,
    element by element within its bound (`against`: `reference(case, training)` unless given). A parameter
    missing from `ours`, or one `ours` has and torch does not train, raises. (Not the loss: a wrong loss moves
    the gradients.)"""
    against = against or reference(case, training)
    if set(ours) != set(against.want):
        raise ValueError(f"the import trains {sorted(set(ours) - set(against.want))} that torch does not and not "
                         f"{sorted(set(against.want) - set(ours))} that torch does")
    return [_check(path, np.asarray(ours[path], np.float64), want, against.bounds[path], against.before[path])
            for path, want in against.want.items()]


def _check(path: str, got: np.ndarray, want: np.ndarray, bound: np.ndarray, before: np.ndarray) -> ParameterCheck:
    if got.shape != want.shape:
        raise ValueError(f"{path}: the import's value has shape {got.shape}, torch's {want.shape}")
    update = float(np.abs(want - before).max(initial=0))
    if not np.isfinite(got).all():
        return ParameterCheck(path, float("inf"), update, float("inf"), float(bound.min(initial=0)))
    miss = np.abs(got - want)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(miss == 0, 0.0, miss / bound)
    worst = int(ratios.argmax()) if ratios.size else 0
    return ParameterCheck(path, float(miss.max(initial=0)), update, float(ratios.max(initial=0)),
                          float(bound.flat[worst]) if bound.size else 0.0)
