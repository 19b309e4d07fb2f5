"""ATen op -> Tapestry kernels: one converter per op family, kept as data in CONVERTERS.

A converter receives the Builder and the op's arguments (graph Values for
tensors computed from inputs, torch tensors for constants, Python values for
the rest) and returns the Value (or tuple of Values) of the op. It raises
Unsupported for a form it does not map, and the op then runs opaque.

One module per family of ops; importing this package registers them all.
"""
from tapestry.importer.aten import (  # noqa: F401  (each module registers its converters)
    attention,
    convolution,
    elementwise,
    embedding,
    fourier,
    indexing,
    linalg,
    moe,
    normalization,
    recurrent,
    reductions,
    views,
)
