"""Compute time of a Compute step on a device roofline.

Every device runs its shard at once, so the step takes as long as its slowest
device; when the mesh has more devices than the host has cores (`DeviceProfile.cores`),
they time-share them and the step stretches by devices / cores. FLOPs and bytes come from the kernel's sympy
formulas (lambdified in Signature; bytes at each tensor's dtype size), so a fused kernel never pays for its
intermediate: the intermediate is simply not among its inputs or outputs. The peak is the profile's for the
kernel's compute dtype (tensor cores run bfloat16 many times faster than float32).
"""
from __future__ import annotations

from dataclasses import dataclass

from tapestry import dtypes
from tapestry.cost.profile import DeviceProfile
from tapestry.kernels import Signature
from tapestry.plan.plan import Compute, Step
from tapestry.sharding import Block, Mesh
from tapestry.sharding.partition import exchange_work


# What a view step costs: far below any launch, so it never outweighs a real saving, but not zero, so among
# plans that differ only by views extraction picks the one with fewest (a growing rule otherwise left
# transpose(relu(transpose(x))) tied with relu(x)).
VIEW_SECONDS = 1e-9


def compute_dtype(sig: Signature) -> str:
    """The dtype a kernel's arithmetic runs in: its floating inputs' (promoted; not its accumulators'), else its
    result's."""
    held = sig.kernel.accumulators
    floats = [d for slot, d in zip(sig.kernel.inputs, sig.input_dtypes) if dtypes.is_float(d) and slot not in held]
    return dtypes.promote(*floats) if floats else sig.dtype


@dataclass(frozen=True)
class Roofline:
    """Prices Compute steps; every other step is free here (see AlphaBeta for Reshard)."""

    device: DeviceProfile

    def shard_time(self, sig: Signature, block: Block, work: Block = None) -> float:
        """max(flops/peak, bytes/bandwidth) + launch overhead; an idle device costs nothing, a view VIEW_SECONDS.

        Views are all but free: on a local block they are metadata (or fold into the
        consumer's load), and charging them a launch would bias extraction
        towards rewrites that merely remove transposes.

        `work`: the block whose FLOPs the device does, where it differs from the block it reads (an expert-parallel
        step reads its own block, its experts' weights, and computes the rows of its whole group that meet them,
        `exchange_work`: where the experts split unevenly the busiest device meets more rows than its own).
        """
        if block is None or block.is_empty:
            return 0.0
        if sig.kernel.is_view:
            return VIEW_SECONDS
        flops, nbytes = sig.cost(block)
        if work is not None:
            flops = sig.cost(work)[0]
        peak = self.device.peak(compute_dtype(sig))
        return max(flops / peak, nbytes / self.device.mem_bandwidth) + self.device.launch_overhead

    def compute_time(self, step: Compute, mesh: Mesh) -> float:
        """The slowest device's shard time, priced once per distinct block, and where the kernel has no `work`
        (what a block costs is then its shape's, `Signature.cost`) once per block shape: 512 devices' even
        blocks have one or two shapes. Ragged blocks (a dim the devices do not divide) so cost their largest."""
        sig = step.signature
        if step.exchange:
            work = exchange_work(sig, step.blocks, step.exchange, mesh, step.exchange_group)
            return max((self.shard_time(sig, b, w) for b, w in set(zip(step.blocks, work))), default=0.0)
        blocks = set(step.blocks)
        if sig.kernel.work is None:
            blocks = set({None if b is None else b.shape: b for b in blocks}.values())
        return max((self.shard_time(sig, b) for b in blocks), default=0.0)

    def step_cost(self, step: Step, mesh: Mesh) -> float:
        """The step's time with every device running at once, stretched when the mesh outnumbers the cores."""
        if not isinstance(step, Compute):
            return 0.0
        return self.compute_time(step, mesh) * self.device.oversubscription(mesh.size)
