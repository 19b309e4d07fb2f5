"""`tapestry.launch(fn, nproc, *args)`: a plain script or notebook runs `fn` on local ranks in a gloo group.

The ranks are forked (on Linux; spawned elsewhere), so `fn` may be defined in a notebook or a script without a
`__main__` guard, and a rank starts in milliseconds rather than re-importing torch. Supervision is the runtime's
(runtime.launch.supervise): a rank that raises or dies stops every rank with an error naming the rank and the
call of its parallel program it was in, within the timeout; no rank outlives the launcher; SIGTERM ends cleanly.
"""
from __future__ import annotations

import datetime
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tapestry.lower.compile import use_persistent_cache
from tapestry.runtime.launch import (
    RankFailure, _die_with_parent, _exit_now, free_port, init_group, reaped, supervise,
)

__all__ = ["RankFailure", "launch", "note_call"]

_PROGRESS: tuple[Any, int] | None = None  # in a launched rank: (shared array of each rank's call, this rank)


def forked() -> bool:
    """Whether this process is a rank `launch` forked (native libraries with thread pools, egglog's, must not be
    used here if the launcher loaded them: planning then runs in a fresh process)."""
    return _PROGRESS is not None


def note_call(call: int) -> None:
    """A parallel program starts its call `call` (0-based) on this rank: what the launcher names if the rank fails."""
    if _PROGRESS is not None:
        array, rank = _PROGRESS
        array[rank] = call


def launch(fn: Callable[..., Any], *args: Any, nproc: int | None = None, timeout: float = 600.0,
           backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `nproc` local ranks, each in one process group of `backend` (the rank is
    `dist.get_rank()`); returns each rank's result, by rank. `launch(fn, *args, nproc=4)`, or `launch(fn, 4, *args)`.
    Results travel pickled (torch tensors by value). A failure raises RankFailure naming the rank and its call;
    `timeout` bounds the whole run."""
    if nproc is None:
        if not args or not isinstance(args[0], int):
            raise TypeError("launch(fn, *args, nproc=N): say how many ranks to start")
        nproc, args = args[0], args[1:]
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    if dist.is_initialized():
        raise RuntimeError("tapestry.launch starts its own ranks: call it outside a process group (under torchrun, "
                           "call the function directly on each rank instead)")
    use_persistent_cache()
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    results: Any = ctx.Queue()
    progress: Any = ctx.Array("i", [-1] * nproc, lock=False)
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(fn, args, kwargs, r, nproc, port, backend, timeout, results, progress))
             for r in range(nproc)]
    with reaped(procs):
        for p in procs:
            p.start()
        done = supervise(procs, results, timeout, lambda r: _where(progress, r), lambda r: (progress[r],))
    return [pickle.loads(b) for b in done]


def _where(progress: Any, rank: int) -> str:
    return "start-up" if progress[rank] < 0 else f"call {progress[rank]} of its parallel program"


def _forget_compile_workers() -> None:
    """A forked rank inherits the launcher's inductor worker pools without their threads and processes: a compile
    submitted to them waits forever (the launcher compiled first, e.g. `warm_cache`). Start from empty pools."""
    from torch._inductor import async_compile

    async_compile.after_fork()
    async_compile.AsyncCompile.pool.cache_clear()


def _rank(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], rank: int, world: int, port: int,
          backend: str, timeout: float, results: Any, progress: Any) -> None:
    global _PROGRESS
    _die_with_parent()
    _PROGRESS = (progress, rank)
    torch.set_num_threads(1)
    _forget_compile_workers()
    try:
        init_group(backend, rank, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                   timeout=datetime.timedelta(seconds=timeout))
        result = fn(*args, **kwargs)
    except BaseException as err:
        where = _where(progress, rank)
        results.put(("error", rank, f"rank {rank} failed in {where}: {type(err).__name__}: {err}\n"
                                    f"{traceback.format_exc()}"))
        raise SystemExit(1) from None
    results.put(("ok", rank, pickle.dumps(result)))  # by value: shared-memory tensors die with this process
    dist.destroy_process_group()
    _exit_now(results)
