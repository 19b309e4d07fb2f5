"""The block graph IR: a list of named nodes, each an input or a kernel applied to earlier nodes.

Like torch.fx's Graph, it is plain to read and print: nodes are kept in a valid
execution order, so every walk over `graph.nodes` is already topological.
"""
from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from tapestry import dtypes
from tapestry.dtypes import DTYPES
from tapestry.kernels import KERNELS, Kernel, KernelError, Params, Shape, Signature, get_kernel
from tapestry.zspace.zrange import as_point

INPUT = "input"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.]*$")  # module paths ("0.weight") included


class GraphError(ValueError):
    """An invalid graph: the message names the op and input at fault."""


def check_name(name: object, what: str = "name") -> str:
    """`name` if it is an identifier (module paths like "0.weight" included), else GraphError: names become file
    names (`tapestry run --save-outputs DIR` writes DIR/NAME.npy), so "../x" or "/tmp/x" must never pass."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise GraphError(f"{what} {name!r} is not an identifier (letters, digits, '_' and '.', not starting with '.')")
    return name


@dataclass(frozen=True)
class Value:
    """A handle on a node's result, returned by the builder methods."""

    name: str
    shape: Shape
    dtype: str = "float32"

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Node:
    name: str
    op: str
    args: tuple[str, ...]
    params: Params
    shape: Shape
    dtype: str = "float32"

    @property
    def is_input(self) -> bool:
        return self.op == INPUT

    def __str__(self) -> str:
        if self.is_input:
            return f"{self.name}: {self.dtype}{list(self.shape)} = input()"
        params = "".join(f", {k}={v}" for k, v in self.params)
        return f"{self.name}: {self.dtype}{list(self.shape)} = {self.op}({', '.join(self.args)}{params})"


class Graph:
    """Build with g.input(...), then one method per kernel (g.linear, g.relu, ...), then g.output(...)."""

    def __init__(self) -> None:
        self._nodes: dict[str, Node] = {}
        self._signatures: dict[str, Signature] = {}
        self._op_counts: Counter[str] = Counter()  # nodes per kernel: fresh names in O(1), not a walk per op
        self._bound: dict[tuple, Signature] = {}  # `_bind`'s signatures: a model's repeated layers bind once
        self.outputs: dict[str, str] = {}
        self.constants: dict[str, np.ndarray] = {}  # inputs whose value is part of the program (folded masks)
        self.carried: dict[str, str] = {}  # output -> the input it becomes at the next step (see `carry`)
        self.static: set[str] = set()  # inputs whose value stays fixed across runs (inference weights)
        self.examples: dict[str, np.ndarray] = {}  # example values of inputs (see `example`)
        self.nonnegative: set[str] = set()  # inputs never negative (Adam's second moments): checks draw magnitudes

    # -- building ------------------------------------------------------------------------------
    def input(self, name: str, shape: Shape, dtype: str = "float32", static: bool = False) -> Value:
        """A program input; `static`: its value stays the same from run to run (an inference weight), so what is
        computed from static inputs and constants alone is prepared once, not paid for per run (`fixed`)."""
        self._check_new_name(name)
        if dtype not in DTYPES:
            raise GraphError(f"input {name!r}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        try:
            shape = as_point(shape)  # [8.9, 6] is refused, not truncated
        except TypeError:
            raise GraphError(f"input {name!r}: shape {list(shape)} is not whole numbers") from None
        if any(s < 0 for s in shape):
            raise GraphError(f"input {name!r}: shape {list(shape)} has a negative size")
        self._nodes[name] = Node(name, INPUT, (), (), shape, dtype)
        if static:
            self.static.add(name)
        return Value(name, shape, dtype)

    def constant(self, name: str, value: np.ndarray) -> Value:
        """An input whose value is fixed by the program: random and verification inputs use it as is."""
        array = np.asarray(value)
        handle = self.input(name, array.shape, dtypes.name_of(array.dtype))
        self.constants[name] = array
        return handle

    def example(self, name: str, value: np.ndarray) -> None:
        """An example value of input `name`, which checks (tapestry.random_inputs, optimize()'s meaning check) use
        instead of random draws: an op may have a contract random values break (EmbeddingBag's offsets start at 0
        and rise). The importer records the example values of integer inputs."""
        if name not in self._nodes or not self._nodes[name].is_input:
            raise GraphError(f"example: {name!r} is not an input of the graph")
        node, array = self._nodes[name], np.asarray(value)
        if array.shape != node.shape:
            raise GraphError(f"example: input {name!r} has shape {list(node.shape)}, the value {list(array.shape)}")
        self.examples[name] = dtypes.cast(array, node.dtype)

    def op(self, op: str, *args: Value | str, name: str | None = None, **params: Any) -> Value:
        """Apply kernel `op` to earlier values; the generic form of g.<kernel>(...)."""
        label = name or self._fresh_name(op)
        try:
            kernel = get_kernel(op)
        except KernelError as err:
            raise GraphError(f"op {label!r}: {err}") from None
        self._check_new_name(label)
        if len(args) > len(kernel.inputs):
            extra = ", ".join(repr(a) for a in args[len(kernel.inputs):])
            keywords = ", ".join(f"{p}=..." for p in kernel.params) or "none"
            raise GraphError(f"op {label!r} ({op}) takes {len(kernel.inputs)} tensor input(s) "
                             f"({', '.join(kernel.inputs)}); got also {extra}: parameters go by keyword ({keywords})")
        arg_names = tuple(a.name if isinstance(a, Value) else str(a) for a in args)
        for slot, arg in zip(kernel.inputs, arg_names):
            if arg not in self._nodes:
                raise GraphError(f"op {label!r} ({op}): input {slot!r} refers to {arg!r}, which is not defined before it")
        args = [self._nodes[a] for a in arg_names]
        try:
            sig = self._bind(kernel, tuple(a.shape for a in args), tuple(a.dtype for a in args), params)
        except (KernelError, dtypes.DtypeError) as err:
            shapes = ", ".join(f"{s}={a.name}{list(a.shape)} {a.dtype}" for s, a in zip(kernel.inputs, args))
            raise GraphError(f"op {label!r} ({op}): {err} [inputs: {shapes}]") from None
        self._nodes[label] = Node(label, op, arg_names, sig.params, sig.output_shape, sig.dtype)
        self._signatures[label] = sig
        self._op_counts[op] += 1
        return Value(label, sig.output_shape, sig.dtype)

    def output(self, name: str, value: Value | str) -> None:
        check_name(name, "output")
        target = value.name if isinstance(value, Value) else value
        if target not in self._nodes:
            raise GraphError(f"output {name!r} refers to {target!r}, which is not defined")
        if name in self.outputs:
            raise GraphError(f"output {name!r} is defined twice")
        self.outputs[name] = target

    def carry(self, output: str, input: str) -> None:
        """Output `output` is input `input`'s value at the next step (a training step's updated weight or
        optimizer state): `tapestry.optimize` then delivers it in the layout `input` is placed in (steady state)."""
        self.check_carry(output, input)
        if output in self.carried or input in self.carried.values():
            raise GraphError(f"carry: {output!r} or {input!r} is already carried")
        self.carried[output] = input

    def check_carry(self, output: str, input: str) -> None:
        """GraphError unless `output` is an output and `input` an input of the same shape and dtype."""
        if output not in self.outputs:
            raise GraphError(f"carry: {output!r} is not an output of the graph")
        if input not in self._nodes or not self._nodes[input].is_input:
            raise GraphError(f"carry: {input!r} is not an input of the graph")
        out, into = self._nodes[self.outputs[output]], self._nodes[input]
        if (out.shape, out.dtype) != (into.shape, into.dtype):
            raise GraphError(f"carry: output {output!r} is {out.dtype}{list(out.shape)} but input {input!r} is "
                             f"{into.dtype}{list(into.shape)}; a carried value keeps its shape and dtype")

    def check_plannable(self) -> None:
        """Refuse what a plan cannot hold: a graph with no outputs computes nothing, and a zero-size tensor has
        no cells to place on devices (plans give every device a block; `tapestry.evaluate` computes such
        graphs, with the right shapes)."""
        if not self.outputs:
            raise GraphError("the graph has no outputs: mark the values to compute with g.output(name, value) "
                             "(or \"outputs\" in graph JSON)")
        for node in self._nodes.values():
            if 0 in node.shape:
                what = "input" if node.is_input else f"op ({node.op})"
                raise GraphError(f"{what} {node.name!r} has shape {list(node.shape)}: plans cannot place "
                                 "zero-size tensors on devices; tapestry.evaluate computes this graph")

    def truncate(self, length: int) -> None:
        """Drop every node added after the first `length`: a builder's rollback of a half-built subgraph."""
        for node in self.added_after(length):
            name = node.name
            del self._nodes[name]
            if not node.is_input:
                self._op_counts[node.op] -= 1
            self._signatures.pop(name, None)
            self.constants.pop(name, None)
            self.examples.pop(name, None)
            self.static.discard(name)
            self.nonnegative.discard(name)

    def __getattr__(self, op: str) -> Any:
        if op.startswith("_") or op not in KERNELS:
            raise AttributeError(f"Graph has no attribute or kernel {op!r}; kernels: {', '.join(sorted(KERNELS))}")
        return partial(self.op, op)

    def __dir__(self) -> list[str]:
        return [*super().__dir__(), *KERNELS]

    def _bind(self, kernel: Kernel, shapes: tuple[Shape, ...], in_dtypes: tuple[str, ...],
              params: Mapping[str, Any]) -> Signature:
        """`kernel.bind`, once per distinct call: a Signature is a frozen value of its kernel, shapes, dtypes and
        params, so the nodes of repeated layers share one. Params are told apart by type and repr, not by ==
        (True == 1 == 1.0 and 0.0 == -0.0, which bind keeps apart or refuses)."""
        key = (kernel.name, shapes, in_dtypes, tuple((k, type(v), repr(v)) for k, v in sorted(params.items())))
        sig = self._bound.get(key)
        if sig is None or sig.kernel is not kernel:  # not bound yet, or by a kernel since registered again
            sig = self._bound[key] = kernel.bind(shapes, params, in_dtypes)
        return sig

    def _fresh_name(self, op: str) -> str:
        count = self._op_counts[op]
        while f"{op}_{count}" in self._nodes:
            count += 1
        return f"{op}_{count}"

    def _check_new_name(self, name: str) -> None:
        check_name(name)
        if name in self._nodes:
            raise GraphError(f"name {name!r} is defined twice")

    # -- reading -------------------------------------------------------------------------------
    @property
    def nodes(self) -> tuple[Node, ...]:
        return tuple(self._nodes.values())

    def added_after(self, length: int) -> tuple[Node, ...]:
        """The nodes after the first `length`, in order: what a builder added since (read from the end, so a
        converter's few nodes cost as many steps, not the whole graph's)."""
        added = list(itertools.islice(reversed(self._nodes.values()), max(len(self._nodes) - length, 0)))
        return tuple(reversed(added))

    @property
    def inputs(self) -> tuple[Node, ...]:
        return tuple(n for n in self._nodes.values() if n.is_input)

    @property
    def ops(self) -> tuple[Node, ...]:
        return tuple(n for n in self._nodes.values() if not n.is_input)

    def __getitem__(self, name: str) -> Node:
        return self._nodes[name]

    def __contains__(self, name: str) -> bool:
        return name in self._nodes

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def fixed(self) -> frozenset[str]:
        """The inputs whose value is the same in every run: static inputs and constants."""
        return frozenset(self.static) | frozenset(self.constants)

    def signature(self, name: str) -> Signature:
        return self._signatures[name]

    def users(self) -> Mapping[str, tuple[str, ...]]:
        uses: dict[str, list[str]] = {n: [] for n in self._nodes}
        for node in self._nodes.values():
            for arg in node.args:
                uses[arg].append(node.name)
        return {k: tuple(v) for k, v in uses.items()}

    def __str__(self) -> str:
        lines = [str(n) for n in self._nodes.values()]
        lines += [f"output {k} = {v}" for k, v in self.outputs.items()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return "Graph(\n  " + str(self).replace("\n", "\n  ") + "\n)"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Graph) and self.nodes == other.nodes and self.outputs == other.outputs
                and self.static == other.static and self.nonnegative == other.nonnegative
                and self.constants.keys() == other.constants.keys()
                and all(np.array_equal(v, other.constants[k]) for k, v in self.constants.items())
                and self.examples.keys() == other.examples.keys()
                and all(np.array_equal(v, other.examples[k]) for k, v in self.examples.items()))
