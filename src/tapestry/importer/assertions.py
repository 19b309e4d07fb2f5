"""The checks an exported program makes (`aten._assert_*` nodes), evaluated at import time.

Why here and not dropped: a Tapestry graph has static shapes and dtypes, so every such check that reads only
them (or constants) can be decided now, once, for every run. A check that holds is then bookkeeping; one that
fails means the program (or the importer's value for it) is not what torch traced, and the import stops naming
the node. A check of a value only known at run time cannot be decided now and a plan has no run-time checks, so
the import stops rather than drop it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tapestry import dtypes
from tapestry.graph import Value
from tapestry.importer.errors import TorchImportError

ASSERTS = ("aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten._assert_async.default",
           "aten._assert_async.msg")


def check_assertion(node: torch.fx.Node, name: str, args: Sequence[Any], kwargs: dict[str, Any], where: str) -> None:
    """Raise TorchImportError if the `aten._assert_*` node `node` (resolved `args`/`kwargs`) fails or cannot be
    decided at import time; return if it holds. `where` locates the node for the message."""
    context = f"{name} (node {node.name!r}) at {where}"
    if name == "aten._assert_tensor_metadata.default":
        failed = _metadata_mismatch(node, *args, **kwargs)
        if failed:
            raise TorchImportError(f"{context}: the check fails: {failed}")
        return
    if name not in ASSERTS:
        raise TorchImportError(f"{context}: an assertion the importer does not know how to check")
    condition, message = (*args, None)[:2]
    if isinstance(condition, torch.Tensor) and condition.device.type != "meta" and condition.numel() == 1:
        condition = condition.item()
    if not isinstance(condition, (bool, int, float)):
        raise TorchImportError(
            f"{context}: checks {_described(condition)}, known only at run time; a plan has no run-time checks, "
            "and the import will not drop the check")
    if not condition:
        raise TorchImportError(f"{context}: the check fails" + (f": {message}" if message else ""))


def _metadata_mismatch(node: torch.fx.Node, value: Any, size: Sequence[int] | None = None,
                       stride: Sequence[int] | None = None, dtype: torch.dtype | None = None,
                       device: torch.device | None = None, layout: torch.layout | None = None) -> str:
    """What of `_assert_tensor_metadata`'s claims is false, or "". Shape and dtype are checked against the value
    the importer made (what the plan computes); stride, device and layout, which a Tapestry value does not have
    (a plan places and lays out each value itself), against the tensor torch traced."""
    if isinstance(value, Value):
        shape, dtype_name = tuple(value.shape), value.dtype
    elif isinstance(value, torch.Tensor):
        shape, dtype_name = tuple(value.shape), dtypes.name_of(value.dtype)
    else:
        return f"it reads {_described(value)}, not a tensor"
    traced = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    wrong = []
    if size is not None and tuple(size) != shape:
        wrong.append(f"shape {list(shape)}, expected {list(size)}")
    if dtype is not None and dtypes.name_of(dtype) != dtype_name:
        wrong.append(f"dtype {dtype_name}, expected {dtypes.name_of(dtype)}")
    storage = {"stride": None if stride is None else tuple(stride), "device": device, "layout": layout}
    if any(claim is not None for claim in storage.values()) and not isinstance(traced, torch.Tensor):
        wrong.append("stride, device or layout claimed, but torch recorded no traced tensor to check them on")
    elif isinstance(traced, torch.Tensor):
        had = {"stride": tuple(traced.stride()), "device": traced.device, "layout": traced.layout}
        wrong += [f"traced {key} {had[key]}, expected {claim}" for key, claim in storage.items()
                  if claim is not None and had[key] != claim]
    return "; ".join(wrong)


def _described(value: Any) -> str:
    if isinstance(value, Value):
        return f"graph value {value.name!r} (shape {list(value.shape)}, {value.dtype})"
    return f"a {type(value).__name__}"
