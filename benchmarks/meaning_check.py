"""What the meaning check costs above verify.CHECK_CELLS: the sampled check (verify.check_sampled) against a whole
device-by-device simulation (verify.check_meaning) of the same plan, optimized on Mesh(4). Writes the section
"Meaning check" of docs/benchmarks.md.

    .venv/bin/python benchmarks/meaning_check.py
"""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section  # noqa: E402

from tapestry import optimize  # noqa: E402
from tapestry.egraph.driver import Budget  # noqa: E402
from tapestry.models import mlp, seeds_example, transformer_stack  # noqa: E402
from tapestry.sharding import Mesh  # noqa: E402
from tapestry.verify import cells, check_meaning, check_sampled  # noqa: E402

GRAPHS = {
    "transformer_stack(2, batch=4, seq=128, dim=256)": lambda: transformer_stack(2, batch=4, seq=128, dim=256),
    "mlp(4, batch=1024, width=512)": lambda: mlp(4, 1024, 512),
    "seeds_example(2048, 512, 512, bfloat16)": lambda: seeds_example(2048, 512, 512, "bfloat16"),
}


def seconds(run: Callable[[], object], repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    rows = ["| graph | cells | sampled check, s | whole simulation, s |", "|---|---:|---:|---:|"]
    for name, make in GRAPHS.items():
        graph = make()
        plan = optimize(graph, Mesh(4), budget=Budget(seconds=20)).plan
        sampled, whole = seconds(lambda: check_sampled(plan)), seconds(lambda: check_meaning(plan))
        rows.append(f"| `{name}` | {cells(graph):,} | {sampled:.2f} | {whole:.2f} |")
        print(rows[-1], flush=True)
    body = ("Median of 3 runs each on this machine (2 cores, shared). Attention makes one output line depend on the\n"
            "whole sequence, so the transformer's sampled check costs about what a whole simulation does;\n"
            "row-local programs cost a fraction.\n\n" + "\n".join(rows))
    write_section("Meaning check", ".venv/bin/python benchmarks/meaning_check.py", body)


if __name__ == "__main__":
    main()
