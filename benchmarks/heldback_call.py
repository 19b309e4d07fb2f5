"""Issue 24's held-back call, timed: a Hugging Face LLaMA built under torch.device("meta"), its training step
imported with `from_torch`, then `tapestry.optimize(..., Mesh(8, 8), gpu-h100-nccl, memory_budget=80 GB)`.

    python benchmarks/heldback_call.py [--hidden 256] [--layers 2] [--mesh 8x8] [--batch 8] [--seq 128]

Prints import and optimize wall and CPU seconds, peak RSS, the plan's predicted step and peak memory, its status.
"""
from __future__ import annotations

import argparse
import resource
import time

import torch
import transformers

import tapestry
from tapestry.cost import DefaultCostModel, load_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--mesh", default="8x8")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=2 * args.seq)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))  # on the CPU, as a user makes a batch

    def loss(module: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return module(input_ids=ids, labels=labels, use_cache=False).loss

    wall, cpu = time.perf_counter(), time.process_time()
    imported = tapestry.from_torch(model, (ids, ids), verbose=False,
                                   training=tapestry.Training(loss=loss, optimizer="adam", lr=1e-4))
    print(f"import: {time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} s CPU")
    mesh = tapestry.Mesh(*(int(n) for n in args.mesh.split("x")))
    wall, cpu = time.perf_counter(), time.process_time()
    result = tapestry.optimize(imported.graph, mesh=mesh, memory_budget=80 * 10**9,
                               cost_model=DefaultCostModel(load_profile("gpu-h100-nccl")))
    print(f"optimize: {time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} s CPU; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    print(f"plan: {result.plan.cost * 1e3:.2f} ms predicted, {result.peak_memory / 2**20:.1f} MiB per device, "
          f"status {result.status}, {result.replicated_share:.0%} of compute replicated")


if __name__ == "__main__":
    main()
