"""Plan -> one program per rank.

Every plan step becomes, on each rank, the exact local work it implies: a Place
reads the rank's input block, a Compute runs the kernel on the rank's index
block, and a Reshard becomes one collective (or point-to-point moves) whose
regions come from sharding.comm.transfers. The collective chosen for a reshard
is the same on every rank, so the programs stay in SPMD lockstep; a rank with
no data for a collective still joins it with an empty contribution.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tapestry.kernels import Params, Shape, get_kernel
from tapestry.plan import exchange, ring
from tapestry.plan.plan import Compute, Place, Plan, Reshard, delivered, output_gathers
from tapestry.sharding import Block, Layout, Mesh
from tapestry.sharding.collectives import Collective, Group, reshard_groups
from tapestry.sharding.comm import Transfer, overlap, transfers
from tapestry.zspace import ZRange


class LoweringError(ValueError):
    """A plan whose steps do not fit together (a read outside a held block, an unknown value)."""


@dataclass(frozen=True)
class Piece:
    """A region (global coordinates) that moves to or from rank `peer`."""

    peer: int
    region: ZRange


@dataclass(frozen=True)
class Read:
    """Where a shard finds one argument: `box` of buffer `buffer` (local coordinates), zero-padded by
    `pad` (before, after) per dim, because a kernel may read outside the tensor (conv padding)."""

    buffer: str
    box: ZRange | None  # None: the read lies wholly outside the tensor
    pad: tuple[tuple[int, int], ...]
    shape: Shape
    dtype: str = "float32"
    whole: bool = False  # the read is the whole held buffer: no slicing at all

    @property
    def slices(self) -> tuple[slice, ...]:
        return () if self.box is None else self.box.slices()


@dataclass(frozen=True)
class PlaceBlock:
    """Materialise this rank's block of program input `input`."""

    step: int
    out: str
    input: str
    block: ZRange

    def __str__(self) -> str:
        return f"{self.out} = place {self.input}{_box(self.block)}"


@dataclass(frozen=True)
class ShardCompute:
    """Run `kernel` on this rank's index block; `kwargs` are the impl's call kwargs for that block."""

    step: int
    out: str
    kernel: str
    kwargs: Params
    index: ZRange
    reads: tuple[Read, ...]
    out_block: ZRange

    def __str__(self) -> str:
        reads = ", ".join(_show(r) for r in self.reads)
        kwargs = "".join(f", {k}={v}" for k, v in self.kwargs)
        return f"{self.out}{_box(self.out_block)} = {self.kernel}({reads}{kwargs})  index {_box(self.index)}"


@dataclass(frozen=True)
class GroupCompute:
    """A compute step its rank runs together with the ranks of `group` (global ranks in the group's order, None:
    the whole mesh; `member` this rank's place in it): `reads` are its blocks of every input for its own index
    block `index`."""

    step: int
    out: str
    kernel: str
    params: Params
    input_shapes: tuple[Shape, ...]
    input_dtypes: tuple[str, ...]
    index: ZRange
    reads: tuple[Read, ...]
    out_block: ZRange
    group: tuple[int, ...] | None
    member: int

    KIND: ClassVar[str] = ""  # what the step is, in its printed line

    def __str__(self) -> str:
        among = "" if self.group is None else f"  among ranks {','.join(map(str, self.group))}"
        reads = ", ".join(_show(r) for r in self.reads)
        return (f"{self.out}{_box(self.out_block)} = {self.kernel}({reads}) {self.KIND}, index "
                f"{_box(self.index)}{among}")


@dataclass(frozen=True)
class ExpertCompute(GroupCompute):
    """An expert-parallel step (plan.exchange): it trades rows with the ranks of `group` (every member's index
    block in `blocks`, in group order) by all-to-all and computes the rows its experts own (lower.exchange)."""

    blocks: tuple[ZRange, ...] = ()

    KIND: ClassVar[str] = "expert parallel"


@dataclass(frozen=True)
class RingCompute(GroupCompute):
    """A ring-attention step (plan.ring): a travelling input's (k's, v's) read is only its own key block; round by
    round it meets the key block of each member of `group` (`keys` each member's [start, end)), passing what it
    has on to the next member while it computes (lower.ring)."""

    keys: tuple[tuple[int, int], ...] = ()

    KIND: ClassVar[str] = "ring attention"


@dataclass(frozen=True)
class Comm:
    """Common to every communication step: this rank's source and destination blocks, and the ranks it moves them
    among (sharding.collectives.reshard_groups), None for the whole mesh. Lists of blocks are in group order.
    `dtype` is the value's dtype from the plan: a rank holding no block of the source still makes buffers of it."""

    step: int
    out: str
    src: str
    src_block: Block
    out_block: Block
    group: tuple[int, ...] | None
    dtype: str

    @property
    def kind(self) -> str:
        return _KIND_NAMES[type(self)]

    def member(self, rank: int) -> int:
        """Where global rank `rank` comes in the group's lists."""
        return rank if self.group is None else self.group.index(rank)

    def __str__(self) -> str:
        among = "" if self.group is None else f"  among ranks {','.join(map(str, self.group))}"
        return f"{self.out}{_box(self.out_block)} = {self.kind} {self.src}{_box(self.src_block)}{self._detail()}{among}"

    def _detail(self) -> str:
        return ""


@dataclass(frozen=True)
class Local(Comm):
    """No data moves: this rank's destination block lies inside its own source block."""


@dataclass(frozen=True)
class AllGather(Comm):
    """Every rank contributes its whole source block (padded to the largest); `take` says which
    region of whose block lands in this rank's destination."""

    blocks: tuple[Block, ...]
    take: tuple[Piece, ...]

    def _detail(self) -> str:
        return "  take " + ", ".join(f"{p.region}@{p.peer}" for p in self.take) if self.take else ""


@dataclass(frozen=True)
class AllReduce(Comm):
    """Every rank sums `region`: its partial source block's cells of it, zeros where it holds none."""

    region: ZRange


@dataclass(frozen=True)
class ReduceScatter(Comm):
    """Rank j receives the sum over ranks of their partial cells of `out_blocks[j]` (padded to the largest)."""

    out_blocks: tuple[Block, ...]


@dataclass(frozen=True)
class Exchange(Comm):
    """Exact block moves: `send` and `recv` pieces (ordered the same on both ends), plus the `local`
    part of the destination already held; `accumulate` sums arrivals (partial source)."""

    send: tuple[Piece, ...]
    recv: tuple[Piece, ...]
    local: ZRange | None
    accumulate: bool

    def _detail(self) -> str:
        parts = [f"send {p.region}->{p.peer}" for p in self.send]
        parts += [f"recv {p.region}<-{p.peer}" for p in self.recv]
        return ("  " + ", ".join(parts) if parts else "") + ("  (summed)" if self.accumulate else "")


@dataclass(frozen=True)
class AllToAll(Exchange):
    """Every rank trades with every other: one all_to_all_single with exact split sizes."""


@dataclass(frozen=True)
class SendRecv(Exchange):
    """Only some pairs trade (halos): batched isend/irecv."""


@dataclass(frozen=True)
class Gather(SendRecv):
    """Every move goes to one rank, `root` (the outputs' gather to rank 0, or any block move with a single
    receiver): one `dist.gather` of each rank's packed pieces, padded to the largest (`sizes[r]` elements
    from rank r). Every rank joins, even with nothing to give. A send_recv to the cost model."""

    root: int = 0
    sizes: tuple[int, ...] = ()


_KIND_NAMES: dict[type, str] = {
    Local: "local", AllGather: "all_gather", AllReduce: "all_reduce", ReduceScatter: "reduce_scatter",
    AllToAll: "all_to_all", SendRecv: "send_recv", Gather: "gather",
}

RankStep = PlaceBlock | ShardCompute | GroupCompute | Comm


def viewed(step: RankStep) -> str | None:
    """The buffer whose storage the step's buffer shares (the runtime makes none of its own), None where it makes
    its own: a Local move inside the held source block, or an `always_view` kernel reading one held box unpadded
    (a zero fill broadcast from a scalar holds the scalar's bytes only)."""
    if isinstance(step, Local):
        return step.src if step.src_block is not None and step.src_block.contains(step.out_block) else None
    if isinstance(step, ShardCompute) and get_kernel(step.kernel).always_view and len(step.reads) == 1:
        read = step.reads[0]
        return read.buffer if read.box is not None and not any(any(p) for p in read.pad) else None
    return None


@dataclass(frozen=True)
class RankProgram:
    rank: int
    world: int
    steps: tuple[RankStep, ...]

    def dead_after(self, keep: Collection[str] = ()) -> tuple[tuple[str, ...], ...]:
        """Per step, the buffers no later step reads (its own result too, if nothing does), except `keep`:
        the runtime drops them there, so a rank holds only live values, as cost.memory assumes."""
        last: dict[str, int] = {}
        for k, step in enumerate(self.steps):
            last[step.out] = k
            for name in _reads(step):
                last[name] = k
        dead: list[list[str]] = [[] for _ in self.steps]
        for name, k in last.items():
            if name not in keep:
                dead[k].append(name)
        return tuple(map(tuple, dead))

    def __str__(self) -> str:
        lines = [f"rank {self.rank} of {self.world}"]
        lines += [f"  [{s.step:>3}] {s}" for s in self.steps]
        return "\n".join(lines)


@dataclass(frozen=True)
class LoweredProgram:
    """The per-rank programs, plus where each delivered output is found whole: on rank 0, or with `everywhere` on
    every rank. Outputs not delivered stay in the plan's layout, in the buffer named by the plan's value."""

    plan: Plan
    ranks: tuple[RankProgram, ...]
    outputs: Mapping[str, str]  # delivered output name -> buffer holding the whole value (on rank 0 or everywhere)
    everywhere: bool = False

    @property
    def groups(self) -> list[tuple[int, ...]]:
        """Every group of ranks some collective runs among, short of the whole mesh, in one order for all ranks."""
        return sorted({s.group for r in self.ranks for s in r.steps
                       if isinstance(s, Comm | GroupCompute) and s.group is not None})

    def describe(self, step: int) -> str:
        """One line naming plan step `step`, for error messages."""
        for rank in self.ranks:
            for s in rank.steps:
                if s.step == step:
                    return f"step {step} ({type(s).__name__} -> {s.out})"
        return f"step {step}"

    def __str__(self) -> str:
        return "\n\n".join(str(r) for r in self.ranks)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickles as the plan's JSON (kernels hold lambdas); lowering again is cheap and deterministic."""
        delivering = tuple(self.outputs) if set(self.outputs) != set(self.plan.outputs) else None
        return _lower_json, (self.plan.to_json(), delivering, self.everywhere)


def lower(plan: Plan, deliver: Collection[str] | None = None, everywhere: bool = False, pieces: bool = True
          ) -> LoweredProgram:
    """One program per device of the plan's mesh, then a gather of the outputs `deliver` (default: every output)
    to rank 0, or with `everywhere` to every rank (an all-gather: each rank gets the whole value). A training step
    delivers only its loss; its new state stays where the plan put it.

    Without `pieces`, all-gathers have no `take` and all-to-alls no `send` or `recv`: every rank's blocks and
    buffers as lowered, which is all cost.memory reads, without the pieces that grow as a group's size squared
    (262,144 for one all-gather among 512 ranks). Such a program cannot run."""
    unknown = sorted(set(deliver or ()) - set(plan.outputs))
    if unknown:
        raise LoweringError(f"deliver: {', '.join(map(repr, unknown))} is no output of the plan; its outputs are "
                            f"{', '.join(map(repr, plan.outputs))}")
    mesh = plan.mesh
    per_rank: list[list[RankStep]] = [[] for _ in mesh.devices]
    layouts: dict[str, Layout] = {}
    for index, step in enumerate((*plan.steps, *output_gathers(plan, deliver, everywhere))):
        for rank, rank_step in enumerate(lower_step(index, step, plan, layouts, pieces)):
            if rank_step is not None:
                per_rank[rank].append(rank_step)
        layouts[step.out] = step.layout
    outputs = {name: delivered(value, everywhere) for name, value in plan.outputs.items()
               if deliver is None or name in deliver}
    ranks = tuple(RankProgram(r, mesh.size, tuple(steps)) for r, steps in enumerate(per_rank))
    return LoweredProgram(plan, ranks, outputs, everywhere)


def _lower_json(data: Mapping[str, Any], deliver: tuple[str, ...] | None = None, everywhere: bool = False
                ) -> LoweredProgram:
    return lower(Plan.from_json(data), deliver, everywhere)


def lower_step(index: int, step: Place | Compute | Reshard, plan: Plan, layouts: Mapping[str, Layout],
               pieces: bool = True) -> list[RankStep | None]:
    """Each rank's part of plan step `index` (None: it takes none), given the layouts of the values made before it
    (`lower`'s `pieces` likewise)."""
    if isinstance(step, Place):
        return [None if b is None else PlaceBlock(index, step.out, step.input, b) for b in step.layout.blocks]
    if isinstance(step, Compute) and step.exchange:
        return _experts(index, step, layouts, plan.dtypes, plan.mesh)
    if isinstance(step, Compute) and step.ring:
        return _ringed(index, step, layouts, plan.dtypes, plan.mesh)
    if isinstance(step, Compute):
        return _shards(index, step, layouts, plan.dtypes, plan.mesh)
    return _reshard(index, step, layouts, plan.mesh, plan.dtypes, pieces)


def _shards(index: int, step: Compute, layouts: Mapping[str, Layout], dtypes: Mapping[str, str], mesh: Mesh
            ) -> list[RankStep | None]:
    """Every rank's run of `step`: made once per distinct (index block, argument blocks held), which is all a
    rank's run depends on (a replicated step on 512 ranks is one run, not 512)."""
    boxes: dict[tuple[int, ZRange], ZRange] = {}
    made: dict[tuple[Block, ...], ShardCompute | None] = {}
    runs: list[RankStep | None] = []
    for rank in mesh.devices:
        key = (step.blocks[rank], *(layouts[a].blocks[rank] if a in layouts else None for a in step.args))
        if key not in made:
            made[key] = _shard(index, step, rank, layouts, dtypes, boxes)
        runs.append(made[key])
    return runs


def _shard(index: int, step: Compute, rank: int, layouts: Mapping[str, Layout], dtypes: Mapping[str, str],
           boxes: dict[tuple[int, ZRange], ZRange] | None = None) -> ShardCompute | None:
    """Rank `rank`'s run of `step`; `boxes` keeps the step's projected blocks (argument i, block; -1: the output)
    across its ranks, where blocks repeat."""
    block = step.blocks[rank]
    if block is None:
        return None
    sig = step.signature
    boxes = {} if boxes is None else boxes
    reads = []
    for i, (arg, shape, projection) in enumerate(zip(step.args, step.input_shapes, sig.projections)):
        if arg not in layouts:
            raise LoweringError(f"step {index} ({step.out}) reads {arg!r}, which no earlier step makes")
        held = layouts[arg].blocks[rank]
        want = boxes.get((i, block)) or boxes.setdefault((i, block), projection.apply(block))
        reads.append(_read(arg, held, dtypes[arg], want, shape, f"step {index} ({step.out})"))
    kwargs = tuple(sorted(sig.call_kwargs(block).items()))
    out = boxes.get((-1, block)) or boxes.setdefault((-1, block), sig.output.apply(block))
    return ShardCompute(index, step.out, step.kernel, kwargs, block, tuple(reads), out)


def _experts(index: int, step: Compute, layouts: Mapping[str, Layout], dtypes: Mapping[str, str], mesh: Mesh
             ) -> list[RankStep | None]:
    """Each rank's expert-parallel step: its reads for its own block, and its group along the exchange axes."""
    steps: list[RankStep | None] = [None] * mesh.size
    for group in exchange.members(step, mesh):
        blocks = tuple(step.blocks[r] for r in group)
        if any(b is None for b in blocks):
            raise LoweringError(f"step {index} ({step.out}): a member of expert-parallel group {group} idles")
        members = None if len(group) == mesh.size else group
        for member, rank in enumerate(group):
            shard = _shard(index, step, rank, layouts, dtypes)
            assert shard is not None
            steps[rank] = ExpertCompute(index, step.out, step.kernel, step.params, step.input_shapes,
                                        step.input_dtypes, shard.index, shard.reads, shard.out_block, members,
                                        member, blocks=blocks)  # type: ignore[arg-type]
    return steps


def _ringed(index: int, step: Compute, layouts: Mapping[str, Layout], dtypes: Mapping[str, str], mesh: Mesh
            ) -> list[RankStep | None]:
    """Each rank's ring step: its reads (its own key block of a travelling input), and its ring."""
    steps: list[RankStep | None] = [None] * mesh.size
    keys, moving, sig = ring.keys(step, mesh), ring.travelling(step), step.signature
    for group in ring.members(step, mesh):
        if any(step.blocks[r] is None for r in group):
            raise LoweringError(f"step {index} ({step.out}): a member of ring {group} idles")
        members = None if len(group) == mesh.size else group
        for member, rank in enumerate(group):
            reads = []
            for arg, shape, want, moves, projection in zip(step.args, step.input_shapes,
                                                           ring.reads(step, rank, keys[rank]), moving,
                                                           sig.projections):
                if arg not in layouts:
                    raise LoweringError(f"step {index} ({step.out}) reads {arg!r}, which no earlier step makes")
                region = want if moves else projection.apply(step.blocks[rank])
                reads.append(_read(arg, layouts[arg].blocks[rank], dtypes[arg], region, shape,
                                   f"step {index} ({step.out})"))
            block = step.blocks[rank]
            steps[rank] = RingCompute(index, step.out, step.kernel, step.params, step.input_shapes, step.input_dtypes,
                                      block, tuple(reads), sig.output.apply(block), members, member,
                                      keys=tuple(keys[r] for r in group))
    return steps


def _read(buffer: str, held: Block, dtype: str, want: ZRange, shape: Shape, where: str) -> Read:
    inside = ZRange.from_shape(shape).intersection(want)
    pad = tuple((max(0, -s), max(0, e - size)) for s, e, size in zip(want.start, want.end, shape))
    if inside is None or inside.is_empty:
        return Read(buffer, None, pad, want.shape, dtype)
    if held is None or not held.contains(inside):
        raise LoweringError(f"{where}: needs {inside} of {buffer!r} but this rank holds {held}")
    return Read(buffer, inside.translate([-s for s in held.start]), pad, want.shape, dtype, inside == held)


def _reshard(index: int, step: Reshard, layouts: Mapping[str, Layout], mesh: Mesh, dtypes: Mapping[str, str],
             pieces: bool = True) -> list[RankStep | None]:
    if step.src not in layouts:
        raise LoweringError(f"step {index} ({step.out}) reshards {step.src!r}, which no earlier step makes")
    steps: list[RankStep | None] = [None] * mesh.size
    dtype = dtypes[step.src]
    for group in reshard_groups(step.src_layout, step.layout, step.shape, mesh):
        for rank, rank_step in zip(group.ranks, _group_steps(index, step, group, mesh, dtype, pieces)):
            steps[rank] = rank_step
    return steps


def _group_steps(index: int, step: Reshard, group: Group, mesh: Mesh, dtype: str, pieces: bool = True
                 ) -> list[RankStep | None]:
    """One group's steps, in its rank order: blocks listed in group order, peers named by global rank. The moves
    are found only for the steps that list them (`lower`'s `pieces`; a send_recv always: who joins it and its
    root follow from them)."""
    src, dst, ranks = group.src, group.dst, group.ranks
    kind = step_type(group)
    members = None if len(ranks) == mesh.size or kind is Local else ranks  # Local moves nothing: no group
    listed = kind is SendRecv or pieces and kind in (AllGather, AllToAll)
    moves = [Transfer(ranks[t.src], ranks[t.dst], t.region) for t in transfers(src, dst)] if listed else []
    roots = {t.dst for t in moves}
    sent, received = _pieces(moves)
    if kind is SendRecv and len(roots) == 1:
        root = roots.pop()
        sizes = tuple(sum(p.region.size for p in sent.get(r, ())) for r in ranks)
        return [Gather(index, step.out, step.src, s, d, members, dtype, sent.get(r, ()), received.get(r, ()),
                       overlap(s, d), src.partial, root, sizes) for r, s, d in zip(ranks, src.blocks, dst.blocks)]
    steps: list[RankStep | None] = []
    for rank, held, need in zip(ranks, src.blocks, dst.blocks):
        common = (index, step.out, step.src, held, need, members, dtype)
        own = overlap(held, need)
        if kind is Local:
            steps.append(None if need is None else Local(*common))
        elif kind is AllReduce:
            steps.append(AllReduce(*common, region=next(b for b in dst.blocks if b is not None)))
        elif kind is ReduceScatter:
            steps.append(ReduceScatter(*common, out_blocks=dst.blocks))
        elif kind is AllGather:
            take = ((Piece(rank, own),) if own is not None and listed else ()) + received.get(rank, ())
            steps.append(AllGather(*common, blocks=src.blocks, take=take))
        else:
            send, recv = sent.get(rank, ()), received.get(rank, ())
            quiet = kind is SendRecv and not send and not recv
            steps.append(None if quiet and need is None else kind(*common, send, recv, own, src.partial))
    return steps


def _pieces(moves: list[Transfer]) -> tuple[dict[int, tuple[Piece, ...]], dict[int, tuple[Piece, ...]]]:
    """(what each rank sends, what each rank receives): its moves in order, tagged with the other end. Indexed
    once per group (each rank scanning every move was 37% of pricing three hand plans' peak memory on 512
    devices)."""
    sent: dict[int, list[Piece]] = {}
    received: dict[int, list[Piece]] = {}
    for t in moves:
        sent.setdefault(t.src, []).append(Piece(t.dst, t.region))
        received.setdefault(t.dst, []).append(Piece(t.src, t.region))
    return ({r: tuple(p) for r, p in sent.items()}, {r: tuple(p) for r, p in received.items()})


def step_type(group: Group) -> type[Comm]:
    """The step for sharding.collectives' name of one group's reshard. Each step type moves the exact regions
    of the layouts, whatever they are; an all_reduce's destination blocks are one region (`collectives._classify`
    names no other so), each rank's addend of it sliced from its partial block."""
    return _STEP_TYPES[group.kind]


_STEP_TYPES: dict[Collective, type[Comm]] = {
    Collective.NOOP: Local, Collective.ALL_GATHER: AllGather, Collective.ALL_REDUCE: AllReduce,
    Collective.REDUCE_SCATTER: ReduceScatter, Collective.ALL_TO_ALL: AllToAll, Collective.SEND_RECV: SendRecv,
}


def _reads(step: RankStep) -> tuple[str, ...]:
    if isinstance(step, ShardCompute | GroupCompute):
        return tuple(r.buffer for r in step.reads if r.box is not None)
    return (step.src,) if isinstance(step, Comm) else ()


def _box(block: Block) -> str:
    return "[idle]" if block is None else "[" + ", ".join(f"{s}:{e}" for s, e in zip(block.start, block.end)) + "]"


def _show(read: Read) -> str:
    pad = f" pad {list(read.pad)}" if any(any(p) for p in read.pad) else ""
    return f"{read.buffer}{_box(read.box) if read.box is not None else '[zeros]'}{pad}"
