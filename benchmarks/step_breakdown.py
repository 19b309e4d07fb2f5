"""Where one LLaMA block's training step goes under the cost model (issue 24: the MFU goal).

One `importer.zoo.LlamaBlock` at a LLaMA-2 width, built on the meta device in bfloat16, one Adam step (MSE loss)
of `--batch` sequences x `--seq` tokens, planned whole on one device (`build_plan` on Mesh(1): no communication,
so what is left is what the kernels cost) and by the hand 2-D recipe (training/plans.data_tensor_parallel: data
parallel over the nodes, Megatron tensor parallel in the node) on `--mesh`. Each plan's time is split by
`cost.breakdown` (phase x what bounds each step), and each kind further by how much of it is attention: the
fused flash kernels the training import keeps (kernels/flash.py), and any step making an attention-sized value (its
last two dims the sequence x the sequence: the scores and probabilities a math attention materializes, which a
flash kernel never writes). Writes the "Step breakdown" section.

    python benchmarks/step_breakdown.py                 # 7B width, 8 x 2048, 8x8
    python benchmarks/step_breakdown.py --quick         # a small width, to check the script
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

from _report import write_section

PROFILE = "gpu-h100-cluster"
WIDTHS = {"70B": (8192, 28672, 64), "13B": (5120, 13824, 40), "7B": (4096, 11008, 32), "tiny": (256, 512, 4)}


def import_block(width: str, batch: int, seq: int) -> Any:
    import torch

    import tapestry
    from tapestry.importer.zoo import LlamaBlock

    hidden, mlp, heads = WIDTHS[width]
    with torch.device("meta"):
        block = LlamaBlock(hidden, heads, mlp).to(torch.bfloat16)
    x = torch.zeros(batch, seq, hidden, dtype=torch.bfloat16, device="meta")

    def loss(m: Any, x: Any, y: Any) -> Any:
        return torch.nn.functional.mse_loss(m(x), y)

    return tapestry.from_torch(block, (x, x), training=tapestry.Training(loss=loss, optimizer="adam", lr=1e-4),
                               verbose=False)


def attention_sized(plan: Any, seq: int, model: Any) -> dict[str, float]:
    """Seconds (launches apart) of the plan's attention steps, by phase/kind: fused flash kernels, and steps that
    make an attention-sized value (math attention)."""
    from tapestry.cost.breakdown import compute_kind, phases
    from tapestry.plan import Compute

    phase, device = phases(plan), model.profile.device
    found: dict[str, float] = defaultdict(float)
    for step in plan.steps:
        if not isinstance(step, Compute) or step.signature.kernel.is_view:
            continue
        shape = step.signature.output_shape
        fused = step.signature.kernel.name.startswith("flash_attention")
        if fused or (len(shape) >= 2 and shape[-1] == seq and shape[-2] == seq):
            kind = compute_kind(step, device)
            launch = device.launch_overhead * device.oversubscription(plan.mesh.size)  # filed apart, as breakdown
            found[f"{phase[step.out]}/{kind}"] += max(model.step_cost(step, plan.mesh) - launch, 0.0)
    return dict(found)


def report(name: str, plan: Any, seq: int, model: Any) -> str:
    from tapestry.cost import plan_cost
    from tapestry.cost.breakdown import breakdown

    found = breakdown(plan, model, model.profile.device)
    attention = attention_sized(plan, seq, model)
    lines = [f"{name}: predicted {plan_cost(plan, model) * 1e3:.2f} ms, its compute's FLOPs at the bf16 peak "
             f"{found.model_seconds * 1e3:.2f} ms", "",
             "| phase | kind | steps | ms | of it attention ms | share |", "|---|---|---:|---:|---:|---:|"]
    total = found.total
    for key in sorted(found.seconds, key=lambda k: (["forward", "backward", "update", "step"].index(k[0]),
                                                    -found.seconds[k])):
        seconds = found.seconds[key]
        if abs(seconds) < 1e-6:
            continue
        att = attention.get(f"{key[0]}/{key[1]}")
        lines.append(f"| {key[0]} | {key[1]} | {found.count.get(key, 0)} | {seconds * 1e3:.2f} | "
                     f"{'' if att is None else f'{att * 1e3:.2f}'} | {seconds / total:.1%} |")
    lines.append(f"| all | total | {sum(found.count.values())} | {total * 1e3:.2f} | "
                 f"{sum(attention.values()) * 1e3:.2f} | 100% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", default="7B", choices=sorted(WIDTHS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.width, args.batch, args.seq, args.mesh = "tiny", 2, 64, "2x4"
    import re

    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.plan import build_plan
    from tapestry.training.plans import data_tensor_parallel

    model = DefaultCostModel(load_profile(PROFILE))
    started = time.perf_counter()
    imported = import_block(args.width, args.batch, args.seq)
    graph = imported.graph
    print(f"imported in {time.perf_counter() - started:.1f} s", flush=True)
    hidden = {n.name: 0 if re.search(r"(^|\.)(q|k|v|gate|up)\.weight$", n.name) else 1 for n in graph.inputs
              if re.search(r"(^|\.)(q|k|v|gate|up|o|down)\.weight$", n.name) and not n.name.startswith("adam.")}
    if len(hidden) != 7:
        raise ValueError(f"expected the block's 7 weights for Megatron's split, found {sorted(hidden)}")
    mesh = tapestry.Mesh(*(int(n) for n in args.mesh.split("x")))
    one = report("One device (Mesh(1), nothing split)", build_plan(graph, tapestry.Mesh(1)), args.seq, model)
    hand = report(f"DP {mesh.shape[0]} x TP {mesh.shape[-1]} on {args.mesh}",
                  data_tensor_parallel(graph, mesh, imported.translation.user_inputs, hidden), args.seq, model)
    hidden_size, mlp, heads = WIDTHS[args.width]
    body = "\n".join([
        f"One LLaMA block at the {args.width} width (hidden {hidden_size}, MLP {mlp}, {heads} heads), bfloat16, "
        f"one Adam step of {args.batch} x {args.seq} tokens (MSE loss), priced with the `{PROFILE}` profile. "
        "Kinds (`cost.breakdown`): `compute-bound <dtype>` (FLOPs at that dtype's peak outweigh bytes: bfloat16 "
        "989 TFLOP/s on tensor cores, float32 66.9 on CUDA cores), `memory-bound` (bytes at 3.35 TB/s), "
        "`launch` (5 µs a kernel), collectives by kind, and the gradient reductions the backward hides "
        "(negative). `attention`: the fused flash attention kernels the training import keeps "
        "(`flash_attention`, `flash_attention_backward`: no score matrix in memory, causal pairs only), plus any "
        "step making a value whose last two dims are the sequence x the sequence (a math attention's scores).",
        "", one, "", hand, "",
    ])
    print(body)
    if not args.no_write and not args.quick:
        command = "python benchmarks/step_breakdown.py" + (f" --width {args.width}" if args.width != "7B" else "")
        write_section("Step breakdown", command, body)


if __name__ == "__main__":
    main()
