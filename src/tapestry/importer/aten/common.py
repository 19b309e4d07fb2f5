"""What every converter family reads: numbers among the arguments and axes counted from the end."""
from __future__ import annotations

from typing import Any

import torch


Scalar = (bool, int, float)


def _scalar(value: Any) -> float | None:
    """A Python number, or a 0-dim constant tensor, as a float; else None."""
    if isinstance(value, Scalar):
        return float(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return float(value.item())
    return None


def _axis(value: int, ndim: int) -> int:
    return value % ndim if ndim else 0
