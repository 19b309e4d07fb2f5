"""Proof a lowered program's collectives match across ranks, without ranks: each rank's RankFunction traced by
make_fx on meta tensors in one process, under torch's `fake` process group (one rank at a time), and the
functional collectives of the traces compared.

    report = check_collectives(lower(plan))   # raises CollectiveMismatch naming the step, the ranks, the sizes

What is checked is what a real run needs to neither hang nor corrupt: on every group, each member issues the
same sequence of collectives (kind, plan step), and the sizes agree: all_gather and all_reduce inputs of one
size, reduce_scatter inputs of one size divisible by the group, and for all_to_all what rank a sends to b is
what b expects from a. The sizes are read off the traced graph (the shapes torch would hand NCCL), not off the
lowered steps, so a lowering and a runtime that disagree are caught too.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from tapestry.lower.program import (
    AllGather, AllReduce, AllToAll, Comm, Gather, Local, LoweredProgram, PlaceBlock, ReduceScatter, SendRecv,
)
from tapestry.spmd.trace import RankFunction, buffer_dtypes, make_groups

_OPS = {  # functional collective op -> the kind it carries out
    "all_gather_into_tensor": "all_gather", "all_reduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all",
}

_KINDS = {  # communication step -> the functional collective the runtime issues for it
    AllGather: "all_gather", AllReduce: "all_reduce", ReduceScatter: "reduce_scatter", AllToAll: "all_to_all",
    SendRecv: "all_to_all", Gather: "all_to_all",
}


class CollectiveMismatch(ValueError):
    """Ranks whose collectives do not pair up: a real run would hang or move the wrong bytes."""


@dataclass(frozen=True)
class Collective:
    """One traced collective of one rank: its plan step, kind, group (global ranks, group order), input elements
    and, for all_to_all, the elements it sends to and receives from each member."""

    rank: int
    step: int
    kind: str
    group: tuple[int, ...]
    numel: int
    sends: tuple[int, ...] = ()
    receives: tuple[int, ...] = ()


@dataclass(frozen=True)
class CollectiveReport:
    traced: tuple[tuple[Collective, ...], ...]  # per rank, its collectives in issue order
    seconds: float  # tracing and checking

    @property
    def collectives(self) -> int:
        return sum(map(len, self.traced))

    @property
    def groups(self) -> int:
        """Process groups used, the whole mesh included."""
        return len({c.group for rank in self.traced for c in rank})

    @property
    def kinds(self) -> dict[str, int]:
        """Per kind, how many collectives (all ranks together)."""
        return dict(sorted(Counter(c.kind for rank in self.traced for c in rank).items()))

    def __str__(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in self.kinds.items())
        return (f"collectives match: {len(self.traced)} ranks, {self.groups} groups, {self.collectives} "
                f"collectives ({kinds}), traced and checked in {self.seconds:.1f} s")


def check_collectives(program: LoweredProgram) -> CollectiveReport:
    """Trace every rank of `program` under the fake process group and check its collectives pair up; raises
    CollectiveMismatch naming the step, the ranks and what differs. Must not run inside a process group."""
    if dist.is_initialized():
        raise RuntimeError("check_collectives makes its own fake process group; call it outside torch.distributed")
    start = time.perf_counter()
    traced = tuple(tuple(trace_rank(program, rank)) for rank in range(len(program.ranks)))
    match(program, traced)
    return CollectiveReport(traced, time.perf_counter() - start)


def trace_rank(program: LoweredProgram, rank: int) -> list[Collective]:
    """Rank `rank`'s collectives, in issue order, from its RankFunction traced on meta tensors under a fake
    process group of the program's size (made and destroyed here)."""
    world = len(program.ranks)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        groups = make_groups(program)
        meta = torch.device("meta")
        fn = RankFunction.of(program, rank, groups, device=meta)
        dtypes = buffer_dtypes(program)
        shapes = {s.out: s.block.shape for s in program.ranks[rank].steps if isinstance(s, PlaceBlock)}
        args = [torch.empty(shapes[name], dtype=getattr(torch, dtypes[name]), device=meta) for name in fn.inputs]
        try:
            graph = make_fx(fn.flat, tracing_mode="fake")(*args)
        except Exception as err:  # a kernel with no meta form, a read outside a block: say whose program
            raise RuntimeError(f"rank {rank}: its program does not trace on meta tensors: {err}") from err
        members = {name: tuple(dist.get_process_group_ranks(pg)) for name, pg in _group_names(groups)}
        issued = [s for s in fn.steps if isinstance(s, Comm) and not isinstance(s, Local)]
        found = list(_collectives(graph, members))
    finally:
        dist.destroy_process_group()
    if len(found) != len(issued):
        raise CollectiveMismatch(f"rank {rank}: its trace has {len(found)} collectives, its program "
                                 f"{len(issued)} communication steps")
    for step, (kind, group, *_) in zip(issued, found):
        meant = (_KINDS[type(step)], step.group or tuple(range(world)))
        if (kind, group) != meant:
            raise CollectiveMismatch(f"{program.describe(step.step)}, rank {rank}: traced as {kind} among ranks "
                                     f"{_ranks(group)}, but the step is {meant[0]} among ranks {_ranks(meant[1])}")
    return [Collective(rank, step.step, *c) for step, c in zip(issued, found)]


def _group_names(groups: dict) -> Iterator[tuple[str, dist.ProcessGroup]]:
    for pg in (dist.group.WORLD, *groups.values()):
        if pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER:
            yield pg.group_name, pg


def _collectives(graph: torch.fx.GraphModule, members: dict[str, tuple[int, ...]]
                 ) -> Iterator[tuple[str, tuple[int, ...], int, tuple[int, ...], tuple[int, ...]]]:
    """(kind, group, input elements, sends, receives) of each functional collective node, in graph order."""
    for node in graph.graph.nodes:
        name = getattr(node.target, "__name__", "").split(".")[0]
        if node.op != "call_function" or "_c10d_functional" not in str(node.target) or name not in _OPS:
            continue
        numel = node.args[0].meta["val"].numel()
        group = members[node.args[-1]]
        if name == "all_to_all_single":
            receives, sends = (tuple(int(n) for n in split) for split in node.args[1:3])
            yield _OPS[name], group, numel, sends, receives
        else:
            yield _OPS[name], group, numel, (), ()


def match(program: LoweredProgram, traced: Sequence[Sequence[Collective]]) -> None:
    """Check that per group every member issues the same sequence, with sizes that pair up."""
    on: dict[tuple[int, ...], dict[int, list[Collective]]] = {}  # group -> member -> its collectives there
    for rank, collectives in enumerate(traced):
        for c in collectives:
            if rank not in c.group:
                raise CollectiveMismatch(f"{program.describe(c.step)}: rank {rank} joins a {c.kind} among ranks "
                                         f"{_ranks(c.group)}, which it is not one of")
            on.setdefault(c.group, {}).setdefault(rank, []).append(c)
    for group, per_rank in on.items():
        absent = [r for r in group if r not in per_rank]
        if absent:
            first = per_rank[min(per_rank)][0]
            raise CollectiveMismatch(f"{program.describe(first.step)}: ranks {_ranks(tuple(absent))} issue no "
                                     f"collective among ranks {_ranks(group)}; rank {min(per_rank)} issues a "
                                     f"{first.kind} there")
        lead = group[0]
        for rank in group[1:]:
            ours, theirs = per_rank[lead], per_rank[rank]
            for k, (a, b) in enumerate(zip(ours, theirs)):
                if (a.step, a.kind) != (b.step, b.kind):
                    raise CollectiveMismatch(f"collective {k} among ranks {_ranks(group)}: rank {lead} issues "
                                             f"{a.kind} of {program.describe(a.step)}, rank {rank} {b.kind} of "
                                             f"{program.describe(b.step)}")
            if len(ours) != len(theirs):
                raise CollectiveMismatch(f"among ranks {_ranks(group)}: rank {lead} issues {len(ours)} collectives, "
                                         f"rank {rank} {len(theirs)}")
        for position in zip(*(per_rank[r] for r in group)):
            _sizes(program, group, position)


def _sizes(program: LoweredProgram, group: tuple[int, ...], calls: tuple[Collective, ...]) -> None:
    where = f"{program.describe(calls[0].step)}, {calls[0].kind} among ranks {_ranks(group)}"
    if calls[0].kind == "all_to_all":
        for a in calls:
            for b in calls:
                sent, expected = a.sends[group.index(b.rank)], b.receives[group.index(a.rank)]
                if sent != expected:
                    raise CollectiveMismatch(f"{where}: rank {a.rank} sends {sent} elements to rank {b.rank}, "
                                             f"which expects {expected} from it")
        return
    sizes = {c.rank: c.numel for c in calls}
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"rank {r}: {n}" for r, n in sizes.items())
        raise CollectiveMismatch(f"{where}: the ranks give inputs of different sizes ({shown})")
    if calls[0].kind == "reduce_scatter" and calls[0].numel % len(group):
        raise CollectiveMismatch(f"{where}: an input of {calls[0].numel} elements does not split {len(group)} ways")


def _ranks(ranks: tuple[int, ...]) -> str:
    return ",".join(map(str, ranks))
