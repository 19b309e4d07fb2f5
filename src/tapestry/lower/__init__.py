"""Lowering: a plan becomes one program per rank, with inductor-compiled shard kernels."""
from tapestry.lower.compile import shard_function, use_persistent_cache
from tapestry.lower.program import (
    AllGather, AllReduce, AllToAll, Comm, Exchange, Gather, Local, LoweredProgram, LoweringError, Piece, PlaceBlock,
    RankProgram, RankStep, Read, ReduceScatter, SendRecv, ShardCompute, lower, step_type,
)

__all__ = [
    "AllGather", "AllReduce", "AllToAll", "Comm", "Exchange", "Gather", "Local", "LoweredProgram", "LoweringError", "Piece",
    "PlaceBlock", "RankProgram", "RankStep", "Read", "ReduceScatter", "SendRecv", "ShardCompute", "lower", "step_type",
    "shard_function", "use_persistent_cache",
]
