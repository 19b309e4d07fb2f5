"""The graphs small models import as are the ones recorded in tests/data/imported/: the importer's speed-ups
(fresh names, schema decoding, caches) must not change a single node, name, parameter, constant or coverage count.

An intended change to what the importer makes regenerates the records, to be reviewed in the diff:

    TAPESTRY_REGENERATE_IMPORTS=1 pytest tests/test_import_golden.py
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from itertools import zip_longest
from pathlib import Path

import numpy as np
import pytest
import torch

import tapestry

transformers = pytest.importorskip("transformers")

RECORDS = Path(__file__).resolve().parent / "data" / "imported"


def canonical(imported: tapestry.TorchImport) -> str:
    """Everything an import decides, as text: the graph as printed (names, kernels, params, shapes, dtypes),
    outputs, carried and static inputs, constants and examples (by hash), and the translation's maps."""
    graph, translation = imported.graph, imported.translation

    def digest(value: np.ndarray) -> str:
        return f"{value.dtype}{list(value.shape)} {hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()}"

    def counts(table: dict) -> str:
        return json.dumps({op: dict(sorted(made.items())) for op, made in sorted(table.items())})

    lines = [str(graph), f"carried {json.dumps(sorted(graph.carried.items()))}",
             f"static {json.dumps(sorted(graph.static))}",
             *(f"constant {name} {digest(v)}" for name, v in graph.constants.items()),
             *(f"example {name} {digest(v)}" for name, v in graph.examples.items()),
             f"state {json.dumps(translation.state)}", f"user inputs {json.dumps(translation.user_inputs)}",
             f"outputs {json.dumps(translation.outputs)}", f"coverage {counts(translation.coverage)}",
             f"declined {counts(translation.declined)}"]
    return "\n".join(lines) + "\n"


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _training_step() -> tapestry.TorchImport:
    """One AdamW step of a one-layer Hugging Face LLaMA (rotary tables, causal mask, cross entropy)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    def loss(m: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, labels=labels, use_cache=False).loss

    training = tapestry.Training(loss=loss, optimizer="adamw", lr=1e-3)
    return tapestry.from_torch(model, (ids, ids), training=training, verbose=False)


def _weightless_forward() -> tapestry.TorchImport:
    """The same model's forward built on the meta device in bfloat16 (the cluster benchmark's import)."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config()).to(torch.bfloat16).eval()
    ids = torch.zeros(2, 8, dtype=torch.int64, device="meta")
    return tapestry.from_torch(model, (ids,), {"use_cache": False}, verbose=False)


CASES: dict[str, Callable[[], tapestry.TorchImport]] = {
    "llama_adamw_step": _training_step,
    "llama_meta_bf16_forward": _weightless_forward,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_small_model_imports_as_the_recorded_graph(name):
    got = canonical(CASES[name]())
    record = RECORDS / f"{name}.txt"
    if os.environ.get("TAPESTRY_REGENERATE_IMPORTS"):
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(got)
    want = record.read_text()
    if got != want:
        at, (ours, theirs) = next((i, pair) for i, pair in enumerate(zip_longest(got.splitlines(), want.splitlines()))
                                  if pair[0] != pair[1])
        pytest.fail(f"{name} imports differently from {record.name} at line {at + 1}: got {ours!r}, recorded "
                    f"{theirs!r} (an intended change: regenerate, see this file's docstring)")
