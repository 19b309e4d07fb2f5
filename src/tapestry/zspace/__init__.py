"""ZSpace: integer boxes, affine index projections, and their islpy oracle."""

from tapestry.zspace.affine import IndexProjection, ZAffineMap
from tapestry.zspace.isl import (
    bounding_box,
    box_of,
    covers,
    difference,
    footprint,
    is_partition,
    partition_problems,
    set_size,
    to_isl_map,
    to_isl_set,
)
from tapestry.zspace.zrange import Point, ZRange

__all__ = [
    "IndexProjection",
    "Point",
    "ZAffineMap",
    "ZRange",
    "bounding_box",
    "box_of",
    "covers",
    "difference",
    "footprint",
    "is_partition",
    "partition_problems",
    "set_size",
    "to_isl_map",
    "to_isl_set",
]
