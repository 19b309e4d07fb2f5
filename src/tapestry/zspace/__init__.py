"""ZSpace: integer boxes, affine index projections, and their islpy oracle.

The oracle's names load islpy on first use, so that running a saved plan (`tapestry run PLAN.json`) needs only
torch and numpy: a machine that runs plans need not have islpy.
"""
from __future__ import annotations

import importlib
from typing import Any

from tapestry.zspace.affine import IndexProjection, ZAffineMap
from tapestry.zspace.zrange import Point, ZRange

_ISL = ("bounding_box", "box_of", "covers", "difference", "footprint", "is_partition", "partition_problems",
        "set_size", "to_isl_map", "to_isl_set")


def __getattr__(name: str) -> Any:
    if name in _ISL:
        return getattr(importlib.import_module("tapestry.zspace.isl"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["IndexProjection", "Point", "ZAffineMap", "ZRange", *_ISL]
