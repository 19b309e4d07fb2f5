"""Shard kernels as callables: compiled by inductor once per (kernel, kwargs, argument blocks), or eager.

A shard is traced to an aten graph (make_fx) and handed to inductor, torch.compile's
compiler, through its precompilation API `torch._inductor.standalone_compile`. Each
compiled function is static in shapes and strides (the fast path on CPU) and is only
ever called with the blocks it was made for, so it skips dynamo's frame hook and guard
checks: about 5 µs a call instead of about 22 µs through `torch.compile`
(docs/benchmarks.md, "Lowering"). The inductor cache lives in a persistent folder, so a second process, or a
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
ArgSpec = tuple[Shape, tuple[int, ...], str]  # one argument block: shape, strides, dtype name ("float32")


def use_persistent_cache() -> Path:
    """Point inductor at the persistent cache unless the user already chose one."""
    os.environ.setdefault(CACHE_ENV, str(DEFAULT_CACHE))
    return Path(os.environ[CACHE_ENV])


def shard_function(kernel: str, kwargs: Params, compile: bool) -> ShardFn:
    """The callable for one shard step. Views never compile: they move no data."""
    if compile and not get_kernel(kernel).is_view:
        return _FirstCall(kernel, kwargs)
    return _eager(kernel, kwargs)


def spec(t: torch.Tensor) -> ArgSpec:
    return tuple(t.shape), t.stride(), str(t.dtype).removeprefix("torch.")


def contiguous(shape: Shape, dtype: str) -> ArgSpec:
    return spec(torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))


class _FirstCall:
    """Compiles for the arguments of its first call. A shard step gets the same blocks, laid out the same way
    (a slice of a held buffer, a transposed view), on every run, so it needs no guards after that."""

    __slots__ = ("kernel", "kwargs", "fn")

    def __init__(self, kernel: str, kwargs: Params) -> None:
        self.kernel, self.kwargs = kernel, kwargs
        self.fn: ShardFn | None = None

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if self.fn is None:
            self.fn = compiled(self.kernel, self.kwargs, tuple(map(spec, args)), str(args[0].device) if args else "cpu")
        return self.fn(*args)


@functools.cache
def _eager(kernel: str, kwargs: Params) -> ShardFn:
    return functools.partial(get_kernel(kernel).torch, **dict(kwargs))


@functools.cache
def compiled(kernel: str, kwargs: Params, args: tuple[ArgSpec, ...], device: str = "cpu") -> ShardFn:
    """`kernel` compiled by inductor for exactly these argument blocks (static shapes and strides)."""
    use_persistent_cache()
    examples = [torch.empty_strided(shape, strides, dtype=getattr(torch, dtype), device=device).zero_()
                for shape, strides, dtype in args]
    graph = make_fx(_eager(kernel, kwargs))(*examples)
    return torch._inductor.standalone_compile(graph, examples, dynamic_shapes="from_example_inputs")


def warm_cache(program: LoweredProgram) -> int:
    """Compile every distinct shard kernel of `program` once, here, so that ranks load it from the persistent
    cache instead of all compiling it at once. Returns how many kernels it compiled. Blocks are taken to be
    contiguous; a shard that reads a strided view compiles on its first run, and is cached from then on."""
    from tapestry.lower.program import ShardCompute

    distinct = {(s.kernel, s.kwargs, tuple(contiguous(r.shape, r.dtype) for r in s.reads))
                for rank in program.ranks for s in rank.steps
                if isinstance(s, ShardCompute) and not get_kernel(s.kernel).is_view}
    for kernel, kwargs, args in distinct:
        compiled(kernel, kwargs, args)
    return len(distinct)
