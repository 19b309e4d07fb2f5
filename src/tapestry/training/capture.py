"""Trace one training step (forward, backward, update) into an ATen graph and translate it."""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel

from tapestry.importer.capture import TorchImportError
from tapestry.importer.translate import Placeholder, Translation, translate
from tapestry.training import STEP, Training, state_name, updated


class _LossOf(torch.nn.Module):
    """`loss(module, *args)` as a module, so that functional_call swaps the traced parameters in."""

    def __init__(self, module: torch.nn.Module, loss: Any) -> None:
        super().__init__()
        self.module, self.loss = module, loss

    def forward(self, *args: Any) -> torch.Tensor:
        return self.loss(self.module, *args)


def capture(module: torch.nn.Module, args: tuple[Any, ...], training: Training, strict: bool) -> Translation:
    paths = [name for name, p in module.named_parameters() if p.requires_grad]
    n = len(paths)
    wrapper = _LossOf(module, training.loss)
    frozen = {f"module.{k}": v for k, v in [*module.named_buffers(),
                                             *((k, p) for k, p in module.named_parameters() if not p.requires_grad)]}

    def step(*flat: torch.Tensor) -> list[torch.Tensor]:
        params = list(flat[:n])
        state = {slot: list(flat[n * (i + 1): n * (i + 2)]) for i, slot in enumerate(training.slots)}
        count = flat[n * (len(training.slots) + 1)] if training.slots else None
        user = flat[n * (len(training.slots) + 1) + (1 if training.slots else 0):]
        with torch.enable_grad():
            swapped = {**frozen, **{f"module.{k}": p for k, p in zip(paths, params)}}
            loss = torch.func.functional_call(wrapper, swapped, tuple(user))
            if loss.dim() != 0:
                raise TorchImportError(f"the loss must be a scalar; it has shape {list(loss.shape)}")
            grads = torch.autograd.grad(loss, params)
        new_params, new_state, new_count = training.update(params, list(grads), state, count)
        return [loss, *new_params, *(t for slot in training.slots for t in new_state[slot]),
                *([new_count] if training.slots else [])]

    named = dict(module.named_parameters())
    params = [named[p].detach().clone().requires_grad_() for p in paths]
    flat = [*params, *(torch.zeros_like(p) for _ in training.slots for p in params),
            *([torch.zeros((), dtype=torch.float32)] if training.slots else []), *args]
    try:
        # attention's math backend: its backward is matmuls and a softmax's, where the fused CPU kernel's
        # backward is one opaque op that needs the forward's private log-sum-exp
        with warnings.catch_warnings(), sdpa_kernel([SDPBackend.MATH]):
            warnings.simplefilter("ignore", FutureWarning)
            traced = make_fx(step, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*flat)
    except TorchImportError:
        raise
    except Exception as err:  # tracing raises many types; the user needs the first line
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise TorchImportError(f"could not trace a training step of {type(module).__name__}: "
                               f"{type(err).__name__}: {first}") from None
    inputs = [*paths, *(state_name(s, p) for s in training.slots for p in paths), *([STEP] if training.slots else [])]
    names = [*inputs, *(f"arg{i}" for i in range(len(args)))]
    holders = [node for node in traced.graph.nodes if node.op == "placeholder"]
    roles = {h.name: Placeholder("state" if i < len(inputs) else "user", name)
             for i, (h, name) in enumerate(zip(holders, names))}
    (returned,) = [node.args[0] for node in traced.graph.nodes if node.op == "output"]
    outputs = [("loss", returned[0]), *((updated(name), node) for name, node in zip(inputs, returned[1:]))]
    translation = translate(traced.graph, roles, outputs, strict)
    for name in inputs:  # the step repeats: plans keep each weight and state tensor where it was placed
        translation.graph.carry(updated(name), name)
    return translation
