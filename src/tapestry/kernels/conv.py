"""conv2d over NCHW, with stride, zero padding and groups; conv2d_bias adds a bias; the _relu twins apply relu
in the same kernel.

Output rows and columns are windowed index dims: neighbouring blocks read
overlapping input rows (halos). Padding is an offset of -padding in x's
projection; reads outside x are zeros, so each block is a plain valid conv.

Groups: output channel k = Kg·g + kg and input channel Cg·g + c, both affine in
the index dims g, kg, c. A box of (g, kg) points selects the bounding box of
its channels, which is exact only when the box has one g or every kg; so with
groups > 1 a block holds whole groups (kg and c have one point, reading Kg and
Cg channels) and g is the split dim, while with groups = 1 kg and c are the
usual output-channel and additive input-channel dims. Either way a block is a
conv with (x's channels / w's input channels) groups.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry.kernels.kernel import Kernel, KernelError, Shape, SignatureSpec, numeric
from tapestry.kernels.registry import register
from tapestry.zspace import IndexProjection, ZAffineMap

DIMS = ("n", "kg", "oh", "ow", "c", "g")  # n, kg, oh, ow, c keep conv2d's positions from before groups
N, KG, OH, OW, C, G = range(len(DIMS))


def _row(**coefficients: int) -> list[int]:
    return [coefficients.get(d, 0) for d in DIMS]


def conv2d_signature(x: Shape, w: Shape, *bias: Shape, stride: int, padding: int, groups: int) -> SignatureSpec:
    if len(x) != 4 or len(w) != 4 or groups < 1 or x[1] != w[1] * groups or w[0] % groups:
        raise KernelError(
            f"conv2d needs x[N, C, H, W] and w[K, C/groups, kh, kw] with groups={groups} dividing C and K; "
            f"got x{list(x)}, w{list(w)}"
        )
    if bias and bias[0] != (w[0],):
        raise KernelError(f"conv2d_bias needs b[{w[0]}]; got b{list(bias[0])}")
    if stride < 1 or padding < 0:
        raise KernelError(f"conv2d needs stride >= 1 and padding >= 0; got stride={stride}, padding={padding}")
    (n, _, h, wd), (k, cg, kh, kw) = x, w
    kg = k // groups
    oh, ow = (h + 2 * padding - kh) // stride + 1, (wd + 2 * padding - kw) // stride + 1
    if oh < 1 or ow < 1:
        raise KernelError(f"conv2d kernel {kh}x{kw} is larger than the padded input {h}x{wd}")
    ks, cs = (1, 1) if groups == 1 else (kg, cg)  # channels one kg / c point reads (see the module doc)
    channel_out = _row(kg=ks, g=kg)

    def projection(rows: list[list[int]], shape: tuple[int, ...], offset: list[int] | None = None) -> IndexProjection:
        return IndexProjection(ZAffineMap(rows, offset, in_dim=len(DIMS)), shape)

    return SignatureSpec(
        dims=DIMS,
        sizes=(n, kg // ks, oh, ow, cg // cs, groups),
        inputs=(
            projection([_row(n=1), _row(c=cs, g=cg), _row(oh=stride), _row(ow=stride)], (1, cs, kh, kw),
                       [0, 0, -padding, -padding]),
            projection([channel_out, _row(c=cs), _row(), _row()], (ks, cs, kh, kw)),
            *(projection([channel_out], (ks,)) for _ in bias),
        ),
        output=projection([_row(n=1), channel_out, _row(oh=1), _row(ow=1)], (1, ks, 1, 1)),
        flops_per_point=2 * kh * kw * ks * cs,
    )


def _conv2d(x: np.ndarray, w: np.ndarray, *bias: np.ndarray, stride: int, padding: int, groups: int) -> np.ndarray:
    """Valid grouped correlation of an (already padded) block."""
    (k, cg, kh, kw), gb = w.shape, x.shape[1] // w.shape[1]
    windows = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride]
    n, _, oh, ow = windows.shape[:4]
    out = np.einsum(
        "ngchwij,gkcij->ngkhw", windows.reshape(n, gb, cg, oh, ow, kh, kw), w.reshape(gb, k // gb, cg, kh, kw)
    ).reshape(n, k, oh, ow)
    return out + bias[0][:, None, None] if bias else out


def _relu_after(conv):
    """The conv with relu applied to its result, as one kernel (TASO's conv2d activation mode)."""
    relu = torch.relu if conv is _conv2d_torch else (lambda y: np.maximum(y, 0))
    return lambda *args, **params: relu(conv(*args, **params))


def _conv2d_torch(x: torch.Tensor, w: torch.Tensor, *bias: torch.Tensor, stride: int, padding: int, groups: int
                  ) -> torch.Tensor:
    """The block is already padded; it holds x.shape[1] // w.shape[1] whole groups."""
    return torch.nn.functional.conv2d(x, w, *bias, stride=stride, groups=x.shape[1] // w.shape[1])


def _sampler(with_bias: bool):
    def sample(draw):
        groups = draw(st.integers(1, 3))
        n, cg, kg = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
        kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        padding, stride = draw(st.integers(0, 1)), draw(st.integers(1, 2))
        h, wd = draw(st.integers(max(1, kh - 2 * padding), 6)), draw(st.integers(max(1, kw - 2 * padding), 6))
        shapes = ((n, cg * groups, h, wd), (kg * groups, cg, kh, kw), *([(kg * groups,)] if with_bias else []))
        return shapes, {"stride": stride, "padding": padding, "groups": groups}

    return sample


def _conv(name: str, inputs: tuple[str, ...], additive: frozenset[str], doc: str, relu: bool = False) -> Kernel:
    return register(
        Kernel(
            name=name,
            inputs=inputs,
            signature=conv2d_signature,
            numpy=_relu_after(_conv2d) if relu else _conv2d,
            torch=_relu_after(_conv2d_torch) if relu else _conv2d_torch,
            sample=_sampler(len(inputs) == 3),
            params={"stride": 1, "padding": 0, "groups": 1},
            additive=additive,
            dtype_rule=numeric(name, inputs),
            takes_zero_size=False,
            doc=doc,
        )
    )


conv2d = _conv("conv2d", ("x", "w"), frozenset({"c"}), "2-D convolution (cross-correlation), NCHW, no bias")
# The bias must be added once, so c is not additive: splitting it needs conv2d + add.
conv2d_bias = _conv("conv2d_bias", ("x", "w", "b"), frozenset(), "2-D convolution plus a per-channel bias")
# relu of a partial sum is not the sum of relus: no fused kernel splits its contraction.
conv2d_relu = _conv("conv2d_relu", ("x", "w"), frozenset(), "relu(conv2d(x, w)), fused", relu=True)
conv2d_bias_relu = _conv("conv2d_bias_relu", ("x", "w", "b"), frozenset(), "relu(conv2d_bias(x, w, b)), fused",
                         relu=True)
