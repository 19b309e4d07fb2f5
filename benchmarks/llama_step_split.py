"""How a Hugging Face LLaMA AdamW step (one layer) splits on Mesh(4): the share of compute FLOPs the plan splits
over devices and the blocks of the embedding gradient (the `scatter_add` its backward imports as), per size and
per hash seed (one process each: the seed is fixed at interpreter start). Writes the "LLaMA training step on
Mesh(4)" section of docs/benchmarks.md.

    python benchmarks/llama_step_split.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

SIZES = [(64, 32, 2, 8), (2048, 256, 4, 64)]  # vocab, hidden, batch, length (the first: the golden import's)
SEEDS = (0, 1, 2)
COMMAND = "python benchmarks/llama_step_split.py"


def measure(vocab: int, hidden: int, batch: int, length: int) -> dict:
    import torch
    import transformers
    from tapestry.importer.report import import_report
    from tapestry.plan.plan import Compute

    import tapestry

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max(64, length))
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))
    training = tapestry.Training(loss=lambda m, i, y: m(input_ids=i, labels=y, use_cache=False).loss,
                                 optimizer="adamw", lr=1e-3)
    imported = tapestry.from_torch(model, (ids, ids), training=training, verbose=False)
    plan = tapestry.optimize(imported.graph, mesh=tapestry.Mesh(4)).plan
    report = import_report("llama", imported, tapestry.Mesh(4), plan)
    grads = [s for s in plan.steps if isinstance(s, Compute) and s.kernel == "scatter_add"]
    blocks = [sorted({(tuple(b.start), tuple(b.end)) for b in s.blocks}) for s in grads]
    return {"opaque": sum(imported.opaque.values()), "sharded": report.plan_sharded,
            "grad": "; ".join(" ".join(f"{list(a)}..{list(b)}" for a, b in bs) for bs in blocks)}


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(measure(*(int(a) for a in sys.argv[1:]))))
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from _report import write_section

    rows = ["| vocab, hidden, tokens | hash seed | opaque ops | plan splits (FLOPs) | embedding gradient blocks |",
            "|---|---|---|---|---|"]
    for vocab, hidden, batch, length in SIZES:
        for seed in SEEDS:
            done = subprocess.run([sys.executable, __file__, str(vocab), str(hidden), str(batch), str(length)],
                                  env={**os.environ, "PYTHONHASHSEED": str(seed)}, capture_output=True, text=True,
                                  check=True)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(f"| {vocab}, {hidden}, {batch}x{length} | {seed} | {got['opaque']} | {got['sharded']:.2%} "
                        f"| {got['grad']} |")
            print(rows[-1], flush=True)
    body = ("One AdamW step of a one-layer LLaMA (`transformers.LlamaForCausalLM`, 4 heads, 2 KV heads) imported "
            "with `from_torch` and optimized on Mesh(4) (default cost model). The embedding's backward, the NLL "
            "backward's one-hot and the label shift import as kernels (no opaque op), so the embedding gradient "
            "can split; whether the plan splits it is the cost model's choice: at the golden import's tiny size "
            "the whole plan stays on one block.\n\n" + "\n".join(rows))
    write_section("LLaMA training step on Mesh(4)", COMMAND, body)


if __name__ == "__main__":
    main()
