"""Import without weights: a module built on the meta device imports as the same graph as with real weights, and
no fold is ever materialized at activation size (large folds stay graph ops over small constants)."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import tapestry
from tapestry import dtypes
from tapestry.evaluator import evaluate
from tapestry.importer import translate
from tapestry.importer.zoo import LlamaBlock

SRC = Path(__file__).resolve().parents[1] / "src"


def _llama(device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device(device):
        return LlamaModel(config).eval()


def _structure(graph: tapestry.Graph) -> list[tuple]:
    return [(n.op, n.shape, n.dtype, n.params) for n in graph.ops]


def test_from_tensor_refuses_a_tensor_without_data():
    with pytest.raises(dtypes.NoDataError, match=r"parameter 'w' \[2, 3\] float32 has no data"):
        dtypes.from_tensor(torch.ones(2, 3, device="meta"), "parameter 'w'")


def test_a_llama_built_on_meta_imports_the_graph_its_real_twin_imports():
    ids = torch.randint(0, 128, (2, 12))
    real = tapestry.from_torch(_llama("cpu"), (ids,), {"use_cache": False}, verbose=False)
    meta = tapestry.from_torch(_llama("meta"), (ids.to("meta"),), {"use_cache": False}, verbose=False)
    assert _structure(meta.graph) == _structure(real.graph)
    assert meta.graph.constants.keys() == real.graph.constants.keys()
    for name, value in real.graph.constants.items():  # position ids and masks depend on shapes only
        np.testing.assert_array_equal(meta.graph.constants[name], value)


def test_large_folds_stay_graph_ops_and_compute_what_torch_computes(monkeypatch):
    """With the fold limit at 16 cells, the causal mask, position ids and rotary tables of a Hugging Face LLaMA are
    emitted as kernels over constants of at most 16 cells, and the graph still computes the module's output."""
    monkeypatch.setattr(translate, "FOLD_CELLS", 16)
    module, ids = _llama("cpu"), torch.randint(0, 128, (2, 12))
    imported = tapestry.from_torch(module, (ids,), {"use_cache": False}, verbose=False)
    assert max(v.size for v in imported.graph.constants.values()) <= 16
    (ours,) = imported.outputs(evaluate(imported.graph, imported.inputs(ids, use_cache=False)))
    np.testing.assert_allclose(ours, module(ids, use_cache=False).last_hidden_state.detach().numpy(), atol=1e-5)


class Zeros(torch.nn.Module):
    """A zero tensor and a fill at activation size, as a traced backward makes them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.zeros(x.shape) + torch.full(x.shape, 0.5) * torch.ones_like(x)


def test_a_large_fill_is_a_one_cell_constant_expanded(monkeypatch):
    monkeypatch.setattr(translate, "FOLD_CELLS", 16)
    module, x = Zeros(), torch.randn(4, 8)
    imported = tapestry.from_torch(module, (x,), verbose=False)
    assert {v.shape for v in imported.graph.constants.values()} == {()}
    assert sum(n.op == "expand" for n in imported.graph.ops) == 3
    (ours,) = imported.outputs(evaluate(imported.graph, imported.inputs(x)))
    np.testing.assert_allclose(ours, module(x).detach().numpy(), atol=1e-6)


def _mse(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(module(x), y)


def test_a_training_step_of_a_block_on_meta_imports_as_its_real_twin(monkeypatch):
    """The traced step's zeros, above the fold limit, stay kernels (attention is fused: no mask is made); the
    step built from real weights still matches torch's SGD step."""
    monkeypatch.setattr(translate, "FOLD_CELLS", 16)
    training = tapestry.Training(loss=_mse, lr=1e-1)
    torch.manual_seed(0)
    model, x, y = LlamaBlock(16, 2, 32), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    with torch.device("meta"):
        ghost = LlamaBlock(16, 2, 32)
    real = tapestry.from_torch(model, (x, y), training=training, verbose=False)
    meta = tapestry.from_torch(ghost, (x.to("meta"), y.to("meta")), training=training, verbose=False)
    assert _structure(meta.graph) == _structure(real.graph)
    assert max((v.size for v in real.graph.constants.values()), default=0) <= 16
    ours = real.outputs(evaluate(real.graph, real.inputs(x, y)))
    reference = copy.deepcopy(model)
    loss = _mse(reference, x, y)
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=1e-1).step()
    np.testing.assert_allclose(ours["loss"], loss.item(), rtol=1e-5)
    for path, p in reference.named_parameters():
        np.testing.assert_allclose(ours["parameters"][path], p.detach().numpy(), atol=1e-5)


def test_a_hugging_face_llama_training_step_on_meta_imports_as_its_real_twin():
    """Rotary tables, the causal mask and cross-entropy's zeros: nothing in the step needs the weights' values."""
    def loss(module: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return module(ids, labels=labels, use_cache=False).loss

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    training, ids = tapestry.Training(loss=loss, optimizer="adam", lr=1e-3), torch.randint(0, 128, (2, 12))
    graphs = []
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        with torch.device(device):
            module = LlamaForCausalLM(config)
        graphs.append(tapestry.from_torch(module, (ids.to(device),) * 2, training=training, verbose=False).graph)
    assert _structure(graphs[1]) == _structure(graphs[0])


RSS_SCRIPT = textwrap.dedent("""
    import json, re, torch, tapestry
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=1, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    ids = torch.zeros(2, 2048, dtype=torch.int64, device="meta")
    imported = tapestry.from_torch(model, (ids,), {"use_cache": False}, verbose=False)
    # VmHWM, not ru_maxrss: Linux carries a forking parent's peak into its child's ru_maxrss across exec
    peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    print(json.dumps({"rss": peak,
                      "constant_bytes": sum(v.nbytes for v in imported.graph.constants.values()),
                      "ops": len(imported.graph.ops)}))
""")


def test_a_7b_wide_llama_layer_on_meta_imports_in_bounded_memory():
    """One LLaMA-7B layer with its embedding and head holds 1.9 GB of float32 weights; built on meta, its import
    (batch 2, sequence 2048) stays far below that, with no constant over the fold limit."""
    run = subprocess.run([sys.executable, "-c", RSS_SCRIPT], capture_output=True, text=True, timeout=600,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["rss"] < 1.0e9, found
    assert found["constant_bytes"] < translate.FOLD_CELLS * 8 * 10, found


def test_a_model_on_meta_imports_with_its_batch_made_on_the_cpu():
    """A user builds the model under torch.device("meta") and the batch as usual: the import traces both on meta
    (before: FakeTensorDeviceMismatchError, cpu and meta), for a forward and a training step."""
    ids = torch.randint(0, 128, (2, 12))
    forward = tapestry.from_torch(_llama("meta"), (ids,), {"use_cache": False}, verbose=False)
    assert _structure(forward.graph) == _structure(tapestry.from_torch(
        _llama("meta"), (ids.to("meta"),), {"use_cache": False}, verbose=False).graph)
    with torch.device("meta"):
        block = LlamaBlock(16, 2, 32)
    x = torch.randn(2, 4, 16)
    step = tapestry.from_torch(block, (x, x), training=tapestry.Training(loss=_mse, lr=1e-1), verbose=False)
    assert step.graph["arg0"].shape == (2, 4, 16)
