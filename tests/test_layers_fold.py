"""A model's repeated layers are found on the imported graph, before saturation (graph.layers), and the graph
folds to the prefix, two layers and the suffix: a two-layer model's program whatever the depth."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import tapestry
from tapestry.graph import Graph
from tapestry.graph.layers import find_layers, fold


def llama_step(layers: int) -> Graph:
    """transformers' LLaMA, tiny, one Adam training step (rotary tables and masks shared or made per layer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=64, max_position_embeddings=64)
    ids = torch.randint(0, 64, (2, 8))

    def loss(m: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return m(ids, labels=labels, use_cache=False).loss

    return tapestry.from_torch(LlamaForCausalLM(config), (ids, ids), verbose=False,
                               training=tapestry.Training(loss=loss, optimizer="adam", lr=1e-4)).graph


def kinds(graph: Graph) -> Counter:
    return Counter((node.op, node.params, node.shape, node.dtype) for node in graph)


@pytest.fixture(scope="module")
def steps() -> dict[int, Graph]:
    return {n: llama_step(n) for n in (2, 3, 5)}


def test_finds_every_layer_of_a_llama_training_step_forward_backward_and_update(steps):
    three, five = find_layers(steps[3]), find_layers(steps[5])
    assert three is not None and five is not None
    assert (three.copies, five.copies) == (3, 5)
    assert len(three.chains) == len(five.chains)  # one layer's nodes, whatever the depth
    for graph, layers in ((steps[3], three), (steps[5], five)):
        outside = len(graph) - len(layers.chains) * layers.copies
        assert outside == len(steps[2]) - 2 * len(layers.chains)  # the prefix and suffix alone stay outside
        for chain in layers.chains:
            assert len({(graph[n].op, graph[n].params, graph[n].shape) for n in chain}) == 1
        carried = {graph.carried[out] for chain in layers.outputs for out in chain}
        assert carried == {name for chain in layers.chains for name in chain if name in graph.carried.values()}
    weights = [chain for chain in five.chains if chain[0].endswith("q_proj.weight")]
    assert [w.split(".")[2] for w in weights[0]] == ["0", "1", "2", "3", "4"]


def test_two_layers_are_too_few_to_fold(steps):
    assert find_layers(steps[2]) is None


def test_the_folded_graph_is_the_two_layer_program(steps):
    folded = fold(steps[5], find_layers(steps[5]))
    assert folded is not None
    assert kinds(folded.graph) == kinds(steps[2])
    assert len(folded.graph.outputs) == len(steps[2].outputs)
    assert len(folded.graph.carried) == len(steps[2].carried)


def test_numbered_names_alone_are_not_layers():
    """Inputs named like layers but used unlike: no shift checks out, so nothing is folded."""
    g = Graph()
    w = [g.input(f"layers.{k}.weight", (4, 4)) for k in range(3)]
    x = g.input("x", (4, 4))
    y = g.matmul(x, w[0])
    y = g.add(y, w[1])
    y = g.matmul(w[2], y)
    g.output("y", y)
    assert find_layers(g) is None
