"""dft{1,2,3}_real(x, axes): the real part of the discrete Fourier transform of a real tensor over 1, 2 or 3
`axes`, torch.fft.fftn(x, dim=axes).real (FNet's token mixing); one kernel per count of axes, as conv1d and conv2d.

out[k] = Re Σ_j x[j] exp(-2πi Σ_m k_m j_m / n_m) is linear in x, so the signature models it as a sum, like a
matmul: the index space is x's dims plus one `source` dim per transformed axis (j_m, the position read), and the
sources are additive reductions (a device holding x[j0:j1] adds its terms to every output position). A block
computes its part from the block's absolute positions (`block_start`): the twiddles exp(-2πi k j / n) of its
rows and columns, one axis after another, then the real part: the real part of a sum is the sum of the parts.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry import dtypes
from tapestry.kernels.kernel import Kernel, KernelError, ParamValue, Shape, SignatureSpec, follow
from tapestry.kernels.registry import register
from tapestry.zspace import ZRange

NORMS = ("backward", "forward", "ortho")  # torch.fft's: no scaling, 1/n, 1/sqrt(n)
AXES = (1, 2, 3)  # counts of axes transformed at once: a kernel each, each axis with its additive source dim


def dft_real_signature(x: Shape, axes: tuple[int, ...], lengths: tuple[int, ...], norm: str) -> SignatureSpec:
    n = len(x)
    if sorted(set(axes)) != list(axes) or not all(0 <= a < n for a in axes):
        raise KernelError(f"axes {list(axes)} must be distinct increasing dims of x{list(x)}")
    if tuple(lengths) != tuple(x[a] for a in axes):
        raise KernelError(f"lengths {list(lengths)} must be x{list(x)}'s sizes along axes {list(axes)}")
    if norm not in NORMS:
        raise KernelError(f"norm {norm!r} is none of {NORMS}")
    source = {a: n + m for m, a in enumerate(axes)}
    return SignatureSpec(
        dims=(*(f"d{d}" for d in range(n)), *(f"source{m}" for m in range(len(axes)))),
        sizes=(*x, *lengths),
        inputs=(follow(n + len(axes), [source.get(d, d) for d in range(n)]),),
        output=follow(n + len(axes), range(n)),
        flops_per_point=2,
    )


def _scale(lengths: Sequence[int], norm: str) -> float:
    total = math.prod(lengths)
    return {"backward": 1.0, "forward": 1.0 / total, "ortho": 1.0 / math.sqrt(total)}[norm]


def _twiddles(k0: int, k: int, j0: int, j: int, n: int) -> np.ndarray:
    """exp(-2πi k j / n) for rows k0..k0+k and columns j0..j0+j, the product taken mod n (exact phases)."""
    phase = np.outer(np.arange(k0, k0 + k, dtype=np.int64), np.arange(j0, j0 + j, dtype=np.int64)) % n
    return np.exp(-2j * np.pi * phase / n)


def _dft_real_numpy(x: np.ndarray, axes: tuple[int, ...], lengths: tuple[int, ...], norm: str,
                    block_start: tuple[int, ...], out_shape: tuple[int, ...]) -> np.ndarray:
    y = x.astype(np.complex128)
    for m, (a, n) in enumerate(zip(axes, lengths)):
        w = _twiddles(block_start[a], out_shape[a], block_start[x.ndim + m], x.shape[a], n)
        y = np.moveaxis(np.tensordot(w, y, axes=([1], [a])), 0, a)
    return (y.real * _scale(lengths, norm)).astype(x.dtype, copy=False)


def _dft_real_torch(x: Any, axes: tuple[int, ...], lengths: tuple[int, ...], norm: str,
                    block_start: tuple[int, ...], out_shape: tuple[int, ...]) -> Any:
    """As `_dft_real_numpy`, in real arithmetic (Inductor makes no code for complex ops): the pair (re, im)
    through each axis's cos and -sin matrices."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    re, im = x.to(wide), None
    for m, (a, n) in enumerate(zip(axes, lengths)):
        w = _twiddles(block_start[a], out_shape[a], block_start[x.dim() + m], x.shape[a], n)
        cos, sin = (torch.from_numpy(part).to(device=x.device, dtype=wide) for part in (w.real, w.imag))

        def along(matrix: Any, y: Any, a: int = a) -> Any:
            return torch.movedim(torch.tensordot(matrix, y, dims=([1], [a])), 0, a)

        re, im = ((along(cos, re), along(sin, re)) if im is None else
                  (along(cos, re) - along(sin, im), along(cos, im) + along(sin, re)))
    return (re * _scale(lengths, norm)).to(x.dtype)


def _float_only(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    """A real float tensor's transform keeps its dtype (torch computes integers' in float32: cast them first)."""
    if not dtypes.is_float(in_dtypes[0]):
        raise KernelError(f"x must be a float tensor, got {in_dtypes[0]}")
    return in_dtypes[0]


def _work(sig: Any, block: ZRange) -> float:
    """The share of the block's points (2 FLOPs each) its axis-by-axis evaluation takes: transforming axis m
    is a complex matrix product (8 FLOPs per multiply-add) over the axes done so far at their output sizes and
    the rest at their source sizes."""
    params = dict(sig.params)
    n = len(sig.input_shapes[0])
    sizes = block.shape
    axes = params["axes"]
    others = math.prod(s for d, s in enumerate(sizes[:n]) if d not in axes)
    outs = [sizes[a] for a in axes]
    sources = list(sizes[n:])
    flops = sum(8 * others * math.prod(outs[:m + 1]) * math.prod(sources[m:]) for m in range(len(axes)))
    points = others * math.prod(outs) * math.prod(sources)
    return flops / (2 * points) if points else 1.0


def _signature(count: int) -> Callable[..., SignatureSpec]:
    def signature(x: Shape, axes: tuple[int, ...], lengths: tuple[int, ...], norm: str) -> SignatureSpec:
        if len(axes) != count:
            raise KernelError(f"dft{count}_real transforms {count} axes, not {len(axes)} ({list(axes)})")
        return dft_real_signature(x, axes, lengths, norm)

    return signature


def _sampler(count: int) -> Callable[[Callable[[Any], Any]], tuple[tuple[Shape, ...], dict[str, ParamValue]]]:
    def sample(draw):
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=count, max_size=count + 1)))
        axes = tuple(sorted(draw(st.sets(st.integers(0, len(shape) - 1), min_size=count, max_size=count))))
        params = {"axes": axes, "lengths": tuple(shape[a] for a in axes), "norm": draw(st.sampled_from(NORMS))}
        return (shape,), params

    return sample


for count in AXES:
    register(
        Kernel(
            name=f"dft{count}_real",
            inputs=("x",),
            signature=_signature(count),
            numpy=_dft_real_numpy,
            torch=_dft_real_torch,
            sample=_sampler(count),
            params={"axes": tuple(range(count)), "lengths": (1,) * count, "norm": "backward"},
            additive=frozenset(f"source{m}" for m in range(count)),
            needs_block_start=True,
            needs_out_shape=True,
            work=_work,
            dtype_rule=_float_only,
            takes_zero_size=False,
            doc=f"real part of the DFT of a real tensor over {count} `axes` (torch.fft.fftn(x, dim=axes).real)",
        )
    )
