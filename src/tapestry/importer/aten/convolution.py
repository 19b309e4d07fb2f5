"""Convolutions (1-D, 2-D, transposed), pooling, padding and upsampling: vision and audio models."""
from __future__ import annotations

from typing import Any

import torch

from tapestry import dtypes
from tapestry.graph import Value
from tapestry.importer.aten.reductions import _reduce
from tapestry.importer.translate import Builder, Unsupported, converts


def _square(name: str, value: Any) -> int:
    values = [value] if isinstance(value, int) else list(value)
    if len(set(values)) != 1:
        raise Unsupported(f"{name} {values} differs between dims")
    return int(values[0])


def _named_padding(padding: str, kernel: tuple[int, ...]) -> list[int]:
    """padding="valid" (none) or "same" (stride 1, the output as large as the input) as a padding per dim; "same"
    with an even kernel pads one side more than the other, which the kernels do not."""
    if padding == "valid":
        return [0] * len(kernel)
    if padding != "same" or any(k % 2 == 0 for k in kernel):
        raise Unsupported(f"padding={padding!r} with kernel {list(kernel)}")
    return [(k - 1) // 2 for k in kernel]


@converts("aten.conv2d.default", "aten.conv2d.padding", "aten.convolution.default")
def _conv2d(b: Builder, x: Any, w: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
            *rest: Any) -> Value:
    if str(b.node.target) == "aten.convolution.default":
        transposed, _, groups = rest
        if transposed:
            raise Unsupported("transposed convolution")
    else:
        groups = rest[0] if rest else 1
    if _square("dilation", dilation) != 1 or b.tensor(x).ndim != 4:
        raise Unsupported("dilation or a non-NCHW input")
    if isinstance(padding, str):
        padding = _named_padding(padding, b.tensor(w).shape[2:])
    params = {"stride": _square("stride", stride), "padding": _square("padding", padding), "groups": int(groups)}
    if bias is None:
        return b.op("conv2d", b.tensor(x), b.tensor(w), **params)
    return b.op("conv2d_bias", b.tensor(x), b.tensor(w), b.tensor(bias), **params)


def _floor_mode(b: Builder, value: Value, kernel: Any, stride: Any, padding: Any, ceil_mode: bool) -> bool:
    """Whether the pooling's windows are those of floor mode: ceil_mode adds a last, partial window only where
    the input leaves a remainder, and where it does not, the two modes are one."""
    if not ceil_mode:
        return True
    per_dim = [[v] * 2 if isinstance(v, int) else list(v) for v in (kernel, stride or kernel, padding)]
    floor = [(n + 2 * p - k) // s + 1 for n, k, s, p in zip(value.shape[-2:], *per_dim)]
    return floor == list(b.shape[-2:])


@converts("aten.max_pool2d.default", "aten.max_pool2d_with_indices.default")
def _max_pool(b: Builder, x: Any, kernel: Any, stride: Any = (), padding: Any = 0, dilation: Any = 1,
              ceil_mode: bool = False) -> Any:
    value = b.tensor(x)
    if not _floor_mode(b, value, kernel, stride, padding, ceil_mode) or _square("dilation", dilation) != 1:
        raise Unsupported("ceil_mode with a partial last window, or dilation")
    k = _square("kernel", kernel)
    pooled = b.op("max_pool2d", value, kernel=k, stride=_square("stride", stride or k),
                  padding=_square("padding", padding))
    # the indices: no kernel makes them (translate declines the node where a backward reads them)
    return (pooled, None) if "with_indices" in str(b.node.target) else pooled


@converts("aten.avg_pool2d.default")
def _avg_pool(b: Builder, x: Any, kernel: Any, stride: Any = (), padding: Any = 0, ceil_mode: bool = False,
              count_include_pad: bool = True, divisor_override: Any = None) -> Value:
    value = b.tensor(x)
    if divisor_override is not None:
        raise Unsupported("divisor_override")
    (kh, kw), (sh, sw) = ([v] * 2 if isinstance(v, int) else list(v) for v in (kernel, stride or kernel))
    *lead, h, w = value.shape
    unpadded = padding in (0, [0, 0], (0, 0))
    if unpadded and kh >= h and kw >= w:  # one window over the whole input (EfficientNet's head)
        return _reduce(b, "mean", value, [-1, -2], True)
    if not _floor_mode(b, value, kernel, stride, padding, ceil_mode):
        raise Unsupported("ceil_mode with a partial last window")
    if unpadded and (kh, kw) == (sh, sw) and kh != kw and h % kh == 0 and w % kw == 0:  # Funnel's (2, 1) tiles
        tiles = b.op("reshape", value, shape=(*lead, h // kh, kh, w // kw, kw))
        return _reduce(b, "mean", tiles, [-1, -3], False)
    k = _square("kernel", kernel)
    return b.op("avg_pool2d", value, kernel=k, stride=_square("stride", stride or k),
                padding=_square("padding", padding), count_include_pad=bool(count_include_pad))


@converts("aten.adaptive_avg_pool2d.default", "aten._adaptive_avg_pool2d.default")
def _adaptive_avg_pool(b: Builder, x: Any, size: Any) -> Value:
    value = b.tensor(x)
    h, w = value.shape[-2:]
    oh, ow = (size, size) if isinstance(size, int) else size
    if (oh, ow) == (1, 1):
        return _reduce(b, "mean", value, [-1, -2], True)
    if h % oh or w % ow or h // oh != w // ow:
        raise Unsupported(f"output {oh}x{ow} does not tile the input {h}x{w} evenly")
    k = h // oh
    return b.op("avg_pool2d", value, kernel=k, stride=k, padding=0, count_include_pad=True)


@converts("aten.adaptive_avg_pool1d.default")
def _adaptive_avg_pool1d(b: Builder, x: Any, size: Any) -> Value:
    """Swin's pooler: L cells in `size` equal runs, each averaged (a `reshape` and a `mean` of the runs)."""
    value = b.tensor(x)
    (out,), length = _per_dim("output_size", size, 1), value.shape[-1]
    if length % out:
        raise Unsupported(f"output {out} does not tile the input {length} evenly")
    runs = b.op("reshape", value, shape=(*value.shape[:-1], out, length // out))
    return b.op("mean", runs, axis=runs.ndim - 1, keepdim=False)


@converts("aten.pad.default")
def _pad(b: Builder, x: Any, pad: list[int], mode: str = "constant", value: float | None = None) -> Value:
    if mode != "constant":
        raise Unsupported(f"mode={mode!r} (constant padding is taken)")
    return _constant_pad(b, x, pad, 0.0 if value is None else value)


@converts("aten.constant_pad_nd.default")
def _constant_pad(b: Builder, x: Any, pad: list[int], value: float = 0.0) -> Value:
    """The value is the third argument here (the loss's shift of int64 labels pads with -100), not a mode."""
    tensor = b.tensor(x)
    return tensor if not any(pad) else b.op("pad", tensor, pad=tuple(int(p) for p in pad), value=float(value))


def _per_dim(name: str, value: Any, n: int) -> list[int]:
    values = [int(value)] * n if isinstance(value, int) else [int(v) for v in value]
    if len(values) == 1:
        values *= n
    if len(values) != n:
        raise Unsupported(f"{name} {values} for {n} spatial dims")
    return values


@converts("aten.conv1d.default")
def _conv1d(b: Builder, x: Any, w: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
            groups: int = 1) -> Value:
    """conv2d over [N, C, 1, L]: the padding made explicit (a `pad` of L), the kernel one row high."""
    value, weight = b.tensor(x), b.tensor(w)
    if isinstance(padding, str) or _per_dim("dilation", dilation, 1) != [1] or value.ndim != 3:
        raise Unsupported("string padding, dilation or a non-NCL input")
    (p,), (s,) = _per_dim("padding", padding, 1), _per_dim("stride", stride, 1)
    padded = b.op("pad", value, pad=(p, p), value=0.0) if p else value
    rows = b.op("reshape", padded, shape=(padded.shape[0], padded.shape[1], 1, padded.shape[2]))
    kernel = b.op("reshape", weight, shape=(weight.shape[0], weight.shape[1], 1, weight.shape[2]))
    params = {"stride": s, "padding": 0, "groups": int(groups)}
    out = b.op("conv2d", rows, kernel, **params) if bias is None else \
        b.op("conv2d_bias", rows, kernel, b.tensor(bias), **params)
    return b.op("reshape", out, shape=b.shape)


@converts("aten.conv_transpose2d.input")
def _conv_transpose2d(b: Builder, x: Any, w: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
                      output_padding: Any = 0, groups: int = 1, dilation: Any = 1) -> Value:
    """A transposed conv is a conv2d (stride 1) of x with stride-1 zeros put between its cells and k-1-p padding
    around, by the weight flipped in space with its channel axes swapped (per group)."""
    value, weight = b.tensor(x), b.tensor(w)
    if value.ndim != 4 or _per_dim("dilation", dilation, 2) != [1, 1]:
        raise Unsupported("dilation or a non-NCHW input")
    strides, pads, extra = (_per_dim(n, v, 2) for n, v in (("stride", stride), ("padding", padding),
                                                           ("output_padding", output_padding)))
    n, c, h, wd = value.shape
    cin, kg, kh, kw = weight.shape
    spread = value
    if strides != [1, 1]:  # [N, C, H, 1, W, 1] padded to [N, C, H, sh, W, sw]: each cell, then sh-1 zeros
        (sh, sw) = strides
        spread = b.op("reshape", value, shape=(n, c, h, 1, wd, 1))
        spread = b.op("pad", spread, pad=(0, sw - 1, 0, 0, 0, sh - 1), value=0.0)
        spread = b.op("reshape", spread, shape=(n, c, h * sh, wd * sw))
    # then (k-1-p) on each side, less the trailing stride-1 zeros, plus output_padding at the end
    around = []
    for size, k, s, p, op in ((wd, kw, strides[1], pads[1], extra[1]), (h, kh, strides[0], pads[0], extra[0])):
        around += [k - 1 - p, k - 1 - p - (s - 1) + op]
    padded = b.op("pad", spread, pad=tuple(around), value=0.0) if any(around) else spread
    flipped = weight
    for axis, size in ((2, kh), (3, kw)):
        if size > 1:
            flipped = b.op("take", flipped, b.constant(torch.arange(size - 1, -1, -1)), axis=axis)
    swapped = b.op("reshape", flipped, shape=(groups, cin // groups, kg, kh, kw))
    swapped = b.op("transpose", swapped, perm=(0, 2, 1, 3, 4))
    swapped = b.op("reshape", swapped, shape=(groups * kg, cin // groups, kh, kw))
    params = {"stride": 1, "padding": 0, "groups": int(groups)}
    if bias is None:
        return b.op("conv2d", padded, swapped, **params)
    return b.op("conv2d_bias", padded, swapped, b.tensor(bias), **params)


def _upsampled_size(b: Builder) -> tuple[int, int]:
    return b.shape[-2], b.shape[-1]


@converts("aten.upsample_nearest2d.vec", "aten.upsample_nearest2d.default")
def _upsample_nearest(b: Builder, x: Any, *rest: Any) -> Value:
    """Whole scale factors are views (each cell repeated: reshape, expand, reshape); others a `take` of the rows
    and columns torch picks (read off torch's own op applied to their positions)."""
    value = b.tensor(x)
    (n, c, h, w), (oh, ow) = value.shape, _upsampled_size(b)
    if oh % h == 0 and ow % w == 0 and _nearest_index(b, rest, h, oh, 2) == [i // (oh // h) for i in range(oh)] \
            and _nearest_index(b, rest, w, ow, 3) == [i // (ow // w) for i in range(ow)]:
        fh, fw = oh // h, ow // w
        cells = b.op("reshape", value, shape=(n, c, h, 1, w, 1))
        cells = b.op("expand", cells, shape=(n, c, h, fh, w, fw))
        return b.op("reshape", cells, shape=(n, c, oh, ow))
    rows = b.op("take", value, b.constant(torch.tensor(_nearest_index(b, rest, h, oh, 2))), axis=2)
    return b.op("take", rows, b.constant(torch.tensor(_nearest_index(b, rest, w, ow, 3))), axis=3)


def _nearest_index(b: Builder, rest: tuple[Any, ...], size: int, out: int, axis: int) -> list[int]:
    """The input position torch's op reads for each output position along `axis`: the op run on positions."""
    shape = [1, 1, 1, 1]
    shape[axis] = size
    positions = torch.arange(size, dtype=torch.float64).reshape(shape)
    other = 3 if axis == 2 else 2
    positions = positions.expand(*(s if d != other else b.node.args[0].meta["val"].shape[other]
                                   for d, s in enumerate(shape)))
    picked = b.node.target(positions, *rest)
    return [int(v) for v in picked.select(other, 0).flatten()]


@converts("aten.upsample_bilinear2d.vec", "aten.upsample_bilinear2d.default")
def _upsample_bilinear(b: Builder, x: Any, *rest: Any) -> Value:
    """Bilinear interpolation is separable and linear: x @ Aw then Ah @ (that), two matmuls by constant
    matrices read off torch's own op applied to unit vectors (so align_corners and scales are torch's)."""
    value = b.tensor(x)
    (n, c, h, w), (oh, ow) = value.shape, _upsampled_size(b)
    if not dtypes.is_float(value.dtype):
        raise Unsupported(f"a {value.dtype} input")
    a_h, a_w = (_interpolation(b, rest, size, axis) for size, axis in ((h, 2), (w, 3)))  # [size, out]
    dtype = getattr(torch, value.dtype)
    across = b.op("matmul", value, b.constant(a_w.to(dtype)))  # [N, C, H, OW]
    down = b.op("matmul", b.op("transpose", across, perm=(0, 1, 3, 2)), b.constant(a_h.to(dtype)))  # [N, C, OW, OH]
    return b.op("transpose", down, perm=(0, 1, 3, 2))


def _interpolation(b: Builder, rest: tuple[Any, ...], size: int, axis: int) -> torch.Tensor:
    """[size, out]: row j is the op's output along `axis` for the unit vector e_j (constant along the other
    spatial axis, which interpolation keeps constant)."""
    shape = list(b.node.args[0].meta["val"].shape[2:])
    units = torch.eye(size, dtype=torch.float64).reshape(size, 1, *(size if d == axis - 2 else 1 for d in range(2)))
    units = units.expand(size, 1, *shape)
    out = b.node.target(units, *rest)  # [size, 1, OH, OW]
    return out[:, 0, :, 0] if axis == 2 else out[:, 0, 0, :]


@converts("aten.im2col.default")
def _im2col(b: Builder, x: Any, kernel_size: Any, dilation: Any, padding: Any, stride: Any) -> Value:
    """nn.Unfold (ConvBERT's span convolution): x[N, C, H, W] padded, one strided window offset (i, j) at a time
    read as a `slice` of every output position, the kh·kw offsets `concat`ed beside the channels and `reshape`d to
    [N, C·kh·kw, L] (channel c, offset i·kw + j, as torch orders them)."""
    value = b.tensor(x)
    if value.ndim != 4:
        raise Unsupported(f"an unbatched im2col (x{list(value.shape)}; [N, C, H, W] is taken)")
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = ((int(a), int(b_)) for a, b_ in (kernel_size, dilation, padding, stride))
    n, c = value.shape[:2]
    padded = b.op("pad", value, pad=(pw, pw, ph, ph), value=0.0) if ph or pw else value
    height, width = padded.shape[2:]
    oh, ow = (height - dh * (kh - 1) - 1) // sh + 1, (width - dw * (kw - 1) - 1) // sw + 1
    out = None
    for i, j in ((i, j) for i in range(kh) for j in range(kw)):
        window = padded
        for axis, start, size, step, full in ((2, i * dh, oh, sh, height), (3, j * dw, ow, sw, width)):
            if (start, size, step) != (0, full, 1):
                window = b.op("slice", window, axis=axis, start=start, stop=start + (size - 1) * step + 1, step=step)
        window = b.op("reshape", window, shape=(n, c, 1, oh * ow))
        out = window if out is None else b.op("concat", out, window, axis=2)
    return b.op("reshape", out, shape=(n, c * kh * kw, oh * ow))
