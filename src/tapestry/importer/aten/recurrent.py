"""Recurrent layers (LSTM, GRU): a loop of cells, unrolled over time."""
from __future__ import annotations

from typing import Any

from tapestry.graph import Value
from tapestry.importer.translate import Builder, Unsupported, converts


def _unit_major(b: Builder, w: Value, gates: int) -> Value:
    """torch's gate-major weight [gates·H, in] as [in, H·gates]: column h·gates + gate, so a block of hidden units
    holds all the gates of each unit (splitting H then splits every gate alike). Weights are static: free."""
    hidden = w.shape[0] // gates
    split = b.op("reshape", w, shape=(gates, hidden, w.shape[1]))
    return b.op("reshape", b.op("transpose", split, perm=(2, 1, 0)), shape=(w.shape[1], hidden * gates))


def _unit_major_bias(b: Builder, bias: Value, gates: int) -> Value:
    hidden = bias.shape[0] // gates
    split = b.op("transpose", b.op("reshape", bias, shape=(gates, hidden)), perm=(1, 0))
    return b.op("reshape", split, shape=(hidden * gates,))


def _project(b: Builder, x: Value, w: Value, bias: Value | None, gates: int) -> Value:
    """x[..., in] · w (gate-major) + bias, as [..., H, gates]."""
    weight = _unit_major(b, w, gates)
    out = b.op("matmul", x, weight) if bias is None else b.op("linear", x, weight, _unit_major_bias(b, bias, gates))
    return b.op("reshape", out, shape=(*x.shape[:-1], w.shape[0] // gates, gates))


def _gate(b: Builder, gates: Value, index: int) -> Value:
    return b.op("select", gates, axis=gates.ndim - 1, index=index)


def _lstm_step(b: Builder, inputs: Value, h: Value, state: list[Value], w_hh: Value, b_hh: Value | None
               ) -> tuple[Value, list[Value]]:
    gates = b.op("add", inputs, _project(b, h, w_hh, b_hh, 4))  # [B, H, 4]: i, f, g, o
    i, f, g, o = (_gate(b, gates, k) for k in range(4))
    c = b.op("add", b.op("mul", b.op("sigmoid", f), state[0]), b.op("mul", b.op("sigmoid", i), b.op("tanh", g)))
    return b.op("mul", b.op("sigmoid", o), b.op("tanh", c)), [c]


def _gru_step(b: Builder, inputs: Value, h: Value, state: list[Value], w_hh: Value, b_hh: Value | None
              ) -> tuple[Value, list[Value]]:
    hidden = _project(b, h, w_hh, b_hh, 3)  # [B, H, 3]: r, z, n
    r = b.op("sigmoid", b.op("add", _gate(b, inputs, 0), _gate(b, hidden, 0)))
    z = b.op("sigmoid", b.op("add", _gate(b, inputs, 1), _gate(b, hidden, 1)))
    n = b.op("tanh", b.op("add", _gate(b, inputs, 2), b.op("mul", r, _gate(b, hidden, 2))))
    return b.op("add", n, b.op("mul", z, b.op("sub", h, n))), []  # (1 - z)·n + z·h


def _stacked(b: Builder, values: list[Value]) -> Value:
    """[*shape] values as [len, *shape] (a concat chain, as `stack`)."""
    lifted = [b.op("reshape", v, shape=(1, *v.shape)) for v in values]
    out = lifted[0]
    for v in lifted[1:]:
        out = b.op("concat", out, v, axis=0)
    return out


def _recurrent(b: Builder, kind: str, x: Any, hx: list[Any], params: list[Any], has_biases: bool, num_layers: int,
               dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> tuple[Value, ...]:
    """An LSTM or GRU unrolled over time: per layer and direction, one input projection of the whole sequence,
    then per step a cell (its hidden projection, gates, state update). Batch and hidden units shard; the hidden
    projection reads the whole previous h, so sharding hidden units gathers h every step."""
    gates, step = {"lstm": (4, _lstm_step), "gru": (3, _gru_step)}[kind]
    value = b.tensor(x)
    if train and dropout:
        raise Unsupported("dropout between layers in training")
    if value.ndim != 3:
        raise Unsupported(f"a {value.ndim}-D input (batched [T, B, in] or [B, T, in] is taken)")
    per, directions = (4 if has_biases else 2), (2 if bidirectional else 1)
    if len(params) != num_layers * directions * per:
        raise Unsupported(f"{len(params)} weights for {num_layers} layer(s) (projections are not taken)")
    sequence = b.op("transpose", value, perm=(1, 0, 2)) if batch_first else value  # [T, B, in]
    states = [b.tensor(h) for h in hx]  # each [layers·directions, B, H]
    finals: list[list[Value]] = [[] for _ in states]
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            slot = layer * directions + direction
            w_ih, w_hh, *biases = (b.tensor(p) for p in params[slot * per : (slot + 1) * per])
            b_ih, b_hh = biases or (None, None)
            inputs = _project(b, sequence, w_ih, b_ih, gates)  # [T, B, H, gates]
            h, *state = (b.op("select", s, axis=0, index=slot) for s in states)
            steps = range(sequence.shape[0])
            seen: dict[int, Value] = {}
            for t in reversed(steps) if direction else steps:
                h, state = step(b, b.op("select", inputs, axis=0, index=t), h, state, w_hh, b_hh)
                seen[t] = h
            outputs.append(_stacked(b, [seen[t] for t in steps]))
            for final, last in zip(finals, [h, *state]):
                final.append(last)
        sequence = outputs[0] if directions == 1 else b.op("concat", outputs[0], outputs[1], axis=2)
    output = b.op("transpose", sequence, perm=(1, 0, 2)) if batch_first else sequence
    return (output, *(_stacked(b, final) for final in finals))


@converts("aten.lstm.input")
def _lstm(b: Builder, x: Any, hx: list[Any], params: list[Any], *flags: Any) -> tuple[Value, ...]:
    return _recurrent(b, "lstm", x, list(hx), list(params), *flags)


@converts("aten.gru.input")
def _gru(b: Builder, x: Any, hx: Any, params: list[Any], *flags: Any) -> tuple[Value, ...]:
    return _recurrent(b, "gru", x, [hx], list(params), *flags)
