"""Fourier transforms whose only use is their real part (FNet's token mixing: torch.fft.fftn(x).real).

Tapestry has no complex dtype, so a transform maps only where every reader takes the real part: it becomes
`RealPart` of the real kernel dft{1,2,3}_real, which only `aten.real` reads (`real_parts` first rewrites the
exported form of `.real`, view_as_real(z)[..., 0], to it); `aten.real` of a real tensor is the tensor itself."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tapestry.graph import Value
from tapestry.importer.aten.common import _axis
from tapestry.importer.translate import Builder, Standin, Unsupported, converts
from tapestry.kernels.fourier import AXES

REAL = torch.ops.aten.real.default


@dataclass(frozen=True)
class RealPart(Standin):
    """The real part of a complex transform, the only part its readers take."""

    value: Value


def real_parts(graph: torch.fx.Graph) -> None:
    """view_as_real(z)[..., 0] (select on the last dim) as real(z), in place (the select node retargeted, so
    whatever names it still does): the same values."""
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.select.int or not isinstance(node.args[0], torch.fx.Node):
            continue
        pairs, dim, index = node.args
        rank = pairs.meta["val"].dim() if "val" in pairs.meta else 0
        if pairs.target is torch.ops.aten.view_as_real.default and index == 0 and rank and dim % rank == rank - 1:
            node.target, node.args, node.kwargs = REAL, (pairs.args[0],), {}
            if not pairs.users:
                graph.erase_node(pairs)


def _dft_real(b: Builder, x: Any, sizes: Any, dims: Any, norm: str | None) -> RealPart:
    value = b.tensor(x)
    readers = sorted({str(user.target) for user in b.node.users if user.target is not REAL})
    if readers:
        raise Unsupported(f"the complex result is read by {', '.join(readers)}, not only by its real part")
    if sizes is not None:
        raise Unsupported("a transform length (s=/n=) pads or trims: not mapped")
    axes = tuple(sorted({_axis(d, value.ndim) for d in (range(value.ndim) if dims is None else dims)}))
    if len(axes) not in AXES:
        raise Unsupported(f"{len(axes)} axes transformed at once (kernels for {AXES})")
    return RealPart(b.op(f"dft{len(axes)}_real", value, axes=axes, lengths=tuple(value.shape[a] for a in axes),
                         norm=norm or "backward"))


@converts("aten.fft_fftn.default", "aten.fft_fft2.default")
def _fftn(b: Builder, x: Any, s: Any = None, dim: Any = None, norm: str | None = None) -> RealPart:
    if dim is None and "fft2" in str(b.node.target):
        dim = (-2, -1)
    return _dft_real(b, x, s, dim, norm)


@converts("aten.fft_fft.default")
def _fft(b: Builder, x: Any, n: Any = None, dim: int = -1, norm: str | None = None) -> RealPart:
    return _dft_real(b, x, n, (dim,), norm)


@converts("aten.real.default")
def _real(b: Builder, x: Any) -> Value:
    if isinstance(x, RealPart):
        return x.value
    value = b.tensor(x)
    if not value.dtype.startswith(("float", "bfloat")):
        raise Unsupported(f"real part of a {value.dtype} tensor")
    return value
