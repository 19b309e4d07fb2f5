"""Train a 2-layer MLP with Adam: one training step imported as a graph, optimised on 4 devices, run for several
steps on 4 gloo ranks (parameters and optimizer state carried from step to step), and compared with torch.optim.

The plan is steady: every updated parameter and optimizer state tensor comes out in the layout its input was
placed in (the import marks `new.<name>` as carried to `<name>`), so the steps run back to back on the ranks
(`chain=True`), each rank's block of the result being its block of the next step's input, with no re-layout.

    python examples/train_mlp.py [--steps 3] [--nproc 4] [--compile]

The shard kernels run eagerly by default: a training step is about a hundred small kernels (the backward and the
update are elementwise), and compiling each of them cold takes minutes on a 2-core machine for no gain at this size.
"""
from __future__ import annotations

import argparse
import copy

import numpy as np
import torch

import tapestry
from tapestry.optimizer import steady_violations
from tapestry.training.strategy import storage

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
x, y = torch.randn(64, 32), torch.randn(64, 8)


def loss(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(module(x), y)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--compile", action="store_true", help="compile the shard kernels with inductor")
    args = parser.parse_args()

    training = tapestry.Training(loss=loss, optimizer="adam", lr=1e-2)
    imported = tapestry.from_torch(model, (x, y), training=training)
    plan = tapestry.optimize(imported.graph, mesh=tapestry.Mesh(args.nproc)).plan
    unsteady = steady_violations(plan, imported.graph.carried)
    if unsteady:
        print(f"the plan moves state between steps: {unsteady[0]}")
        return 1
    for name, kept in storage(plan).items():
        if not name.startswith("adam."):
            print(f"{name}: {kept.strategy}, {kept.layout.name(imported.graph[name].shape, plan.mesh)}")
    # the steps run back to back on the ranks: each rank's block of new.X is its block of X at the next step
    run = tapestry.run_plan(plan, imported.inputs(x, y), repeat=args.steps, chain=True, compile=args.compile)
    state = imported.outputs(run.outputs)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(args.steps):
        optimizer.zero_grad()
        want = loss(reference, x, y)
        want.backward()
        optimizer.step()
    error = max(float(np.abs(state["parameters"][name] - p.detach().numpy()).max())
                for name, p in reference.named_parameters())
    print(f"after {int(state['optimizer_state']['step'])} steps on {args.nproc} ranks: loss {float(state['loss']):.6f} "
          f"(torch {want.item():.6f}), largest parameter difference from torch.optim.Adam {error:.2e}")
    return 0 if error <= 1e-5 and int(state["optimizer_state"]["step"]) == args.steps else 1


if __name__ == "__main__":
    raise SystemExit(main())
