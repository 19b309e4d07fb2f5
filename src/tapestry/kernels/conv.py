"""conv2d over NCHW, with stride and zero padding.

Output rows and columns are windowed index dims: neighbouring blocks read
overlapping input rows (halos). Padding is an offset of -padding in x's
projection; reads outside x are zeros, so each block is a plain valid conv.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry.kernels.kernel import Kernel, KernelError, Shape, SignatureSpec, follow
from tapestry.kernels.registry import register


def conv2d_signature(x: Shape, w: Shape, stride: int, padding: int) -> SignatureSpec:
    if len(x) != 4 or len(w) != 4 or x[1] != w[1]:
        raise KernelError(f"conv2d needs x[N, C, H, W] and w[K, C, kh, kw] with equal C; got x{list(x)}, w{list(w)}")
    if stride < 1 or padding < 0:
        raise KernelError(f"conv2d needs stride >= 1 and padding >= 0; got stride={stride}, padding={padding}")
    (n, c, h, wd), (k, _, kh, kw) = x, w
    oh, ow = (h + 2 * padding - kh) // stride + 1, (wd + 2 * padding - kw) // stride + 1
    if oh < 1 or ow < 1:
        raise KernelError(f"conv2d kernel {kh}x{kw} is larger than the padded input {h}x{wd}")
    return SignatureSpec(
        dims=("n", "k", "oh", "ow", "c"),
        sizes=(n, k, oh, ow, c),
        inputs=(
            follow(5, [0, 4, 2, 3], shape=(1, 1, kh, kw), scale=(1, 1, stride, stride), offset=(0, 0, -padding, -padding)),
            follow(5, [1, 4, None, None], shape=(1, 1, kh, kw)),
        ),
        output=follow(5, [0, 1, 2, 3]),
        flops_per_point=2 * kh * kw,
    )


def _conv2d(x: np.ndarray, w: np.ndarray, stride: int, padding: int) -> np.ndarray:
    """Valid correlation of an (already padded) block."""
    kh, kw = w.shape[2:]
    windows = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride]
    return np.einsum("nchwij,kcij->nkhw", windows, w).astype(x.dtype)


def _sample(draw):
    n, c, k = (draw(st.integers(1, 3)) for _ in range(3))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    padding, stride = draw(st.integers(0, 1)), draw(st.integers(1, 2))
    h, wd = draw(st.integers(max(1, kh - 2 * padding), 7)), draw(st.integers(max(1, kw - 2 * padding), 7))
    return ((n, c, h, wd), (k, c, kh, kw)), {"stride": stride, "padding": padding}


register(
    Kernel(
        name="conv2d",
        inputs=("x", "w"),
        signature=conv2d_signature,
        numpy=_conv2d,
        torch=lambda x, w, stride, padding: torch.nn.functional.conv2d(x, w, stride=stride),
        sample=_sample,
        params={"stride": 1, "padding": 0},
        additive=frozenset({"c"}),
        doc="2-D convolution (cross-correlation), NCHW, no bias",
    )
)
