"""The best expert-parallel plan the search finds for a held-back call, priced honestly (issue 24, gep24).

`python benchmarks/forced_ep.py FLAGS` takes benchmarks/heldback_call.py's flags (training steps only), plans the
step with every grouped mm that is not exchanged priced out (1 s each: the search must exchange the experts, over
whole axes or in groups of one, `Compute.exchange_group`), then prices that plan by the held-back call's own cost
model (gpu-h100-nccl): what expert parallelism, as the e-graph holds it, would cost against the plain call's plan.
`--groups` prices out whole-axis exchanges too (each expert kernel must exchange in groups, gep24b): what the
search's best grouped plan costs, against the one it picks when both are open.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import heldback_call

import tapestry
from tapestry.cost import DefaultCostModel, load_profile, plan_cost
from tapestry.cost.breakdown import breakdown
from tapestry.plan import Compute

EXPERT_KERNELS = ("grouped_mm", "grouped_mm_k", "grouped_mm_blocks", "grouped_mm_blocks_k")


@dataclass(frozen=True)
class Forced:
    """`base`, with every expert kernel that is not exchanged (`groups`: in groups) priced out."""

    base: Any
    groups: bool = False

    def step_cost(self, step: Any, mesh: tapestry.Mesh) -> float:
        if isinstance(step, Compute) and step.kernel in EXPERT_KERNELS and not (
                step.exchange_group if self.groups else step.exchange):
            return 1.0
        return self.base.step_cost(step, mesh)


def main() -> None:
    parser = heldback_call.arguments()
    parser.add_argument("--groups", action="store_true", help="price out whole-axis exchanges too")
    parser.add_argument("--breakdown", action="store_true", help="print the plan's seconds per phase and kind")
    args = parser.parse_args()
    model, ids = heldback_call.build(args)

    def loss(module: Any, ids: Any, labels: Any) -> Any:
        return module(input_ids=ids, labels=labels, use_cache=False).loss

    imported = tapestry.from_torch(model, (ids, ids), verbose=False,
                                   training=tapestry.Training(loss=loss, optimizer="adam", lr=1e-4))
    mesh = tapestry.Mesh(*(int(n) for n in args.mesh.split("x")))
    honest = DefaultCostModel(load_profile(args.profile))
    cpu = time.process_time()
    result = tapestry.optimize(imported.graph, mesh=mesh, memory_budget=int(args.budget_gb * 10**9),
                               cost_model=Forced(honest, args.groups))
    print(f"optimize under the forced model: {time.process_time() - cpu:.1f} s CPU, status {result.status}")
    print(f"exchanges: {heldback_call.exchanges(result.plan) or 'none'}")
    print(f"priced by {args.profile}: {plan_cost(result.plan, honest) * 1e3:.2f} ms, peak "
          f"{result.peak_memory / 10**9:.2f} GB per device")
    if args.breakdown:
        print(breakdown(result.plan, honest, honest.profile.device).table())


if __name__ == "__main__":
    main()
