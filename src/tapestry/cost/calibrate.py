"""Measure this machine into a Profile: one CPU core as a device, gloo on loopback as the links; or, with
`calibrate_cuda`, one GPU as a device and nccl between GPUs as the links.

Each number is the median of a few repetitions after a warm-up, because the
cores are shared and noisy; the raw medians are kept in the provenance so a
profile can be judged later. Link alpha and beta are fitted by non-negative
least squares to the same ring formulas the cost model prices with. On a GPU
every timed call ends with a device synchronisation: kernels are only queued
by the call itself.
"""
from __future__ import annotations

import datetime
import functools
import os
import platform
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.progress import Progress
from scipy.optimize import nnls

from tapestry.cost.comm import RING
from tapestry.cost.profile import DeviceProfile, Link, Profile, load_profile

WORLD = 2


@dataclass(frozen=True)
class Budget:
    """How much to measure: the full run stays under a minute, `quick` is a smoke test."""

    matmul_sizes: tuple[int, ...]
    copy_elements: int
    collective_elements: tuple[int, ...]
    reps: int

    @classmethod
    def choose(cls, quick: bool) -> Budget:
        if quick:
            return cls((64, 128), 1 << 16, (1, 1 << 10), 3)
        return cls((256, 512, 1024), 1 << 24, (1, 1 << 10, 1 << 16, 1 << 20, 1 << 22), 9)


def _no_sync() -> None:
    """The CPU's kernels are done when the call returns."""


def synchronizer(device: str) -> Callable[[], None]:
    """What ends a timed region on `device`: nothing on the CPU, waiting for the queued kernels on a GPU."""
    return functools.partial(torch.cuda.synchronize, device) if device.startswith("cuda") else _no_sync


def median_seconds(fn: Callable[[], Any], reps: int, sync: Callable[[], None] = _no_sync) -> float:
    fn()  # warm-up: allocation, first-touch, lazy init
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(sizes: tuple[int, ...], reps: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> dict[int, float]:
    """FLOP/s of an n×n matmul per size; the peak is the best size."""
    rates = {}
    for n in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        rates[n] = 2 * n**3 / median_seconds(lambda: torch.mm(a, b), reps, synchronizer(device))
    return rates


def memory_bandwidth(elements: int, reps: int, device: str = "cpu") -> float:
    """Bytes/s of c = a + b on arrays far larger than cache: two reads and a write per element."""
    a, b = torch.randn(elements, device=device), torch.randn(elements, device=device)
    c = torch.empty(elements, device=device)
    return 3 * 4 * elements / median_seconds(lambda: torch.add(a, b, out=c), reps, synchronizer(device))


def launch_overhead(reps: int, compile: bool = True, calls: int = 2000, device: str = "cpu") -> tuple[float, float]:
    """Seconds per call, with no work, of (the runtime's shard function for a one-element add: inductor-compiled
    unless `compile` is False, a plain torch.add). The first is what every shard kernel costs the runtime
    beyond its flops and bytes: the compiled callable's wrappers dwarf a bare torch call. On a GPU the calls
    queue their kernels, so this is the host's rate of issuing them, synchronised once per `calls`."""
    from tapestry.lower.compile import shard_function

    a, b = torch.ones(1, device=device), torch.ones(1, device=device)
    shard = shard_function("add", (), compile)
    sync = synchronizer(device)

    def many(fn: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                fn(a, b)
        return run

    return median_seconds(many(shard), reps, sync) / calls, median_seconds(many(torch.add), reps, sync) / calls


def _matmul_worker(rank: int, n: int, reps: int, start: Any, results: Any) -> None:
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    start.wait()
    results.put(median_seconds(lambda: torch.mm(a, b), reps))


def concurrent_cores(n: int, reps: int, alone: float) -> tuple[float, int]:
    """How many one-thread devices this host really runs at once: as many processes as it has cores each time
    an n×n matmul together; the cores are that count times the rate each keeps relative to running `alone`
    (seconds per matmul in this process). Other jobs on the machine lower it, as they lower every rank."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores == 1:
        return 1.0, 1
    ctx = mp.get_context("spawn")
    results, start = ctx.SimpleQueue(), ctx.Barrier(cores)
    procs = [ctx.Process(target=_matmul_worker, args=(r, n, reps, start, results)) for r in range(cores)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    together = [results.get() for _ in procs]
    return min(float(cores), sum(alone / t for t in together)), cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_worker(rank: int, port: int, elements: tuple[int, ...], reps: int, results: Any,
                       backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    rows = []
    for n in elements:
        x = torch.ones(n, device=device)
        gathered = [torch.empty(n, device=device) for _ in range(WORLD)]
        for kind, call, buffer in (
            ("all_reduce", lambda: dist.all_reduce(x), 4 * n),
            ("all_gather", lambda: dist.all_gather(gathered, x), 4 * n * WORLD),
        ):
            dist.barrier()
            rows.append((kind, buffer, median_seconds(call, reps, synchronizer(device))))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def collectives(elements: tuple[int, ...], reps: int, backend: str = "gloo") -> list[tuple[str, int, float]]:
    """(collective, buffer bytes, median seconds) from two processes: on loopback (gloo), or on two GPUs (nccl)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(_collective_worker, args=(_free_port(), elements, reps, results, backend), nprocs=WORLD, join=True)
    return results.get()


def fit_link(rows: list[tuple[str, int, float]], p: int = WORLD) -> Link:
    """alpha and 1/beta ≥ 0 minimising the squared relative error of the ring formulas."""
    design, target = [], []
    for kind, nbytes, seconds in rows:
        steps, fraction = RING[kind](p)
        design.append([steps / seconds, fraction * nbytes / seconds])  # relative: small messages count too
        target.append(1.0)
    (alpha, inverse_beta), _ = nnls(np.array(design), np.array(target))
    return Link(alpha, 1.0 / inverse_beta if inverse_beta > 0 else float("inf"))


@contextmanager
def _phase(progress: Progress, label: str) -> Iterator[None]:
    task = progress.add_task(label, total=None)
    yield
    progress.update(task, total=1, completed=1)


def calibrate(command: str, quick: bool = False, console: Console | None = None) -> Profile:
    """Measure a one-core device and a gloo link on this machine; `command` is recorded as provenance."""
    budget = Budget.choose(quick)
    torch.set_num_threads(1)
    with Progress(console=console or Console(stderr=True)) as progress:
        with _phase(progress, f"matmul {', '.join(map(str, budget.matmul_sizes))}"):
            rates = matmul_flops(budget.matmul_sizes, budget.reps)
        with _phase(progress, f"memory bandwidth ({4 * budget.copy_elements >> 20} MiB arrays)"):
            bandwidth = memory_bandwidth(budget.copy_elements, budget.reps)
        with _phase(progress, "launch overhead (inductor-compiled shard function)" if not quick else "launch overhead"):
            overhead, bare = launch_overhead(budget.reps, compile=not quick)
        n = budget.matmul_sizes[0]
        with _phase(progress, f"concurrent cores ({n}x{n} matmuls in parallel processes)"):
            a = torch.randn(n, n)
            alone = median_seconds(lambda: torch.mm(a, a), max(budget.reps, 20))
            cores, physical = concurrent_cores(n, max(budget.reps, 20), alone)
        with _phase(progress, f"gloo all_reduce/all_gather, {WORLD} processes on loopback"):
            rows = collectives(budget.collective_elements, budget.reps)
    link = fit_link(rows)
    return Profile(
        name="cpu-gloo",
        device=DeviceProfile(max(rates.values()), bandwidth, overhead, cores),
        links=(link,),
        provenance={
            "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {platform.processor() or platform.platform()}",
            "torch": torch.__version__,
            "method": (
                "one torch thread per device; medians of repeated runs. peak_flops: best float32 n×n matmul; "
                "mem_bandwidth: c = a + b (3 × 4 bytes per element); launch_overhead: one call of the runtime's "
                f"{'eager' if quick else 'inductor-compiled'} shard function for a one-element add "
                "(tapestry.lower.shard_function), what each shard kernel costs beyond its flops and bytes; "
                f"cores: {physical} processes each timing a {n}x{n} matmul at once, the sum of their rates relative "
                "to one process alone (below the core count when other jobs share the machine); "
                f"links: gloo all_reduce/all_gather between {WORLD} spawned processes over tcp://127.0.0.1, "
                "alpha and beta fitted (NNLS, relative error) to the ring formulas of tapestry.cost.comm"
            ),
            "matmul_flops_by_size": {str(n): r for n, r in rates.items()},
            "bare_torch_call_seconds": bare,
            "physical_cores": physical,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "collectives": [{"kind": k, "bytes": b, "seconds": s} for k, b, s in rows],
        },
    )


GPU_MATMUL_SIZES = (1024, 2048, 4096, 8192)


def driver_version() -> str | None:
    """The NVIDIA driver's version, from nvidia-smi; None without one."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def calibrate_cuda(command: str, name: str, quick: bool = False, console: Console | None = None,
                   links_from: str = "gpu-h100-nccl") -> Profile:
    """Measure GPU 0 as one device (float32 matmuls with torch's default precision, so TF32 only if it is
    enabled), and nccl between GPUs 0 and 1 as the link. With one GPU there is no link to measure: the links
    are copied from the profile `links_from`, and the provenance says so."""
    sizes = (256, 512) if quick else GPU_MATMUL_SIZES
    elements, reps = (1 << 20, 3) if quick else (1 << 28, 20)
    device = "cuda:0"
    torch.cuda.set_device(device)
    with Progress(console=console or Console(stderr=True)) as progress:
        with _phase(progress, f"float32 matmul {', '.join(map(str, sizes))}"):
            rates = matmul_flops(sizes, reps, device)
        with _phase(progress, f"bfloat16 matmul {', '.join(map(str, sizes))}"):
            half = matmul_flops(sizes, reps, device, torch.bfloat16)
        with _phase(progress, f"memory bandwidth ({4 * elements >> 20} MiB arrays)"):
            bandwidth = memory_bandwidth(elements, reps, device)
        with _phase(progress, "launch overhead (inductor-compiled shard function)" if not quick else "launch overhead"):
            overhead, bare = launch_overhead(reps, compile=not quick, device=device)
        gpus = torch.cuda.device_count()
        if gpus >= 2:
            with _phase(progress, f"nccl all_reduce/all_gather, {WORLD} GPUs"):
                rows = collectives(Budget.choose(quick).collective_elements, reps, "nccl")
            links: tuple[Link, ...] = (fit_link(rows),)
            how = ("nccl all_reduce/all_gather between GPUs 0 and 1, alpha and beta fitted (NNLS, relative error) "
                   "to the ring formulas of tapestry.cost.comm")
        else:
            rows, links = [], load_profile(links_from).links
            how = f"not measured: one GPU, no link; copied from the {links_from} profile"
    properties = torch.cuda.get_device_properties(device)
    return Profile(
        name=name,
        device=DeviceProfile(max(rates.values()), bandwidth, overhead, 0.0, (("bfloat16", max(half.values())),)),
        links=links,
        provenance={
            "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{properties.name}, {properties.total_memory >> 20} MiB, {properties.multi_processor_count} "
                       f"SMs, driver {driver_version()}; host {platform.machine()} {platform.platform()}",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "method": (
                f"one GPU per device; medians of {reps} runs after a warm-up, each ended by torch.cuda.synchronize. "
                f"peak_flops: best float32 n×n torch.mm (TF32 {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}); "
                "mem_bandwidth: c = a + b (3 × 4 bytes per element); launch_overhead: one call of the runtime's "
                f"{'eager' if quick else 'inductor-compiled'} shard function for a one-element add "
                f"(tapestry.lower.shard_function), host time per call over 2000 queued calls; cores: 0 (one GPU per "
                f"rank); links: {how}"
            ),
            "matmul_flops_by_size": {str(n): r for n, r in rates.items()},
            "bfloat16_matmul_flops_by_size": {str(n): r for n, r in half.items()},
            "bare_torch_call_seconds": bare,
            "gpus": gpus,
            "collectives": [{"kind": k, "bytes": b, "seconds": s} for k, b, s in rows],
        },
    )

