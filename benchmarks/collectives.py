"""Collective check benchmark: how long `tapestry.spmd.check.check_collectives` takes to trace every rank of a
large mesh (make_fx on meta tensors under torch's fake process group) and match its collectives.

One Adam step of linear(dim, 4 dim) -> relu -> linear(4 dim, dim) at `batch` rows (as benchmarks/training.py),
planned by the hand strategy `training.plans.data_tensor_parallel` (data parallel over mesh axis 0, Megatron over
axis 1) and lowered with its outputs gathered to rank 0. Writes the "Collective check" section of
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import time

import torch
from _report import write_section

import tapestry
from tapestry.lower import lower
from tapestry.spmd.check import check_collectives
from tapestry.training.plans import data_tensor_parallel

HIDDEN = {"0.weight": 0, "0.bias": 0, "2.weight": 1}  # column-parallel, then row-parallel


def mse(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(module(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mesh", type=int, nargs=2, default=(8, 8), metavar=("DATA", "TENSOR"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.dim, 4 * args.dim), torch.nn.ReLU(),
                                torch.nn.Linear(4 * args.dim, args.dim))
    step = (torch.randn(args.batch, args.dim), torch.randn(args.batch, args.dim))
    imported = tapestry.from_torch(model, step, training=tapestry.Training(loss=mse, optimizer="adam"), verbose=False)
    mesh = tapestry.Mesh(*args.mesh)
    start = time.perf_counter()
    plan = data_tensor_parallel(imported.graph, mesh, ("arg0", "arg1"), HIDDEN)
    program = lower(plan)
    planned = time.perf_counter() - start
    report = check_collectives(program)
    body = (f"Adam step, dim {args.dim}, batch {args.batch}, data x tensor parallel on Mesh{tuple(args.mesh)} "
            f"({len(plan.steps)} plan steps): planned and lowered in {planned:.1f} s; {report}.\n")
    print(body)
    write_section("Collective check", "PYTHONPATH=src python benchmarks/collectives.py " +
                  f"--dim {args.dim} --batch {args.batch} --mesh {args.mesh[0]} {args.mesh[1]}", body)


if __name__ == "__main__":
    main()
