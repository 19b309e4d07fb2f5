"""Indexing and orderings: take, gather, scatter (of a value), scatter_add, index_add, index_put, one_hot, topk, sort
and argsort."""
from __future__ import annotations

import math
import operator
from typing import Any

import torch

from tapestry.graph import Value
from tapestry.importer.aten.common import _axis, _scalar
from tapestry.importer.aten.elementwise import _scaled
from tapestry.importer.translate import Builder, Unsupported, converts


@converts("aten.index.Tensor")
def _index(b: Builder, x: Any, indices: list[Any]) -> Value:
    """x[idx], x[:, idx] (one integer index tensor) and x[i, j]: the indexed dims (moved first when not adjacent,
    as torch does) merged into one (`reshape`) and read at the flat position Σ i_k · stride_k (negatives wrapped,
    the indices broadcast), a `take`. x[arange(n), j] (pooling at a position per row: CLIP's
    `h[arange(B), ids.argmax(-1)]`, sequence classifiers' last token) is a `gather` instead, so rows split."""
    value = b.tensor(x)
    axes = [axis for axis, i in enumerate(indices) if i is not None]
    if len(axes) == 2 and axes[1] == axes[0] + 1 and _is_arange(indices[axes[0]], value.shape[axes[0]]):
        idx = b.tensor(indices[axes[1]])
        if idx.dtype in ("int32", "int64") and idx.shape == (value.shape[axes[0]],):
            return _select_per_row(b, value, axes[0], _wrapped(b, idx, value.shape[axes[1]]))
        indices = [idx if axis == axes[1] else i for axis, i in enumerate(indices)]  # one constant, not two
    given = [(axis, b.tensor(i)) for axis, i in enumerate(indices) if i is not None]
    if axes != list(range(axes[0], axes[0] + len(axes))):  # not adjacent: torch puts the index dims first
        value = b.op("transpose", value, perm=(*axes, *(d for d in range(value.ndim) if d not in axes)))
        given = [(k, i) for k, (_, i) in enumerate(given)]
        axes = list(range(len(given)))
    if any(i.dtype not in ("int32", "int64") for _, i in given):
        raise Unsupported("a bool mask index (its result's shape depends on the values)")
    first = axes[0]
    if len(given) == 1:
        return b.op("take", value, given[0][1], axis=first)
    shape = tuple(torch.broadcast_shapes(*(i.shape for _, i in given)))
    sizes = [value.shape[a] for a in axes]
    flat = None
    for k, (axis, idx) in enumerate(given):
        idx = _wrapped(b, idx, sizes[k])
        stride = math.prod(sizes[k + 1 :])
        term = idx if stride == 1 else b.op("mul_scalar", idx, value=float(stride))
        term = term if term.shape == shape else b.op("expand", term, shape=shape)
        flat = term if flat is None else b.op("add", flat, term)
    merged = b.op("reshape", value, shape=(*value.shape[:first], math.prod(sizes), *value.shape[axes[-1] + 1 :]))
    return b.op("take", merged, flat, axis=first)


def _wrapped(b: Builder, idx: Value, size: int) -> Value:
    """An int64 index with negatives counted from the end (`size` added), as torch reads them."""
    idx = idx if idx.dtype == "int64" else b.op("cast", idx, dtype="int64")
    negative = b.op("cast", b.op("lt_scalar", idx, value=0.0), dtype="int64")
    return b.op("add", idx, b.op("mul_scalar", negative, value=float(size)))


def _is_arange(index: Any, n: int) -> bool:
    """A constant index tensor [0, 1, ..., n-1]: it picks each row of its dim once, in order."""
    return isinstance(index, torch.Tensor) and index.shape == (n,) and bool((index == torch.arange(n)).all())


def _select_per_row(b: Builder, x: Value, axis: int, idx: Value) -> Value:
    """x[..., arange(n), idx, ...]: row r of `axis` reads its own position idx[r] of the next dim, a `gather` along
    that dim (x's other dims follow the index's, so rows split with x and nothing is exchanged), the dim dropped."""
    n, after = x.shape[axis], x.shape[axis + 2 :]
    column = b.op("reshape", idx, shape=(*(1,) * axis, n, 1, *(1,) * len(after)))
    picked = b.op("gather", x, b.op("expand", column, shape=(*x.shape[:axis], n, 1, *after)), axis=axis + 1)
    return b.op("reshape", picked, shape=(*x.shape[:axis], n, *after))


@converts("aten.index_select.default")
def _index_select(b: Builder, x: Any, dim: int, idx: Any) -> Value:
    value = b.tensor(x)
    return b.op("take", value, b.tensor(idx), axis=_axis(dim, value.ndim))


@converts("aten.gather.default")
def _gather(b: Builder, x: Any, dim: int, index: Any, sparse_grad: bool = False) -> Value:
    value = b.tensor(x)
    return b.op("gather", value, b.tensor(index), axis=_axis(dim, value.ndim))


@converts("aten.scatter_add.default")
def _scatter_add(b: Builder, x: Any, dim: int, index: Any, src: Any) -> Value:
    return _scattered(b, "scatter_add", x, dim, index, src)


@converts("aten.scatter.src")
def _scatter_src(b: Builder, x: Any, dim: int, index: Any, src: Any) -> Value:
    """x with src written at index along `dim` (a topk's backward: the values' gradients put back in their
    columns): `scatter`."""
    return _scattered(b, "scatter", x, dim, index, src)


def _scattered(b: Builder, kernel: str, x: Any, dim: int, index: Any, src: Any) -> Value:
    """`kernel` (scatter_add or scatter) of src at index along `dim`, where src is index's shape: torch reads a box
    of a larger src, which the kernels do not."""
    value, idx, source = b.tensor(x), b.tensor(index), b.tensor(src)
    if idx.shape != source.shape:
        raise Unsupported(f"src{list(source.shape)} larger than index{list(idx.shape)} (torch reads a box of it)")
    return b.op(kernel, value, idx, source, axis=_axis(dim, value.ndim))


@converts("aten.scatter.value")
def _scatter_value(b: Builder, x: Any, dim: int, index: Any, value: Any) -> Value:
    """x with `value` written at index along `dim` (the NLL loss backward's one-hot of the labels): every write
    is the same value, so their order does not matter and the written cells are a mask, index == an iota along
    `dim` (any of index's positions along it), filled in: elementwise, it splits by rows and along `dim`."""
    target, idx = b.tensor(x), b.tensor(index)
    axis = _axis(dim, target.ndim)
    if idx.ndim != target.ndim or any(i != s for d, (i, s) in enumerate(zip(idx.shape, target.shape)) if d != axis):
        raise Unsupported(f"index{list(idx.shape)} smaller than x{list(target.shape)} off dim {axis} (x's shape is "
                          "taken)")
    if idx.dtype not in ("int32", "int64") or isinstance(value, torch.Tensor):
        raise Unsupported(f"a {idx.dtype} index or a tensor value (an integer index and a number are taken)")
    size, count = target.shape[axis], idx.shape[axis]
    iota = torch.arange(size, dtype=getattr(torch, idx.dtype))
    if count == 1:  # one position per row: index broadcast against the iota is the mask
        mask = b.op("eq", idx, b.constant(iota.reshape(tuple(size if d == axis else 1 for d in range(idx.ndim)))))
    else:  # a new axis after `dim` holds the iota; a cell is written when any of the `count` positions names it
        column = b.op("reshape", idx, shape=(*idx.shape[: axis + 1], 1, *idx.shape[axis + 1 :]))
        hits = b.op("eq", column, b.constant(iota.reshape((1,) * (axis + 1) + (size,) + (1,) * (idx.ndim - axis - 1))))
        found = b.op("sum", b.op("cast", hits, dtype="int64"), axis=axis, keepdim=False)
        mask = b.op("ne_scalar", found, value=0.0)
    return b.op("masked_fill", target, mask, value=float(value))


def _index_add(b: Builder, x: Value, axis: int, idx: Value, src: Value) -> Value:
    """x with src[..., k, ...] added at row idx[k] of `axis` (1-D idx): a scatter_add of idx broadcast to src; rows
    of a matrix added into zeros (a take's backward: MoE's dispatch and combine, an embedding's) are scatter_rows,
    whose rows split into partial sums or travel to their targets by all-to-all (expert parallel), where a
    scatter_add reads its source rows whole."""
    if idx.ndim != 1:
        raise Unsupported(f"a {idx.ndim}-D index (1-D is taken)")
    full = (*x.shape[:axis], idx.shape[0], *x.shape[axis + 1 :])
    src = src if src.shape == full else b.op("expand", src, shape=full)
    if axis == 0 and x.ndim == 2 and _is_zeros(b, x):
        return b.op("scatter_rows", src, idx, rows=x.shape[0])
    column = b.op("reshape", idx, shape=tuple(s if d == axis else 1 for d, s in enumerate(full)))
    return b.op("scatter_add", x, b.op("expand", column, shape=full), src, axis=axis)


def _is_zeros(b: Builder, x: Value) -> bool:
    """x is a constant of zeros, or one expanded (`Builder.filled`'s zeros)."""
    node = b.graph[x.name]
    if node.op == "expand":
        node = b.graph[node.args[0]]
    value = b.graph.constants.get(node.name)
    return value is not None and not value.any()


@converts("aten.index_add.default")
def _index_add_op(b: Builder, x: Any, dim: int, index: Any, source: Any, alpha: Any = 1) -> Value:
    value = b.tensor(x)
    return _index_add(b, value, _axis(dim, value.ndim), b.tensor(index), _scaled(b, b.tensor(source), alpha))


@converts("aten.index_put.default")
def _index_put(b: Builder, x: Any, indices: list[Any], values: Any, accumulate: bool = False) -> Value:
    """x[idx] += v (accumulate) is a scatter_add: an N-D idx (the embedding's backward: the gradient rows of
    every token added at its id) flattened with v's matching dims, negatives counted from the end as torch does.
    Without accumulate, repeated indices write in an unspecified order, so only a permutation is taken: the
    indices of a full sort of the axis (MoE's inverse permutation, `inv[perm] = arange`) write every row once,
    which is a scatter_add into zeros. A bool mask with one value is a `masked_fill` (`_masked_put`)."""
    given = [(axis, i) for axis, i in enumerate(indices) if i is not None]
    if len(given) != 1:
        raise Unsupported(f"{len(given)} index tensors (one is taken: x[idx] += v, x[:, idx] += v)")
    (axis, idx), = given
    idx, value = b.tensor(idx), b.tensor(x)
    if idx.dtype == "bool":
        return _masked_put(b, value, axis, idx, values, accumulate)
    if accumulate:
        source = b.tensor(values)
        if idx.ndim != 1:
            full = (*value.shape[:axis], *idx.shape, *value.shape[axis + 1 :])
            if tuple(torch.broadcast_shapes(source.shape, full)) != full:
                raise Unsupported(f"values{list(source.shape)} do not broadcast to x[idx]{list(full)}")
            source = source if source.shape == full else b.op("expand", source, shape=full)
            count = math.prod(idx.shape)
            source = b.op("reshape", source, shape=(*value.shape[:axis], count, *value.shape[axis + 1 :]))
            idx = b.op("reshape", idx, shape=(count,))
        return _index_add(b, value, axis, _wrapped(b, idx, value.shape[axis]), source)
    if not (_is_permutation(b, idx) and idx.shape[0] == value.shape[axis]):
        raise Unsupported("index_put without accumulate of indices not known to be a permutation (repeated "
                          "indices write in an unspecified order)")
    zeros = b.constant(torch.zeros(value.shape, dtype=getattr(torch, value.dtype)))
    return _index_add(b, zeros, axis, idx, b.tensor(values))


def _masked_put(b: Builder, x: Value, axis: int, mask: Value, values: Any, accumulate: bool) -> Value:
    """x[mask] = v with a bool mask over x's dims from `axis` and one value (Longformer's
    `extended_attention_mask[attention_mask == 2] = max`): a `masked_fill`, elementwise. A tensor of values (one
    per true cell, a count the data sets) or accumulate stays opaque."""
    fill = _scalar(values)
    if fill is None or accumulate:
        raise Unsupported("a bool mask index with a tensor of values or accumulate (one value written is taken)")
    if x.shape[axis : axis + mask.ndim] != mask.shape:
        raise Unsupported(f"a bool mask{list(mask.shape)} over x{list(x.shape)}'s dims from {axis} of other sizes")
    if mask.ndim != x.ndim:
        mask = b.op("reshape", mask, shape=(*(1,) * axis, *mask.shape, *(1,) * (x.ndim - axis - mask.ndim)))
    return b.op("masked_fill", x, mask, value=fill)


def _is_permutation(b: Builder, idx: Value) -> bool:
    """idx is the positions of a full 1-D sort (a `topk` with indices and k the whole axis)."""
    if idx.ndim != 1 or idx.name not in b.graph:
        return False
    node = b.graph[idx.name]
    return node.op == "topk" and dict(node.params)["indices"] and b.graph[node.args[0]].shape == idx.shape


@converts("aten.one_hot.default")
def _one_hot(b: Builder, x: Any, num_classes: int = -1) -> Value:
    """`one_hot`, elementwise over x with a class dim (torch.export traces only a given num_classes)."""
    return b.op("one_hot", b.tensor(x), classes=int(num_classes))


def _ordered(b: Builder, x: Value, axis: int, k: int, largest: bool) -> tuple[Value, Value]:
    return tuple(b.op("topk", x, axis=axis, k=k, largest=largest, indices=i) for i in (False, True))


@converts("aten.topk.default")
def _topk(b: Builder, x: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> tuple[Value, Value]:
    """sorted=False leaves the order of the k chosen unspecified (CPU torch's is std::nth_element's, neither sorted
    nor a sharded kernel's): it is the sorted kernel only where nothing reads that order (`_order_unread`)."""
    value = b.tensor(x)
    axis = _axis(dim, value.ndim)
    if not sorted and not _order_unread(b.node, axis, int(k)):
        raise Unsupported("sorted=False with its order read (torch leaves the order unspecified; a sorted kernel "
                          "takes it where k=1, or where only its indices are read, each by a scatter of one value "
                          "along its dim)")
    return _ordered(b, value, axis, int(k), bool(largest))


SCATTERS_OF_A_VALUE = (torch.ops.aten.scatter.value, torch.ops.aten.scatter_.value)


def _order_unread(node: torch.fx.Node, axis: int, k: int) -> bool:
    """Whether the program reads nothing of an unsorted topk's order, so the sorted kernel gives eager's result
    exactly: k = 1 (one element, one order), or the values unread and each reader of the indices a scatter of one
    value along the topk's axis (the chosen set's mask, as DeepSeek-V3's group choice builds it), which writes the
    same cells whatever the order. Ties aside, as for sorted=True (ordering.py: stable ties)."""
    if k == 1:
        return True
    outputs = {use.args[1]: use for use in node.users if use.target is operator.getitem}
    if len(outputs) != len(node.users) or outputs.keys() - {0, 1} or (0 in outputs and outputs[0].users):
        return False
    indices = outputs.get(1)
    return all(_scatters_along(use, indices, axis) for use in (indices.users if indices else ()))


def _scatters_along(use: torch.fx.Node, indices: torch.fx.Node, axis: int) -> bool:
    """`use` is scatter(x, axis, indices, value) with `indices` read there only, as the positions."""
    if use.target not in SCATTERS_OF_A_VALUE or len(use.args) != 4 or use.kwargs:
        return False
    x, dim, index, value = use.args
    return (index is indices and indices not in (x, value) and isinstance(x, torch.fx.Node)
            and isinstance(dim, int) and dim % x.meta["val"].ndim == axis)


@converts("aten.sort.default", "aten.sort.stable")
def _sort(b: Builder, x: Any, dim: int = -1, descending: bool = False, *, stable: bool | None = None
          ) -> tuple[Value, Value]:
    """The kernel is a stable sort. An unstable one (stable False or None, torch's default) orders ties as its
    algorithm does (CPU torch's vectorized sort of more than 16 elements does not keep them in order), so the
    kernel is taken for it only where nothing reads that order (`_ties_unread`)."""
    value = b.tensor(x)
    axis = _axis(dim, value.ndim)
    if not stable and not _ties_unread(b.node, axis, value.shape[axis]):
        raise Unsupported("an unstable sort (stable=False, torch's default) with its indices read (torch leaves the "
                          "order of ties unspecified; the stable kernel takes it where only the values are read, or "
                          "the indices only by scatters of one value along its dim)")
    return _ordered(b, value, axis, value.shape[axis], bool(descending))


@converts("aten.argsort.default", "aten.argsort.stable")
def _argsort(b: Builder, x: Any, dim: int = -1, descending: bool = False, *, stable: bool | None = None) -> Value:
    return _sort(b, x, dim, descending, stable=stable)[1]


def _ties_unread(node: torch.fx.Node, axis: int, size: int) -> bool:
    """Whether the program reads nothing of an unstable sort's order of ties, so the stable kernel gives eager's
    result: an axis of one element; or the indices unread (ties are equal values, so the sorted values are the same
    in any order of them, but for the sign of a tied zero: -0.0 and 0.0 compare equal) or read only by scatters of
    one value along the sort's dim, which write every cell of it whatever the order. An argsort is its indices."""
    if size <= 1:
        return True
    if node.target in (torch.ops.aten.argsort.default, torch.ops.aten.argsort.stable):
        indices: torch.fx.Node | None = node
    else:
        outputs = {use.args[1]: use for use in node.users if use.target is operator.getitem}
        if len(outputs) != len(node.users) or outputs.keys() - {0, 1}:
            return False
        indices = outputs.get(1)
    return all(_scatters_along(use, indices, axis) for use in (indices.users if indices else ()))
