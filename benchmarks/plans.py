"""Plans benchmark: the optimizer's plan against the parallel strategies experts write by hand.

For the MLP (linear -> gelu -> linear) and the transformer block, over sizes, meshes and both
shipped profiles: data parallel, Megatron tensor parallel (column then row, one all-reduce per
block), Megatron TP + sequence parallel (reduce-scatter and all-gather instead of all-reduce) and,
on 2-D meshes, DP x TP, each built with `build_plan`; then the optimizer, unbudgeted and with the
budget of the leanest hand plan. Predicted time and exact peak memory per device for each. The
optimizer searches a superset of the hand plans, so a row where it is slower than the best hand plan
that fits the same budget is flagged: a bug to find. Writes the "Plans" section of
docs/benchmarks.md and docs/img/plans-winners.png; and at small sizes on gloo, runs the plans to set the
predicted order against the measured one.
"""
from __future__ import annotations

import argparse
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from _report import best_hand, grid_rows, mib, us, worse_summary, worse_than_hand, write_section
from tapestry.cost import DefaultCostModel, load_profile, peak_memory, plan_cost
from tapestry.graph import Graph
from tapestry.models import transformer_block
from tapestry.optimizer import Explored, MemoryBudgetError, explore
from tapestry.plan import Plan, build_plan
from tapestry.plan.build import expand_linears
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.partition import make_partition, output_layout

IMG = Path(__file__).resolve().parent.parent / "docs" / "img" / "plans-winners.png"
PROFILES = ("gpu-h100-nccl", "cpu-gloo")
Axes = Mapping[str, tuple]


def mlp_block(tokens: int, hidden: int, dtype: str = "float32") -> Graph:
    """linear -> gelu -> linear, written as a user would."""
    g = Graph()
    x = g.input("x", (tokens, hidden), dtype)
    up = g.linear(x, g.input("w1", (hidden, 4 * hidden), dtype), g.input("b1", (4 * hidden,), dtype), name="fc1")
    down = g.linear(g.gelu(up, name="act"), g.input("w2", (4 * hidden, hidden), dtype),
                    g.input("b2", (hidden,), dtype), name="fc2")
    g.output("y", down)
    return g


# -- hand-written strategies: per op and mesh axis, the output tensor dim to split (an int), an index dim by
# name (a reduction, which has no output dim), or None (replicated) -------------------------------------------
def mlp_tp(sequence: bool) -> Axes:
    """Megatron: fc1 column-split, gelu on the split, fc2 row-split (k) then one all-reduce; with sequence
    parallelism the bias add splits tokens instead (a reduce-scatter)."""
    return {"fc1_mm": (1,), "fc1": (1,), "act": (1,), "fc2_mm": ("k",), "fc2": (0 if sequence else None,)}


def block_tp(sequence: bool) -> Axes:
    """Megatron attention (q, k, v column-split = split by heads, the output projection row-split) and MLP; with
    sequence parallelism the norms, residual adds and biases after each row split run split by tokens."""
    seq = 1 if sequence else None
    heads = {f"linear_{i}{suffix}": (2,) for i in range(3) for suffix in ("_mm", "")}
    heads |= {f"reshape_{i}": (2,) for i in range(3)} | {f"transpose_{i}": (1,) for i in range(3)}
    heads |= {op: (1,) for op in ("matmul_0", "mul_0", "softmax_0", "matmul_1")}
    heads |= {"transpose_3": (2,), "reshape_3": (2,), "linear_3_mm": ("k",)}
    mlp = {"linear_4_mm": (2,), "linear_4": (2,), "gelu_0": (2,), "linear_5_mm": ("k",)}
    tokens = {op: (seq,) for op in ("layer_norm_0", "linear_3", "add_0", "layer_norm_1", "linear_5", "add_1")}
    return heads | mlp | tokens


def data_parallel(graph: Graph) -> Axes:
    """Every op splits its output's first dim: the batch (tokens for the MLP)."""
    return {node.name: (0,) for node in graph.ops}


def dp_tp(graph: Graph, tp: Axes) -> Axes:
    """2-D mesh: axis 0 splits the batch, axis 1 runs `tp`."""
    return {node.name: (0, tp.get(node.name, (None,))[0]) for node in graph.ops}


def index_axes(graph: Graph, strategy: Axes) -> dict[str, tuple[int | str | None, ...]]:
    """`strategy` as build_plan axes: each output dim becomes the index dim that tiles it."""
    def index_dim(op: str, choice: int | str | None) -> int | str | None:
        if not isinstance(choice, int):
            return choice
        sig = graph.signature(op)
        two = Mesh(2)
        want = Layout.split(sig.output_shape, two, (choice,))
        for dim in sig.splittable:
            if output_layout(sig, make_partition(sig, two, (dim,))) == want:
                return dim
        raise ValueError(f"{op}: no index dim tiles output dim {choice} of {sig}")

    return {op: tuple(index_dim(op, c) for c in axes) for op, axes in strategy.items()}


@dataclass(frozen=True)
class Case:
    model: str
    hidden: int
    tokens: int  # per device
    mesh: Mesh

    def graph(self) -> Graph:
        devices = self.mesh.size
        if self.model == "mlp":
            return mlp_block(self.tokens * devices, self.hidden)
        return transformer_block(devices, self.tokens, self.hidden, max(1, self.hidden // 128))

    def hand_plans(self, graph: Graph) -> dict[str, Plan]:
        wide = expand_linears(graph)
        tp = mlp_tp if self.model == "mlp" else block_tp
        strategies = ({"DPxTP": dp_tp(wide, tp(False))} if self.mesh.ndim == 2 else
                      {"DP": data_parallel(wide), "TP": tp(False), "TP+SP": tp(True)})
        return {name: build_plan(wide, self.mesh, index_axes(wide, axes))
                for name, axes in strategies.items()}


@dataclass(frozen=True)
class Row:
    case: Case
    profile: str
    budget: int | None
    hand: dict[str, tuple[float, int]]  # strategy -> (seconds, peak bytes)
    found: tuple[float, int] | None  # the optimizer's (seconds, peak bytes); None: nothing fits
    status: str

    @property
    def best_hand(self) -> tuple[str, float] | None:
        return best_hand(self.hand, self.budget)

    @property
    def worse(self) -> bool:
        return worse_than_hand(self.found, self.hand, self.budget)


def rows_for(case: Case, time_limit: float) -> list[Row]:
    graph = case.graph()
    hand = case.hand_plans(graph)
    explored: Explored = explore(graph, case.mesh)
    rows = []
    for profile in PROFILES:
        model = DefaultCostModel(load_profile(profile))
        priced = {name: (plan_cost(plan, model), max(peak_memory(plan))) for name, plan in hand.items()}
        lean = min(peak for _, peak in priced.values())
        for budget in (None, lean):
            try:
                result = explored.extract(model, time_limit=time_limit, memory_budget=budget)
                found, status = (result.plan.cost, result.peak_memory), result.selection.status
            except MemoryBudgetError:
                found, status = None, "no fit"
            rows.append(Row(case, profile, budget, priced, found, status))
    return rows


def grid(full: bool) -> list[Case]:
    if full:
        hidden, tokens = (1024, 2048, 4096, 8192), (64, 512, 2048, 8192)
        meshes = (Mesh(2), Mesh(4), Mesh(8), Mesh(2, 2), Mesh(2, 4))
        return [Case(m, h, t, mesh) for m in ("mlp", "block") for h, t, mesh in itertools.product(hidden, tokens, meshes)]
    return [*(Case("mlp", h, t, mesh) for h, t, mesh in itertools.product((1024, 4096), (64, 1024), (Mesh(8), Mesh(2, 2)))),
            Case("block", 1024, 128, Mesh(4))]


def table(rows: list[Row]) -> str:
    head = ("| model | hidden | tokens/dev | mesh | profile | budget MiB | DP µs / MiB | TP µs / MiB | "
            "TP+SP µs / MiB | DPxTP µs / MiB | optimizer µs / MiB | status | best hand | flag |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [f"{us(r.hand[s][0])} / {mib(r.hand[s][1])}" if s in r.hand else "" for s in ("DP", "TP", "TP+SP",
                                                                                                  "DPxTP")]
        best = r.best_hand
        found = r.found or (None, None)
        flag = "**WORSE**" if r.worse else ""
        lines.append(f"| {r.case.model} | {r.case.hidden} | {r.case.tokens} | {r.case.mesh} | {r.profile} | "
                     f"{mib(r.budget) if r.budget else 'none'} | {' | '.join(cells)} | "
                     f"{us(found[0])} / {mib(found[1])} | {r.status} | {best[0] if best else '—'} | {flag} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    """Per profile, unbudgeted, on each model's widest 1-D mesh: which hand strategy is fastest at each
    (tokens, hidden), and how much faster the optimizer's plan is than it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"DP": "tab:blue", "TP": "tab:orange", "TP+SP": "tab:green"}
    widest = {m: max(r.case.mesh.size for r in rows if r.case.model == m and r.case.mesh.ndim == 1)
              for m in {r.case.model for r in rows if r.case.mesh.ndim == 1}}
    shown = [r for r in rows if r.case.mesh.ndim == 1 and r.case.mesh.size == widest[r.case.model]
             and r.budget is None and r.best_hand is not None and r.found is not None]
    fig, axes = plt.subplots(1, len(PROFILES), figsize=(5 * len(PROFILES), 4), squeeze=False)
    for ax, profile in zip(axes[0], PROFILES):
        for r in shown:
            if r.profile != profile:
                continue
            name, best = r.best_hand
            marker = "o" if r.case.model == "mlp" else "s"
            ax.scatter(r.case.tokens, r.case.hidden, c=colors[name], marker=marker, s=120)
            ax.annotate(f"{best / r.found[0]:.2g}x", (r.case.tokens, r.case.hidden), fontsize=7,
                        xytext=(6, 4), textcoords="offset points")
        ax.set(xscale="log", yscale="log", xlabel="tokens per device", ylabel="hidden size", title=profile)
        ax.set_xticks(sorted({r.case.tokens for r in shown}), [str(t) for t in sorted({r.case.tokens for r in shown})])
        ax.set_yticks(sorted({r.case.hidden for r in shown}), [str(h) for h in sorted({r.case.hidden for r in shown})])
        ax.minorticks_off()
    handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=n) for n, c in colors.items()]
    axes[0][0].legend(handles=handles, title="best hand plan", fontsize=7)
    sizes = ", ".join(f"{m} on {n}" for m, n in sorted(widest.items()))
    fig.suptitle(f"fastest hand plan (colour; circle MLP, square block; {sizes} devices) and the optimizer's "
                 "speed-up over it (label)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def measured_order(time_limit: float, repeat: int = 20) -> str:
    """On gloo at small sizes: each plan's predicted time (cpu-gloo, plan plus output gathers) against its
    median measured time on 2 ranks (compiled shards, one thread per rank), and whether they order alike."""
    from lowering import kendall

    from tapestry.cost import run_costs
    from tapestry.runtime import run_plans

    model = DefaultCostModel(load_profile("cpu-gloo"))
    lines = ["| workload | plan | predicted ms | measured ms |", "|---|---|---|---|"]
    taus = []
    for case in (Case("mlp", 256, 64, Mesh(2)), Case("block", 256, 32, Mesh(2))):
        graph = case.graph()
        plans = {**case.hand_plans(graph), "optimizer": explore(graph, case.mesh).extract(model, time_limit=time_limit).plan}
        runs = run_plans(list(plans.values()), nproc=case.mesh.size, warmup=3, repeat=repeat, timeout=600)
        predicted = [sum(run_costs(plan, model).values()) for plan in plans.values()]
        measured = [run.seconds for run in runs]
        for name, p, m in zip(plans, predicted, measured):
            lines.append(f"| {case.model} {case.hidden} x {case.tokens}/dev on {case.mesh} | {name} | {p * 1e3:.2f} | "
                         f"{m * 1e3:.2f} |")
        tau, agree, pairs = kendall(predicted, measured)
        taus.append(f"{case.model}: Kendall tau {tau:.2f} ({agree} of {pairs} pairs ordered alike)")
    return ("\n".join(lines) + "\n\nPredicted against measured order: " + "; ".join(taus) + ". One run of "
            f"{repeat} timed iterations on cores other jobs may share: rerun before reading much into close times.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the whole grid (hours on 2 cores)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="ILP seconds per extraction")
    args = parser.parse_args()
    rows, started = grid_rows(grid(args.full), rows_for, args.time_limit)
    plot(rows, IMG)
    order = measured_order(args.time_limit)
    summary = worse_summary(rows, started)
    body = "\n\n".join([
        "Predicted time (µs) and exact peak memory per device (MiB, cost.peak_memory: weights resident, "
        "activations to their last reader) of hand-built strategies and of the optimizer's plan, float32. "
        "Hand plans run on the graph with each linear written as matmul + add (a row split needs the contraction "
        "as an index dim; the e-graph makes the same rewrite). The budget rows give the optimizer the peak of the "
        "leanest hand plan; `best hand` is the fastest hand plan within the row's budget. Tokens per device: the "
        "MLP has devices x tokens rows; the block has batch = devices and sequence = tokens, heads = hidden / 128.",
        summary,
        table(rows),
        f"![which hand plan wins where, and the optimizer's speed-up](img/{IMG.name})",
        "### Predicted and measured order on gloo",
        order,
    ])
    command = "python benchmarks/plans.py" + (" --full" if args.full else "")
    write_section("Plans", command, body)


if __name__ == "__main__":
    main()
