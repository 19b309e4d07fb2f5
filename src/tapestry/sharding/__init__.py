"""Meshes, layouts, candidate partitions and communication sets."""
from tapestry.sharding.layout import Block, Layout
from tapestry.sharding.mesh import Mesh

__all__ = ["Block", "Layout", "Mesh"]
