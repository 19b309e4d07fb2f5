"""Opaque kernels: an ATen op Tapestry has no kernel for, run whole through torch.

Import never stops at one unknown op: the op becomes `opaque<n>` (n tensor
arguments), whose index space is a single point, so it runs whole on every
device that computes it, and `explain` names the ATen op. Its non-tensor
arguments travel as JSON in a string param, so the node is an ordinary,
serializable graph op.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from tapestry import dtypes
from tapestry.kernels.kernel import Kernel, Shape, SignatureSpec, follow
from tapestry.kernels.registry import register

MAX_ARITY = 16  # an LSTM layer takes 2 + 4 tensors per layer and direction
_TAGS = {torch.dtype: "dtype", torch.device: "device", torch.memory_format: "memory_format", torch.layout: "layout"}


def encode_args(args: Any, kwargs: dict[str, Any], tensors: list[Any]) -> str:
    """[args, kwargs] as JSON; each tensor (an fx node) becomes {"tensor": i}, appended to `tensors`. Keyword
    names stay keys of the top-level dict, so a keyword named like a tag (`dtype=`) is never read as one."""

    def enc(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return [enc(x) for x in a]
        for kind, tag in _TAGS.items():
            if isinstance(a, kind):
                return {tag: str(a).removeprefix("torch.")}
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        tensors.append(a)
        return {"tensor": len(tensors) - 1}

    return json.dumps([enc(list(args)), {k: enc(v) for k, v in kwargs.items()}])


def decode_args(text: str, tensors: tuple[Any, ...]) -> tuple[list[Any], dict[str, Any]]:
    """encode_args' (args, kwargs), tensors put back."""

    def dec(a: Any) -> Any:
        if isinstance(a, list):
            return [dec(x) for x in a]
        if isinstance(a, dict):
            if "tensor" in a:
                return tensors[a["tensor"]]
            if "dtype" in a:
                return getattr(torch, a["dtype"])
            if "device" in a:
                return torch.device(a["device"])
            if "memory_format" in a:
                return getattr(torch, a["memory_format"])
            if "layout" in a:
                return getattr(torch, a["layout"])
            raise ValueError(f"opaque op argument {a!r} is no tag encode_args writes")
        return a

    positional, keywords = json.loads(text)
    return [dec(a) for a in positional], {k: dec(v) for k, v in keywords.items()}


def aten_op(name: str) -> Any:
    """`aten.cumsum.default` -> torch.ops.aten.cumsum.default."""
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def run_torch(*tensors: torch.Tensor, aten: str, args: str, output: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    positional, keywords = decode_args(args, tensors)
    result = aten_op(aten)(*positional, **keywords)
    result = result[output] if isinstance(result, (tuple, list)) else result
    return result.to(dtypes.to_torch(dtype)).reshape(shape)


def run_numpy(*arrays: np.ndarray, **params: Any) -> np.ndarray:
    return dtypes.from_tensor(run_torch(*(dtypes.to_tensor(a) for a in arrays), **params))


def _signature(*shapes: Shape, aten: str, args: str, output: int, shape: tuple[int, ...], dtype: str) -> SignatureSpec:
    return SignatureSpec((), (), tuple(follow(0, [None] * len(s), shape=s) for s in shapes),
                         follow(0, [None] * len(shape), shape=shape), 1)


def _sample_params(n: int) -> dict[str, Any]:
    """zeros() with no tensor argument, else cat() of all of them."""
    if n == 0:
        return {"aten": "aten.zeros.default", "args": json.dumps([[[2, 3]], {}]), "shape": (2, 3)}
    tensors = [{"tensor": i} for i in range(n)]
    return {"aten": "aten.cat.default", "args": json.dumps([[tensors, 0], {}]), "shape": (2 * n, 3)}


def opaque_name(arity: int) -> str:
    return f"opaque{arity}"


for _arity in range(MAX_ARITY + 1):
    register(
        Kernel(
            name=opaque_name(_arity),
            inputs=tuple(f"x{i}" for i in range(_arity)),
            signature=_signature,
            numpy=run_numpy,
            torch=run_torch,
            sample=lambda draw, n=_arity: (((2, 3),) * n, _sample_params(n)),
            params={"aten": "", "args": "[[], {}]", "output": 0, "shape": (), "dtype": "float32"},
            dtype_rule=lambda in_dtypes, params: params["dtype"],
            doc=f"an ATen op with {_arity} tensor argument(s) and no Tapestry kernel, run whole through torch",
        )
    )
