"""Persistent SPMD execution: each rank's program as one compiled function, run in the user's process group.

A layer above plan, lower and runtime.launch: nothing below imports it. `trace` is the engine (a rank's steps as
one pure torch function with functional collectives, compiled whole by torch.compile).
"""
from tapestry.spmd.trace import RankFunction, buffer_dtypes, compiled, make_groups, place

__all__ = ["RankFunction", "buffer_dtypes", "compiled", "make_groups", "place"]
