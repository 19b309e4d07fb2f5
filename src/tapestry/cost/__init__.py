"""Cost models: seconds per distributed step, peak memory per device, and device profiles.

See docs/cost-models.md. A cost model is anything with `step_cost(step, mesh)`;
DefaultCostModel prices compute on a roofline and communication with alpha-beta.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tapestry.cost.comm import AlphaBeta, collective_time
from tapestry.cost.memory import RankPeak, layout_bytes, peak_memory, rank_peaks, resident_bytes
from tapestry.cost.fusion import fused_costs
from tapestry.cost.model import CostModel, alike_key, plan_cost, run_costs, step_costs
from tapestry.cost.profile import DeviceProfile, Link, Profile, builtin_profiles, load_profile
from tapestry.cost.roofline import Roofline
from tapestry.plan.plan import Plan, Reshard, Step
from tapestry.sharding import Mesh


@dataclass(frozen=True)
class DefaultCostModel:
    """Roofline for Compute, alpha-beta for Reshard, and Place free: inputs arrive already laid out. With `fuse`,
    a plan's chains of elementwise kernels are priced as the one kernel inductor compiles them into
    (`cost.fusion`; the rank programs of spmd are compiled whole)."""

    profile: Profile
    fuse: bool = True

    @property
    def roofline(self) -> Roofline:
        return Roofline(self.profile.device)

    @property
    def comm(self) -> AlphaBeta:
        return AlphaBeta(self.profile)

    def step_cost(self, step: Step, mesh: Mesh) -> float:
        return self.roofline.step_cost(step, mesh) + self.comm.step_cost(step, mesh)

    def reshard_floors(self, steps: Sequence[Reshard], mesh: Mesh) -> np.ndarray:
        """A lower bound on `step_cost` of each reshard (`AlphaBeta.reshard_floors`; the roofline's share is at
        least 0): what extraction prices moves it has not yet chosen at (egraph.extractor_pricing)."""
        return self.comm.reshard_floors(steps, mesh)

    @property
    def fused_device(self) -> DeviceProfile | None:
        """With `fuse`, the device extraction prices fusible e-nodes as fusion group members on
        (egraph.fused_prices), so that it chooses by the price `plan_step_costs` gives the plan; else None."""
        return self.profile.device if self.fuse else None

    def plan_step_costs(self, plan: Plan) -> dict[str, float]:
        """Seconds per per-run step of `plan`, fusion groups charged as one kernel (`cost.fusion`) with `fuse`.
        Steps alike but for their names are priced once (`step_cost` reads no name): an expanded plan runs copy 1's
        steps once per later copy."""
        priced: dict[tuple, float] = {}
        costs = {}
        for step in plan.steps:
            if step.out not in plan.prepared:
                key = alike_key(step)
                if key not in priced:
                    priced[key] = self.step_cost(step, plan.mesh)
                costs[step.out] = priced[key]
        return fused_costs(plan, costs, self.profile.device) if self.fuse else costs


def default_cost_model() -> DefaultCostModel:
    """The model tapestry.optimize prices plans with unless given one (here, not in the optimizer, so that a plan
    cache key is made without importing the optimizer and egglog)."""
    return DefaultCostModel(load_profile("cpu-gloo"))


__all__ = [
    "AlphaBeta",
    "CostModel",
    "DefaultCostModel",
    "DeviceProfile",
    "Link",
    "Profile",
    "RankPeak",
    "Roofline",
    "default_cost_model",
    "builtin_profiles",
    "collective_time",
    "layout_bytes",
    "load_profile",
    "peak_memory",
    "rank_peaks",
    "resident_bytes",
    "plan_cost",
    "run_costs",
    "step_costs",
]
