"""The kernel registry. Each kernel is one `register(Kernel(...))` entry; see docs/kernels.md."""
from tapestry.kernels import conv, elementwise, fused, linear, matmul, reductions, views  # noqa: F401  (registration)
from tapestry.kernels import attention, embedding, flash  # noqa: F401  (registration)
from tapestry.kernels import experts, fourier, indexing, ordering, scan, shape, vision  # noqa: F401  (registration)
from tapestry.kernels import opaque  # noqa: F401  (registration; after the kernels it may stand in for)
from tapestry.kernels.kernel import DimKind, Kernel, KernelError, Params, ParamValue, Shape, Signature, SignatureSpec, follow
from tapestry.kernels.registry import KERNELS, get_kernel, register

__all__ = [
    "KERNELS",
    "DimKind",
    "Kernel",
    "KernelError",
    "Params",
    "ParamValue",
    "Shape",
    "Signature",
    "SignatureSpec",
    "follow",
    "get_kernel",
    "register",
]
