"""Running one rank's program: buffers in, kernels and collectives, outputs and step timings out.

The process group must already be initialised (by the spawn launcher or by
torchrun); this module only walks the rank's steps in order.
"""
from __future__ import annotations

import math
import os
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tapestry import dtypes
from tapestry.evaluator import random_inputs
from tapestry.graph import Graph
from tapestry.lower.compile import shard_function
from tapestry.plan import Place
from tapestry.lower.program import (
    AllGather, AllReduce, AllToAll, Comm, Exchange, ExpertCompute, Gather, GroupCompute, Local, LoweredProgram,
    PlaceBlock, RankStep, Read, ReduceScatter, RingCompute, SendRecv, ShardCompute,
)
from tapestry.lower.exchange import run_experts
from tapestry.lower.ring import run_ring
from tapestry.sharding import Block
from tapestry.zspace import ZRange

Work = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]  # one step, bound: buffers in, its result out
Group = dist.ProcessGroup | None  # a collective's ranks; None: the whole mesh
FAULT_ENV = "TAPESTRY_FAULT"  # "RANK:STEP": that rank exits abruptly inside that plan step; "RANK:STEP:hang": it
# stops there for good, as a rank stuck in a kernel or a lost message would (failure tests)
FAULT_EXIT_CODE = 17


class InputError(ValueError):
    """Supplied inputs do not match the graph: the message names the input and the file."""


@dataclass(frozen=True)
class InputSource:
    """Program inputs: files NAME.npy / NAME.pt in `directory`, else standard normals from `seed`
    (exactly tapestry.random_inputs, so --verify compares like with like)."""

    seed: int = 0
    directory: Path | None = None

    def check(self, graph: Graph) -> None:
        """Fail early, in the launching process, with the input and file at fault. A constant's value is part of
        the program: it comes from the graph, and a file holding another value for it is refused."""
        if self.directory is not None:
            for node in graph.inputs:
                if node.name not in graph.constants:
                    self._open(node.name, node.shape)
                elif self._files(node.name) and not np.array_equal(self._open(node.name, node.shape),
                                                                   graph.constants[node.name]):
                    raise InputError(f"input {node.name!r} is a constant of the graph (its value is part of the "
                                     f"program), and {self._files(node.name)[0]} holds another value: remove it")

    def block(self, graph: Graph, name: str, region: ZRange) -> np.ndarray:
        node = graph[name]
        if self.directory is None:
            return _seeded(graph, self.seed)[name][region.slices()]
        if name in graph.constants:
            return graph.constants[name][region.slices()]
        return dtypes.cast(self._open(name, node.shape)[region.slices()], node.dtype)


    def _files(self, name: str) -> list[Path]:
        assert self.directory is not None
        return [p for p in (self.directory / f"{name}.npy", self.directory / f"{name}.pt") if p.exists()]

    def _open(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        assert self.directory is not None
        npy, pt = self.directory / f"{name}.npy", self.directory / f"{name}.pt"
        if not npy.exists() and not pt.exists():
            raise InputError(f"input {name!r}: found neither {npy.name} nor {pt.name} in {self.directory}")
        path = npy if npy.exists() else pt
        try:  # a .npy is memory-mapped: each rank reads only its block from disk
            array = np.load(npy, mmap_mode="r") if path == npy else torch.load(pt, weights_only=True)
        except (ValueError, OSError, EOFError, RuntimeError, pickle.UnpicklingError) as err:
            raise InputError(f"input {name!r}: {path} is not a readable {path.suffix} file: {err}") from None
        if isinstance(array, torch.Tensor):
            array = dtypes.from_tensor(array)
        if not isinstance(array, np.ndarray):  # .npz data in a .npy file, a dict saved with torch.save
            raise InputError(f"input {name!r}: {path} holds a {type(array).__name__}, not one array")
        if tuple(array.shape) != tuple(shape):
            raise InputError(f"input {name!r}: {path} has shape {list(array.shape)}, the graph expects {list(shape)}")
        return array


def check_supplied(graph: Graph, inputs: Mapping[str, Any]) -> None:
    """Arrays given by name must be the graph's inputs, each one supplied; a constant may be left out or given
    with its own value (tapestry.random_inputs includes it), never another: its value is part of the program.
    InputError naming the first input at fault."""
    for name, value in inputs.items():
        if name in graph.constants:
            if not np.array_equal(np.asarray(value), graph.constants[name]):
                raise InputError(f"input {name!r} is a constant of the graph (its value is part of the program), "
                                 "and the value given differs; leave it out of the inputs")
            continue
        if name not in graph or not graph[name].is_input:
            raise InputError(f"{name!r} is not an input of the graph; its inputs are "
                             f"{', '.join(n.name for n in graph.inputs if n.name not in graph.constants)}")
    missing = [n.name for n in graph.inputs if n.name not in inputs and n.name not in graph.constants]
    if missing:
        raise InputError(f"input {missing[0]!r} was not supplied" + (f" (nor {', '.join(map(repr, missing[1:]))})"
                                                                       if len(missing) > 1 else ""))


_SEEDED: dict[tuple[int, int], dict[str, np.ndarray]] = {}


def _seeded(graph: Graph, seed: int) -> dict[str, np.ndarray]:
    """Generated once per process: the generator's stream fixes every input, so blocks need the whole draw."""
    key = (id(graph), seed)
    if key not in _SEEDED:
        _SEEDED[key] = random_inputs(graph, seed)
    return _SEEDED[key]


@dataclass(frozen=True)
class StepTime:
    step: int
    label: str
    kind: str  # "place", "prepare" (a step of `Plan.prepared`, run once), "compute" or "comm"
    seconds: float


@dataclass(frozen=True)
class RankReport:
    """One rank's timings: per step (median over the timed iterations) and per iteration."""

    rank: int
    steps: tuple[StepTime, ...]
    iterations: tuple[float, ...]


class StepFailed(RuntimeError):
    """A step raised: the message names the rank and the step."""


@dataclass
class RankRunner:
    """Executes one rank's steps; kernels are looked up once per step and reused across iterations."""

    program: LoweredProgram
    rank: int
    inputs: InputSource
    compile: bool
    device: torch.device
    on_step: Callable[[int], None] = lambda step: None
    chain: bool = False  # each iteration's carried outputs are the next one's inputs (training steps)

    @cached_property
    def steps(self) -> tuple[RankStep, ...]:
        return self.program.ranks[self.rank].steps

    @cached_property
    def _fault(self) -> int | None:
        rank, _, step = os.environ.get(FAULT_ENV, "").partition(":")
        return int(step.partition(":")[0]) if rank and int(rank) == self.rank else None

    def _trip(self) -> None:
        """The fault FAULT_ENV asks for, in this rank's faulty step: exit abruptly, or hang."""
        if os.environ[FAULT_ENV].endswith(":hang"):
            while True:
                time.sleep(60)
        os._exit(FAULT_EXIT_CODE)

    def run(self, warmup: int = 0, repeat: int = 1) -> tuple[dict[str, torch.Tensor], RankReport]:
        """Place the inputs once, then run the rest of the program warmup + repeat times; timings are from the
        last `repeat` runs. Placing is setup, as for any program handed tensors already laid out: the
        iterations start from the same placed buffers (no step writes into a buffer it reads), and a place
        step's time is that of the one placement, outside the iterations' wall times. With `chain`, each
        iteration starts instead from the carried outputs of the one before, where they stay: this rank's
        block of `new.X` becomes its block of `X` (a steady plan places and delivers them alike). The steps of
        `Plan.prepared` (computed from static inputs alone) run once after placing, as setup too: a serving loop
        runs them at load time, so the iterations start from their results as from the placed inputs."""
        placed, place_times = self.place()
        placed, prepare_times = self.prepare(placed)
        program = self._bound
        times: list[list[float]] = []
        totals: list[float] = []
        buffers: dict[str, torch.Tensor] = dict(placed)
        for _ in range(warmup + repeat):
            dist.barrier()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # start from an idle GPU: the barrier itself is a device collective
            start = time.perf_counter()
            buffers, step_times = self.once(placed)
            totals.append(time.perf_counter() - start)
            if self.chain:
                placed = {**placed, **{p: buffers[o] for p, o in self._carried.items() if p in placed}}
            times.append(step_times)
        kept = times[warmup:]
        steps = tuple(StepTime(s.step, _label(s), "place", place_times[k]) for k, s in enumerate(self._placing))
        steps += tuple(StepTime(s.step, _label(s), "prepare", t) for (s, _, _), t in zip(self._preparing, prepare_times))
        steps += tuple(
            StepTime(s.step, _label(s), _kind(s), float(np.median([t[i] for t in kept]))) for i, (s, _, _) in enumerate(program)
        )
        position = {s.step: k for k, s in enumerate(self.steps)}
        steps = tuple(sorted(steps, key=lambda t: position[t.step]))
        return buffers, RankReport(self.rank, steps, tuple(totals[warmup:]))

    @cached_property
    def _carried(self) -> dict[str, str]:
        """Place buffer of each carried input -> the buffer of its output (the plan is steady: same layout)."""
        plan = self.program.plan
        placed = {s.input: s.out for s in plan.steps if isinstance(s, Place)}
        return {placed[x]: plan.outputs[out] for out, x in plan.graph.carried.items() if x in placed}

    @cached_property
    def _placing(self) -> tuple[PlaceBlock, ...]:
        return tuple(s for s in self.steps if isinstance(s, PlaceBlock))

    def place(self) -> tuple[dict[str, torch.Tensor], list[float]]:
        """This rank's blocks of the program inputs, and the seconds each took."""
        buffers: dict[str, torch.Tensor] = {}
        times = []
        graph = self.program.plan.graph
        for step in self._placing:
            self._enter(step)
            start = time.perf_counter()
            try:
                array = self.inputs.block(graph, step.input, step.block)  # to_tensor makes it contiguous
                if not array.flags.writeable:  # a block of a memory-mapped .npy: torch warns about sharing it
                    array = array.copy()
                buffers[step.out] = dtypes.to_tensor(array).to(self.device)
            except Exception as err:
                raise self._failed(step, err) from err
            times.append(time.perf_counter() - start)
        return buffers, times

    def prepare(self, placed: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[float]]:
        """The placed buffers plus the results of the prepared steps, run once in program order (every rank alike,
        so their collectives match), and the seconds each took. Nothing is dropped: the iterations read them."""
        buffers = dict(placed)
        times = []
        for step, work, _ in self._preparing:
            self._enter(step)
            start = time.perf_counter()
            try:
                buffers[step.out] = work(buffers)
            except Exception as err:
                raise self._failed(step, err) from err
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - start)
        return buffers, times

    def _enter(self, step: RankStep) -> None:
        self.on_step(step.step)
        if self._fault == step.step:
            self._trip()

    def _failed(self, step: RankStep, err: Exception) -> StepFailed:
        return StepFailed(f"rank {self.rank} failed in {self.program.describe(step.step)}: {type(err).__name__}: {err}")

    @cached_property
    def _groups(self) -> dict[tuple[int, ...], dist.ProcessGroup]:
        """The program's groups of ranks, made on every rank in one order (new_group is collective)."""
        return {ranks: dist.new_group(list(ranks)) for ranks in self.program.groups}

    @cached_property
    def _all_bound(self) -> list[tuple[RankStep, Work, tuple[str, ...]]]:
        """Every non-place step with its work bound once (kernel looked up, reads resolved to slices) and the
        buffers to drop after it."""
        self._groups  # made here, at the same point of every rank's program: new_group is collective
        keep = set(self.program.outputs.values()) if self.rank == 0 else set()
        if self.chain:
            keep |= set(self._carried.values())
        dead = self.program.ranks[self.rank].dead_after(keep)
        return [(s, self._bind(s), d) for s, d in zip(self.steps, dead) if not isinstance(s, PlaceBlock)]

    @cached_property
    def _prepared_steps(self) -> frozenset[int]:
        plan = self.program.plan
        return frozenset(k for k, s in enumerate(plan.steps) if s.out in plan.prepared)

    @cached_property
    def _preparing(self) -> list[tuple[RankStep, Work, tuple[str, ...]]]:
        """The bound steps of prepared plan steps: `prepare` runs them once (their buffers are never dropped)."""
        return [b for b in self._all_bound if b[0].step in self._prepared_steps]

    @cached_property
    def _bound(self) -> list[tuple[RankStep, Work, tuple[str, ...]]]:
        """The bound steps each iteration runs: all but the placing and the prepared ones."""
        return [b for b in self._all_bound if b[0].step not in self._prepared_steps]

    def _bind(self, step: RankStep) -> Work:
        device = self.device
        if isinstance(step, ShardCompute):
            fn = shard_function(step.kernel, step.kwargs, self.compile)
            readers = [_reader(r, device) for r in step.reads]
            return lambda buffers: fn(*(read(buffers) for read in readers))
        if isinstance(step, ExpertCompute):  # eager: its row counts are the data's
            readers = [_reader(r, device) for r in step.reads]
            among = dist.group.WORLD if step.group is None else self._groups[step.group]
            return lambda buffers: run_experts(step, [read(buffers) for read in readers], among)
        if isinstance(step, RingCompute):
            readers = [_reader(r, device) for r in step.reads]
            among = dist.group.WORLD if step.group is None else self._groups[step.group]
            return lambda buffers: run_ring(step, [read(buffers) for read in readers], among)
        comm, src = _COMMS[type(step)], step.src
        group = None if step.group is None else self._groups[step.group]
        return lambda buffers: comm(step, buffers.get(src), device, group)

    def once(self, placed: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[float]]:
        """One run of the program after `place`: the buffers left at the end, and the seconds per step. On a GPU
        the steps are only queued, so a step's time is read from CUDA events, from the end of the step before to
        its own end on the device's stream; one synchronisation at the end, so launches still overlap kernels."""
        buffers = dict(placed)  # `placed` keeps the inputs for the next iteration; dropping them here frees nothing
        times: list[float] = []
        on_step, fault, marks = self.on_step, self._fault, self._marks
        if marks:
            marks[0].record()
        for k, (step, work, dead) in enumerate(self._bound, 1):
            on_step(step.step)
            if fault == step.step:
                self._trip()
            start = time.perf_counter()
            try:
                buffers[step.out] = work(buffers)
            except Exception as err:
                raise self._failed(step, err) from err
            if marks:
                marks[k].record()
            else:
                times.append(time.perf_counter() - start)
            for name in dead:
                buffers.pop(name, None)  # a rank holding no block of a value still names it as a collective's source
        if marks:
            marks[-1].synchronize()
            times = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        return buffers, times

    @cached_property
    def _marks(self) -> list[torch.cuda.Event]:
        """On a GPU, one timing event before the first step and one after each; none on the CPU."""
        if self.device.type != "cuda":
            return []
        return [torch.cuda.Event(enable_timing=True) for _ in range(len(self._bound) + 1)]


def _kind(step: RankStep) -> str:
    if isinstance(step, PlaceBlock):
        return "place"
    return "compute" if isinstance(step, ShardCompute | GroupCompute) else "comm"


def _label(step: RankStep) -> str:
    if isinstance(step, PlaceBlock):
        return f"place {step.input} -> {step.out}"
    if isinstance(step, ShardCompute | GroupCompute):
        return f"{step.kernel} -> {step.out}"
    return f"{step.kind} {step.src} -> {step.out}"


def _reader(read: Read, device: torch.device) -> Work:
    """One argument of a shard: the held buffer itself, a view of it, zero-padded, or zeros."""
    name, slices = read.buffer, read.slices
    if read.box is None:
        return lambda buffers: torch.zeros(read.shape, dtype=getattr(torch, read.dtype), device=device)
    if any(any(p) for p in read.pad):
        pad = [p for before_after in reversed(read.pad) for p in before_after]
        return lambda buffers: F.pad(buffers[name][slices], pad)
    if read.whole:
        return lambda buffers: buffers[name]
    return lambda buffers: buffers[name][slices]


# -- communication ----------------------------------------------------------------------------


def _at(region: ZRange, block: ZRange) -> tuple[slice, ...]:
    return region.relative_to(block)


def _zeros(block: Block, step: Comm, device: torch.device) -> torch.Tensor:
    """Zeros of the step's value dtype (from the plan): a rank holding no block has no tensor to copy it from."""
    return torch.zeros(() if block is None else block.shape, dtype=_dtype(step), device=device)


def _local(step: Local, src: torch.Tensor | None, device: torch.device, group: Group) -> torch.Tensor:
    assert step.out_block is not None
    if src is not None and step.src_block is not None and step.src_block.contains(step.out_block):
        return src[_at(step.out_block, step.src_block)]
    out = _zeros(step.out_block, step, device)  # partial source: cells no device holds are zero
    _copy_overlap(out, step.out_block, src, step.src_block)
    return out


def _copy_overlap(out: torch.Tensor, out_block: ZRange, src: torch.Tensor | None, src_block: Block) -> None:
    inside = None if src is None or src_block is None else src_block.intersection(out_block)
    if inside is not None and not inside.is_empty:
        out[_at(inside, out_block)] = src[_at(inside, src_block)]


def _padded(blocks: tuple[Block, ...]) -> int:
    return max((b.size for b in blocks if b is not None), default=0)


def _all_gather(step: AllGather, src: torch.Tensor | None, device: torch.device, group: Group) -> torch.Tensor:
    size = _padded(step.blocks)
    flat = _zeros(ZRange.from_shape((size,)), step, device)
    if src is not None:
        flat[: src.numel()] = src.reshape(-1)
    gathered = [torch.empty_like(flat) for _ in step.blocks]
    dist.all_gather(gathered, flat, group=group)
    out = _zeros(step.out_block, step, device)
    for piece in step.take:
        block = step.blocks[step.member(piece.peer)]
        assert block is not None and step.out_block is not None
        held = gathered[step.member(piece.peer)][: block.size].view(block.shape)
        out[_at(piece.region, step.out_block)] = held[_at(piece.region, block)]
    return out


def _all_reduce(step: AllReduce, src: torch.Tensor | None, device: torch.device, group: Group) -> torch.Tensor:
    if src is not None and step.src_block == step.region:
        buf = src.clone()
    else:  # a partial block spanning more (or less) than the region: its addend of the region
        buf = _zeros(step.region, step, device)
        _copy_overlap(buf, step.region, src, step.src_block)
    dist.all_reduce(buf, group=group)
    return buf


def _reduce_scatter(step: ReduceScatter, src: torch.Tensor | None, device: torch.device, group: Group) -> torch.Tensor:
    size = _padded(step.out_blocks)
    contributions = []
    for block in step.out_blocks:
        part = _zeros(block, step, device)
        if block is not None:
            _copy_overlap(part, block, src, step.src_block)
        contributions.append(F.pad(part.reshape(-1), (0, size - part.numel())))
    out = torch.empty_like(contributions[0]) if contributions else _zeros(None, step, device)
    dist.reduce_scatter(out, contributions, group=group)
    return out[: math.prod(step.out_block.shape)].view(step.out_block.shape) if step.out_block else out


def _exchange(step: Exchange, src: torch.Tensor | None, device: torch.device, group: Group) -> torch.Tensor:
    members = step.group or tuple(range(dist.get_world_size()))
    outgoing = [_pack(step, src, peer, device) for peer in members]
    counts = [sum(p.region.size for p in step.recv if p.peer == peer) for peer in members]
    if isinstance(step, Gather):
        incoming = _gather(step, outgoing[step.member(step.root)], src, device, group)
    elif isinstance(step, AllToAll):
        received = torch.empty(sum(counts), dtype=_dtype(step), device=device)
        dist.all_to_all_single(received, torch.cat(outgoing), counts, [t.numel() for t in outgoing], group=group)
        incoming = list(received.split(counts))
    else:
        incoming = [torch.empty(n, dtype=_dtype(step), device=device) for n in counts]
        ops = [dist.P2POp(dist.isend, t, peer, group) for peer, t in zip(members, outgoing) if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, peer, group) for peer, t in zip(members, incoming) if t.numel()]
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
    if step.out_block is None:
        return _zeros(None, step, device)
    covered = (step.local.size if step.local is not None else 0) + sum(p.region.size for p in step.recv)
    if not step.accumulate and covered == step.out_block.size:  # disjoint pieces fill it: no need to zero it
        out = torch.empty(step.out_block.shape, dtype=_dtype(step), device=device)
    else:
        out = _zeros(step.out_block, step, device)
    if step.local is not None:
        out[_at(step.local, step.out_block)] = src[_at(step.local, step.src_block)]
    offsets = [0] * len(members)
    for piece in step.recv:
        k = step.member(piece.peer)
        data = incoming[k][offsets[k] : offsets[k] + piece.region.size].view(piece.region.shape)
        offsets[k] += piece.region.size
        target = out[_at(piece.region, step.out_block)]
        if step.accumulate:
            target += data
        else:
            target.copy_(data)
    return out


def _dtype(step: Comm) -> torch.dtype:
    return dtypes.to_torch(step.dtype)


def _gather(step: Gather, sending: torch.Tensor, src: torch.Tensor | None, device: torch.device, group: Group
            ) -> list[torch.Tensor]:
    """One dist.gather to the root of every rank's packed pieces, each padded to the largest."""
    size = max(step.sizes)
    flat = sending if sending.numel() == size else F.pad(sending, (0, size - sending.numel()))
    rank = dist.get_rank()
    slots = [torch.empty(size, dtype=flat.dtype, device=device) for _ in step.sizes] if rank == step.root else None
    dist.gather(flat, slots, dst=step.root, group=group)
    return [] if slots is None else [slot[:n] for slot, n in zip(slots, step.sizes)]


def _pack(step: Exchange, src: torch.Tensor | None, peer: int, device: torch.device) -> torch.Tensor:
    parts = [src[_at(p.region, step.src_block)].reshape(-1) for p in step.send if p.peer == peer]
    if len(parts) == 1:
        return parts[0].contiguous()  # no copy when the region is contiguous in the block (whole blocks, rows)
    return torch.cat(parts) if parts else _zeros(ZRange.from_shape((0,)), step, device)


_COMMS: dict[type, Callable[[Comm, torch.Tensor | None, torch.device, Group], torch.Tensor]] = {
    Local: _local, AllGather: _all_gather, AllReduce: _all_reduce, ReduceScatter: _reduce_scatter,
    AllToAll: _exchange, SendRecv: _exchange, Gather: _exchange,
}
