"""Launching a lowered plan: one process per rank, forked from a forkserver or started by torchrun.

Failure is the launcher's main job. A rank that raises reports the step it was
in; a rank that dies outright is found by its exit code, and the step it was in
is read from a shared progress array. Either way the other ranks are killed at
once (they would otherwise wait in a collective), so nothing outlives the
timeout, and the error names the rank and the step.

A rank needs torch, tapestry and inductor, some 6 CPU s of imports in a fresh interpreter: the ranks fork from a
forkserver that imported them once (one per launching process, kept for its later runs). The server is a fresh,
single-threaded interpreter that never computed, so a fork of it is as clean as a spawned rank. What a spawned
rank would inherit from the launcher as it is now, a forked one is given: its environment, stdout and stderr (the
server's are the launcher's as they were when it started); the working directory and sys.path come with every start.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tapestry import dtypes
from tapestry.lower.compile import use_persistent_cache
from tapestry.lower.program import LoweredProgram, lower
from tapestry.graph import Graph
from tapestry.plan.plan import Plan, steady_violations
from tapestry.runtime.execute import InputSource, RankReport, RankRunner, StepFailed, check_supplied

RANK_MODULES = ("tapestry.runtime.launch", "torch._inductor.config")  # what the forkserver imports for every rank
GRACE_S = 1.0  # after a first failure, how long to wait for the other ranks' reports before killing them
Inputs = Mapping[str, np.ndarray] | str | Path | InputSource | None


class RankFailure(RuntimeError):
    """A rank raised, died or overran the timeout; the message names it and its step."""


@dataclass(frozen=True)
class RunResult:
    outputs: Mapping[str, np.ndarray]
    ranks: tuple[RankReport, ...]

    @property
    def seconds(self) -> float:
        """Median over timed iterations of the slowest rank's wall time."""
        return float(np.median(np.max([r.iterations for r in self.ranks], axis=0)))


@dataclass(frozen=True)
class Job:
    """Everything a rank needs; pickled to the ranks. Several programs run one after another in the
    same process group, because starting the ranks costs far more than a small plan."""

    programs: tuple[LoweredProgram, ...]
    inputs: tuple[InputSource, ...]
    compile: bool
    backend: str
    timeout: float
    warmup: int = 0
    repeat: int = 1
    chain: bool = False


def default_backend(ranks: int = 1) -> str:
    """nccl when each of `ranks` local ranks can have a GPU of its own (nccl needs one per rank), else gloo."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks else "gloo"


def check_backend(backend: str, ranks: int) -> None:
    """Refuse, before any rank starts, an nccl run with fewer local GPUs than ranks."""
    if backend == "nccl" and torch.cuda.device_count() < ranks:
        raise ValueError(f"nccl needs one GPU per rank: {ranks} ranks, {torch.cuda.device_count()} GPUs here "
                         "(--backend gloo runs on the CPU)")


def run_plan(plan: Plan, inputs: Inputs = None, nproc: int | None = None, **options: Any) -> RunResult:
    """Run `plan` on `nproc` (= its mesh size) ranks of its own. `inputs`: arrays by name, a folder of
    NAME.npy / NAME.pt files, or None for tapestry.random_inputs(graph, seed). `options` as for run_plans."""
    return run_plans([plan], [inputs], nproc, **options)[0]


def run_plans(
    plans: Sequence[Plan],
    inputs: Sequence[Inputs] | None = None,
    nproc: int | None = None,
    compile: bool = True,
    backend: str | None = None,
    seed: int = 0,
    timeout: float = 300.0,
    warmup: int = 0,
    repeat: int = 1,
    chain: bool = False,
) -> list[RunResult]:
    """Run several plans on the same mesh size, in order, in one process group started for them. With `chain`, the
    warmup + repeat iterations are consecutive steps: each starts from the carried outputs (graph.carried) of
    the one before, kept on the ranks, and the outputs are the last step's; the plans must be steady."""
    if nproc is not None and nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    if chain:
        for plan in plans:
            moved = steady_violations(plan, plan.graph.carried)
            if moved:
                raise ValueError(f"chain needs a steady plan (outputs where their inputs are placed): {moved[0]}")
    sizes = {p.mesh.size for p in plans}
    nproc = nproc or sizes.pop()
    for plan in plans:
        if plan.mesh.size != nproc:
            raise ValueError(f"the plan's mesh {plan.mesh} has {plan.mesh.size} devices; cannot run it on {nproc} ranks")
    with tempfile.TemporaryDirectory(prefix="tapestry-inputs-") as scratch:
        sources = []
        for k, (plan, given) in enumerate(zip(plans, inputs or [None] * len(plans))):
            sources.append(_source(given, seed, Path(scratch) / str(k), plan.graph))
            sources[-1].check(plan.graph)
        job = Job(tuple(lower(p) for p in plans), tuple(sources), compile, backend or default_backend(nproc), timeout,
                  warmup, repeat, chain)
        return spawn(job)


def _source(inputs: Inputs, seed: int, scratch: Path, graph: Graph) -> InputSource:
    if isinstance(inputs, InputSource):
        return inputs
    if inputs is None:
        return InputSource(seed)
    if isinstance(inputs, (str, Path)):
        return InputSource(seed, Path(inputs))
    check_supplied(graph, inputs)  # before any file is written: errors name inputs, not the scratch files
    scratch.mkdir()
    for name, array in inputs.items():  # ranks map the files and read only their own blocks
        if name in graph.constants:
            continue  # InputSource takes constants from the graph
        np.save(scratch / f"{name}.npy", np.asarray(array))
    return InputSource(seed, scratch)


def spawn(job: Job) -> list[RunResult]:
    use_persistent_cache()  # inherited by the ranks
    world = len(job.programs[0].ranks)
    check_backend(job.backend, world)
    ctx = _rank_context()
    results: Any = ctx.Queue()
    # per rank: program index, plan step. No lock: each rank writes only its own two slots, once per step, and
    # a lock shared by every rank costs each step a cross-process acquire (and a wait whenever the holder is
    # descheduled, as it often is with more ranks than cores).
    progress: Any = ctx.Array("i", [-1] * 2 * world, lock=False)
    port = free_port()
    surroundings = Surroundings(dict(os.environ))
    procs = [ctx.Process(target=_spawned_rank, args=(job, r, world, port, results, progress, surroundings))
             for r in range(world)]
    with reaped(procs):
        with _main_module_hidden():
            for p in procs:
                p.start()
        return _supervise(job, procs, results, progress)


@dataclass(frozen=True)
class Surroundings:
    """The launcher's environment, stdout and stderr, for a rank to take on: the forkserver's are the launcher's as
    they were when the server started (a test's captured output, a variable set since). Pickled to a rank, the
    descriptors travel as such (the forkserver duplicates them into the rank)."""

    environ: Mapping[str, str]
    stdout: int = 1
    stderr: int = 2

    def __reduce__(self) -> tuple[Any, ...]:
        return _received, (self.environ, reduction.DupFd(self.stdout), reduction.DupFd(self.stderr))

    def take_on(self) -> None:
        """In the rank: the launcher's environment, and its stdout and stderr as descriptors 1 and 2."""
        os.environ.clear()
        os.environ.update(self.environ)
        for stream, fd, given in ((sys.stdout, 1, self.stdout), (sys.stderr, 2, self.stderr)):
            if stream is not None:
                stream.flush()
            os.dup2(given, fd)
            os.close(given)


def _received(environ: Mapping[str, str], stdout: Any, stderr: Any) -> Surroundings:
    return Surroundings(environ, stdout.detach(), stderr.detach())


def _rank_context() -> Any:
    """The forkserver context, its server to import RANK_MODULES (where this process has not started it yet)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_MODULES))
    return ctx


@contextlib.contextmanager
def reaped(procs: Sequence[Any]) -> Iterator[None]:
    """No rank outlives the block: on the way out (results, a failure, SIGTERM or SIGHUP) the ranks still running
    are killed, and every started rank is joined."""
    with _stopped_by_signals():
        try:
            yield
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                if p.pid is not None:
                    p.join()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Ranks never import the user's __main__: a script without an `if __name__ == "__main__":` guard would run
    again in every rank (and in the forkserver, which the first start starts), and stdin, `python -c` or a notebook
    have no file to import. A rank needs only tapestry (the job pickles as plan JSON), so the ranks start as if
    __main__ were an empty module."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


class Stopped(SystemExit):
    """The launcher was sent SIGTERM or SIGHUP: its ranks are killed on the way out, and it exits 128 + signal."""


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGTERM (what `timeout` and CI send) and SIGHUP unwind the launcher like Ctrl-C does, so its cleanup kills
    the ranks; by default they would end it at once and leave the ranks waiting in a collective."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; ranks still die with their launcher (_die_with_launcher)
        return

    def stop(signum: int, frame: Any) -> None:
        raise Stopped(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank when the launcher that forked it dies, even by SIGKILL, so no rank outlives
    it (tapestry.launch's ranks; the ranks of a plan fork from a forkserver: _die_with_launcher)."""
    if not _killed_with_parent():
        return
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the launcher died before prctl took effect
        os._exit(1)


def _die_with_launcher() -> None:
    """No rank outlives its launcher, even one killed by SIGKILL: a thread waits on the launcher's sentinel (a pipe
    only the launcher writes to, at its end once the launcher is gone, or already) and ends the rank then. The
    forkserver that forked the rank is not the launcher, and outlives it while any rank holds the pipe it watches;
    Linux: the kernel kills the rank when the forkserver dies too."""
    launcher = mp.parent_process()
    if launcher is not None:
        threading.Thread(target=_exit_after, args=(launcher,), name="launcher-watch", daemon=True).start()
    _killed_with_parent()


def _exit_after(launcher: Any) -> None:
    launcher.join()
    os._exit(1)


def _killed_with_parent() -> bool:
    """Linux: the kernel sends this process SIGKILL when its parent dies. Whether it could (elsewhere it cannot)."""
    if not sys.platform.startswith("linux"):
        return False
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return True


def _supervise(job: Job, procs: list[Any], results: Any, progress: Any) -> list[RunResult]:
    result = supervise(procs, results, job.timeout, functools.partial(_where, job, progress),
                       lambda r: (progress[2 * r], progress[2 * r + 1]))[0]
    assert result is not None
    return result


def supervise(procs: Sequence[Any], results: Any, timeout: float, where: Callable[[int], str],
              position: Callable[[int], tuple[int, ...]] | None = None) -> list[Any]:
    """Wait for every rank's ("ok" | "error", rank, payload) on `results`; the payloads of "ok" by rank. A rank that
    reports an error or dies outright (`where(rank)` names what it was doing) fails the run after GRACE_S, so the
    others' reports come in too; past `timeout` the ranks still running are named, those behind the furthest
    `position(rank)` (how far it got, comparable across ranks) first. The caller kills them."""
    deadline = time.monotonic() + timeout
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    failed_at: float | None = None
    while len(done) < len(procs):
        try:
            kind, rank, payload = results.get(timeout=0.05)
            (done if kind == "ok" else errors)[rank] = payload
        except queue.Empty:
            pass
        died = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors}
        now = time.monotonic()
        if (errors or died) and failed_at is None:
            failed_at = now
        if failed_at is not None and now - failed_at > GRACE_S:
            raise RankFailure(_failure(died, errors, where))
        if now > deadline:
            late = [r for r in range(len(procs)) if r not in done]
            raise RankFailure(_timed_out(timeout, late, where, position))
    return [done[r] for r in range(len(procs))]


def _timed_out(timeout: float, late: Sequence[int], where: Callable[[int], str],
               position: Callable[[int], tuple[int, ...]] | None) -> str:
    """Where each unfinished rank is, led by the stuck ones: the ranks at the furthest `position` wait there (in a
    collective) for those that had not reached it."""
    everywhere = "; ".join(f"rank {r} in {where(r)}" for r in late)
    at = {r: position(r) for r in late} if position is not None else {}
    waiting = [r for r in late if at and at[r] == max(at.values())]
    behind = [r for r in late if at and r not in waiting]
    if not behind:
        return f"timed out after {timeout:g} s: {everywhere}"
    return (f"timed out after {timeout:g} s: rank(s) {', '.join(map(str, behind))} had not reached "
            f"{where(waiting[0])}, where rank(s) {', '.join(map(str, waiting))} wait for them; {everywhere}")


def _failure(died: Mapping[int, int], errors: Mapping[int, str], where: Callable[[int], str]) -> str:
    """Ranks that died outright come first: the others' errors are usually their peers' broken connections."""
    lines = [f"rank {r} exited with code {code} in {where(r)}" for r, code in sorted(died.items())]
    lines += [errors[r] for r in errors]
    return "\n".join(lines)


def _where(job: Job, progress: Any, rank: int) -> str:
    program, step = progress[2 * rank], progress[2 * rank + 1]
    if program < 0:
        return "start-up"
    return job.programs[program].describe(step) + (f" of plan {program}" if len(job.programs) > 1 else "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned_rank(job: Job, rank: int, world: int, port: int, results: Any, progress: Any,
                  surroundings: Surroundings) -> None:
    _die_with_launcher()
    surroundings.take_on()
    # The ranks share the machine's cores already; a pool of compile workers per rank would oversubscribe them,
    # and its processes, left to os._exit, leave "leaked semaphore objects" behind.
    from torch._inductor import config as inductor_config

    inductor_config.compile_threads = 1
    def on_step(program: int, step: int) -> None:
        progress[2 * rank], progress[2 * rank + 1] = program, step

    try:
        init_group(job.backend, rank, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                   timeout=datetime.timedelta(seconds=job.timeout))
        result = run_rank(job, rank, rank, on_step)
    except StepFailed as err:
        results.put(("error", rank, str(err)))
        raise SystemExit(1) from None
    except BaseException as err:  # start-up or gather failures: no step to name
        results.put(("error", rank, f"rank {rank} failed: {type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    results.put(("ok", rank, result))
    dist.destroy_process_group()
    _exit_now(results)


def _exit_now(results: Any) -> None:
    """Leave without the interpreter's teardown, once the results are sent: gloo's worker threads can still hold
    tensors then, and freeing them while the interpreter shuts down aborts the process ("terminate called
    without an active exception", pytorch/pytorch#179291) now and then."""
    results.close()
    results.join_thread()
    os._exit(0)


def run_torchrun(job: Job) -> list[RunResult] | None:
    """The torchrun entry: RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT come from the environment.
    Returns the results on rank 0, None elsewhere."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != len(job.programs[0].ranks):
        raise ValueError(f"the plan has {len(job.programs[0].ranks)} ranks but torchrun started {world}")
    use_persistent_cache()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    init_group(job.backend, local_rank, timeout=datetime.timedelta(seconds=job.timeout))
    try:
        return run_rank(job, rank, local_rank)
    finally:
        dist.destroy_process_group()


def rank_device(backend: str, local_rank: int) -> torch.device:
    """Where a rank computes: its own GPU under nccl, else the CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def init_group(backend: str, local_rank: int, **options: Any) -> None:
    """Join the process group. Under nccl the rank is bound to its GPU first (device_id): nccl then never guesses
    the rank's device from its global rank, which hangs when ranks and GPUs are numbered differently."""
    device = rank_device(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options["device_id"] = device
    dist.init_process_group(backend, **options)


def run_rank(
    job: Job, rank: int, local_rank: int, on_step: Callable[[int, int], None] = lambda program, step: None
) -> list[RunResult] | None:
    """Run this rank's programs; after each, gather timings (and the outputs rank 0 assembled) on rank 0."""
    torch.set_num_threads(1)
    device = rank_device(job.backend, local_rank)
    results = []
    for k, (program, inputs) in enumerate(zip(job.programs, job.inputs)):
        runner = RankRunner(program, rank, inputs, job.compile, device, functools.partial(on_step, k), job.chain)
        buffers, report = runner.run(job.warmup, job.repeat)
        reports: list[RankReport] | None = [report] * len(program.ranks) if rank == 0 else None
        dist.gather_object(report, reports, dst=0)
        if reports is not None:
            outputs = {name: dtypes.from_tensor(buffers[buf]) for name, buf in program.outputs.items()}
            results.append(RunResult(outputs, tuple(reports)))
    return results if rank == 0 else None
