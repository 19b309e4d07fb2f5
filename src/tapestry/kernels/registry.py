"""The kernel registry: name -> Kernel. Kernel modules register themselves on import."""
from __future__ import annotations

import difflib

from tapestry.kernels.kernel import Kernel, KernelError

KERNELS: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    if kernel.name in KERNELS:
        raise KernelError(f"kernel {kernel.name!r} is already registered")
    KERNELS[kernel.name] = kernel
    return kernel


def get_kernel(name: str) -> Kernel:
    try:
        return KERNELS[name]
    except KeyError:
        close = difflib.get_close_matches(name, KERNELS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KernelError(f"unknown kernel {name!r}{hint}; known kernels: {', '.join(sorted(KERNELS))}") from None
