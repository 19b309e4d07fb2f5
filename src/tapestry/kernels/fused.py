"""Fused elementwise chains: one pass over memory instead of two."""
from __future__ import annotations

import numpy as np
import torch

from tapestry.kernels.elementwise import _binary_sample, broadcast_signature
from tapestry.kernels.kernel import Kernel, numeric
from tapestry.kernels.registry import register

register(
    Kernel(
        name="add_relu",
        inputs=("a", "b"),
        signature=broadcast_signature,
        numpy=lambda a, b: np.maximum(a + b, 0),
        torch=lambda a, b: torch.relu(a + b),
        sample=_binary_sample,
        dtype_rule=numeric("add_relu", ("a", "b")),
        doc="relu(a + b), fused",
    )
)
