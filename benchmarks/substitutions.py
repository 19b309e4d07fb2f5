"""Substitution parity with TASO and Tensat. Writes two sections of docs/benchmarks.md:

- "TASO substitutions proven": `tapestry.equivalent` on TASO's 133 substitutions, instantiated with concrete shapes
  (tapestry.testing.taso), with the shipped rules (rules/ and rules/taso/), and on their deliberately wrong variants.
- "Substitutions on Tensat's models": a BERT layer, a NasRNN cell, a ResNeXt block and an Inception-style block,
  optimised with the default rules (rules/) and with every rule file (+ rules/taso/: the merges and TASO's
  algebra), on 1 and 4 devices under gpu-h100-nccl, next to Tensat's own numbers.

    .venv/bin/python benchmarks/substitutions.py [--skip-proofs] [--skip-models]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section  # noqa: E402

from tapestry import optimize  # noqa: E402
from tapestry.cost import DefaultCostModel, load_profile  # noqa: E402
from tapestry.egraph.driver import Budget  # noqa: E402
from tapestry.egraph.rules import BUILTIN_DIR, TASO_DIR  # noqa: E402
from tapestry.evaluator import evaluate, random_inputs  # noqa: E402
from tapestry.graph import Graph, GraphError, Value  # noqa: E402
from tapestry.models import transformer_block  # noqa: E402
from tapestry.plan.plan import Compute  # noqa: E402
from tapestry.prove import equivalent  # noqa: E402
from tapestry.testing.taso import substitutions, wrong_variant  # noqa: E402
from tapestry.verify import error  # noqa: E402

PROOF_BUDGET = Budget(seconds=10, iterations=12)
RULE_SETS = {"default (rules/)": [BUILTIN_DIR], "+ taso/ (merges, algebra)": [BUILTIN_DIR, TASO_DIR]}
# Tensat's recorded runs (uwplse/tensat, with_release/{bert,nasrnn,resnext50}_1_stats.txt at commit 234840b, first
# run; times in ms on its GPU, measured by TASO): the whole model, not one block, so only the ratios compare.
TENSAT = {
    "BERT layer": dict(model="BERT (8 layers)", original=1.2058, optimized=0.9095, nodes=1569, classes=625,
                       saturation=0.490, extraction=0.494),
    "NasRNN cell": dict(model="NasRNN (5 steps)", original=1.6016, optimized=1.0694, nodes=1990, classes=1345,
                        saturation=0.073, extraction=0.197),
    "ResNeXt block": dict(model="ResNeXt-50", original=7.2576, optimized=4.5027, nodes=371, classes=287,
                          saturation=0.464, extraction=0.035),
}


def agree(a: Graph, b: Graph) -> bool:
    inputs = random_inputs(a, 0)
    got, want = evaluate(b, inputs), evaluate(a, inputs)
    return all(got[k].shape == want[k].shape and error(got[k], want[k], "float32").ok for k in want)


def proofs() -> str:
    subs = substitutions()
    times, proven, missed = [], 0, []
    for sub in subs:
        start = time.perf_counter()
        result = equivalent(*sub.graphs(), budget=PROOF_BUDGET)
        times.append(time.perf_counter() - start)
        proven += result.proven
        if not result.proven:
            missed.append(sub.name)
        print(sub.name, result.proven, f"{times[-1]:.2f}s", flush=True)
    wrong, wrong_proven = 0, []
    for sub in subs:
        variant = wrong_variant(sub)
        try:
            if variant is None or agree(*variant.graphs()):
                continue
        except GraphError:
            continue
        wrong += 1
        if equivalent(*variant.graphs(), budget=PROOF_BUDGET).proven:
            wrong_proven.append(variant.name)
    return (
        f"Proven: **{proven} of {len(subs)}** ({100 * proven / len(subs):.1f}%), each within the 10 s budget: "
        f"median {statistics.median(times):.2f} s, max {max(times):.2f} s per proof. Not proven: "
        f"{', '.join(missed) or 'none'} (each permutes channels in both the input and the filter of a conv; "
        f"no rule reorders channels). Deliberately wrong variants (a matmul's or conv's operands swapped, add and "
        f"mul exchanged, or a concat's operands swapped; kept when the evaluator says the sides differ): "
        f"**{len(wrong_proven)} of {wrong} proven**{': ' + ', '.join(wrong_proven) if wrong_proven else ''}.\n\n"
        "Rules: rules/ and rules/taso/ (tapestry.prove.PROOF_RULES). Shapes: matrices 4x4, activations and filters "
        "2x2x3x3."
    )


# -- Tensat's models, built with the Graph API --------------------------------------------------------


def nasrnn_cell(batch: int = 64, hidden: int = 512) -> Graph:
    """One NasRNN cell as TASO's examples/nasrnn.py builds it: eight x @ Wx_i + h @ Wh_i, then a tree of
    activations, adds and muls."""
    g = Graph()
    x, h = g.input("x", (batch, hidden)), g.input("h", (batch, hidden))
    t = [g.add(g.matmul(x, g.input(f"wx{i}", (hidden, hidden))), g.matmul(h, g.input(f"wh{i}", (hidden, hidden))))
         for i in range(8)]
    m0 = g.add(g.relu(t[0]), g.sigmoid(t[3]))
    m1 = g.add(g.sigmoid(t[1]), g.tanh(t[2]))
    m2 = g.mul(g.sigmoid(t[4]), g.tanh(t[5]))
    m3 = g.mul(g.sigmoid(t[6]), g.relu(t[7]))
    m4 = g.mul(g.sigmoid(m1), g.tanh(m2))
    m5 = g.mul(g.tanh(m0), g.tanh(m3))
    g.output("h_next", g.tanh(g.mul(g.tanh(m4), g.tanh(m5))))
    return g


def conv(g: Graph, x: Value, name: str, out: int, k: int, groups: int = 1, relu: bool = True) -> Value:
    w = g.input(name, (out, x.shape[1] // groups, k, k))
    y = g.conv2d(x, w, groups=groups, padding=k // 2)
    return g.relu(y) if relu else y


def resnext_block(channels: int = 256, width: int = 128, groups: int = 32, size: int = 14) -> Graph:
    """A ResNeXt-50 bottleneck: 1x1, grouped 3x3, 1x1, residual add, relu."""
    g = Graph()
    x = g.input("x", (1, channels, size, size))
    y = conv(g, conv(g, x, "w1", width, 1), "w2", width, 3, groups)
    g.output("y", g.relu(g.add(x, conv(g, y, "w3", channels, 1, relu=False))))
    return g


def inception_block(channels: int = 192, size: int = 28) -> Graph:
    """An Inception-v3-style block: 1x1, 1x1 -> 3x3, 1x1 -> 3x3 -> 3x3 branches of one input, concatenated."""
    g = Graph()
    x = g.input("x", (1, channels, size, size))
    a = conv(g, x, "a1", 64, 1)
    b = conv(g, conv(g, x, "b1", 48, 1), "b2", 64, 3)
    c = conv(g, conv(g, conv(g, x, "c1", 64, 1), "c2", 96, 3), "c3", 96, 3)
    g.output("y", g.concat(g.concat(a, b, axis=1), c, axis=1))
    return g


MODELS = {
    "BERT layer": lambda: transformer_block(batch=1, seq=64, dim=1024, heads=16),
    "NasRNN cell": nasrnn_cell,
    "ResNeXt block": resnext_block,
    "Inception block": inception_block,
}


def chosen_merges(steps) -> str:
    """The plan's compute steps made by a merge or TASO rule, by rule (file:line)."""
    found: dict[str, int] = {}
    for step in steps:
        if isinstance(step, Compute) and "made by" in step.origin:
            for rule in step.origin.split("made by ", 1)[1].split(" in round")[0].split(" or "):
                if rule.startswith(("merge.egg", "conv_merge.egg", "concat.egg", "conv.egg")):
                    found[rule] = found.get(rule, 0) + 1
    return ", ".join(f"{rule} x{n}" for rule, n in sorted(found.items())) or "none"


def models(budget_seconds: float) -> str:
    cost_model = DefaultCostModel(load_profile("gpu-h100-nccl"))
    rows = ["| model | rules | devices | e-nodes | optimize s | predicted ms | speed-up vs default, 1 device | "
            "merges and TASO rules in the plan |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for name, build in MODELS.items():
        graph = build()
        baseline = None
        for label, rules in RULE_SETS.items():
            for devices in (1, 4):
                start = time.perf_counter()
                result = optimize(graph, devices, rules=rules, cost_model=cost_model,
                                  budget=Budget(seconds=budget_seconds))
                seconds = time.perf_counter() - start
                baseline = baseline or result.plan.cost
                row = (f"| {name} | {label} | {devices} | {result.stats.enodes:,} | {seconds:.1f} | "
                       f"{1e3 * result.plan.cost:.3f} | {baseline / result.plan.cost:.2f} | "
                       f"{chosen_merges(result.plan.steps)} |")
                print(row, flush=True)
                rows.append(row)
    tensat = ["| Tensat model | original ms | optimized ms | speed-up | e-nodes | e-classes | saturation s | "
              "extraction s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t in TENSAT.values():
        tensat.append(f"| {t['model']} | {t['original']:.3f} | {t['optimized']:.3f} | "
                      f"{t['original'] / t['optimized']:.2f} | {t['nodes']:,} | {t['classes']:,} | "
                      f"{t['saturation']:.3f} | {t['extraction']:.3f} |")
    return (
        "\n".join(rows)
        + "\n\nPredicted times are the plans' under gpu-h100-nccl (float32). The speed-up is over the plan found with "
        "the default rules on one device, so the 4-device rows mix sharding and substitution.\n\n"
        "Tensat's own numbers (uwplse/tensat, `with_release/*_stats.txt` at commit 234840b, first of its runs; whole "
        "models, times measured by TASO on its GPU; Yang et al., MLSys'21, report up to 16% over TASO and 48x less "
        "optimisation time on average):\n\n" + "\n".join(tensat)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-proofs", action="store_true")
    parser.add_argument("--skip-models", action="store_true")
    parser.add_argument("--budget-seconds", type=float, default=60.0, help="optimize budget per model")
    args = parser.parse_args()
    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the start"
    if not args.skip_proofs:
        write_section("TASO substitutions proven", "python benchmarks/substitutions.py --skip-models",
                      proofs() + f"\n\nMachine: {load}.")
    if not args.skip_models:
        write_section("Substitutions on Tensat's models", "python benchmarks/substitutions.py --skip-proofs",
                      models(args.budget_seconds) + f"\n\nMachine: {load}.")


if __name__ == "__main__":
    main()
