"""Pools and batch norm over NCHW.

Pools are windowed like conv2d: the block reads its windows, with padding as
reads outside x. Those reads are zeros, but a max pool pads with -inf and an
avg pool without count_include_pad does not count padding, so the pool impls
take `read_pad` (how many of the block's leading and trailing rows and columns
are padding) and treat those cells as torch does. batch_norm (eval mode) is
elementwise in x, reading the per-channel vectors along dim 1.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from tapestry import dtypes
from tapestry.kernels.kernel import Kernel, KernelError, ParamValue, Shape, SignatureSpec, follow, numeric
from tapestry.kernels.registry import register

Pad = tuple[tuple[tuple[int, int], ...], ...]


def _floats_only(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    """torch pools only floats."""
    if not dtypes.is_float(in_dtypes[0]):
        raise KernelError(f"pools need a float x; got {in_dtypes[0]}")
    return in_dtypes[0]


def pool_signature(x: Shape, kernel: int, stride: int, padding: int, **_: ParamValue) -> SignatureSpec:
    """Index dims n, c, oh, ow; oh and ow are windowed when the window overlaps its stride."""
    s = stride or kernel
    if len(x) != 4 or kernel < 1 or s < 1 or not 0 <= padding <= kernel // 2:
        raise KernelError(
            f"pools need x[N, C, H, W], kernel >= 1, stride >= 0 and 0 <= padding <= kernel // 2; "
            f"got x{list(x)}, kernel={kernel}, stride={stride}, padding={padding}"
        )
    n, c, h, w = x
    oh, ow = (h + 2 * padding - kernel) // s + 1, (w + 2 * padding - kernel) // s + 1
    if oh < 1 or ow < 1:
        raise KernelError(f"pool window {kernel}x{kernel} is larger than the padded input {h}x{w}")
    window = follow(4, range(4), shape=(1, 1, kernel, kernel), scale=(1, 1, s, s), offset=(0, 0, -padding, -padding))
    return SignatureSpec(("n", "c", "oh", "ow"), (n, c, oh, ow), (window,), follow(4, range(4)), kernel * kernel)


def _real(x: np.ndarray | torch.Tensor, read_pad: Pad) -> tuple[np.ndarray | torch.Tensor, tuple[int, ...]]:
    """The block's cells inside x, and torch's F.pad spec (left, right, top, bottom) that restores the block."""
    (top, bottom), (left, right) = read_pad[0][2:]
    return x[:, :, top : x.shape[2] - bottom, left : x.shape[3] - right], (left, right, top, bottom)


def _windows(x: np.ndarray, kernel: int, stride: int) -> np.ndarray:
    return np.lib.stride_tricks.sliding_window_view(x, (kernel, kernel), axis=(2, 3))[:, :, ::stride, ::stride]


def _np_pad(x: np.ndarray, pad: tuple[int, ...], value: float) -> np.ndarray:
    left, right, top, bottom = pad
    return np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=value)


def _max_pool(x: np.ndarray, kernel: int, stride: int, padding: int, read_pad: Pad) -> np.ndarray:
    real, pad = _real(x, read_pad)
    return _windows(_np_pad(real, pad, -np.inf), kernel, stride or kernel).max(axis=(-2, -1))


def _max_pool_torch(x: torch.Tensor, kernel: int, stride: int, padding: int, read_pad: Pad) -> torch.Tensor:
    real, pad = _real(x, read_pad)
    return F.max_pool2d(F.pad(real, pad, value=-torch.inf), kernel, stride or kernel)


def _avg_pool(
    x: np.ndarray, kernel: int, stride: int, padding: int, count_include_pad: bool, read_pad: Pad
) -> np.ndarray:
    sums = _windows(x, kernel, stride or kernel).sum(axis=(-2, -1))
    if count_include_pad:
        return sums / (kernel * kernel)
    real, pad = _real(x, read_pad)
    mask = _np_pad(np.ones((1, 1, *real.shape[2:])), pad, 0.0)
    return sums / _windows(mask, kernel, stride or kernel).sum(axis=(-2, -1))


def _avg_pool_torch(
    x: torch.Tensor, kernel: int, stride: int, padding: int, count_include_pad: bool, read_pad: Pad
) -> torch.Tensor:
    means = F.avg_pool2d(x, kernel, stride or kernel)
    if count_include_pad:
        return means
    real, pad = _real(x, read_pad)
    mask = F.pad(torch.ones((1, 1, *real.shape[2:]), dtype=x.dtype, device=x.device), pad)
    return means / F.avg_pool2d(mask, kernel, stride or kernel)


def _pool_sampler(avg: bool):
    def sample(draw):
        kernel = draw(st.integers(1, 3))
        padding, stride = draw(st.integers(0, kernel // 2)), draw(st.integers(0, 2))
        least = max(1, kernel - 2 * padding)
        n, c = draw(st.integers(1, 2)), draw(st.integers(1, 3))
        shape = (n, c, draw(st.integers(least, 7)), draw(st.integers(least, 7)))
        params = {"kernel": kernel, "stride": stride, "padding": padding}
        return (shape,), {**params, "count_include_pad": draw(st.booleans())} if avg else params

    return sample


register(
    Kernel(
        name="max_pool2d",
        inputs=("x",),
        signature=pool_signature,
        numpy=_max_pool,
        torch=_max_pool_torch,
        sample=_pool_sampler(avg=False),
        params={"kernel": 1, "stride": 0, "padding": 0},
        needs_read_pad=True,
        dtype_rule=_floats_only,
        takes_zero_size=False,
        doc="max over kernel×kernel windows, NCHW; stride 0 means the kernel size; padding is -inf",
    )
)

register(
    Kernel(
        name="avg_pool2d",
        inputs=("x",),
        signature=pool_signature,
        numpy=_avg_pool,
        torch=_avg_pool_torch,
        sample=_pool_sampler(avg=True),
        params={"kernel": 1, "stride": 0, "padding": 0, "count_include_pad": True},
        needs_read_pad=True,
        dtype_rule=_floats_only,
        takes_zero_size=False,
        doc="mean over kernel×kernel windows, NCHW; stride 0 means the kernel size",
    )
)


def batch_norm_signature(x: Shape, mean: Shape, var: Shape, w: Shape, b: Shape, eps: float) -> SignatureSpec:
    if len(x) < 2 or any(v != x[1:2] for v in (mean, var, w, b)):
        raise KernelError(
            f"batch_norm needs x[N, C, ...] and mean, var, w, b of shape [C]; got x{list(x)}, "
            f"mean{list(mean)}, var{list(var)}, w{list(w)}, b{list(b)}"
        )
    n = len(x)
    channel = follow(n, [1])
    return SignatureSpec(
        ("n", "c", *(f"s{i}" for i in range(n - 2))), x, (follow(n, range(n)), *[channel] * 4), follow(n, range(n)), 4
    )


def _batch_norm(x: np.ndarray, mean: np.ndarray, var: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float
                ) -> np.ndarray:
    def per_channel(v: np.ndarray) -> np.ndarray:
        return v.reshape(-1, *(1,) * (x.ndim - 2))

    with np.errstate(invalid="ignore", divide="ignore"):  # a negative variance gives NaN, as torch does, silently
        return (x - per_channel(mean)) / np.sqrt(per_channel(var) + eps) * per_channel(w) + per_channel(b)


def _sample_batch_norm(draw):
    x = (draw(st.integers(1, 3)), draw(st.integers(1, 4)), *draw(st.lists(st.integers(1, 5), max_size=2)))
    return (x, *[x[1:2]] * 4), {"eps": draw(st.sampled_from([1e-5, 1e-3]))}


register(
    Kernel(
        name="batch_norm",
        inputs=("x", "mean", "var", "w", "b"),
        signature=batch_norm_signature,
        numpy=_batch_norm,
        torch=lambda x, mean, var, w, b, eps: F.batch_norm(x, mean, var, w, b, False, 0.0, eps),
        sample=_sample_batch_norm,
        params={"eps": 1e-5},
        dtype_rule=numeric("batch_norm", ("x", "mean", "var", "w", "b"), floats_only=True),
        doc="batch norm in eval mode: (x - mean) / sqrt(var + eps) · w + b per channel (dim 1)",
    )
)
