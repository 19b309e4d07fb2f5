"""The optimizer at scale: a transformer stack (batch 4, 256 tokens, hidden 1024, 16 heads) on meshes 8, 2x4 and
2x2x2 at 1 to 48 layers, each phase timed on its own. Writes docs/benchmarks.md and docs/img/saturation-scaling.png.

    .venv/bin/python benchmarks/saturation.py [--quick] [--row-seconds S]

Each row runs in a child process with a wall-clock cap (`--row-seconds`): a row that passes it is marked and the
deeper rows of its mesh are skipped, so the whole run stays bounded. Phases: saturate (`explore`: generation, rule
rounds, serialization), price (the extraction graph under the default cost model), greedy-dag and ILP extraction
(time limit 10 s, the default of `optimize`), and decode (the plan from the ILP's selection). Peak RSS is the child's.
"""
from __future__ import annotations

import argparse
import multiprocessing
import queue as queue_module
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import DOC, write_section  # noqa: E402
from rich.progress import Progress  # noqa: E402

from tapestry.egraph.generate import Generator  # noqa: E402
from tapestry.egraph.rules import load_rules  # noqa: E402
from tapestry.egraph.session import Session  # noqa: E402
from tapestry.extract import extract  # noqa: E402
from tapestry.models import mlp, transformer_stack  # noqa: E402
from tapestry.optimizer import default_cost_model, explore  # noqa: E402
from tapestry.plan.plan import Compute  # noqa: E402
from tapestry.sharding import Mesh  # noqa: E402

MESHES = ("8", "2x4", "2x2x2")
LAYERS = (1, 2, 4, 12, 24, 48)
QUICK_LAYERS = (1, 2, 4)
ILP_SECONDS = 10.0
PLOT = DOC.parent / "img" / "saturation-scaling.png"


@dataclass(frozen=True)
class Row:
    mesh: str
    layers: int
    ops: int
    enodes: int
    extraction_nodes: int
    stopped_by: str
    saturate: float
    price: float
    greedy: float
    ilp: float
    decode: float
    status: str
    gap: float | None  # None: no phase bounded the ILP's search (extract.ilp._result)
    greedy_cost: float
    ilp_cost: float
    fused: int
    rss_mib: float

    @property
    def total(self) -> float:
        return self.saturate + self.price + self.ilp + self.decode


def measure(mesh: str, layers: int) -> Row:
    """One row, phase by phase, in this process."""
    graph = transformer_stack(layers, batch=4, seq=256, dim=1024, heads=16)
    tick = time.perf_counter()
    explored = explore(graph, Mesh.parse(mesh))
    saturated = time.perf_counter()
    egraph = explored.decoder.extraction_graph(list(explored.roots), default_cost_model())
    priced = time.perf_counter()
    greedy = extract(egraph, "greedy-dag")
    ilp = extract(egraph, "ilp", ILP_SECONDS, repeated=explored.repeated)  # as optimize extracts
    extracted = time.perf_counter()
    plan = explored.decoder.plan(egraph, ilp, graph, explored.names)
    decoded = time.perf_counter()
    own_ops = {node.op for node in graph.ops}
    fused = sum(1 for step in plan.steps if isinstance(step, Compute) and step.kernel not in own_ops)
    return Row(mesh, layers, len(graph.ops), explored.stats.enodes, egraph.num_nodes, explored.stats.stopped_by,
               saturated - tick, priced - saturated, greedy.seconds, extracted - priced - greedy.seconds,
               decoded - extracted, ilp.status, ilp.gap, greedy.dag_cost, ilp.dag_cost, fused,
               resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _child(mesh: str, layers: int, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    queue.put(asdict(measure(mesh, layers)))


def measure_capped(mesh: str, layers: int, seconds: float) -> Row | None:
    """`measure` in a child process; None when it is still running after `seconds` (it is then killed)."""
    context = multiprocessing.get_context("spawn")  # a forked child can inherit locks held by the progress thread
    queue = context.Queue()
    child = context.Process(target=_child, args=(mesh, layers, queue))
    child.start()
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            try:
                return Row(**queue.get(timeout=1.0))
            except queue_module.Empty:
                if not child.is_alive():
                    raise RuntimeError(f"mesh {mesh}, {layers} layers: the measuring process exited with "
                                       f"{child.exitcode}") from None
        return None
    finally:
        child.kill()
        child.join()


def table(rows: list[Row | str]) -> str:
    head = ("| mesh | layers | ops | e-nodes | extraction nodes | stopped by | saturate s | price s | greedy-dag s "
            "| ILP s | decode s | total s | ILP status | gap | greedy-dag cost | ILP cost | ILP / greedy "
            "| fused kernels | peak RSS MiB |")
    lines = [head, "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
            continue
        lines.append(
            f"| {row.mesh} | {row.layers} | {row.ops} | {row.enodes:,} | {row.extraction_nodes:,} | "
            f"{row.stopped_by} | {row.saturate:.1f} | {row.price:.1f} | {row.greedy:.2f} | {row.ilp:.1f} | "
            f"{row.decode:.2f} | {row.total:.1f} | "
            f"{row.status} | {'—' if row.gap is None else f'{row.gap:.4f}'} | "
            f"{row.greedy_cost:.6g} | {row.ilp_cost:.6g} | "
            f"{row.ilp_cost / row.greedy_cost:.4f} | {row.fused} | {row.rss_mib:,.0f} |")
    return "\n".join(lines)


def targets(rows: list[Row]) -> str:
    """Issue 12's targets next to what this run measured."""
    def total(mesh: str, layers: int) -> str:
        row = next((r for r in rows if r.mesh == mesh and r.layers == layers), None)
        if row is None:
            return "not measured (over the cap or skipped)"
        return (f"{row.total:.1f} s, stopped by {row.stopped_by}, {row.fused} fused kernels, ILP {row.status} "
                f"(gap {'none' if row.gap is None else f'{row.gap:.4f}'})")
    return "\n".join([
        "Targets (issue 12) against this run:",
        "",
        f"- 12 layers on mesh 8, at most 10 s: {total('8', 12)}.",
        f"- 12 layers on 2x4 to a fixpoint with fused kernels, at most 30 s (aim 10 s): {total('2x4', 12)}.",
        f"- 48 layers on 2x4, at most 2 minutes: {total('2x4', 48)}.",
    ])


def plot(rows: list[Row]) -> None:
    """Seconds end to end (solid) and saturation alone (dashed) against layers, one colour per mesh."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mesh, colour in zip(MESHES, ("tab:blue", "tab:orange", "tab:green")):
        mine = [r for r in rows if r.mesh == mesh]
        if not mine:
            continue
        layers = [r.layers for r in mine]
        ax.plot(layers, [r.total for r in mine], "o-", color=colour, label=f"mesh {mesh}: total")
        ax.plot(layers, [r.saturate for r in mine], "s--", color=colour, alpha=0.6, label=f"mesh {mesh}: saturate")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({r.layers for r in rows}), [str(n) for n in sorted({r.layers for r in rows})])
    ax.set_xlabel("layers (transformer stack, hidden 1024)")
    ax.set_ylabel("seconds")
    ax.set_title("Optimizer time against depth (2 shared cores)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


def encode_seconds(ops: int) -> float:
    """Time to put a block graph of `ops` ops into a fresh e-graph (bindings AST, in bulk)."""
    gen = Generator(Session(load_rules()), mlp(ops // 2, 64, 64), Mesh(1))
    start = time.perf_counter()
    gen.encode()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"layers {QUICK_LAYERS} only")
    parser.add_argument("--row-seconds", type=float, default=300.0, metavar="S",
                        help="wall-clock cap per row; deeper rows of a mesh that passed it are skipped")
    args = parser.parse_args()
    depths = QUICK_LAYERS if args.quick else LAYERS
    rows: list[Row | str] = []
    with Progress() as progress:
        task = progress.add_task("rows", total=len(MESHES) * len(depths))
        for mesh in MESHES:
            capped = 0
            for layers in depths:
                progress.update(task, description=f"mesh {mesh}, {layers} layers")
                if capped:
                    rows.append(f"| {mesh} | {layers} | skipped: {capped} layers passed the cap |"
                                + " |" * 16)
                else:
                    row = measure_capped(mesh, layers, args.row_seconds)
                    if row is None:
                        capped = layers
                        rows.append(f"| {mesh} | {layers} | over the cap of {args.row_seconds:.0f} s |"
                                    + " |" * 16)
                    else:
                        rows.append(row)
                    last = rows[-1]
                    progress.console.print(last if isinstance(last, str) else table([last]).splitlines()[-1])
                progress.advance(task)
    measured = [r for r in rows if isinstance(r, Row)]
    plot(measured)
    encode = encode_seconds(1000)
    body = (
        table(rows)
        + "\n\n" + targets(measured)
        + f"\n\n![seconds against layers per mesh](img/{PLOT.name})\n\n"
        "A transformer stack (`tapestry.models.transformer_stack`: batch 4, 256 tokens, hidden 1024, 16 heads) under "
        "the default saturation budget and cost model. Phases are timed one by one: saturate is `explore` "
        "(generation, rule rounds, serialization), price builds the extraction graph (every node's cost), then "
        f"greedy-dag and the ILP (CP-SAT, time limit {ILP_SECONDS:.0f} s, warm-started from the cheaper of "
        "greedy-dag and, from 3 identical layers on, the periodic plan: one folded layer solved and copied onto "
        "every layer, docs/extraction.md) extract, and decode turns the ILP's selection into a plan. e-nodes are egglog's (stats.enodes); extraction nodes "
        "are the extraction graph's, reshards between every value's layouts included; total is saturate + price + "
        "ILP + decode. gap is the ILP's "
        "(cost - bound) / cost, 0 when proven optimal. Fused kernels: plan steps whose kernel is no op of the "
        "graph (from fusion.egg or substitution.egg). Peak RSS is the measuring process's. "
        f"Each row ran in its own process, capped at {args.row_seconds:.0f} s."
        f"\n\nBulk encoding of a 1,000-op block graph through the bindings API: {encode:.3f} s (target < 2 s)."
    )
    command = "python benchmarks/saturation.py" + (" --quick" if args.quick else "")
    if args.row_seconds != 300.0:
        command += f" --row-seconds {args.row_seconds:g}"
    write_section("Saturation", command, body)


if __name__ == "__main__":
    main()
