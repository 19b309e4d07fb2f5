"""embedding(ids, weight[V, D]) -> [*ids, D]: row ids[i] of the table, for every i.

The index dims are ids' dims and the feature dim D, all parallel. Which rows a block needs depends on the
ids' values, not on where the block lies, so every block reads its columns of the table whole.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from hypothesis import strategies as st

from tapestry.kernels.kernel import Kernel, KernelError, ParamValue, Shape, SignatureSpec, follow
from tapestry.kernels.registry import register


def embedding_signature(ids: Shape, weight: Shape) -> SignatureSpec:
    if len(weight) != 2:
        raise KernelError(f"embedding needs weight[V, D]; got weight{list(weight)}")
    n = len(ids) + 1
    return SignatureSpec(
        dims=(*(f"d{i}" for i in range(len(ids))), "feature"),
        sizes=(*ids, weight[1]),
        inputs=(follow(n, range(len(ids))), follow(n, [None, n - 1], shape=(weight[0], 1))),
        output=follow(n, range(n)),
        flops_per_point=0,
    )


def _rule(in_dtypes: tuple[str, ...], params: Mapping[str, ParamValue]) -> str:
    if in_dtypes[0] not in ("int32", "int64"):
        raise KernelError(f"ids must be int32 or int64, got {in_dtypes[0]}")
    return in_dtypes[1]


def _sample(draw):
    ids = tuple(draw(st.lists(st.integers(1, 5), max_size=2)))
    weight = (draw(st.integers(1, 8)), draw(st.integers(1, 6)))
    return (ids, weight), {}, (draw(st.sampled_from(["int64", "int32"])), "float")


register(
    Kernel(
        name="embedding",
        inputs=("ids", "weight"),
        signature=embedding_signature,
        numpy=lambda ids, weight: weight[ids],
        torch=lambda ids, weight: torch.nn.functional.embedding(ids, weight),
        sample=_sample,
        dtype_rule=_rule,
        index_bound=lambda shapes, slot, params: shapes[1][0] if slot == 0 else None,
        takes_zero_size=False,
        doc="rows of weight[V, D] picked by integer ids (weight's dtype)",
    )
)
