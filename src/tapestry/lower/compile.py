"""Shard kernels as callables: compiled by inductor once per (kernel, kwargs, argument blocks, device), or eager.

A shard is traced to an aten graph (make_fx) and handed to inductor, torch.compile's
compiler, through its precompilation API `torch._inductor.standalone_compile`. Each
compiled function is static-shaped (the fast path on CPU) and is only ever called with
the blocks it was made for, so it skips dynamo's frame hook and guard checks: about
5 µs a call instead of about 22 µs through `torch.compile` (docs/benchmarks.md,
"Lowering"). The inductor cache lives in a persistent folder, so a second process, or a
second run, loads the code instead of compiling it again.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tapestry.kernels import Params, Shape, get_kernel

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
DEFAULT_CACHE = Path.home() / ".cache" / "tapestry" / "inductor"

if TYPE_CHECKING:
    from tapestry.lower.program import LoweredProgram

ShardFn = Callable[..., torch.Tensor]
ArgSpec = tuple[Shape, str]  # one argument block: its shape and dtype name ("float32")


def use_persistent_cache() -> Path:
    """Point inductor at the persistent cache unless the user already chose one."""
    os.environ.setdefault(CACHE_ENV, str(DEFAULT_CACHE))
    return Path(os.environ[CACHE_ENV])


def shard_function(kernel: str, kwargs: Params, args: tuple[ArgSpec, ...], compile: bool, device: str = "cpu") -> ShardFn:
    """The callable for one shard. Views never compile: they move no data."""
    if compile and not get_kernel(kernel).is_view:
        return _compiled(kernel, kwargs, args, device)
    return _eager(kernel, kwargs)


@functools.cache
def _eager(kernel: str, kwargs: Params) -> ShardFn:
    return functools.partial(get_kernel(kernel).torch, **dict(kwargs))


@functools.cache
def _compiled(kernel: str, kwargs: Params, args: tuple[ArgSpec, ...], device: str) -> ShardFn:
    use_persistent_cache()
    examples = [torch.zeros(shape, dtype=getattr(torch, dtype), device=device) for shape, dtype in args]
    graph = make_fx(_eager(kernel, kwargs))(*examples)
    return torch._inductor.standalone_compile(graph, examples, dynamic_shapes="from_example_inputs")


def warm_cache(program: LoweredProgram) -> int:
    """Compile every distinct shard kernel of `program` once, here, so that ranks load it from the
    persistent cache instead of all compiling it at once. Returns how many kernels it compiled."""
    from tapestry.lower.program import ShardCompute

    distinct = {(s.kernel, s.kwargs, s.arg_specs) for rank in program.ranks for s in rank.steps
                if isinstance(s, ShardCompute) and not get_kernel(s.kernel).is_view}
    for kernel, kwargs, args in distinct:
        shard_function(kernel, kwargs, args, True)
    return len(distinct)
