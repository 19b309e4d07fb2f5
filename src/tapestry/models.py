"""Example programs used by the demo, benchmarks and tests: the seeds' layer, MLPs, a transformer block.

Each takes the dtype of all its inputs (float32 by default; bfloat16 for the GPU benchmark).
"""
from __future__ import annotations

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
