"""Serve a module with Tapestry's plan under torchrun, one process per rank:

    torchrun --nproc-per-node 2 examples/serve_torchrun.py               # tapestry opens the group from torchrun's env
    torchrun --nproc-per-node 2 examples/serve_torchrun.py --own-group   # the script opens its own gloo group first

Every rank passes the same batch and gets the whole output; rank 0 prints the largest difference from the module.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import tapestry


class MLP(torch.nn.Module):
    def __init__(self, dims: tuple[int, ...] = (256, 1024, 1024, 256)) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            x = layer(x) if k == len(self.layers) - 1 else torch.relu(layer(x))
        return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--own-group", action="store_true", help="call dist.init_process_group before tapestry")
    parser.add_argument("--no-compile", action="store_true", help="run each rank's function eager")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    if args.own_group:
        dist.init_process_group("gloo")
    torch.manual_seed(0)  # every rank builds the same module
    module = MLP((32, 64, 64, 32)).eval()
    batch = torch.randn(16, 32)
    model = tapestry.parallelize(module, (batch,), mesh=tapestry.Mesh(2), compile=not args.no_compile)
    worst = 0.0
    for call in range(args.calls):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(call))  # the same on every rank
        with torch.no_grad():
            worst = max(worst, (model(x) - module(x)).abs().max().item())
    print(f"rank {dist.get_rank()}: {args.calls} calls, max abs difference from the module {worst:.2e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
