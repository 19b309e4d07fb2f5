"""Elementwise kernels: unary activations and numpy-broadcasting binary ops."""
from __future__ import annotations

import numpy as np
import scipy.special
import torch
from hypothesis import strategies as st

from tapestry.kernels.kernel import Kernel, KernelError, Shape, SignatureSpec, follow
from tapestry.kernels.registry import register


def _shape(draw, min_dims: int = 1, max_dims: int = 3) -> Shape:
    return tuple(draw(st.lists(st.integers(1, 7), min_size=min_dims, max_size=max_dims)))


def unary_signature(flops: int):
    def signature(x: Shape) -> SignatureSpec:
        n = len(x)
        ident = follow(n, range(n))
        return SignatureSpec(tuple(f"d{i}" for i in range(n)), x, (ident,), ident, flops)

    return signature


def _unary(name: str, flops: int, np_fn, torch_fn, doc: str) -> Kernel:
    return register(
        Kernel(
            name=name,
            inputs=("x",),
            signature=unary_signature(flops),
            numpy=np_fn,
            torch=torch_fn,
            sample=lambda draw: ((_shape(draw, 0),), {}),
            doc=doc,
        )
    )


def _gelu(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + scipy.special.erf(x / np.sqrt(2.0)))).astype(x.dtype)


relu = _unary("relu", 1, lambda x: np.maximum(x, 0), torch.relu, "max(x, 0)")
gelu = _unary("gelu", 8, _gelu, torch.nn.functional.gelu, "x·Φ(x), the exact (erf) form")
exp = _unary("exp", 4, np.exp, torch.exp, "e^x")


def broadcast_signature(a: Shape, b: Shape) -> SignatureSpec:
    """Index space is the broadcast shape; a size-1 input dim reads the same cell everywhere."""
    try:
        out = tuple(np.broadcast_shapes(a, b))
    except ValueError:
        raise KernelError(f"shapes {list(a)} and {list(b)} do not broadcast") from None
    n = len(out)

    def projection(shape: Shape):
        lead = n - len(shape)
        return follow(n, [None if size == 1 and out[lead + r] != 1 else lead + r for r, size in enumerate(shape)])

    return SignatureSpec(tuple(f"d{i}" for i in range(n)), out, (projection(a), projection(b)), follow(n, range(n)))


def _binary_sample(draw):
    out = _shape(draw, 0)
    def operand():
        keep = draw(st.integers(0, len(out)))
        return tuple(s if draw(st.booleans()) else 1 for s in out[len(out) - keep :])
    return (operand(), operand()) if draw(st.booleans()) else (out, operand()), {}


def _binary(name: str, np_fn, torch_fn, doc: str) -> Kernel:
    return register(
        Kernel(
            name=name,
            inputs=("a", "b"),
            signature=broadcast_signature,
            numpy=np_fn,
            torch=torch_fn,
            sample=_binary_sample,
            doc=doc,
        )
    )


add = _binary("add", np.add, torch.add, "a + b with numpy broadcasting")
mul = _binary("mul", np.multiply, torch.mul, "a · b with numpy broadcasting")
