"""Random block graphs over the kernel registry: chains and DAGs with random small shapes."""
from __future__ import annotations

from hypothesis import strategies as st

from tapestry.graph import Graph, Value

SIZES = st.integers(1, 6)


@st.composite
def block_graphs(draw, max_ops: int = 6) -> Graph:
    """Each op reads an earlier value (a chain when it is the last one, a DAG otherwise), plus fresh
    inputs shaped to fit; the last value, and sometimes another, are outputs."""
    g = Graph()
    values: list[Value] = [g.input("x", tuple(draw(st.lists(SIZES, min_size=1, max_size=3))))]
    fresh = iter(range(10_000))

    def new_input(shape: tuple[int, ...]) -> Value:
        return g.input(f"in{next(fresh)}", shape)

    for _ in range(draw(st.integers(1, max_ops))):
        x = values[-1] if draw(st.booleans()) else draw(st.sampled_from(values))
        n = x.ndim
        choices = ["relu", "gelu", "exp", "transpose", "add", "mul"]
        if n >= 1:
            choices += ["linear", "sum", "softmax", "layer_norm"]
        if n >= 2:
            choices += ["matmul"]
        if n >= 1 and x.shape[-1] > 1 and len(x.shape) >= 1:
            choices += ["reshape"] if n >= 2 else []
        op = draw(st.sampled_from(choices))
        if op in ("relu", "gelu", "exp"):
            y = g.op(op, x)
        elif op == "transpose":
            y = g.transpose(x, perm=tuple(draw(st.permutations(range(n)))))
        elif op in ("add", "mul"):
            same = [v for v in values if v.shape == x.shape and v is not x]
            other = draw(st.sampled_from(same)) if same and draw(st.booleans()) else new_input(
                tuple(s if draw(st.booleans()) else 1 for s in x.shape[draw(st.integers(0, n)):]))
            y = g.op(op, x, other)
        elif op == "linear":
            out = draw(SIZES)
            y = g.op(draw(st.sampled_from(["linear", "linear_relu", "linear_gelu"])), x,
                     new_input((x.shape[-1], out)), new_input((out,)))
        elif op in ("sum", "softmax"):
            y = g.op(op, x, axis=draw(st.integers(-n, n - 1)))
        elif op == "layer_norm":
            y = g.layer_norm(x, new_input(x.shape[-1:]), new_input(x.shape[-1:]))
        elif op == "matmul":
            y = g.matmul(x, new_input((x.shape[-1], draw(SIZES))))
        else:
            y = g.reshape(x, shape=(*x.shape[:-2], x.shape[-2] * x.shape[-1]))
        values.append(y)
    g.output("out", values[-1])
    if len(values) > 2 and draw(st.booleans()):
        g.output("side", draw(st.sampled_from(values[1:-1])))
    return g
