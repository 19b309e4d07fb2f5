"""Which families' plans have prepared steps with FLOPs (`Plan.prepared`: made from static inputs alone, run once
ahead of time): the rows whose `plan shards` changed when it came to count only the FLOPs each run pays.

    PYTHONPATH=src python benchmarks/prepared_scan.py [NAME ...] [--mesh 4] [--eager-first]

Each family (default: the held-back zoo's) is imported and optimized once under this process's hash seed; a line
per family gives its prepared compute steps, their FLOPs, and the plan's sharded share of the FLOPs each run pays
beside the share of all its compute FLOPs (prepared ones counted as if every run paid them, as `plan shards` was),
then the FLOPs a run pays and the plan's cost.
`--eager-first` calls the model once before importing it, as zoo_sweep's and heldback_zoo's workers do (they take
the reference first): a model that prepares itself on its first call (RWKV's weight rescale) imports without that
work then (docs/importing.md, Known traps).
"""
from __future__ import annotations

import argparse

import torch
from heldback_zoo import MODELS

import tapestry
from tapestry.importer.report import PlanFlops, flops_of
from tapestry.importer.zoo import FAMILIES
from tapestry.plan import Compute


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", help="held-back zoo or test families (default: the held-back zoo)")
    parser.add_argument("--mesh", default="4")
    parser.add_argument("--eager-first", action="store_true", help="call the model once before importing it")
    args = parser.parse_args()
    mesh = tapestry.Mesh.parse(args.mesh)
    for name in args.names or list(MODELS):
        try:
            module, inputs, kwargs = {**FAMILIES, **MODELS}[name].build()
            if args.eager_first:
                module(*inputs, **kwargs)
            imported = tapestry.from_torch(module, inputs, kwargs, verbose=False)
            plan = tapestry.optimize(imported.graph, mesh).plan
        except Exception as err:  # noqa: BLE001  the scan says what failed and goes on
            print(f"{name}: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}", flush=True)
            continue
        prepared = [s for s in plan.steps if isinstance(s, Compute) and s.out in plan.prepared]
        split = PlanFlops.of(plan)
        whole_prepared = sum(flops_of(s.signature) for s in prepared if len(set(s.blocks)) == 1)
        total = split.per_run + split.prepared
        counted_all = (split.sharded + split.prepared - whole_prepared) / total if total else 1.0
        print(f"{name}: {len(prepared)} prepared compute steps, {split.prepared:.4g} FLOPs; the plan shards "
              f"{split.sharded / split.per_run if split.per_run else 1.0:.1%} of the FLOPs a run pays, "
              f"{counted_all:.1%} counting the prepared ones too; {split.per_run:.4g} FLOPs a run, plan cost "
              f"{plan.cost:.6g} s", flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
