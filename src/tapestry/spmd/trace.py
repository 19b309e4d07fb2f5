"""One rank's program as one pure torch function, collectives included, so that inductor compiles it whole.

    groups = make_groups(program)                        # collective: every rank, same order, once
    fn = RankFunction.of(program, rank, groups)          # the rank's steps after placing
    out = fn(place(program, rank, global_inputs))        # eager: the reference
    out = compiled(fn)(blocks)                           # one FX graph (make_fx), compiled whole by inductor

The function's inputs are this rank's blocks of the plan's placed values, keyed by the place step's buffer
(`PlaceBlock.out`, e.g. "v0"; `place` slices them from whole tensors); it returns the buffers named in `outputs`
(by default the lowered program's delivered outputs plus every plan output's own buffer this rank holds). Shard
kernels run through each kernel's torch lowering (`get_kernel(k).torch`), reads are slices or pads of held
buffers (as in runtime.execute), and every communication step is a functional collective
(`torch.distributed._functional_collectives`: all_gather_single, all_reduce, reduce_scatter_single,
all_to_all_single; their results are waited on at first use, `wait_tensor` once traced). Point-to-point moves
(SendRecv, halos) and gathers to one rank become one all_to_all_single with zero split sizes for the ranks that
trade nothing, so the function has no data-dependent control flow and traces whole.

Every buffer has its plan dtype, even on a rank that holds no block of it (an empty contribution to a
collective is made in the value's dtype).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from inspect import signature
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from tapestry.kernels import get_kernel
from tapestry.lower.compile import use_persistent_cache
from tapestry.lower.program import (
    AllGather, AllReduce, AllToAll, Comm, Exchange, ExpertCompute, Gather, GroupCompute, Local, LoweredProgram,
    PlaceBlock, RankStep, Read, ReduceScatter, RingCompute, SendRecv, ShardCompute,
)
from tapestry.lower.exchange import run_experts
from tapestry.lower.ring import run_ring
from tapestry.sharding import Block
from tapestry.zspace import ZRange

Buffers = dict[str, torch.Tensor]
Groups = Mapping[tuple[int, ...], dist.ProcessGroup]  # a collective's ranks -> its process group
On = tuple[Any, tuple[int, ...]]  # where a collective runs: its process group, and its ranks in group order


def make_groups(program: LoweredProgram) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """The program's groups of ranks short of the whole mesh. `dist.new_group` is collective: every rank calls
    this once, at the same point, and gets the groups in one order (LoweredProgram.groups is sorted)."""
    return {ranks: dist.new_group(list(ranks)) for ranks in program.groups}


def place(program: LoweredProgram, rank: int, inputs: Mapping[str, torch.Tensor], device: torch.device | None = None,
          only: Collection[str] | None = None) -> Buffers:
    """This rank's blocks of the placed inputs (of those named `only`, if given), sliced from the whole tensors
    `inputs` (by graph input name); a missing input or one of another shape or dtype is an error naming it."""
    graph = program.plan.graph
    blocks: Buffers = {}
    for step in program.ranks[rank].steps:
        if not isinstance(step, PlaceBlock) or (only is not None and step.input not in only):
            continue
        if step.input not in inputs:
            raise KeyError(f"input {step.input!r} is missing (rank {rank} places its block {step.block})")
        check_input(graph[step.input].shape, graph[step.input].dtype, step.input, inputs[step.input])
        block = inputs[step.input][step.block.slices()]
        blocks[step.out] = (block if device is None else block.to(device)).contiguous()
    return blocks


def check_input(shape: tuple[int, ...], dtype: str, name: str, given: Any) -> None:
    """Refuse, naming the input, what is not a tensor of the graph's shape and dtype."""
    if not isinstance(given, torch.Tensor):
        raise TypeError(f"input {name!r}: expected a torch.Tensor of shape {list(shape)}, got {type(given).__name__}")
    if tuple(given.shape) != tuple(shape):
        raise ValueError(f"input {name!r}: expected shape {list(shape)}, given {list(given.shape)}")
    if given.dtype != getattr(torch, dtype):
        raise ValueError(f"input {name!r}: expected dtype {dtype}, given {str(given.dtype).removeprefix('torch.')}")


@dataclass(frozen=True, eq=False)
class RankFunction:
    """`steps` of rank `rank` (no place steps) as `fn(buffers) -> buffers`: reads `inputs`, returns `outputs`.

    Pure: it writes into no buffer it is given, so a persistent caller may hand it the same placed weights on
    every call. Buffers no later step reads are dropped as it goes (eager runs hold only live values)."""

    rank: int
    steps: tuple[RankStep, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    blocks: Mapping[str, ZRange]  # each returned buffer's block (global coordinates)
    dtypes: Mapping[str, str]  # every buffer's dtype name
    world: int  # the mesh's size
    groups: Groups  # every group the steps name, and () for the whole mesh
    dead: tuple[tuple[str, ...], ...]  # per step, the buffers no later step reads (dropped there)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def of(cls, program: LoweredProgram, rank: int, groups: Groups, outputs: Collection[str] | None = None,
           steps: Collection[int] | None = None, device: torch.device | None = None,
           whole: dist.ProcessGroup | None = None) -> RankFunction:
        """Rank `rank`'s non-place steps (only plan steps `steps`, if given) returning `outputs` (default: the
        delivered outputs' buffers and each plan output's own buffer; a rank returns only those it holds a block
        of). `whole` is the group of the whole mesh (default: the default group)."""
        chosen = tuple(s for s in program.ranks[rank].steps
                       if not isinstance(s, PlaceBlock) and (steps is None or s.step in steps))
        made: set[str] = set()
        read: list[str] = []
        for step in chosen:
            read += [name for name in _reads(step) if name not in made and name not in read]
            made.add(step.out)
        held = {s.out: _block(s) for s in program.ranks[rank].steps if s.out in made or s.out in read}
        if outputs is None:
            outputs = [*program.outputs.values(), *program.plan.outputs.values()]
        returned = tuple(dict.fromkeys(name for name in outputs if held.get(name) is not None))
        return cls(rank, chosen, tuple(read), returned, {name: held[name] for name in returned},
                   buffer_dtypes(program), program.ranks[rank].world, {(): whole or dist.group.WORLD, **groups},
                   _dead_after(chosen, returned), device or torch.device("cpu"))

    def __call__(self, buffers: Mapping[str, torch.Tensor]) -> Buffers:
        env = dict(buffers)
        missing = [name for name in self.inputs if name not in env]
        if missing:
            raise KeyError(f"rank {self.rank}: buffer(s) {', '.join(map(repr, missing))} not given")
        for step, dead in zip(self.steps, self.dead):
            env[step.out] = self._run(step, env)
            for name in dead:
                env.pop(name, None)
        return {name: _waited(env[name]) for name in self.outputs}

    def flat(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The function on positional tensors, `inputs` in, `outputs` out, in order: what make_fx traces."""
        out = self(dict(zip(self.inputs, tensors)))
        return tuple(out[name] for name in self.outputs)

    def _run(self, step: RankStep, env: Buffers) -> torch.Tensor:
        if isinstance(step, ShardCompute):
            args = [self._read(r, env) for r in step.reads]
            return get_kernel(step.kernel).torch(*args, **dict(step.kwargs))
        if isinstance(step, ExpertCompute):
            return run_experts(step, [self._read(r, env) for r in step.reads], self.groups[step.group or ()])
        if isinstance(step, RingCompute):
            return run_ring(step, [self._read(r, env) for r in step.reads], self.groups[step.group or ()])
        assert isinstance(step, Comm)
        group = self.groups[step.group or ()]
        members = step.group or tuple(range(self.world))
        return _COMMS[type(step)](step, env.get(step.src), self._dtype(step.src), self.device, (group, members))

    def _dtype(self, buffer: str) -> torch.dtype:
        return getattr(torch, self.dtypes[buffer])

    def _read(self, read: Read, env: Buffers) -> torch.Tensor:
        """One argument of a shard: the held buffer itself, a view of it, zero-padded, or zeros."""
        if read.box is None:
            return torch.zeros(read.shape, dtype=getattr(torch, read.dtype), device=self.device)
        held = env[read.buffer]
        if any(any(p) for p in read.pad):
            return F.pad(held[read.slices], [p for before_after in reversed(read.pad) for p in before_after])
        return held if read.whole else held[read.slices]


def _dead_after(steps: tuple[RankStep, ...], keep: Collection[str]) -> tuple[tuple[str, ...], ...]:
    last: dict[str, int] = {}
    for k, step in enumerate(steps):
        for name in (*_reads(step), step.out):
            last[name] = k
    dead: list[list[str]] = [[] for _ in steps]
    for name, k in last.items():
        if name not in keep:
            dead[k].append(name)
    return tuple(map(tuple, dead))


def _block(step: RankStep) -> Block:
    return step.block if isinstance(step, PlaceBlock) else step.out_block


def buffer_dtypes(program: LoweredProgram) -> dict[str, str]:
    """Every buffer's dtype name, from the plan: a step's result keeps its source's (moves) or its kernel's."""
    found = dict(program.plan.dtypes)
    for rank in program.ranks:
        for step in rank.steps:
            if isinstance(step, Comm):
                found.setdefault(step.out, found[step.src])
    return found


def compiled(fn: RankFunction) -> Callable[[Mapping[str, torch.Tensor]], Buffers]:
    """`fn` compiled whole at its first call, for that call's shapes, strides and dtypes (static: a persistent
    program hands it the same blocks every call): traced by make_fx under fake tensors into one FX graph of aten
    ops and functional collectives (so Python-side plan bookkeeping never reaches the compiler), which inductor
    compiles whole (`torch._inductor.standalone_compile`: AOTAutograd, then inductor, each with its on-disk cache;
    no dynamo, which would only trace the traced graph again): it may fuse across steps and reorder
    communication. The compiled artifact is saved by `program_key`, so a later start with the same program loads
    it without tracing again."""
    experts = next((s for s in fn.steps if isinstance(s, ExpertCompute)), None)
    if experts is not None:
        return _eager(fn, f"plan step {experts.step} ({experts.kernel} -> {experts.out}) is expert parallel: the "
                          f"rows it trades are counted from the data")
    run: Callable[[Mapping[str, torch.Tensor]], Buffers] | None = None  # made at the first call, for its blocks

    def call(buffers: Mapping[str, torch.Tensor]) -> Buffers:
        nonlocal run
        if run is None:
            run = _compile(fn, [buffers[name] for name in fn.inputs])
        return run(buffers)

    return call


DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


def _compile(fn: RankFunction, args: list[torch.Tensor]) -> Callable[[Mapping[str, torch.Tensor]], Buffers]:
    from torch._inductor import standalone_compile  # imported at first use: eager programs never pay it

    options = inductor_options(args)
    path = artifact_path(program_key(fn, args, options))
    artifact = _load_artifact(path)
    if artifact is None:
        try:
            graph = make_fx(fn.flat, tracing_mode="fake")(*args)
        except DATA_DEPENDENT as err:  # e.g. grouped_mm's expert offsets read as Python ints
            return _eager(fn, f"a kernel reads tensor values as Python numbers "
                              f"({type(err).__name__}: {str(err).splitlines()[0][:200]})")
        artifact = standalone_compile(graph, args, dynamic_shapes="from_example_inputs", aot=True,
                                      options={"config_patches": dict(options)} if options else {},
                                      **_donated(standalone_compile))
        _save_artifact(artifact, path)
    if not options.get("triton.cudagraphs"):
        return lambda buffers: dict(zip(fn.outputs, artifact(*[buffers[name] for name in fn.inputs])))

    def replayed(buffers: Mapping[str, torch.Tensor]) -> Buffers:
        # a CUDA graph's outputs live in its memory pool and the next replay overwrites them: each call is marked
        # as a new step and its outputs (the loss a caller keeps, the state the next call reads) are copied out
        torch.compiler.cudagraph_mark_step_begin()
        return {name: t.clone() for name, t in zip(fn.outputs, artifact(*[buffers[name] for name in fn.inputs]))}

    return replayed


def _donated(standalone_compile: Callable[..., Any]) -> dict[str, bool]:
    """Hands the traced graph over where standalone_compile takes it (torch 2.13; 2.11 has no such argument and
    copies the graph): nothing else holds it."""
    return {"donate_graph_module": True} if "donate_graph_module" in signature(standalone_compile).parameters else {}


def inductor_options(args: Collection[torch.Tensor]) -> dict[str, Any]:
    """Inductor's config patches for a rank's program on these blocks: CUDA graphs where they are on a GPU (the shapes
    are static: a persistent program hands the compiled function the same blocks every call, so one capture
    replays for every call); on the CPU inductor's defaults."""
    return {"triton.cudagraphs": True} if args and all(t.is_cuda for t in args) else {}


def program_key(fn: RankFunction, args: Collection[torch.Tensor], options: Mapping[str, Any]) -> str:
    """A digest of everything the compiled program depends on: the rank's steps, inputs and outputs, the names of
    the process groups its collectives run on (made in one order, but after whatever groups the user made), the
    blocks' shapes, strides, dtypes and devices, inductor's options, and the torch and tapestry sources."""
    parts = {
        "steps": repr(fn.steps), "inputs": fn.inputs, "outputs": fn.outputs, "rank": fn.rank, "world": fn.world,
        "dtypes": sorted(fn.dtypes.items()),
        "groups": sorted((list(ranks), getattr(group, "group_name", None)) for ranks, group in fn.groups.items()),
        "args": [(list(t.shape), list(t.stride()), str(t.dtype), str(t.device)) for t in args],
        "options": sorted((k, repr(v)) for k, v in options.items()),
        "torch": torch.__version__, "tapestry": _source_digest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def artifact_path(key: str) -> Path:
    """Where the compiled program of `key` is kept: beside inductor's own cache, which holds its kernels."""
    return use_persistent_cache() / "tapestry-programs" / f"{key}.bin"


@functools.cache
def _source_digest() -> str:
    """tapestry's own Python sources (kernels' torch lowerings, this tracer): a change to any makes new keys."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _load_artifact(path: Path) -> Any:
    """The saved compiled program at `path`, or None (absent, or unreadable: then it is compiled again)."""
    from torch._inductor import CompiledArtifact

    if not path.exists():
        return None
    try:
        return CompiledArtifact.load(path=str(path), format="binary")
    except Exception as err:  # a file from another torch build, or cut short: compile afresh, and say so
        warnings.warn(f"{path}: the saved compiled program did not load ({type(err).__name__}: {err}); "
                      "compiling it again", stacklevel=3)
        return None


def _save_artifact(artifact: Any, path: Path) -> None:
    """Save atomically (ranks of one machine and concurrent starts share the folder); a failure only warns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".tmp{os.getpid()}")
    try:
        artifact.save(path=str(scratch), format="binary")
        scratch.replace(path)
    except Exception as err:
        warnings.warn(f"{path}: the compiled program was not saved ({type(err).__name__}: {err}); a later start "
                      "traces it again", stacklevel=3)
        scratch.unlink(missing_ok=True)


def _eager(fn: RankFunction, why: str) -> RankFunction:
    """The fallback where a rank's program cannot be traced whole (its shapes or steps depend on tensor values):
    the program runs step by step, eager, and a warning says which rank and why."""
    warnings.warn(f"rank {fn.rank}: its program is not compiled, it runs eager step by step: {why}", stacklevel=3)
    return fn


# -- communication: each returns this rank's destination block (a 0-d tensor where it holds none) ---------------


def _reads(step: RankStep) -> tuple[str, ...]:
    if isinstance(step, ShardCompute | GroupCompute):
        return tuple(r.buffer for r in step.reads if r.box is not None)
    return (step.src,) if isinstance(step, Comm) else ()


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, fc.AsyncCollectiveTensor) else t


def _at(region: ZRange, block: ZRange) -> tuple[slice, ...]:
    return region.relative_to(block)


def _zeros(block: Block, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(() if block is None else block.shape, dtype=dtype, device=device)


def _flat(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros((n,), dtype=dtype, device=device)


def _padded(blocks: tuple[Block, ...]) -> int:
    return max((b.size for b in blocks if b is not None), default=0)


def _overlap_into(out: torch.Tensor, out_block: ZRange, src: torch.Tensor | None, src_block: Block) -> torch.Tensor:
    """`out` (a fresh tensor) with the cells `src` holds of `out_block` copied in."""
    inside = None if src is None or src_block is None else src_block.intersection(out_block)
    if inside is not None and not inside.is_empty:
        out[_at(inside, out_block)] = src[_at(inside, src_block)]
    return out


def _local(step: Local, src: torch.Tensor | None, dtype: torch.dtype, device: torch.device, on: On
           ) -> torch.Tensor:
    assert step.out_block is not None
    if src is not None and step.src_block is not None and step.src_block.contains(step.out_block):
        return src[_at(step.out_block, step.src_block)]
    return _overlap_into(_zeros(step.out_block, dtype, device), step.out_block, src, step.src_block)


def _all_gather(step: AllGather, src: torch.Tensor | None, dtype: torch.dtype, device: torch.device, on: On
                ) -> torch.Tensor:
    size = _padded(step.blocks)
    flat = _flat(size, dtype, device) if src is None else src.reshape(-1)
    if flat.numel() < size:
        flat = F.pad(flat, (0, size - flat.numel()))
    gathered = fc.all_gather_single(flat, 0, on[0]).view(len(step.blocks), size)
    if step.out_block is None:
        return _zeros(None, dtype, device)
    if len(step.take) == 1 and step.take[0].region == step.out_block:  # one piece fills the block: a view
        piece = step.take[0]
        block = step.blocks[step.member(piece.peer)]
        assert block is not None
        return gathered[step.member(piece.peer), : block.size].view(block.shape)[_at(piece.region, block)]
    out = _zeros(step.out_block, dtype, device)
    for piece in step.take:
        block = step.blocks[step.member(piece.peer)]
        assert block is not None
        held = gathered[step.member(piece.peer), : block.size].view(block.shape)
        out[_at(piece.region, step.out_block)] = held[_at(piece.region, block)]
    return out


def _all_reduce(step: AllReduce, src: torch.Tensor | None, dtype: torch.dtype, device: torch.device, on: On
                ) -> torch.Tensor:
    if src is None or step.src_block != step.region:  # its addend of the region (zeros where it holds none)
        src = _overlap_into(_zeros(step.region, dtype, device), step.region, src, step.src_block)
    return fc.all_reduce(src, "sum", on[0])


def _reduce_scatter(step: ReduceScatter, src: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                    on: On) -> torch.Tensor:
    size = _padded(step.out_blocks)
    parts = []
    for block in step.out_blocks:
        part = _zeros(block, dtype, device)
        if block is not None:
            part = _overlap_into(part, block, src, step.src_block)
        parts.append(F.pad(part.reshape(-1), (0, size - part.numel())))
    summed = fc.reduce_scatter_single(torch.cat(parts), "sum", 0, on[0])
    if step.out_block is None:
        return _zeros(None, dtype, device)
    return summed[: math.prod(step.out_block.shape)].view(step.out_block.shape)


def _exchange(step: Exchange, src: torch.Tensor | None, dtype: torch.dtype, device: torch.device, on: On
              ) -> torch.Tensor:
    """AllToAll, SendRecv and Gather alike: one all_to_all_single with exact split sizes (zero between ranks that
    trade nothing), then the arrivals written (or, for partial sources, summed) into the destination block."""
    group, members = on
    outgoing = [_pack(step, src, peer, dtype, device) for peer in members]
    counts = [sum(p.region.size for p in step.recv if p.peer == peer) for peer in members]
    received = fc.all_to_all_single(torch.cat(outgoing), counts, [t.numel() for t in outgoing], group)
    if step.out_block is None:
        return _zeros(None, dtype, device)
    out = _zeros(step.out_block, dtype, device)
    if step.local is not None:
        assert src is not None and step.src_block is not None
        out[_at(step.local, step.out_block)] = src[_at(step.local, step.src_block)]
    offsets = [sum(counts[:k]) for k in range(len(members))]
    for piece in step.recv:
        k = step.member(piece.peer)
        data = received[offsets[k] : offsets[k] + piece.region.size].view(piece.region.shape)
        offsets[k] += piece.region.size
        where = _at(piece.region, step.out_block)
        out[where] = out[where] + data if step.accumulate else data
    return out


def _pack(step: Exchange, src: torch.Tensor | None, peer: int, dtype: torch.dtype, device: torch.device
          ) -> torch.Tensor:
    parts = [src[_at(p.region, step.src_block)].reshape(-1) for p in step.send if p.peer == peer]
    return torch.cat(parts) if parts else _flat(0, dtype, device)


_COMMS: dict[type, Callable[..., torch.Tensor]] = {
    Local: _local, AllGather: _all_gather, AllReduce: _all_reduce, ReduceScatter: _reduce_scatter,
    AllToAll: _exchange, SendRecv: _exchange, Gather: _exchange,
}
