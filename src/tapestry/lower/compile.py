"""Shard kernels as callables: torch.compile'd once per (kernel, kwargs, block shapes), or eager.

Compiling per block shape keeps inductor's generated code static-shaped (the
fast path on CPU); the inductor cache lives in a persistent folder so a second
process, or a second run, loads the code instead of compiling it again.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tapestry.kernels import Params, Shape, get_kernel

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
DEFAULT_CACHE = Path.home() / ".cache" / "tapestry" / "inductor"
# Every shard of one kernel shares the impl's code object, and dynamo counts recompiles per code
# object: uneven splits and many layers would pass the default limit of 8 and silently run eager.
RECOMPILE_LIMIT = 256

if TYPE_CHECKING:
    from tapestry.lower.program import LoweredProgram

ShardFn = Callable[..., torch.Tensor]


def use_persistent_cache() -> Path:
    """Point inductor at the persistent cache unless the user already chose one."""
    os.environ.setdefault(CACHE_ENV, str(DEFAULT_CACHE))
    return Path(os.environ[CACHE_ENV])


def shard_function(kernel: str, kwargs: Params, shapes: tuple[Shape, ...], compile: bool) -> ShardFn:
    """The callable for one shard. Views never compile: they move no data."""
    if compile and not get_kernel(kernel).is_view:
        return _compiled(kernel, kwargs, shapes)
    return _eager(kernel, kwargs)


@functools.cache
def _eager(kernel: str, kwargs: Params) -> ShardFn:
    return functools.partial(get_kernel(kernel).torch, **dict(kwargs))


@functools.cache
def _compiled(kernel: str, kwargs: Params, shapes: tuple[Shape, ...]) -> ShardFn:
    """`shapes` is part of the key so each distinct block shape gets its own static-shape graph."""
    use_persistent_cache()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(_eager(kernel, kwargs), dynamic=False, fullgraph=True)


def warm_cache(program: LoweredProgram) -> int:
    """Compile every distinct shard kernel of `program` once, here, so that ranks load it from the
    persistent cache instead of all compiling it at once. Returns how many kernels it compiled."""
    from tapestry.lower.program import ShardCompute

    seen = set()
    for rank in program.ranks:
        for step in rank.steps:
            if isinstance(step, ShardCompute) and not get_kernel(step.kernel).is_view:
                shapes = tuple(r.shape for r in step.reads)
                if (step.kernel, step.kwargs, shapes) not in seen:
                    seen.add((step.kernel, step.kwargs, shapes))
                    shard_function(step.kernel, step.kwargs, shapes, True)(*(torch.zeros(s) for s in shapes))
    return len(seen)
