"""Element types: names, sizes, promotion, and their numpy and torch forms.

A dtype is named by its torch name ("bfloat16", "int64", "bool"); graphs, plans
and JSON carry the name. numpy has no bfloat16, so its numpy form comes from
ml_dtypes; the reference evaluator computes half-precision kernels in float32
and rounds the result (`compute_dtype`), as torch's CPU kernels do.
Promotion follows torch (`torch.promote_types`), so a graph op's dtype is the
dtype torch gives the same op.
"""
from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np

DTYPES = ("bool", "int32", "int64", "float16", "bfloat16", "float32", "float64")
FLOATS = ("float16", "bfloat16", "float32", "float64")
ITEMSIZE = {"bool": 1, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_NUMPY = {**{d: np.dtype(d) for d in DTYPES if d != "bfloat16"}, "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_ORDER = {"bool": 0, "int32": 1, "int64": 2, "float16": 3, "bfloat16": 3, "float32": 4, "float64": 5}


class DtypeError(ValueError):
    """A dtype name that is not one of DTYPES, or operands that cannot be combined."""


def check(name: str, where: str = "") -> str:
    if name not in DTYPES:
        prefix = f"{where}: " if where else ""
        raise DtypeError(f"{prefix}dtype {name!r} is not one of {', '.join(DTYPES)}")
    return name


def itemsize(name: str) -> int:
    return ITEMSIZE[check(name)]


def is_float(name: str) -> bool:
    return name in FLOATS


def to_numpy(name: str) -> np.dtype:
    return _NUMPY[check(name)]


def name_of(dtype: Any) -> str:
    """The name of a numpy or torch dtype (or of an array or tensor's dtype)."""
    dtype = getattr(dtype, "dtype", dtype)
    text = str(dtype).removeprefix("torch.")
    return check("bool" if text == "bool_" else text)


def to_torch(name: str) -> Any:
    import torch

    return getattr(torch, check(name))


@functools.cache
def promote(*names: str) -> str:
    """torch's type promotion over tensor operands (float16 with bfloat16 gives float32, as in torch)."""
    for n in names:
        check(n)
    if not names:
        return "float32"
    top = max(_ORDER[n] for n in names)
    kinds = {n for n in names if _ORDER[n] == top}
    if kinds == {"float16", "bfloat16"}:
        return "float32"
    return kinds.pop()


def random_array(rng: np.random.Generator, shape: tuple[int, ...], name: str, bound: int | None = None,
                 nonnegative: bool = False) -> np.ndarray:
    """Random values of dtype `name`: standard normals (their magnitudes if `nonnegative`), fair booleans, or
    integers in [0, bound) (default 4)."""
    if is_float(name):
        normals = rng.standard_normal(shape)
        return cast(np.abs(normals) if nonnegative else normals, name)
    if name == "bool":
        return rng.random(shape) < 0.5
    return rng.integers(0, max(1, bound or 4), shape).astype(to_numpy(name))


def compute_dtype(name: str) -> np.dtype:
    """The numpy dtype the reference evaluator computes in: float32 for the half types."""
    return np.dtype(np.float32) if name in ("float16", "bfloat16") else to_numpy(name)


def cast(array: Any, name: str) -> np.ndarray:
    """`array` as a numpy array of dtype `name` (bfloat16 through ml_dtypes). A .npy file of bfloat16 loads as
    raw 2-byte records (numpy does not know the type), which are reinterpreted, not converted."""
    array, target = np.asarray(array), to_numpy(name)
    if array.dtype.kind == "V" and array.dtype.itemsize == target.itemsize:
        return array.view(target)
    return array.astype(target, copy=False)


def to_tensor(array: np.ndarray) -> Any:
    """A torch tensor sharing `array`'s memory where torch can (bfloat16 through its 16 bits)."""
    import torch

    array = np.ascontiguousarray(array).reshape(np.shape(array))  # ascontiguousarray makes a 0-dim array 1-dim
    if array.dtype == _NUMPY["bfloat16"]:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


class NoDataError(ValueError):
    """A tensor without data (on the meta device, or a fake tensor) asked for its values."""


def from_tensor(tensor: Any, what: str = "tensor") -> np.ndarray:
    """A CPU numpy copy of `tensor` (bfloat16 as ml_dtypes.bfloat16). A tensor with no data (meta, fake) raises
    NoDataError naming `what`: its values cannot be made up."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    if tensor.is_meta or is_fake(tensor):
        raise NoDataError(f"{what} {list(tensor.shape)} {name_of(tensor.dtype)} has no data (it is on the meta "
                          "device or a fake tensor): load real values before asking for them")
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_NUMPY["bfloat16"])
    return tensor.numpy()
