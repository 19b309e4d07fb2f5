"""Example programs used by the demo, benchmarks and tests: the seeds' layer, MLPs, a transformer block."""
from __future__ import annotations

from tapestry.graph import Graph, Value


def seeds_example(batch: int = 4096, features: int = 1024, out: int = 1024) -> Graph:
    """Y = ReLU(Linear(X, W, b)), the founding documents' running example."""
    g = Graph()
    x = g.input("x", (batch, features))
    w = g.input("w", (features, out))
    b = g.input("b", (out,))
    g.output("y", g.relu(g.linear(x, w, b)))
    return g


def mlp(depth: int = 4, batch: int = 512, width: int = 256) -> Graph:
    """`depth` layers of relu(linear(.)) of equal width."""
    g = Graph()
    h = g.input("x", (batch, width))
    for i in range(depth):
        w = g.input(f"w{i}", (width, width))
        b = g.input(f"b{i}", (width,))
        h = g.relu(g.linear(h, w, b, name=f"fc{i}"), name=f"act{i}")
    g.output("y", h)
    return g


def _attention(g: Graph, x: Value, seq: int, d_model: int, heads: int) -> Value:
    head_dim = d_model // heads

    def project(name: str) -> Value:
        w = g.input(f"w_{name}", (d_model, d_model))
        y = g.matmul(x, w, name=f"{name}_proj")
        return g.transpose(g.reshape(y, shape=(seq, heads, head_dim), name=f"{name}_heads"), perm=(1, 0, 2),
                           name=f"{name}_t")

    q, k, v = project("q"), project("k"), project("v")
    scores = g.mul(g.matmul(q, g.transpose(k, name="k_tt"), name="scores"), g.input("scale", (1,)), name="scaled")
    attn = g.matmul(g.softmax(scores, axis=-1, name="probs"), v, name="attend")
    merged = g.reshape(g.transpose(attn, perm=(1, 0, 2), name="attn_t"), shape=(seq, d_model), name="merge")
    return g.matmul(merged, g.input("w_o", (d_model, d_model)), name="o_proj")


def transformer_block(seq: int = 128, d_model: int = 128, heads: int = 4, ffn: int = 512) -> Graph:
    """Post-norm block: x + attention (no mask), layer norm, x + MLP (gelu), layer norm."""
    g = Graph()
    x = g.input("x", (seq, d_model))
    h = g.add(x, _attention(g, x, seq, d_model, heads), name="residual1")
    h = g.layer_norm(h, g.input("ln1_w", (d_model,)), g.input("ln1_b", (d_model,)), name="ln1")
    up = g.gelu(g.linear(h, g.input("w_up", (d_model, ffn)), g.input("b_up", (ffn,)), name="up"), name="act")
    down = g.linear(up, g.input("w_down", (ffn, d_model)), g.input("b_down", (d_model,)), name="down")
    h = g.add(h, down, name="residual2")
    g.output("y", g.layer_norm(h, g.input("ln2_w", (d_model,)), g.input("ln2_b", (d_model,)), name="ln2"))
    return g
