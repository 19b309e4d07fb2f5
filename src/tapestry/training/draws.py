"""Random draws of a training step (dropout's masks) as inputs drawn fresh every call.

A traced random op reads no tensor, so importing it as it stands would fold the one traced draw into a constant
that every step reuses. The capture cuts each draw out of the graph instead: the op's result becomes a graph
input (`random.0`, `random.1`, ... in the order the step draws them) and a `Draw` records how to make it again.
Each call draws them by calling the same ATen op on torch's default generator, in the traced order, with the
traced strides: on CPU exactly the numbers eager torch draws for the same step after the same `torch.manual_seed`
(eager CPU dropout is `empty_like(x).bernoulli_(1 - p)`, traced as such), so a training step with dropout can be
checked against torch bit for bit. Every rank draws the whole tensor and uses its plan's block of it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

RANDOM = "random"  # graph inputs `random.K`: the step's K-th draw
# ops that fill a tensor with random numbers whatever its values (the first argument gives shape and strides)
FILLS = frozenset({"aten.bernoulli_.float", "aten.bernoulli.p", "aten.uniform_.default", "aten.normal_.default",
                   "aten.rand_like.default", "aten.randn_like.default"})
FACTORIES = frozenset({"aten.rand.default", "aten.randn.default"})  # ops that make a new tensor: shape, dtype=


def random_input(k: int) -> str:
    return f"{RANDOM}.{k}"


@dataclass(frozen=True)
class Draw:
    """One random draw of the step: ATen op `op` (e.g. "aten.bernoulli_.float"), its scalar arguments after the
    tensor or size (`args`: dropout's keep probability 1 - p), the result's shape, strides and torch dtype name."""

    op: str
    args: tuple[float, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, node: torch.fx.Node) -> Draw | None:
        """The draw of fx node `node`, or None if it is no random op this module can repeat (refused then)."""
        op = str(node.target)
        value = node.meta.get("val")
        rest = node.args[1:]
        if (op not in FILLS | FACTORIES or not isinstance(value, torch.Tensor)
                or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in rest)
                or any(k not in ("dtype", "layout", "device", "pin_memory", "memory_format") for k in node.kwargs)):
            return None
        return cls(op, tuple(float(a) for a in rest), tuple(value.shape), tuple(value.stride()),
                   str(value.dtype).removeprefix("torch."))

    def __call__(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """A fresh draw from torch's default generator of `device`, as the traced op drew it."""
        namespace, name, overload = self.op.split(".")
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
        dtype = getattr(torch, self.dtype)
        if self.op in FACTORIES:
            return op(list(self.shape), dtype=dtype, device=device)
        return op(torch.empty_strided(self.shape, self.stride, dtype=dtype, device=device), *self.args)

    def __str__(self) -> str:
        return f"{self.op}({', '.join(map(str, self.args))}) of shape {list(self.shape)} {self.dtype}"


def draw_all(draws: Mapping[str, Draw], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every random input of a step, drawn in the step's order (the order eager torch draws them)."""
    return {name: draw(device) for name, draw in draws.items()}
