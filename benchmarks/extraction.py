"""Extraction benchmark: every extractor on every extraction-gym file we ship (tensat, rover, diospyros).

Reports DAG cost, gap to the best-known tensat costs, time and validity, then writes
the "Extraction" section of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from rich.console import Console

from _report import write_section
from tapestry.extract import EXTRACTORS, EGraph, extract, validate
from tapestry.extract.cpsat import PORTFOLIO
from tapestry.extract.ilp import RELAX_SHARE
from tapestry.extract.separation import PATH_SHARE

GYM = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "extraction-gym"
FOLDERS = ("tensat", "rover", "diospyros")
SUMMARY_GRAPHS = ("vgg", "resnet50", "bert", "nasneta", "nasrnn")
BEST_KNOWN = {  # CPLEX, 10 h cap, SmoothE artifact (see the data README)
    "vgg": 4.850757016778516,
    "resnet50": 4.385794964760862,
    "bert": 0.7047199767839629,
    "nasneta": 11.19945303958957,
    "nasrnn": 0.9447550171626062,
}
PUBLISHED = {"greedy (published)": (46.4, 11.9), "SmoothE (published, GPU)": (17.0, 4.7)}


@dataclass(frozen=True)
class Row:
    folder: str
    graph: str
    nodes: int
    extractor: str
    dag_cost: float
    seconds: float
    valid: bool
    status: str
    ilp_gap: float | None

    @property
    def best_known(self) -> float | None:
        return BEST_KNOWN.get(self.graph.removesuffix("_acyclic")) if self.folder == "tensat" else None

    @property
    def gap_percent(self) -> float | None:
        best = self.best_known
        return None if best is None else 100 * (self.dag_cost / best - 1)


def run(folders: tuple[str, ...], time_limit: float, console: Console) -> list[Row]:
    rows = []
    for folder in folders:
        for path in sorted((GYM / folder).glob("*.json")):
            egraph = EGraph.load(path)
            for name in EXTRACTORS:
                with console.status(f"{folder}/{path.stem}: {name}"):
                    selection = extract(egraph, name, time_limit, stop_gap=0.0)  # proven, as these rows were
                rows.append(
                    Row(
                        folder,
                        path.stem,
                        egraph.num_nodes,
                        name,
                        selection.dag_cost,
                        selection.seconds,
                        not validate(egraph, selection),
                        selection.status,
                        selection.gap,
                    )
                )
                console.log(f"{folder}/{path.stem} {name}: {selection.dag_cost:.6g} in {selection.seconds:.1f} s")
    return rows


def _num(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def markdown(rows: list[Row], time_limit: float) -> str:
    lines = [
        f"Machine: {platform.machine()}, 2 shared CPU cores. ILP: OR-tools CP-SAT on one thread, subsolver "
        f"{', '.join(PORTFOLIO)}, "
        "one run per independent part of the problem, warm start from greedy-dag (greedy plus local search), "
        f"time limit {time_limit:g} s for the whole call. Before CP-SAT, an LP pass (HiGHS with path cuts, "
        f"`relax.py`: at most {RELAX_SHARE:.0%} of the limit, ended when its rounds stop closing the gap, skipped "
        f"where building its path graphs would take over {PATH_SHARE:.0%} of that) offers its rounded solutions "
        "as incumbents and adds its cuts to the model. Gap: DAG cost over the best known "
        "cost (CPLEX, 10 h cap) minus 1; `ILP gap` is the ILP's own (cost - bound) / cost, the bound CP-SAT's "
        "or the LP's, the higher. The `_acyclic` "
        "files have cycles pruned, so their own optimum can be above the best known cost of the full graph: "
        "for them the ILP status and gap, not the gap to best known, say how close to optimal a result is.",
        "",
        "### Summary: gap to best known on the five tensat graphs (vgg, resnet50, bert, nasneta, nasrnn)",
        "",
        "| extractor | worst gap % | mean gap % | worst seconds |",
        "|---|--:|--:|--:|",
    ]
    for name in EXTRACTORS:
        picked = [r for r in rows if r.folder == "tensat" and r.graph in SUMMARY_GRAPHS and r.extractor == name]
        if len(picked) == len(SUMMARY_GRAPHS):
            gaps = [r.gap_percent or 0.0 for r in picked]
            lines.append(f"| {name} | {max(gaps):.2f} | {mean(gaps):.2f} | {max(r.seconds for r in picked):.1f} |")
    lines += [f"| {name} | {worst} | {avg} | |" for name, (worst, avg) in PUBLISHED.items()]
    lines += [
        "",
        "### Per file",
        "",
        "| folder | e-graph | e-nodes | extractor | DAG cost | gap % | seconds | valid & acyclic | ILP status | ILP gap % |",
        "|---|---|--:|---|--:|--:|--:|:-:|---|--:|",
    ]
    for r in rows:
        ilp_gap = None if r.ilp_gap is None else 100 * r.ilp_gap
        lines.append(
            f"| {r.folder} | {r.graph} | {r.nodes} | {r.extractor} | {r.dag_cost:.6f} | {_num(r.gap_percent, '.2f')} "
            f"| {r.seconds:.2f} | {'yes' if r.valid else '**NO**'} | {'' if r.status == 'heuristic' else r.status} "
            f"| {_num(ilp_gap, '.2f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tensat only, ILP limit 20 s unless --time-limit")
    parser.add_argument("--time-limit", type=float, help="ILP time limit per graph in seconds (default 60)")
    args = parser.parse_args()
    if not GYM.exists():
        sys.exit(f"extraction benchmark: data not found at {GYM}")
    time_limit = args.time_limit or (20.0 if args.quick else 60.0)
    console = Console(stderr=True)
    rows = run(("tensat",) if args.quick else FOLDERS, time_limit, console)
    body = markdown(rows, time_limit)
    print(body)
    write_section("Extraction", "python " + " ".join(["benchmarks/extraction.py", *sys.argv[1:]]), body)


if __name__ == "__main__":
    main()
