"""How far `parallelize_step`'s losses drift from one-device torch.optim.AdamW over many steps (issue 26: within 1e-5
over 50 steps), and, for scale, how far torch drifts from itself when every parameter is nudged by one float32 ulp
after the first step (docs/training.md, "The Adam update rounds as torch rounds it").

    torchrun --nproc-per-node 2 benchmarks/loss_drift.py [--steps 50] [--compile]
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import tapestry
from runtime import BATCH, DIMS, MLP, mse


def torch_losses(batches: list[tuple[torch.Tensor, torch.Tensor]], nudge: bool) -> list[float]:
    torch.manual_seed(0)
    module = MLP()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = mse(module(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if nudge and k == 0:
            with torch.no_grad():
                for p in module.parameters():
                    p.copy_(torch.nextafter(p, torch.full_like(p, 1.0)))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--compile", action="store_true", help="torch.compile each rank's program")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(BATCH, DIMS[0], generator=gen), torch.randn(BATCH, DIMS[-1], generator=gen))
               for _ in range(args.steps)]
    want = torch_losses(batches, nudge=False)
    torch.manual_seed(0)
    step = tapestry.parallelize_step(MLP(), mse, batches[0], mesh=tapestry.Mesh(dist.get_world_size()),
                                     optimizer=torch.optim.AdamW, lr=1e-3, weight_decay=0.01, compile=args.compile,
                                     verbose=False)
    ours = [float(step(x, y)) for x, y in batches]
    nudged = torch_losses(batches, nudge=True)
    if dist.get_rank() == 0:
        for name, losses in (("parallelize_step", ours), ("torch, parameters nudged one ulp", nudged)):
            print(f"{name}: largest loss difference from one-device torch over {args.steps} steps "
                  f"{max(abs(a - b) for a, b in zip(losses, want)):.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
