"""Plans: the distributed programs extraction chooses."""
from tapestry.plan.build import build_plan
from tapestry.plan.plan import Compute, Place, Plan, Reshard, Step, output_gathers, steady_violations

__all__ = ["build_plan", "Compute", "Place", "Plan", "Reshard", "Step", "output_gathers", "steady_violations"]
