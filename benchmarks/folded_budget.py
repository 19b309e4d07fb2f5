"""A folded training step under a memory budget its unbounded plan exceeds (issue 24): tests/test_layers_fold.py's
tiny transformers LLaMA step, folded, on Mesh(4), extracted without a budget and then under `--share` of that
plan's peak; prints each plan's predicted time, peak, status and how the budget was kept, with CPU seconds.

    python benchmarks/folded_budget.py --layers 3 --share 0.7
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_layers_fold import llama_step  # noqa: E402

import tapestry  # noqa: E402
from tapestry.cost import DefaultCostModel, load_profile  # noqa: E402
from tapestry.optimizer import MemoryBudgetError  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--mesh", default="4")
    parser.add_argument("--share", default="0.7", help="budgets as shares of the unbounded plan's peak: 0.7,0.4")
    args = parser.parse_args()
    model = DefaultCostModel(load_profile("gpu-h100-nccl"))
    explored = tapestry.optimizer.explore(llama_step(args.layers), tapestry.Mesh(*map(int, args.mesh.split("x"))),
                                          layers=True)
    cpu = time.process_time()
    free = explored.extract(model)
    print(f"unbounded: {free.plan.cost * 1e3:.3f} ms, peak {free.peak_memory:,} bytes, {free.status}, "
          f"{time.process_time() - cpu:.1f} CPU s", flush=True)
    for share in map(float, args.share.split(",")):
        budget, cpu = int(share * free.peak_memory), time.process_time()
        try:
            lean = explored.extract(model, memory_budget=budget)
        except MemoryBudgetError as err:
            print(f"{share} ({budget:,} bytes): MemoryBudgetError: {err} ({time.process_time() - cpu:.1f} CPU s)")
            continue
        print(f"{share} ({budget:,} bytes): {lean.plan.cost * 1e3:.3f} ms, peak {lean.peak_memory:,} bytes, "
              f"{lean.status}, {lean.selection.extractor}: {lean.plan.notes.get('memory_budget')} "
              f"({time.process_time() - cpu:.1f} CPU s)", flush=True)


if __name__ == "__main__":
    main()
