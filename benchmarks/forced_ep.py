"""The best expert-parallel plan the search finds for a held-back call, priced honestly (issue 24, gep24).

`python benchmarks/forced_ep.py FLAGS` takes benchmarks/heldback_call.py's flags (training steps only), plans the
step with every grouped mm that is not exchanged priced out (1 s each: the search must exchange the experts, over
whole axes or in groups of one, `Compute.exchange_group`), then prices that plan by the held-back call's own cost
model (gpu-h100-nccl): what expert parallelism, as the e-graph holds it, would cost against the plain call's plan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import heldback_call

import tapestry
from tapestry.cost import DefaultCostModel, load_profile, plan_cost
from tapestry.plan import Compute

EXPERT_KERNELS = ("grouped_mm", "grouped_mm_k", "grouped_mm_blocks", "grouped_mm_blocks_k")


@dataclass(frozen=True)
class Forced:
    """`base`, with every expert kernel that is not exchanged priced out."""

    base: Any

    def step_cost(self, step: Any, mesh: tapestry.Mesh) -> float:
        if isinstance(step, Compute) and step.kernel in EXPERT_KERNELS and not step.exchange:
            return 1.0
        return self.base.step_cost(step, mesh)


def main() -> None:
    args = heldback_call.arguments().parse_args()
    model, ids = heldback_call.build(args)

    def loss(module: Any, ids: Any, labels: Any) -> Any:
        return module(input_ids=ids, labels=labels, use_cache=False).loss

    imported = tapestry.from_torch(model, (ids, ids), verbose=False,
                                   training=tapestry.Training(loss=loss, optimizer="adam", lr=1e-4))
    mesh = tapestry.Mesh(*(int(n) for n in args.mesh.split("x")))
    honest = DefaultCostModel(load_profile(args.profile))
    cpu = time.process_time()
    result = tapestry.optimize(imported.graph, mesh=mesh, memory_budget=int(args.budget_gb * 10**9),
                               cost_model=Forced(honest))
    print(f"optimize under the forced model: {time.process_time() - cpu:.1f} s CPU, status {result.status}")
    print(f"exchanges: {heldback_call.exchanges(result.plan) or 'none'}")
    print(f"priced by {args.profile}: {plan_cost(result.plan, honest) * 1e3:.2f} ms, peak "
          f"{result.peak_memory / 10**9:.2f} GB per device")


if __name__ == "__main__":
    main()
