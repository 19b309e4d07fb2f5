"""A plan run persistently in the user's process group: made once per rank, called again and again.

    program = ParallelProgram(plan, state={"w": w, ...})      # on every rank: lowers, places state, compiles
    out = program(x=batch)                                    # every rank passes the same whole inputs
    out["y"]                                                  # the whole output, on every rank (a torch tensor)

What stays on the ranks: the blocks of `state` (weights, optimizer state), placed once; the plan's prepared steps
(computed from static inputs alone, run once here); and, for a training step, each carried output (`carry`:
output -> the input it becomes next call) replacing its input's block where it already lies (the plan must be
steady). Per call, each rank slices its own block of every other input from the whole tensor it is handed, runs
its compiled function (spmd.trace) and returns the delivered outputs, whole on every rank. Nothing is spawned
and nothing goes through disk.
"""
from __future__ import annotations

import datetime
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tapestry import dtypes
from tapestry.lower.compile import use_persistent_cache
from tapestry.lower.program import LoweredProgram, PlaceBlock, lower
from tapestry.plan.plan import Plan, steady_violations
from tapestry.runtime.launch import default_backend, free_port, init_group
from tapestry.spmd import faults
from tapestry.spmd.trace import Buffers, RankFunction, compiled, make_groups, place
from tapestry.zspace import ZRange


class RankError(RuntimeError):
    """A call failed on this rank: the message names the rank and the call."""


def join_group(size: int, backend: str | None = None, timeout: float = 600.0) -> None:
    """Make sure a default process group of `size` ranks exists: the user's own, or one opened from torchrun's
    environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT), or, for a mesh of one device, a group of this process.
    From here on a SIGTERM names this rank and its call (spmd.faults), planning included."""
    _open_group(size, backend, timeout)
    faults.watch_sigterm(dist.get_rank())


def _open_group(size: int, backend: str | None, timeout: float) -> None:
    if dist.is_initialized():
        if dist.get_world_size() != size:
            raise ValueError(f"the plan's mesh has {size} devices but the process group has {dist.get_world_size()} "
                             "ranks: plan for a mesh of the group's size")
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != size:
            raise ValueError(f"the plan's mesh has {size} devices but torchrun started {os.environ['WORLD_SIZE']} "
                             "ranks")
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        init_group(backend or default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", size))), local,
                   timeout=datetime.timedelta(seconds=timeout))
        return
    if size == 1:
        init_group(backend or "gloo", 0, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        return
    raise RuntimeError(f"no process group for a mesh of {size} devices: run under torchrun, call "
                       "dist.init_process_group first, or start the ranks with tapestry.launch(fn, nproc)")


@dataclass(frozen=True)
class Held:
    """One input this rank holds between calls: its placed buffer and its block (global coordinates)."""

    buffer: str
    block: ZRange


class ParallelProgram:
    """One rank's share of a plan, placed and compiled once, called with new inputs every call.

    `state`: whole tensors of the inputs that stay between calls (weights; optimizer state), placed once; the
    graph's constants are placed too. Every other graph input is a call input. `deliver`: the outputs each call
    returns, whole on every rank (default: every output not carried). `carry`: output -> input, the outputs that
    become state for the next call, left where the plan puts them. `compile`: compile the rank's function
    whole with inductor (False: eager, the reference)."""

    def __init__(self, plan: Plan, state: Mapping[str, torch.Tensor] | None = None, *,
                 deliver: Collection[str] | None = None, carry: Mapping[str, str] | None = None,
                 compile: bool = True, backend: str | None = None, timeout: float = 600.0) -> None:
        join_group(plan.mesh.size, backend, timeout)
        use_persistent_cache()
        self.plan, self.rank = plan, dist.get_rank()
        self.carry = dict(carry or {})
        moved = steady_violations(plan, self.carry)
        if moved:
            raise ValueError(f"carried state must come out where it is placed (a steady plan): {moved[0]}")
        if deliver is None:
            deliver = [name for name in plan.outputs if name not in self.carry]
        self.program: LoweredProgram = lower(plan, deliver, everywhere=True)
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        graph = plan.graph
        given = dict(state or {})
        unknown = sorted(set(given) - {n.name for n in graph.inputs})
        if unknown:
            raise KeyError(f"state {', '.join(map(repr, unknown))} is no input of the graph")
        missing = sorted(set(graph.static) - set(given) - set(graph.constants))
        if missing:
            raise KeyError(f"static input(s) {', '.join(map(repr, missing))} must be given as state")
        given.update({name: dtypes.to_tensor(value) for name, value in graph.constants.items()})
        self.call_inputs = tuple(n.name for n in graph.inputs if n.name not in given)
        steps = self.program.ranks[self.rank].steps
        self.held = {s.input: Held(s.out, s.block) for s in steps if isinstance(s, PlaceBlock)}
        groups = make_groups(self.program)
        self._state: Buffers = place(self.program, self.rank, given, self.device, only=given)
        prepared = {k for k, s in enumerate(plan.steps) if s.out in plan.prepared}
        rest = {s.step for s in steps} - prepared
        run = RankFunction.of(self.program, self.rank, groups, steps=rest, outputs=self._returned(),
                              device=self.device)
        if prepared:  # once, eager, at load time: their results are state for every call
            prepare = RankFunction.of(self.program, self.rank, groups, steps=prepared, outputs=run.inputs,
                                      device=self.device)
            self._state.update(prepare({k: v for k, v in self._state.items() if k in prepare.inputs}))
        self.function = run
        self._call = compiled(run) if compile else run
        self.calls = 0

    def _returned(self) -> list[str]:
        carried = [self.plan.outputs[out] for out in self.carry]
        return [*self.program.outputs.values(), *carried]

    def __call__(self, *args: torch.Tensor, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The delivered outputs, whole, on every rank, from new `inputs` (whole tensors by graph input name, or
        positionally in `call_inputs` order); every rank passes the same."""
        if args:
            if len(args) > len(self.call_inputs):
                raise TypeError(f"{len(args)} positional inputs given; the call inputs are {list(self.call_inputs)}")
            inputs = {**dict(zip(self.call_inputs, args)), **inputs}
        self.begin_call()
        missing = [n for n in self.call_inputs if n not in inputs]
        extra = sorted(set(inputs) - set(self.call_inputs))
        if missing or extra:
            raise KeyError(f"{self.where}: call inputs are {list(self.call_inputs)}: " + "; ".join(
                ([f"missing {missing}"] if missing else []) + ([f"not inputs of a call {extra}"] if extra else [])))
        try:
            blocks = place(self.program, self.rank, inputs, self.device, only=inputs)
        except (TypeError, ValueError) as err:  # a refused input: say where, keep the type callers catch
            raise type(err)(f"{self.where}: {err}") from None
        try:
            got = self._call({**self._state, **blocks})
        except Exception as err:  # a peer's death shows here as a collective's error: name the rank that died
            gone = faults.exited_peers()
            raise RankError(f"rank {self.rank} failed in call {self.calls}: {type(err).__name__}: {err}"
                            + (f" ({gone})" if gone else "")) from err
        for out, name in self.carry.items():
            held = self.held.get(name)
            if held is not None:
                self._state[held.buffer] = got[self.plan.outputs[out]]
        self.calls += 1
        faults.note_done()
        return {name: got[buffer] for name, buffer in self.program.outputs.items()}

    def begin_call(self) -> None:
        """Call `self.calls` starts on this rank: what a launcher names if the rank fails from here on."""
        faults.note_call(self.calls)

    @property
    def where(self) -> str:
        """This rank and its call, for errors: "rank 1, call 3"."""
        return f"rank {self.rank}, call {self.calls}"

    def state(self) -> dict[str, tuple[ZRange, torch.Tensor]]:
        """This rank's blocks of the state inputs it holds, by graph input name: (block, tensor)."""
        return {name: (h.block, self._state[h.buffer]) for name, h in self.held.items() if h.buffer in self._state}

    def __repr__(self) -> str:
        return (f"ParallelProgram(rank {self.rank} of {self.plan.mesh.size}, {len(self.function.steps)} steps, "
                f"call inputs {list(self.call_inputs)}, delivers {list(self.program.outputs)})")
