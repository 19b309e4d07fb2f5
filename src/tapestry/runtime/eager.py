"""The baseline a user would write by hand: every op as one eager torch call on whole tensors."""
from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import torch

from tapestry import dtypes
from tapestry.evaluator import random_inputs
from tapestry.graph import Graph
from tapestry.zspace import ZRange


def _whole(value: torch.Tensor, region: ZRange) -> torch.Tensor:
    """The op's read of `value`: the tensor itself, or zero-padded where the read leaves it (conv padding)."""
    if region == ZRange.from_shape(tuple(value.shape)):
        return value
    pad = [p for d in reversed(range(region.ndim)) for p in (-region.start[d], region.end[d] - value.shape[d])]
    return torch.nn.functional.pad(value, pad)


def interpret(graph: Graph, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the graph with each kernel's torch impl on whole tensors (or DTensors)."""
    env = dict(values)
    for node in graph.ops:
        sig = graph.signature(node.name)
        args = [_whole(env[a], p.apply(sig.index)) for a, p in zip(node.args, sig.projections)]
        env[node.name] = sig.kernel.torch(*args, **sig.call_kwargs(sig.index))
    return {name: env[target] for name, target in graph.outputs.items()}


def eager_seconds(graph: Graph, warmup: int = 2, repeat: int = 10) -> float:
    """Median wall time of `interpret` in this process, on one thread."""
    torch.set_num_threads(1)
    inputs = {k: dtypes.to_tensor(v) for k, v in random_inputs(graph).items()}
    times = []
    for _ in range(warmup + repeat):
        start = time.perf_counter()
        interpret(graph, inputs)
        times.append(time.perf_counter() - start)
    return float(np.median(times[warmup:]))
