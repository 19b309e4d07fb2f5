"""What an import made of a model: ATen ops in, the kernels they became, the ops left opaque and why, and the
share of the model's FLOPs that can shard (and, given a plan, the share of the FLOPs each run pays that it does
shard, with the FLOPs of its prepared steps beside it: `Plan.prepared`, run once ahead of time, paid by no run).

    tapestry import-report t5 examples/gpt2.py --mesh 2x2 --optimize

FLOPs are the kernels' own counts (`Signature.cost` over the whole index space: 2 per multiply-add, one per
element of an elementwise op). An opaque op's index space is one point, so its FLOPs are torch's count for the
ATen op on meta tensors (torch.utils.flop_counter: matmuls, convolutions, attention, recurrent cells), or one
per output element where torch counts none. An op can shard when some candidate partition of its index space on
the mesh splits it; opaque ops never do.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from tapestry import dtypes
from tapestry.graph import Graph
from tapestry.importer import TorchImport
from tapestry.kernels import Signature
from tapestry.kernels.opaque import aten_op, decode_args
from tapestry.plan import Compute, Plan
from tapestry.sharding import Mesh
from tapestry.sharding.partition import candidate_partitions


@dataclass(frozen=True)
class OpaqueOp:
    aten: str
    count: int
    why: str


@dataclass(frozen=True)
class ImportReport:
    model: str
    mesh: Mesh
    aten_ops: int
    made: dict[str, int]  # "kernels", "folded", "dropped", "opaque" -> ATen ops
    kernels: dict[str, int]  # graph kernel -> ops of it
    opaque: tuple[OpaqueOp, ...]
    flops: float
    shardable_flops: float
    plan_sharded_flops: float | None = None  # of `plan_flops`, those in steps split over devices
    plan_flops: float | None = None  # the FLOPs of the plan's compute steps each run pays (prepared ones left out)
    plan_prepared_flops: float | None = None  # the FLOPs of its prepared compute steps, run once ahead of time

    @property
    def shardable(self) -> float:
        return self.shardable_flops / self.flops if self.flops else 1.0

    @property
    def plan_sharded(self) -> float | None:
        if self.plan_flops is None or self.plan_sharded_flops is None:
            return None
        return self.plan_sharded_flops / self.plan_flops if self.plan_flops else 1.0

    def text(self) -> str:
        made = ", ".join(f"{self.made.get(k, 0)} {k}" for k in ("kernels", "folded", "dropped", "opaque"))
        lines = [f"{self.model}: {self.aten_ops} ATen ops -> {made}",
                 "  kernels: " + ", ".join(f"{k} x{n}" for k, n in sorted(self.kernels.items())),
                 f"  FLOPs: {self.flops:.3g}; can shard on {self.mesh}: {self.shardable:.1%}"]
        if self.plan_sharded is not None:
            lines[-1] += f"; the plan shards {self.plan_sharded:.1%} of the {self.plan_flops:.3g} FLOPs a run pays"
            if self.plan_prepared_flops:
                lines[-1] += f" ({self.plan_prepared_flops:.3g} more prepared once, ahead of time)"
        lines += [f"  opaque: {op.aten} x{op.count}: {op.why}" for op in self.opaque]
        return "\n".join(lines)


def _why_opaque(declined: collections.Counter | None) -> str:
    """Why an op runs opaque: its converter's reasons for declining (most frequent first), or no converter at all."""
    if not declined:
        return "no converter (no Tapestry kernel for this op)"
    return "the converter declined: " + "; ".join(why for why, _ in declined.most_common())


def import_report(name: str, imported: TorchImport, mesh: Mesh, plan: Plan | None = None) -> ImportReport:
    totals: collections.Counter = collections.Counter()
    for made in imported.coverage.values():
        for kind, n in made.items():
            totals[kind if kind in ("folded", "dropped", "opaque") else "kernels"] += n
    graph = imported.graph
    kernels = collections.Counter(node.op for node in graph.ops if not node.op.startswith("opaque"))
    opaque = tuple(OpaqueOp(op, n, _why_opaque(imported.translation.declined.get(op))) for op, n in
                   sorted(imported.opaque.items()))
    flops = shardable = 0.0
    for node in graph.ops:
        work = flops_of(graph.signature(node.name))
        flops += work
        if not node.op.startswith("opaque") and any(any(p.axes) for p in
                                                     candidate_partitions(graph.signature(node.name), mesh)):
            shardable += work
    split = PlanFlops.of(plan) if plan is not None else None
    return ImportReport(name, mesh, sum(totals.values()), dict(totals), dict(kernels), opaque, flops, shardable,
                        *((split.sharded, split.per_run, split.prepared) if split else ()))


@dataclass(frozen=True)
class PlanFlops:
    """A plan's compute FLOPs (`flops_of` each step's whole op): those each run pays, the share of them in steps
    split over devices, and those of its prepared steps, which a run does not pay (made once from static inputs)."""
    per_run: float
    sharded: float
    prepared: float

    @staticmethod
    def of(plan: Plan) -> PlanFlops:
        per_run = sharded = prepared = 0.0
        for step in plan.steps:
            if isinstance(step, Compute):
                work = flops_of(step.signature)
                if step.out in plan.prepared:
                    prepared += work
                else:
                    per_run += work
                    sharded += work if len(set(step.blocks)) > 1 else 0.0
        return PlanFlops(per_run, sharded, prepared)


def model_flops(graph: Graph) -> float:
    """FLOPs of one run of the whole graph, every op unsharded (`flops_of` each): what an MFU counts."""
    return sum(flops_of(graph.signature(op.name)) for op in graph.ops)


def flops_of(sig: Signature) -> float:
    """FLOPs of a whole op (see the module docstring for opaque ops)."""
    if not sig.kernel.name.startswith("opaque"):
        return sig.cost(sig.index)[0]
    params = dict(sig.params)
    metas = tuple(torch.empty(s, dtype=dtypes.to_torch(d), device="meta")
                  for s, d in zip(sig.input_shapes, sig.input_dtypes))
    try:
        positional, keywords = decode_args(params["args"], metas)
        with FlopCounterMode(display=False) as counter:
            aten_op(params["aten"])(*positional, **keywords)
        counted = counter.get_total_flops()
    except Exception:  # noqa: BLE001  an op with no meta kernel (a library's custom op): its output elements
        counted = 0
    return float(counted or math.prod(int(s) for s in params["shape"]))
