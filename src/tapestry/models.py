"""Example programs used by the demo, benchmarks and tests: the seeds' layer, MLPs, a transformer block.

Each takes the dtype of all its inputs (float32 by default; bfloat16 for the GPU benchmark).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tapestry.graph import Graph, Value


def seeds_example(batch: int = 4096, features: int = 1024, out: int = 1024, dtype: str = "float32") -> Graph:
    """Y = ReLU(Linear(X, W, b)), the founding documents' running example."""
    g = Graph()
    x = g.input("x", (batch, features), dtype)
    w = g.input("w", (features, out), dtype)
    b = g.input("b", (out,), dtype)
    g.output("y", g.relu(g.linear(x, w, b)))
    return g


def mlp(depth: int = 4, batch: int = 512, width: int = 256, dtype: str = "float32") -> Graph:
    """`depth` layers of relu(linear(.)) of equal width."""
    g = Graph()
    h = g.input("x", (batch, width), dtype)
    for i in range(depth):
        w = g.input(f"w{i}", (width, width), dtype)
        b = g.input(f"b{i}", (width,), dtype)
        h = g.relu(g.linear(h, w, b, name=f"fc{i}"), name=f"act{i}")
    g.output("y", h)
    return g


def transformer_block(batch: int = 4, seq: int = 64, dim: int = 128, heads: int = 4, dtype: str = "float32") -> Graph:
    """Pre-LN block: unmasked multi-head attention built from matmul/transpose/softmax/mul, then a GELU MLP."""
    return transformer_stack(1, batch, seq, dim, heads, dtype)


def transformer_stack(layers: int, batch: int = 4, seq: int = 64, dim: int = 128, heads: int = 4,
                      dtype: str = "float32") -> Graph:
    """`layers` pre-LN blocks in a row, each with its own weights (named `l{i}.` after the first layer's): the
    deep model of the optimizer-at-scale benchmarks."""
    if layers < 1:
        raise ValueError(f"a transformer stack needs at least one layer, got {layers}")
    g = Graph()
    x = g.input("x", (batch, seq, dim), dtype)
    for layer in range(layers):
        x = _pre_ln_block(g, x, "" if layer == 0 else f"l{layer}.", heads)
    g.output("y", x)
    return g


def _pre_ln_block(g: Graph, x: Value, prefix: str, heads: int) -> Value:
    batch, seq, dim = x.shape
    dh = dim // heads

    def param(name: str, shape: tuple[int, ...]) -> Value:
        return g.input(prefix + name, shape, x.dtype)

    def heads_of(t: Value, perm: tuple[int, ...]) -> Value:
        return g.transpose(g.reshape(t, shape=(batch, seq, heads, dh)), perm=perm)

    h = g.layer_norm(x, param("ln1_w", (dim,)), param("ln1_b", (dim,)))
    q, k, v = (g.linear(h, param(f"w{n}", (dim, dim)), param(f"b{n}", (dim,))) for n in "qkv")
    scores = g.mul(g.matmul(heads_of(q, (0, 2, 1, 3)), heads_of(k, (0, 2, 3, 1))), param("scale", (1,)))
    attn = g.matmul(g.softmax(scores, axis=-1), heads_of(v, (0, 2, 1, 3)))
    merged = g.reshape(g.transpose(attn, perm=(0, 2, 1, 3)), shape=(batch, seq, dim))
    x1 = g.add(x, g.linear(merged, param("wo", (dim, dim)), param("bo", (dim,))))
    h2 = g.layer_norm(x1, param("ln2_w", (dim,)), param("ln2_b", (dim,)))
    up = g.gelu(g.linear(h2, param("w1", (dim, 4 * dim)), param("b1", (4 * dim,))))
    return g.add(x1, g.linear(up, param("w2", (4 * dim, dim)), param("b2", (dim,))))


def moe_layer(tokens: int = 64, hidden: int = 32, ffn: int = 48, experts: int = 8, top_k: int = 2,
              dtype: str = "float32") -> Graph:
    """A Mixtral-style MoE layer's experts, as transformers' grouped-mm path runs them: the routed rows gathered
    in expert order (`order`: each sorted slot's token), two grouped_mms with SwiGLU between, each row scaled by
    its routing weight (`weights`, in sorted order), put back in token order (`inverse`) and summed over the
    top-k. The router's outputs (order, inverse, weights, `ends`: each expert's end row) are inputs: tiny ops
    whose values only the data decides."""
    g = Graph()
    rows = tokens * top_k
    h = g.input("h", (tokens, hidden), dtype)
    order, inverse = g.input("order", (rows,), "int64"), g.input("inverse", (rows,), "int64")
    weights, ends = g.input("weights", (rows, 1), dtype), g.input("ends", (experts,), "int64")
    gate_up = g.input("w_gate_up", (experts, hidden, 2 * ffn), dtype, static=True)
    down = g.input("w_down", (experts, ffn, hidden), dtype, static=True)
    x = g.op("take", h, order, axis=0, name="dispatch")
    up = g.op("grouped_mm", x, gate_up, ends, name="experts_up")
    gate = g.op("slice", up, axis=1, start=0, stop=ffn, name="gate")
    lin = g.op("slice", up, axis=1, start=ffn, stop=2 * ffn, name="lin")
    act = g.op("mul", g.op("silu", gate, name="silu"), lin, name="swiglu")
    out = g.op("mul", g.op("grouped_mm", act, down, ends, name="experts_down"), weights, name="scaled")
    back = g.op("take", out, inverse, axis=0, name="combine")
    per_token = g.op("reshape", back, shape=(tokens, top_k, hidden), name="per_token")
    g.output("y", g.op("sum", per_token, axis=1, name="moe"))
    return g


def moe_routing(tokens: int, experts: int, top_k: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A router's outputs for `moe_layer`, from random logits: (order, inverse, weights, ends), uneven as real
    routing is."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((tokens, experts))
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    probs = np.exp(np.take_along_axis(logits, chosen, axis=1))
    probs /= probs.sum(axis=1, keepdims=True)
    flat = chosen.reshape(-1)
    perm = np.argsort(flat, kind="stable")
    return {"order": (perm // top_k).astype(np.int64), "inverse": np.argsort(perm).astype(np.int64),
            "weights": probs.reshape(-1)[perm].reshape(-1, 1).astype(np.float32),
            "ends": np.cumsum(np.bincount(flat, minlength=experts)).astype(np.int64)}


def llama_decoder(vocab: int = 64, dim: int = 32, layers: int = 4, heads: int = 4, hidden: int = 64) -> Any:
    """A small LLaMA-style decoder as a torch module: embedding, `layers` LlamaBlocks (its `layers` ModuleList,
    what a pipeline cuts into stages), RMSNorm and an LM head; token ids in, logits out."""
    import torch
    from torch import nn

    from tapestry.importer.zoo import LlamaBlock

    class LlamaDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(LlamaBlock(dim, heads, hidden) for _ in range(layers))
            self.norm = nn.RMSNorm(dim, eps=1e-6)
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    return LlamaDecoder()
