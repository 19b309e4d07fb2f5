"""Training benchmark: data parallel, ZeRO-3 and Megatron tensor parallel against the optimizer's plan, for one Adam
step of a two-layer MLP (linear -> relu -> linear, hidden 4 x dim) on 8 devices of the gpu profile.

Over model sizes and batch sizes: each hand-built strategy (tapestry.training.plans) and the optimizer's plan,
unbudgeted and with the budget of the leanest hand plan, with predicted time and exact peak memory per device,
and what the optimizer did with the weights (tapestry.training.strategy). Every plan is steady: weights and
optimizer state come out where they were placed. The optimizer searches a superset of the hand plans, so a row
where it is slower than the best hand plan that fits the same budget is flagged: a bug to find. Writes the
"Training" section of docs/benchmarks.md and docs/img/training-crossover.png.
"""
from __future__ import annotations

import argparse
import itertools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from _report import best_hand, grid_rows, mib, us, worse_summary, worse_than_hand, write_section

import tapestry
from tapestry.cost import DefaultCostModel, load_profile, peak_memory, plan_cost
from tapestry.optimizer import MemoryBudgetError, OptimizeResult, explore
from tapestry.plan import Plan
from tapestry.training.plans import data_parallel, megatron, zero3
from tapestry.training.strategy import GATHERED, IN_PLACE, REPLICATED, storage

IMG = Path(__file__).resolve().parent.parent / "docs" / "img" / "training-crossover.png"
PROFILE = "gpu-h100-nccl"
ARGUMENTS = ("arg0", "arg1")
HIDDEN = {"0.weight": 0, "0.bias": 0, "2.weight": 1}  # Megatron: the first linear by columns, the second by rows
SHORT = {REPLICATED: "R", GATHERED: "G", IN_PLACE: "S"}
HAND = ("DP", "ZeRO-3", "TP")


def mse(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(module(x), y)


@dataclass(frozen=True)
class Case:
    dim: int
    batch: int
    devices: int = 8

    @property
    def parameters(self) -> int:
        return 8 * self.dim * self.dim + 5 * self.dim

    def step(self) -> tapestry.TorchImport:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(self.dim, 4 * self.dim), torch.nn.ReLU(),
                                    torch.nn.Linear(4 * self.dim, self.dim))
        args = (torch.randn(self.batch, self.dim), torch.randn(self.batch, self.dim))
        return tapestry.from_torch(model, args, training=tapestry.Training(loss=mse, optimizer="adam"), verbose=False)


@dataclass(frozen=True)
class Row:
    case: Case
    budget: int | None
    hand: dict[str, tuple[float, int]]  # strategy -> (seconds, peak bytes)
    found: tuple[float, int] | None  # the optimizer's (seconds, peak bytes); None: nothing fits
    strategy: str  # what the optimizer did with each weight and its state
    status: str

    @property
    def best_hand(self) -> tuple[str, float] | None:
        return best_hand(self.hand, self.budget)

    @property
    def worse(self) -> bool:
        return worse_than_hand(self.found, self.hand, self.budget)


def described(plan: Plan) -> str:
    """Weights then Adam state, one letter each: R replicated, G sharded and gathered on use, S sharded in place."""
    found = storage(plan)
    weights = "".join(SHORT[s.strategy] for name, s in found.items() if not name.startswith("adam."))
    state = Counter(SHORT[s.strategy] for name, s in found.items() if name.startswith("adam.") and s.input != "adam.step")
    return f"{weights} / " + " ".join(f"{n}{k}" for k, n in sorted(state.items()))


def rows_for(case: Case, time_limit: float) -> list[Row]:
    imported = case.step()
    graph, mesh = imported.graph, tapestry.Mesh(case.devices)
    model = DefaultCostModel(load_profile(PROFILE))
    hand = {"DP": data_parallel(graph, mesh, ARGUMENTS), "ZeRO-3": zero3(graph, mesh, ARGUMENTS),
            "TP": megatron(graph, mesh, HIDDEN)}
    priced = {name: (plan_cost(plan, model), max(peak_memory(plan))) for name, plan in hand.items()}
    explored = explore(graph, mesh)
    rows = []
    for budget in (None, min(peak for _, peak in priced.values())):
        try:
            result: OptimizeResult = explored.extract(model, time_limit=time_limit, memory_budget=budget)
            found, status, strategy = (result.plan.cost, result.peak_memory), result.selection.status, \
                described(result.plan)
        except MemoryBudgetError:
            found, status, strategy = None, "no fit", ""
        rows.append(Row(case, budget, priced, found, strategy, status))
    return rows


def grid(full: bool) -> list[Case]:
    dims, batches = ((256, 1024, 2048), (64, 512, 4096, 32768)) if not full else \
        ((128, 256, 512, 1024, 2048, 4096), (16, 64, 256, 1024, 4096, 16384, 65536))
    return [Case(d, b) for d, b in itertools.product(dims, batches)]


def table(rows: list[Row]) -> str:
    head = ("| dim | params | batch | budget MiB | DP µs / MiB | ZeRO-3 µs / MiB | TP µs / MiB | optimizer µs / MiB | "
            "its weights / state | status | best hand | flag |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [f"{us(r.hand[s][0], 0)} / {mib(r.hand[s][1])}" for s in HAND]
        found = r.found or (None, None)
        best = r.best_hand
        lines.append(f"| {r.case.dim} | {r.case.parameters / 1e6:.2f} M | {r.case.batch} | "
                     f"{mib(r.budget) if r.budget else 'none'} | {' | '.join(cells)} | "
                     f"{us(found[0], 0)} / {mib(found[1])} | {r.strategy} | {r.status} | "
                     f"{best[0] if best else '—'} | {'**WORSE**' if r.worse else ''} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    """Per model size, unbudgeted: each hand strategy's predicted step time over the optimizer's, against the
    batch; where two lines cross, the best hand strategy changes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.budget is None and r.found is not None]
    dims = sorted({r.case.dim for r in shown})
    fig, axes = plt.subplots(1, len(dims), figsize=(4.2 * len(dims), 3.8), squeeze=False, sharey=True)
    styles = {"DP": ("tab:blue", "o"), "ZeRO-3": ("tab:green", "s"), "TP": ("tab:orange", "^")}
    for ax, dim in zip(axes[0], dims):
        mine = sorted((r for r in shown if r.case.dim == dim), key=lambda r: r.case.batch)
        batches = [r.case.batch for r in mine]
        for name, (color, marker) in styles.items():
            ax.plot(batches, [r.hand[name][0] / r.found[0] for r in mine], color=color, marker=marker,  # type: ignore[index]
                    label=name)
        ax.axhline(1.0, color="black", ls="--", lw=1, label="optimizer")
        ax.set(xscale="log", xlabel="batch", title=f"dim {dim} ({mine[0].case.parameters / 1e6:.2g} M parameters)")
    axes[0][0].set_ylabel("predicted step time / optimizer's")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"One Adam step on {rows[0].case.devices} devices ({PROFILE}): data parallel wins at large batch "
                 "on small models, tensor parallel at small batch on large ones", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="a finer grid (about half an hour on 2 cores)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="ILP seconds per extraction")
    args = parser.parse_args()
    rows, started = grid_rows(grid(args.full), rows_for, args.time_limit)
    plot(rows, IMG)
    summary = worse_summary(rows, started)
    body = "\n\n".join([
        ("One Adam step (forward, backward, update; float32) of linear(dim, 4 dim) -> relu -> linear(4 dim, dim) "
        f"on {rows[0].case.devices} devices of the {PROFILE} profile. Predicted time (µs) and exact peak memory "
        "per device (MiB; cost.peak_memory: weights and Adam state resident, their updates and the activations "
        "live to their last reader) of hand-built data parallel, ZeRO-3 and Megatron tensor parallel "
        "(tapestry.training.plans) and of the optimizer's plan, all steady (each weight and state tensor comes "
        "out where it was placed). The budget rows give the optimizer the peak of the leanest hand plan; `best "
        "hand` is the fastest hand plan within the row's budget. `its weights / state`: per parameter (0.weight, "
        "0.bias, 2.weight, 2.bias) R stored replicated, G stored sharded and gathered whole on use, S sharded and "
        "computed in place; then how many Adam m/v tensors are stored each way."),
        summary,
        table(rows),
        f"![each hand strategy's predicted step time over the optimizer's, against the batch](img/{IMG.name})",
    ])
    command = "python benchmarks/training.py" + (" --full" if args.full else "")
    write_section("Training", command, body)


if __name__ == "__main__":
    main()
