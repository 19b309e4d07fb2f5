"""MoE kernels: grouped_mm (the experts), grouped_mm_k (their weight gradients) and take_rows (the token dispatch
and combine), all expert parallel; grouped_mm_blocks and grouped_mm_blocks_k, the experts of tokens routed
block by block and their weight gradients, expert parallel likewise.

grouped_mm(x[R, D], w[E, D, F], ends[E]) -> [R, F]: rows sorted by expert, expert e owning rows
[ends[e-1], ends[e]) (ends[-1] read as 0), the layout transformers' `grouped_mm_fallback` and
`torch._grouped_mm` take. Which rows an expert owns depends on the values of `ends`, so the signature makes the
expert an index dim that is an additive reduction: a block of experts computes its experts' rows and leaves the
others zero, and blocks over experts sum to the whole. Rows, output features, the contraction and experts split
as any dims do (an expert split alone leaves Partial rows); its `Exchange` splits rows and experts together, each
row moved to its expert's device and back inside the step by all-to-all (expert parallelism: plan/exchange.py).
grouped_mm_k(a[M, R], b[R, N], ends[E]) -> [E, M, N] sums each expert's rows (the weight gradient, a = x.T): the
rows are the additive reduction there and the experts an output dim; exchanged, each row goes to its expert's
device and the sums stay there.
take_rows(x[N, D], idx[M]) -> [M, D] is x[idx] with the table's rows a dim of its own, exchanged the same way.
scatter_rows(src[M, D], idx[M]) -> [N, D] adds each row of src into row idx of zeros (take_rows' backward, and an
embedding's): the rows are an additive reduction and the targets an output dim, so it splits by rows into partial
sums, and exchanged each row goes to its target's device, where the sums stay (as grouped_mm_k's).
"""
from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

import numpy as np
import torch
from hypothesis import strategies as st

from tapestry import dtypes
from tapestry.zspace import ZRange
from tapestry.kernels.kernel import (
    Exchange, Kernel, KernelError, ParamValue, Shape, SignatureSpec, follow, matching,
)
from tapestry.kernels.registry import register


def grouped_mm_signature(x: Shape, w: Shape, ends: Shape) -> SignatureSpec:
    if len(x) != 2 or len(w) != 3 or ends != w[:1] or x[1] != w[1]:
        raise KernelError(f"grouped_mm needs x[R, D], w[E, D, F], ends[E]; got x{list(x)}, w{list(w)}, "
                          f"ends{list(ends)}")
    (rows, inner), (experts, _, out) = x, w
    return SignatureSpec(
        dims=("row", "n", "k", "expert"),
        sizes=(rows, out, inner, experts),
        inputs=(follow(4, [0, 2]), follow(4, [3, 2, 1]), follow(4, [None], shape=(experts,))),
        output=follow(4, [0, 1]),
        flops_per_point=Fraction(2, max(1, experts)),  # each row meets one expert: 2·R·F·D in all
    )


def _spans(ends, row0: int, expert0: int, rows: int, experts: int) -> list[tuple[int, int, int]]:
    """(expert in the block, first row, end row) of the block's rows each expert owns, in block coordinates: the
    block starts at row `row0` and expert `expert0` and has `rows` rows and `experts` experts."""
    ends = [int(e) for e in ends]
    spans = []
    for j in range(experts):
        e = expert0 + j
        lo, hi = (ends[e - 1] if e else 0) - row0, ends[e] - row0
        lo, hi = max(lo, 0), min(hi, rows)
        if hi > lo:
            spans.append((j, lo, hi))
    return spans


def _owned_rows(sig, held, src: ZRange, dst: ZRange) -> list[int]:
    """The rows of `src` that `dst`'s experts own, [ends[e-1], ends[e]) each: one run when ends rise, as sorted
    rows have them; else the run spanning them all (the rows between meet none of dst's experts, so computing
    them there adds zeros: exact for any ends). `ends` is the last input: [E] (grouped_mm's, grouped_mm_k's), or
    [B, E], each block's own (grouped_mm_blocks', grouped_mm_blocks_k's), whose run spans every block's: one run
    of rows travels for all the blocks, a block's rows its experts do not own computing zeros."""
    rows, experts = sig.dims.index(sig.kernel.exchange.rows), sig.dims.index(sig.kernel.exchange.experts)
    spans = [(max(ends[e - 1] if e else 0, src.start[rows]), min(ends[e], src.end[rows]))
             for ends in held[-1].reshape(-1, held[-1].shape[-1]).tolist()
             for e in range(dst.start[experts], dst.end[experts])]
    spans = [(lo, hi) for lo, hi in spans if hi > lo]
    if not spans:
        return []
    return list(range(min(lo for lo, _ in spans) - src.start[rows], max(hi for _, hi in spans) - src.start[rows]))


def _grouped_mm_numpy(x, w, ends, block_start: tuple[int, ...]) -> np.ndarray:
    """w made C-contiguous first: an expert's slice of a transposed view (strides (1, F)) multiplies ~15x slower
    (0.26 of Mixtral's 5.2 CPU s of optimize, in its meaning check)."""
    w = np.ascontiguousarray(w)
    out = np.zeros((x.shape[0], w.shape[2]), dtype=np.result_type(x, w))
    for j, lo, hi in _spans(ends.tolist(), block_start[0], block_start[3], x.shape[0], w.shape[0]):
        out[lo:hi] += x[lo:hi] @ w[j]
    return out


def _grouped_mm_torch(x, w, ends, block_start: tuple[int, ...]):
    out = x.new_zeros((x.shape[0], w.shape[2]))
    for j, lo, hi in _spans(ends.tolist(), block_start[0], block_start[3], x.shape[0], w.shape[0]):
        out[lo:hi] += x[lo:hi] @ w[j]
    return out


def _rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue], name: str = "grouped_mm",
          floats: tuple[str, str] = ("x", "w")) -> str:
    if in_dtypes[2] not in ("int32", "int64"):
        raise KernelError(f"{name}: ends must be int32 or int64, got {in_dtypes[2]}")
    if not all(dtypes.is_float(d) for d in in_dtypes[:2]):
        raise KernelError(f"{name} needs float {floats[0]} and {floats[1]}; got {in_dtypes[0]}, {in_dtypes[1]}")
    return matching(floats)(in_dtypes[:2], params)


def _sample(draw):
    rows, inner, out, experts = (draw(st.integers(1, 5)) for _ in range(4))
    return ((rows, inner), (experts, inner, out), (experts,)), {}, ("float", "float", "int64")


register(
    Kernel(
        name="grouped_mm",
        inputs=("x", "w", "ends"),
        signature=grouped_mm_signature,
        numpy=_grouped_mm_numpy,
        torch=_grouped_mm_torch,
        sample=_sample,
        additive=frozenset({"k", "expert"}),
        # rows sorted by expert: under even routing a device's row block is its experts' rows, so none leave
        exchange=Exchange("row", "expert", select=_owned_rows, leaving=lambda p: 0.0, counted=True),
        needs_block_start=True,
        dtype_rule=_rule,
        index_bound=lambda shapes, slot, params: shapes[0][0] + 1 if slot == 2 else None,
        takes_zero_size=False,
        doc="rows [ends[e-1], ends[e]) of x by w[e], for every expert e (a MoE's expert dispatch)",
    )
)


# -- grouped_mm_blocks: each block of tokens routed on its own -----------------------------------------------------
def grouped_mm_blocks_signature(x: Shape, w: Shape, ends: Shape) -> SignatureSpec:
    """grouped_mm for each block b of rows on its own: x[b] sorted by expert within the block, ends[b] its
    experts' end rows (block-local). The block is a plain dim (its rows and ends travel together), so a batch
    split survives routing (importer/block_routing.py); rows, n, k and experts split as grouped_mm's do, and its
    `Exchange` is grouped_mm's: rows and experts split together, each block's rows moved to their experts' device
    and back (one run of rows for all the blocks a device holds, `_owned_rows`)."""
    if len(x) != 3 or len(w) != 3 or ends != (x[0], w[0]) or x[2] != w[1]:
        raise KernelError(f"grouped_mm_blocks needs x[B, R, D], w[E, D, F], ends[B, E]; got x{list(x)}, "
                          f"w{list(w)}, ends{list(ends)}")
    (blocks, rows, inner), (experts, _, out) = x, w
    return SignatureSpec(
        dims=("block", "row", "n", "k", "expert"),
        sizes=(blocks, rows, out, inner, experts),
        inputs=(follow(5, [0, 1, 3]), follow(5, [4, 3, 2]), follow(5, [0, None], shape=(1, experts))),
        output=follow(5, [0, 1, 2]),
        flops_per_point=Fraction(2, max(1, experts)),  # each row meets one expert: 2·B·R·F·D in all
    )


def _grouped_mm_blocks(x, w, ends, block_start: tuple[int, ...], out):
    """Fills `out` (zeros, x's blocks by w's columns) block by block, as grouped_mm does within each block."""
    for b in range(x.shape[0]):
        for j, lo, hi in _spans(ends[b].tolist(), block_start[1], block_start[4], x.shape[1], w.shape[0]):
            out[b, lo:hi] += x[b, lo:hi] @ w[j]
    return out


def _grouped_mm_blocks_numpy(x, w, ends, block_start: tuple[int, ...]) -> np.ndarray:
    w = np.ascontiguousarray(w)  # as grouped_mm's: a transposed view's expert slices multiply slowly
    return _grouped_mm_blocks(x, w, ends, block_start, np.zeros((*x.shape[:2], w.shape[2]), np.result_type(x, w)))


def _grouped_mm_blocks_torch(x, w, ends, block_start: tuple[int, ...]):
    return _grouped_mm_blocks(x, w, ends, block_start, x.new_zeros((*x.shape[:2], w.shape[2])))


def _sample_blocks(draw):
    blocks, rows, inner, out, experts = (draw(st.integers(1, 4)) for _ in range(5))
    return ((blocks, rows, inner), (experts, inner, out), (blocks, experts)), {}, ("float", "float", "int64")


register(
    Kernel(
        name="grouped_mm_blocks",
        inputs=("x", "w", "ends"),
        signature=grouped_mm_blocks_signature,
        numpy=_grouped_mm_blocks_numpy,
        torch=_grouped_mm_blocks_torch,
        sample=_sample_blocks,
        additive=frozenset({"k", "expert"}),
        # each block's rows sorted by expert: under even routing a device's rows are its experts', as grouped_mm's
        exchange=Exchange("row", "expert", select=_owned_rows, leaving=lambda p: 0.0, counted=True),
        needs_block_start=True,
        dtype_rule=lambda in_dtypes, params: _rule(in_dtypes, params, "grouped_mm_blocks"),
        index_bound=lambda shapes, slot, params: shapes[0][1] + 1 if slot == 2 else None,
        takes_zero_size=False,
        doc="grouped_mm of each block of rows with its own ends[b] (a MoE routed block by block)",
    )
)


def grouped_mm_blocks_k_signature(x: Shape, g: Shape, ends: Shape) -> SignatureSpec:
    """out[e] = sum over blocks b of x[b, rows of e in b].T @ g[b, rows of e in b]: grouped_mm_blocks' weight
    gradient (x its input, g its output's gradient). The blocks and rows are additive reductions (a data-parallel
    split sums partial gradients), the experts an output dim; its `Exchange` is grouped_mm_k's: each block's rows
    sent to their expert's device, where the sums stay."""
    if len(x) != 3 or len(g) != 3 or x[:2] != g[:2] or len(ends) != 2 or ends[0] != x[0]:
        raise KernelError(f"grouped_mm_blocks_k needs x[B, R, M], g[B, R, N], ends[B, E]; got x{list(x)}, "
                          f"g{list(g)}, ends{list(ends)}")
    (blocks, rows, inner), out, experts = x, g[2], ends[1]
    return SignatureSpec(
        dims=("expert", "m", "n", "block", "row"),
        sizes=(experts, inner, out, blocks, rows),
        inputs=(follow(5, [3, 4, 1]), follow(5, [3, 4, 2]), follow(5, [3, None], shape=(1, experts))),
        output=follow(5, [0, 1, 2]),
        flops_per_point=Fraction(2, max(1, experts)),  # each row meets one expert: 2·B·R·M·N in all
    )


def _grouped_mm_blocks_k(x, g, ends, block_start: tuple[int, ...], out):
    """Adds into `out` (zeros, the block's experts by m by n) each block's rows' products, expert by expert."""
    for b in range(x.shape[0]):
        for j, lo, hi in _spans(ends[b].tolist(), block_start[4], block_start[0], x.shape[1], out.shape[0]):
            out[j] += x[b, lo:hi].T @ g[b, lo:hi]
    return out


def _grouped_mm_blocks_k_numpy(x, g, ends, out_shape: tuple[int, ...], block_start: tuple[int, ...]) -> np.ndarray:
    """`out_shape`: the block's expert count is in no read (`ends` is read whole), as grouped_mm_k's."""
    return _grouped_mm_blocks_k(x, g, ends, block_start, np.zeros(out_shape, dtype=np.result_type(x, g)))


def _grouped_mm_blocks_k_torch(x, g, ends, out_shape: tuple[int, ...], block_start: tuple[int, ...]):
    return _grouped_mm_blocks_k(x, g, ends, block_start, x.new_zeros(out_shape))


def _sample_blocks_k(draw):
    blocks, rows, inner, out, experts = (draw(st.integers(1, 4)) for _ in range(5))
    return (((blocks, rows, inner), (blocks, rows, out), (blocks, experts)), {},
            ("float", "float", "int64"))


register(
    Kernel(
        name="grouped_mm_blocks_k",
        inputs=("x", "g", "ends"),
        signature=grouped_mm_blocks_k_signature,
        numpy=_grouped_mm_blocks_k_numpy,
        torch=_grouped_mm_blocks_k_torch,
        sample=_sample_blocks_k,
        additive=frozenset({"block", "row"}),
        # rows sorted by expert within each block: under even routing none leave (grouped_mm_k's)
        exchange=Exchange("row", "expert", select=_owned_rows, leaving=lambda p: 0.0, counted=True),
        needs_out_shape=True,
        needs_block_start=True,
        dtype_rule=lambda in_dtypes, params: _rule(in_dtypes, params, "grouped_mm_blocks_k", ("x", "g")),
        index_bound=lambda shapes, slot, params: shapes[0][1] + 1 if slot == 2 else None,
        takes_zero_size=False,
        doc="sum over blocks b of x[b, rows of e].T @ g[b, rows of e] for every expert e, block-local rows "
            "[ends[b, e-1], ends[b, e]): grouped_mm_blocks' weight gradient",
    )
)


# -- grouped_mm_k: the experts' weight gradients ------------------------------------------------------------------
def grouped_mm_k_signature(a: Shape, b: Shape, ends: Shape) -> SignatureSpec:
    """out[e] = a[:, rows of e] @ b[rows of e] for rows [ends[e-1], ends[e]): torch's 2-D by 2-D `_grouped_mm`,
    groups along the contraction, which is grouped_mm's weight gradient (a = x.T, b = the output's gradient).
    The rows are an additive reduction and the experts an output dim; a block of experts reads every row of its
    row range and computes its experts' (`flops_per_point` 2/E, as grouped_mm's). Its `Exchange` splits rows and
    experts together: each row moved to its expert's device, where the sums are whole (nothing comes back)."""
    if len(a) != 2 or len(b) != 2 or len(ends) != 1 or a[1] != b[0]:
        raise KernelError(f"grouped_mm_k needs a[M, R], b[R, N], ends[E]; got a{list(a)}, b{list(b)}, "
                          f"ends{list(ends)}")
    (inner, rows), (_, out), (experts,) = a, b, ends
    return SignatureSpec(
        dims=("expert", "m", "n", "row"),
        sizes=(experts, inner, out, rows),
        inputs=(follow(4, [1, 3]), follow(4, [3, 2]), follow(4, [None], shape=(experts,))),
        output=follow(4, [0, 1, 2]),
        flops_per_point=Fraction(2, max(1, experts)),  # each row meets one expert: 2·R·M·N in all
    )


def _grouped_mm_k_numpy(a, b, ends, out_shape: tuple[int, ...], block_start: tuple[int, ...]) -> np.ndarray:
    """The block's experts (`out_shape`: `ends` is read whole, so the block's expert count is not in its reads)."""
    out = np.zeros(out_shape, dtype=np.result_type(a, b))
    for j, lo, hi in _spans(ends.tolist(), block_start[3], block_start[0], a.shape[1], out_shape[0]):
        out[j] += a[:, lo:hi] @ b[lo:hi]
    return out


def _grouped_mm_k_torch(a, b, ends, out_shape: tuple[int, ...], block_start: tuple[int, ...]):
    out = a.new_zeros(out_shape)
    for j, lo, hi in _spans(ends.tolist(), block_start[3], block_start[0], a.shape[1], out_shape[0]):
        out[j] += a[:, lo:hi] @ b[lo:hi]
    return out


def _sample_k(draw):
    rows, inner, out, experts = (draw(st.integers(1, 5)) for _ in range(4))
    return ((inner, rows), (rows, out), (experts,)), {}, ("float", "float", "int64")


register(
    Kernel(
        name="grouped_mm_k",
        inputs=("a", "b", "ends"),
        signature=grouped_mm_k_signature,
        numpy=_grouped_mm_k_numpy,
        torch=_grouped_mm_k_torch,
        sample=_sample_k,
        additive=frozenset({"row"}),
        # rows sorted by expert: under even routing a device's row block is its experts' rows, so none leave
        exchange=Exchange("row", "expert", select=_owned_rows, leaving=lambda p: 0.0, counted=True),
        needs_out_shape=True,
        needs_block_start=True,
        dtype_rule=lambda in_dtypes, params: _rule(in_dtypes, params, "grouped_mm_k", ("a", "b")),
        index_bound=lambda shapes, slot, params: shapes[0][1] + 1 if slot == 2 else None,
        takes_zero_size=False,
        doc="a[:, rows of e] @ b[rows of e] for every expert e, rows [ends[e-1], ends[e]): grouped_mm's weight "
            "gradient (torch's 2-D by 2-D _grouped_mm)",
    )
)


# -- take_rows: MoE dispatch and combine -------------------------------------------------------------------------
def take_rows_signature(x: Shape, idx: Shape, rows: int) -> SignatureSpec:
    """x[idx] with the table's rows an index dim ("source") of their own: an additive reduction (a block of table
    rows fills the output rows whose index falls in it, zeros elsewhere), so the table may stay split by rows
    while the output rows gather from it, and rows and source split together exchange rows by all-to-all
    (MoE's token dispatch and combine)."""
    if len(x) != 2 or len(idx) != 1 or rows != x[0]:
        raise KernelError(f"take_rows needs x[N, D], idx[M] and rows=N; got x{list(x)}, idx{list(idx)}, "
                          f"rows={rows}")
    return SignatureSpec(
        dims=("row", "col", "source"),
        sizes=(idx[0], x[1], x[0]),
        inputs=(follow(3, [2, 1]), follow(3, [0])),
        output=follow(3, [0, 1]),
        flops_per_point=0,
    )


def _normalized(idx, rows: int, block_rows: int, start: int, kernel: str = "take_rows"):
    """Each index as a row of the block (negatives count from the end of the table), and whether the block holds
    it; an index outside the table raises, as torch's indexing does."""
    bad = (idx < -rows) | (idx >= rows)
    if bool(bad.any()):
        raise IndexError(f"{kernel}: index {int(idx[bad][0])} is out of bounds for a table of {rows} rows")
    local = (idx % rows) - start
    return local, (local >= 0) & (local < block_rows)


def _take_rows_numpy(x, idx, rows: int, block_start: tuple[int, ...]) -> np.ndarray:
    local, inside = _normalized(np.asarray(idx), rows, x.shape[0], block_start[2])
    out = np.zeros((len(idx), x.shape[1]), dtype=x.dtype)
    out[inside] = x[local[inside]]
    return out


def _take_rows_torch(x, idx, rows: int, block_start: tuple[int, ...]):
    """Whole tables index directly (torch raises on a bad index); a block of rows masks the rows it lacks, with
    shapes that do not depend on the values (it traces with make_fx)."""
    if block_start[2] == 0 and x.shape[0] == rows:
        return x[idx.long()]
    local = (idx.long() % rows) - block_start[2]
    inside = (local >= 0) & (local < x.shape[0])
    picked = x[local.clamp(0, max(x.shape[0] - 1, 0))]
    return torch.where(inside.unsqueeze(1), picked, torch.zeros((), dtype=x.dtype, device=x.device))


def _routed_rows(sig, held, src: ZRange, dst: ZRange) -> list[int]:
    """The rows of `src` whose index falls in `dst`'s table rows."""
    rows = sig.input_shapes[0][0]
    lo, hi = dst.start[2], dst.end[2]
    return [k for k, v in enumerate(held[1].tolist()) if lo <= int(v) % rows < hi]


def _sample_take_rows(draw):
    rows, cols, count = (draw(st.integers(1, 5)) for _ in range(3))
    return ((rows, cols), (count,)), {"rows": rows}, ("float", "int64")


register(
    Kernel(
        name="take_rows",
        inputs=("x", "idx"),
        signature=take_rows_signature,
        numpy=_take_rows_numpy,
        torch=_take_rows_torch,
        sample=_sample_take_rows,
        params={"rows": 1},
        additive=frozenset({"source"}),
        needs_block_start=True,
        # each index names a table row on a uniformly drawn device: (p-1)/p of a device's rows leave
        exchange=Exchange("row", "source", select=_routed_rows, leaving=lambda p: (p - 1) / p),
        dtype_rule=lambda in_dtypes, params: _index_rule(in_dtypes),
        index_bound=lambda shapes, slot, params: shapes[0][0] if slot == 1 else None,
        takes_zero_size=False,
        doc="x[idx] of a 2-D table by a 1-D index, the table's rows an additive dim: a split table gathers by "
            "all-to-all (MoE dispatch and combine); rules/experts.egg makes it from take",
    )
)


def _index_rule(in_dtypes: tuple[str, ...]) -> str:
    if in_dtypes[1] not in ("int32", "int64"):
        raise KernelError(f"take_rows: idx must be int32 or int64, got {in_dtypes[1]}")
    return in_dtypes[0]


# -- scatter_rows: the backward of the dispatch and combine (and of an embedding) ----------------------------------
def scatter_rows_signature(src: Shape, idx: Shape, rows: int) -> SignatureSpec:
    """out[n] = sum of src[m] over the m with idx[m] = n, out [rows, D]: the transpose of take_rows. The rows are
    an additive reduction (a block of rows adds its own, the blocks' partial sums add up), the targets an output
    dim of their own (a block of targets reads every row and keeps those landing in it, one add per row and
    column: `flops_per_point` 1/rows); its `Exchange` splits rows and targets together, each row sent to the device
    holding its target row, where the sums are whole (nothing comes back): an all-to-all of the rows, where a
    target split reading every row gathers them whole."""
    if len(src) != 2 or idx != src[:1] or rows < 1:
        raise KernelError(f"scatter_rows needs src[M, D], idx[M] and rows >= 1; got src{list(src)}, idx{list(idx)}, "
                          f"rows={rows}")
    return SignatureSpec(
        dims=("row", "col", "target"),
        sizes=(src[0], src[1], rows),
        inputs=(follow(3, [0, 1]), follow(3, [0])),
        output=follow(3, [2, 1]),
        flops_per_point=Fraction(1, rows),
    )


def _scatter_rows_numpy(src, idx, rows: int, out_shape: tuple[int, ...], block_start: tuple[int, ...]) -> np.ndarray:
    """The block's target rows (`out_shape`: its target count is in no read) plus the rows whose index lands in
    them."""
    local, inside = _normalized(np.asarray(idx), rows, out_shape[0], block_start[2], "scatter_rows")
    out = np.zeros(out_shape, dtype=src.dtype)
    np.add.at(out, local[inside], src[inside])
    return out


def _scatter_rows_torch(src, idx, rows: int, out_shape: tuple[int, ...], block_start: tuple[int, ...]):
    """As the numpy one, with shapes that do not depend on the values (it traces with make_fx): rows landing
    elsewhere add zeros to row 0."""
    local = (idx.long() % rows) - block_start[2]
    inside = (local >= 0) & (local < out_shape[0])
    kept = torch.where(inside.unsqueeze(1), src, torch.zeros((), dtype=src.dtype, device=src.device))
    return src.new_zeros(out_shape).index_add(0, torch.where(inside, local, 0), kept)


def _targeted_rows(sig, held, src: ZRange, dst: ZRange) -> list[int]:
    """The rows of `src` whose index falls in `dst`'s target rows."""
    rows = sig.output_shape[0]
    lo, hi = dst.start[2], dst.end[2]
    return [k for k, v in enumerate(held[1].tolist()) if lo <= int(v) % rows < hi]


def _scatter_rows_rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    src, idx = in_dtypes
    if idx not in ("int32", "int64"):
        raise KernelError(f"scatter_rows: idx must be int32 or int64, got {idx}")
    if src == "bool":
        raise KernelError("scatter_rows adds rows: src must be numeric, got bool")
    return src


def _sample_scatter_rows(draw):
    rows, cols, count = (draw(st.integers(1, 5)) for _ in range(3))
    return ((count, cols), (count,)), {"rows": rows}, ("float", "int64")


register(
    Kernel(
        name="scatter_rows",
        inputs=("src", "idx"),
        signature=scatter_rows_signature,
        numpy=_scatter_rows_numpy,
        torch=_scatter_rows_torch,
        sample=_sample_scatter_rows,
        params={"rows": 1},
        additive=frozenset({"row"}),
        needs_out_shape=True,
        needs_block_start=True,
        # each index names a target row on a uniformly drawn device: (p-1)/p of a device's rows leave
        exchange=Exchange("row", "target", select=_targeted_rows, leaving=lambda p: (p - 1) / p),
        dtype_rule=_scatter_rows_rule,
        index_bound=lambda shapes, slot, params: params["rows"] if slot == 1 else None,
        takes_zero_size=False,
        doc="zeros[rows, D] with src[m] added at row idx[m] (take_rows' and an embedding's backward), the rows an "
            "additive dim: split by rows it sums partially, exchanged it sends each row to its target's device",
    )
)
