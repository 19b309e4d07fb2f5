"""A 2-layer GPT-2 from transformers (random weights, nothing downloaded), imported, optimised on 4 devices, run on
4 gloo ranks and compared with the module itself.

    python examples/gpt2.py [--nproc 4] [--no-compile]

Also a script for the CLI: it defines `model` and `example_inputs` (`tapestry optimize examples/gpt2.py --mesh 4`).
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import GPT2Config, GPT2Model

import tapestry

torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=128, bos_token_id=0, eos_token_id=0)
model = GPT2Model(config).eval()
example_inputs = (torch.randint(0, config.vocab_size, (4, 32)),)
example_kwargs = {"use_cache": False}  # a DynamicCache output cannot be exported


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--no-compile", action="store_true", help="run the shard kernels eagerly")
    args = parser.parse_args()

    imported = tapestry.from_torch(model, example_inputs, example_kwargs)
    result = tapestry.optimize(imported.graph, mesh=tapestry.Mesh(args.nproc))
    print(result.explain().splitlines()[0])
    run = tapestry.run_plan(result.plan, imported.inputs(*example_inputs, **example_kwargs), compile=not args.no_compile)
    (got,) = imported.outputs(run.outputs)
    with torch.no_grad():
        want = model(*example_inputs, **example_kwargs).last_hidden_state.numpy()
    error = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"ran on {args.nproc} ranks: last_hidden_state {list(got.shape)}, max error relative to the largest "
          f"value {error:.2e} against the module")
    return 0 if error <= 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
