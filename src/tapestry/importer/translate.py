"""Walk an exported ATen graph and build a Tapestry Graph.

Each fx node becomes one of:
- folded: every tensor it reads is a constant (or it reads only metadata, as `new_ones` does), so torch
  computes it now and it becomes a constant (mask construction, position ids). Folds are computed on the CPU
  whatever device the module is on (a module built on the meta device has no data, but its position ids and
  masks depend on shapes only), and only when small (FOLD_CELLS): a larger fold is emitted as the graph op it
  is, over the small constants it reads, and a large tensor of one value (zeros, a fill) as a one-cell constant
  expanded, so no activation-sized constant is ever made;
- dropped: bookkeeping (`clone`, eval-mode `dropout`) that passes its input through, and `_assert_*` checks once
  decided at import on the static shapes, dtypes and constants (importer/assertions.py: one that fails, or that
  reads a value known only at run time, stops the import);
- converted: the converter registered for its ATen op (importer/aten/) emits Tapestry kernels;
- opaque: no converter (or one that declines), so it runs whole through torch (`opaque<n>` kernels),
  or, with strict=True, an error naming the op, its source line and module path.
"""
from __future__ import annotations

import collections
import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from tapestry import dtypes
from tapestry.graph import Graph, GraphError, Value
from tapestry.importer.assertions import check_assertion
from tapestry.importer.capture import TorchImportError
from tapestry.kernels.opaque import MAX_ARITY, encode_args, opaque_name

Converter = Callable[..., Any]
CONVERTERS: dict[str, Converter] = {}
PASS_THROUGH = {
    "aten.clone.default", "aten.contiguous.default", "aten.alias.default", "aten.detach.default",
    "aten.lift_fresh_copy.default", "aten.dropout.default",
}
METADATA_ONLY = {  # read only their tensor argument's shape, dtype or device
    "aten.new_ones.default", "aten.new_zeros.default", "aten.new_full.default", "aten.new_empty.default",
    "aten.ones_like.default", "aten.zeros_like.default", "aten.full_like.default", "aten.empty_like.default",
    "aten.new_empty_strided.default", "aten.sym_size.int",
}
READS_MEMORY = {"aten.as_strided.default", "aten.as_strided_copy.default"}  # read their input's memory layout
FOLD_CELLS = 1 << 16  # the largest fold made into a constant array; a larger one stays a graph op
FILLS: dict[str, Callable[[tuple[Any, ...]], Any]] = {  # ops whose result is one value everywhere: that value
    "aten.full.default": lambda args: args[1], "aten.new_full.default": lambda args: args[2],
    "aten.full_like.default": lambda args: args[1], "aten.scalar_tensor.default": lambda args: args[0],
    **{f"aten.{op}.default": lambda args: 0
       for op in ("zeros", "new_zeros", "zeros_like", "new_empty", "empty_like", "new_empty_strided")},
    **{f"aten.{op}.default": lambda args: 1 for op in ("ones", "new_ones", "ones_like")},
    "aten.empty.memory_format": lambda args: 0,  # empty's cells are any value: zero is one
}


class Standin:
    """A converter's result that is no graph tensor but stands for graph values, read only by the converters it
    is made for (the real part of a complex transform: aten.fourier.RealPart); never folded as a constant."""


class Unsupported(Exception):
    """Raised by a converter for a form of its op it does not map (the node then runs opaque)."""


def converts(*names: str) -> Callable[[Converter], Converter]:
    def register(fn: Converter) -> Converter:
        for name in names:
            CONVERTERS[name] = fn
        return fn

    return register


def op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


@dataclass
class Builder:
    """What converters see: the graph under construction, and constants made into graph inputs."""

    graph: Graph
    node: Any = None  # the fx node being converted
    # ATen op -> {why its converter declined it: count}; those nodes run opaque
    declined: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))

    def op(self, kernel: str, /, *args: Value, **params: Any) -> Value:
        return self.graph.op(kernel, *args, **params)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape torch gives the node being converted."""
        return tuple(int(s) for s in _meta(self.node).shape)

    @property
    def dtype(self) -> str:
        return dtypes.name_of(_meta(self.node).dtype)

    def tensor(self, value: Any) -> Value:
        """A graph value for a converter's tensor operand: constants become graph inputs."""
        if isinstance(value, Value):
            return value
        if isinstance(value, torch.Tensor):
            return self.constant(value)
        raise Unsupported(f"expected a tensor, got {type(value).__name__}")

    def constant(self, tensor: torch.Tensor) -> Value:
        """A constant as a graph input; a floating or bool one whose cells repeat along some dims (a fold of an
        `expand`, such as XLNet's positional embedding over the batch) as its distinct cells expanded, so rules see
        the broadcast (`_distinct_cells`)."""
        what = f"a constant read by {op_name(self.node.target)} at {_where(self.node)}" if self.node else "a constant"
        cells = _distinct_cells(tensor)
        value = self.graph.constant(f"const_{len(self.graph.constants)}", dtypes.from_tensor(cells.contiguous(), what))
        return value if cells.shape == tensor.shape else self.op("expand", value, shape=tuple(tensor.shape))

    def filled(self, value: Any, shape: tuple[int, ...], dtype: str) -> Value:
        """A tensor of one value, as a one-cell constant expanded (a view: no array of its size is made)."""
        cell = self.graph.constant(f"const_{len(self.graph.constants)}", np.full((), value, dtypes.to_numpy(dtype)))
        return self.op("expand", cell, shape=shape)


def _distinct_cells(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` cut to its first cell along each dim whose cells are all alike, bit for bit (NaN never is; 0.0 and
    -0.0 are not): expanding it back gives `tensor`. Floating (a matmul's operand: substitution.egg's expand rule)
    and bool (a mask over the batch: a view, not the batch's copies) constants only: an integer one (the positions
    and ids a causal mask compares, a gather's indices) is left whole, as no rule reads its expand and its expands
    cost the search (the 70B step on 8x8x8: four of them left the first unbudgeted fit unproven at a slow plan that
    fit 80 GB, and its four refits ran, 3x the CPU, docs/benchmarks.md)."""
    from torch._subclasses.fake_tensor import is_fake

    integer = not tensor.is_floating_point() and tensor.dtype != torch.bool
    if tensor.numel() <= 1 or tensor.is_complex() or integer or tensor.is_meta or is_fake(tensor):
        return tensor  # (a tensor without data is left for `dtypes.from_tensor` to name)
    for dim in range(tensor.ndim):
        first = tensor.narrow(dim, 0, 1).expand_as(tensor)
        if tensor.shape[dim] > 1 and torch.equal(tensor, first) and (
                not tensor.is_floating_point() or torch.equal(torch.signbit(tensor), torch.signbit(first))):
            tensor = tensor.narrow(dim, 0, 1)
    return tensor


def _meta(node: Any) -> Any:
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        raise Unsupported("multi-output node")
    if value is None:
        raise Unsupported("no shape recorded")
    return value


def _where(node: Any) -> str:
    """The node's module path and source line, for errors and the coverage report."""
    stack = node.meta.get("nn_module_stack") or {}
    module = next(reversed(stack.values()))[0] if stack else "<top>"
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    line = next((t.strip() for t in reversed(trace) if t.strip().startswith("File ")), "")
    return f"module {module!r}" + (f", {line}" if line else "")


@dataclass(frozen=True)
class Translation:
    graph: Graph
    state: tuple[str, ...]  # graph inputs that are module state (parameters, float buffers), named by path
    user_inputs: tuple[str, ...]  # graph inputs for the flattened user arguments, in order
    outputs: tuple[str, ...]  # graph output names, in the module's flattened output order
    coverage: dict[str, collections.Counter]  # ATen op -> what it became ("linear", "folded", "opaque", ...)
    declined: dict[str, collections.Counter] = field(default_factory=dict)  # ATen op -> {why it runs opaque: count}
    draws: dict[str, Any] = field(default_factory=dict)  # graph input -> its training.draws.Draw, drawn every call


@dataclass(frozen=True)
class Placeholder:
    """What an fx placeholder is: module state or a user argument (graph inputs), a constant, or nothing."""

    kind: str  # "state" | "user" | "random" (a training step's draw, training/draws.py) | "constant" | "none"
    name: str = ""
    value: Any = None  # a constant's tensor


def translate(graph: torch.fx.Graph, placeholders: Mapping[str, Placeholder], outputs: Sequence[tuple[str, Any]],
              strict: bool) -> Translation:
    """Build the Tapestry graph of an ATen fx graph. `placeholders` says what each placeholder (by node name) is;
    `outputs` names the fx nodes (or constants) that become graph outputs, in order."""
    from tapestry.importer import aten  # noqa: F401  (registers the converters)
    from tapestry.importer.aten.fourier import real_parts

    real_parts(graph)  # `.real` as exported, view_as_real(z)[..., 0], read as the one op its converter takes
    builder = Builder(Graph())
    env: dict[Any, Any] = {}
    coverage: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    inputs: dict[str, Value] = {}  # by graph input name: aliased placeholders (tied weights) share one
    for node in graph.nodes:
        if node.op == "placeholder":
            role = placeholders[node.name]
            if role.kind in ("state", "user", "random"):
                if role.name not in inputs:
                    inputs[role.name] = _placeholder(builder.graph, node, role)
                env[node] = inputs[role.name]
            else:
                env[node] = _placeholder(builder.graph, node, role)
        elif node.op == "get_attr":  # a tensor the traced code made itself (GPT-2's `torch.full([], -inf)`)
            env[node] = _attribute(graph, node)
        elif node.op == "call_function":
            env[node] = _call(builder, node, env, strict, coverage)
    for name, value in outputs:
        builder.graph.output(name, builder.tensor(_resolve(value, env)))
    kinds = collections.defaultdict(list)
    for p in placeholders.values():
        kinds[p.kind].append(p.name)
    state = tuple(dict.fromkeys(n for n in kinds["state"] if n in builder.graph))  # a tied weight's paths: one input
    return Translation(builder.graph, state, tuple(kinds["user"]), tuple(name for name, _ in outputs), dict(coverage),
                       dict(builder.declined))


def translate_program(program: torch.export.ExportedProgram, strict: bool) -> Translation:
    """An exported module: parameters and float buffers are state, integer buffers (position ids) constants. For
    inference the state is static (`Graph.input(static=True)`): the same every run, unless the forward mutates it."""
    tables = {**program.state_dict, **program.constants}
    first_name: dict[int, str] = {}  # a tied weight (T5's embedding and LM head) is one tensor under several paths
    placeholders = {}
    for spec in program.graph_signature.input_specs:
        if not isinstance(spec.arg, TensorArgument):
            continue
        value = next(n for n in program.graph.nodes if n.name == spec.arg.name).meta["val"]
        table = tables.get(spec.target)
        if table is not None and table.is_meta:  # an index table with no data (a module built on meta): an input
            placeholders[spec.arg.name] = Placeholder("state", spec.target)
        elif spec.kind is InputKind.CONSTANT_TENSOR or (spec.kind is InputKind.BUFFER
                                                        and not value.dtype.is_floating_point):
            placeholders[spec.arg.name] = Placeholder("constant", spec.target, table)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            name = first_name.setdefault(id(tables[spec.target]), spec.target)
            placeholders[spec.arg.name] = Placeholder("state", name)
        else:
            placeholders[spec.arg.name] = Placeholder("user", spec.arg.name)
    for node in program.graph.nodes:  # non-tensor arguments (use_cache=False): export specialised on them
        if node.op == "placeholder":
            placeholders.setdefault(node.name, Placeholder("none"))
    by_name = {n.name: n for n in program.graph.nodes}
    user = [s.arg.name for s in program.graph_signature.output_specs if s.kind is OutputKind.USER_OUTPUT]
    translation = translate(program.graph, placeholders, [(f"out{i}", by_name[n]) for i, n in enumerate(user)], strict)
    mutated = set(program.graph_signature.buffers_to_mutate.values())  # a train-mode batch norm's running stats
    translation.graph.static.update(n for n in translation.state if n not in mutated)  # inference: weights fixed
    return translation


def _attribute(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.Tensor:
    """A get_attr node's tensor, held by the traced module: a constant (folded where ops read it)."""
    value: Any = graph.owning_module
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    if not isinstance(value, torch.Tensor):
        raise TorchImportError(f"get_attr {node.target!r}: the traced module holds no tensor there")
    return value


def _placeholder(graph: Graph, node: torch.fx.Node, role: Placeholder) -> Any:
    if role.kind == "none":
        return None
    if role.kind == "constant":
        return role.value
    value = node.meta["val"]
    return graph.input(role.name, tuple(int(s) for s in value.shape), dtypes.name_of(value.dtype))


def _is_const(value: Any) -> bool:
    """True when no graph value occurs in `value` (an op's resolved args): torch can compute it now."""
    if isinstance(value, (list, tuple)):
        return all(_is_const(v) for v in value)
    if isinstance(value, dict):
        return all(_is_const(v) for v in value.values())
    return not isinstance(value, (Value, _Lazy, Standin))


def _resolve(value: Any, env: dict[Any, Any]) -> Any:
    if isinstance(value, torch.fx.Node):
        return env[value]
    if isinstance(value, (list, tuple)):
        return type(value)(_resolve(v, env) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, env) for k, v in value.items()}
    return value


def _on(value: Any, device: str) -> Any:
    """An op's resolved args with every tensor and device argument on `device`, and graph values as empty meta
    tensors of their shape (ops that read only metadata): "meta" says a fold's shape, "cpu" computes it."""
    if isinstance(value, Value):
        return torch.empty(value.shape, dtype=dtypes.to_torch(value.dtype), device="meta")
    if isinstance(value, torch.Tensor):
        return value.to(device) if value.device.type != device else value
    if isinstance(value, torch.device):
        return torch.device(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_on(v, device) for v in value)
    if isinstance(value, dict):
        return {k: torch.device(device) if k == "device" and v is not None else _on(v, device)
                for k, v in value.items()}
    return value


def _cells(shape: Sequence[int]) -> int:
    cells = 1
    for s in shape:
        cells *= int(s)
    return cells


def _fold(builder: Builder, node: Any, name: str, args: Any, kwargs: Any,
          coverage: dict[str, collections.Counter]) -> Any:
    """A constant op's result: computed on the CPU when small; a tensor of one value (FILLS) from `Builder.filled`
    (never from the data of a tensor it reads only the shape of); any other large result as its converter's
    kernels over the constants it reads (their folds were small). Only an op no converter takes, or one whose
    shape depends on data, is computed whole, as before."""
    try:
        shaped = node.target(*_on(args, "meta"), **_on(kwargs, "meta"))
    except Exception:  # a shape that depends on values (nonzero): computed below
        shaped = None
    tensor = isinstance(shaped, torch.Tensor)
    large = tensor and _cells(shaped.shape) > FOLD_CELLS
    if tensor and name in FILLS and (large or name in METADATA_ONLY):
        coverage[name]["filled" if large else "folded"] += 1
        if not large:
            return torch.full(shaped.shape, FILLS[name](args), dtype=shaped.dtype)
        builder.node = node
        return builder.filled(FILLS[name](args), tuple(shaped.shape), dtypes.name_of(shaped.dtype))
    if name in METADATA_ONLY:  # sym_size: a number
        coverage[name]["folded"] += 1
        return shaped
    if large and name in CONVERTERS:
        try:
            return _convert(builder, node, name, args, kwargs, coverage)
        except _Declined:
            pass
    coverage[name]["folded"] += 1
    return node.target(*_on(args, "cpu"), **_on(kwargs, "cpu"))


def _call(builder: Builder, node: Any, env: dict[Any, Any], strict: bool,
          coverage: dict[str, collections.Counter]) -> Any:
    """What `node` becomes. An in-place op (`add_`) is converted as its functional twin, and its first argument
    is rebound to the result, so later readers of the mutated tensor read the new value (a traced training
    step is functionalized only where it writes into a view, training/capture.py; an exported forward is). Rebinding
    is right for a tensor without views only: a write into a view would leave its base as it was."""
    functional = functional_twin(node.target)
    if functional is not None:
        result = _call(builder, _retarget(node, functional), env, strict, coverage)
        if isinstance(node.args[0], torch.fx.Node):
            env[node.args[0]] = result
        return result
    name = op_name(node.target)
    args, kwargs = by_schema(node.target, _resolve(node.args, env), _resolve(node.kwargs, env))
    if name in READS_MEMORY:
        args = (_in_memory_order(builder, node, name, args), *args[1:])
    if name.startswith("aten._assert"):
        check_assertion(node, name, args, kwargs, _where(node))  # raises unless it holds
        coverage[name]["dropped"] += 1
        return None
    if name != "getitem" and (_is_const((args, kwargs)) or name in METADATA_ONLY):
        return _fold(builder, node, name, args, kwargs, coverage)
    if name == "getitem":
        container, index = args
        item = container[index]
        if isinstance(item, _Lazy):
            item = item.emit(builder, coverage)
        return item
    if name in PASS_THROUGH:
        coverage[name]["dropped"] += 1
        return args[0]
    shaped = node.meta.get("val")
    if isinstance(shaped, torch.Tensor) and shaped.numel() == 0:  # Phi-3's rotary pass-through `q[..., d:]`
        coverage[name]["folded"] += 1  # no elements, so nothing it reads matters: a constant (`cat` drops it)
        return torch.empty(shaped.shape, dtype=shaped.dtype)
    if name in CONVERTERS:
        try:
            return _convert(builder, node, name, args, kwargs, coverage)
        except _Declined as why:
            if strict:
                raise TorchImportError(f"{name} at {_where(node)}: not supported ({why})") from None
            builder.declined[name][str(why)] += 1
    elif strict:
        raise TorchImportError(f"{name} at {_where(node)}: no Tapestry kernel (strict=True)")
    return _opaque(builder, node, name, args, kwargs, coverage)


def _in_memory_order(builder: Builder, node: Any, name: str, args: Sequence[Any]) -> Any:
    """as_strided's input as torch laid it out in memory when traced. Its sizes and strides index that memory, but
    an opaque op or a fold gets its input row-major: a transposed view (Longformer's chunked query, whose
    `as_strided` overlaps the chunks) would be read in the wrong order. A layout that is a permutation of
    row-major is permuted into memory order first; any other (an offset, gaps, overlap, or reads past the tensor's
    own elements) has no value-level meaning, and raises."""
    x, size, stride, offset = (*args, None)[:4]
    traced = node.args[0].meta["val"]
    order = tuple(sorted(range(traced.ndim), key=lambda d: -traced.stride(d)))
    last = (offset or 0) + sum((n - 1) * step for n, step in zip(size, stride) if n > 0)
    if traced.storage_offset() != 0 or not traced.permute(order).is_contiguous() or last >= traced.numel():
        raise TorchImportError(
            f"{name} at {_where(node)}: reads memory of a tensor traced with strides {list(traced.stride())} and "
            f"offset {traced.storage_offset()} (size {list(size)}, stride {list(stride)}, offset {offset or 0}): "
            "only a permutation of a dense row-major tensor, read within its own elements, has the same values "
            "in a graph of values")
    if order == tuple(range(traced.ndim)):
        return x
    if isinstance(x, torch.Tensor):
        return x.permute(order).contiguous()
    return builder.op("transpose", builder.tensor(x), perm=order)


class _Declined(Exception):
    """A converter did not take the node (the reason is the message)."""


def _convert(builder: Builder, node: Any, name: str, args: Any, kwargs: Any,
             coverage: dict[str, collections.Counter]) -> Any:
    """The node through its converter; _Declined (the graph rolled back) if the converter does not take it."""
    builder.node = node
    size = len(builder.graph)
    try:
        result = CONVERTERS[name](builder, *args, **kwargs)
        if isinstance(result, Value):
            result = _match_torch(builder, result)
        elif isinstance(result, tuple):
            _refuse_unmade_outputs(node, result)
    except Exception as why:  # a form the kernels do not take (or a converter's slip): roll back
        builder.graph.truncate(size)
        raise _Declined(str(why)) from None
    made = {n.op for n in builder.graph.added_after(size) if not n.is_input} or {"view of its input"}
    coverage[name][", ".join(sorted(made))] += 1
    return result


def _refuse_unmade_outputs(node: Any, result: tuple[Any, ...]) -> None:
    """A converter gives None for the outputs its kernels do not make (max pooling's indices, embedding_bag's
    offset2bag): where a later op reads one (a training step's backward), the converter does not take the node."""
    read = {use.args[1] for use in getattr(node, "users", ()) if use.target is operator.getitem}
    unmade = sorted(i for i in read if isinstance(i, int) and result[i] is None)
    if unmade:
        raise Unsupported(f"output(s) {unmade} are read, and its kernels do not make them")


def by_schema(target: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An ATen op's arguments as its schema takes them: the positional ones in order (one passed by name moves
    into place, defaults fill the gaps before it), the keyword-only ones by their schema names. Converters and
    opaque ops then read `cumsum(x, 1, dtype=...)` the same however the call was written."""
    if not isinstance(target, torch._ops.OpOverload):
        return tuple(args), dict(kwargs)
    schema = target._schema
    positional, keywords = _schema_arguments(target)
    if len(args) > len(positional):
        raise TorchImportError(f"{schema.name}: {len(args)} positional arguments, the schema takes {len(positional)}")
    rest, out = dict(kwargs), list(args)
    named = positional[len(args):]
    last = max((i for i, a in enumerate(named) if a.name in rest), default=-1)
    for a in named[: last + 1]:
        if a.name in rest:
            out.append(rest.pop(a.name))
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise TorchImportError(f"{schema.name}: argument {a.name!r} is missing")
    unknown = set(rest) - keywords
    if unknown:
        raise TorchImportError(f"{schema.name}: unknown keyword argument(s) {sorted(unknown)} (schema: {schema})")
    return tuple(out), rest


@functools.cache
def _schema_arguments(target: torch._ops.OpOverload) -> tuple[tuple[Any, ...], frozenset[str]]:
    """An op's positional arguments and keyword-only names, read from its schema once per op, not per node."""
    arguments = target._schema.arguments
    return tuple(a for a in arguments if not a.kwarg_only), frozenset(a.name for a in arguments if a.kwarg_only)


@functools.cache
def functional_twin(target: Any) -> Any:
    """aten.add_.Scalar -> aten.add.Scalar; None for ops that mutate nothing."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return None
    packet = target._schema.name.split("::")[1]
    if not packet.endswith("_"):
        return None
    twin = getattr(torch.ops.aten, packet[:-1], None)
    return getattr(twin, target._overloadname, None) if twin is not None else None


@dataclass(frozen=True)
class _Retargeted:
    """`node` as if it called another op: what converters read of an fx node."""

    target: Any
    args: Any
    kwargs: Any
    meta: Any
    name: str


def _retarget(node: Any, target: Any) -> _Retargeted:
    return _Retargeted(target, node.args, node.kwargs, node.meta, node.name)


def _match_torch(builder: Builder, value: Value) -> Value:
    """Check a converted node against torch's own shape and dtype; cast where promotion rules differ."""
    if value.shape != builder.shape:
        raise Unsupported(f"the kernels give shape {list(value.shape)}, torch {list(builder.shape)}")
    if value.dtype != builder.dtype:
        return builder.op("cast", value, dtype=builder.dtype)
    return value


@dataclass
class _Lazy:
    """One output of a multi-output opaque op, emitted when a getitem reads it."""

    node: Any
    name: str
    args: Any
    kwargs: Any
    output: int

    def emit(self, builder: Builder, coverage: dict[str, collections.Counter]) -> Value:
        value = self.node.meta["val"][self.output]
        return _emit_opaque(builder, self.node, self.name, self.args, self.kwargs, self.output, value, coverage)


def _opaque(builder: Builder, node: Any, name: str, args: Any, kwargs: Any,
            coverage: dict[str, collections.Counter]) -> Any:
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        # an output the trace left out (None: convolution_backward's input gradient when the input needs none)
        return [None if part is None else _Lazy(node, name, args, kwargs, i) for i, part in enumerate(value)]
    if not isinstance(value, torch.Tensor):
        raise TorchImportError(f"{name} at {_where(node)}: returns {type(value).__name__}, not a tensor")
    return _emit_opaque(builder, node, name, args, kwargs, 0, value, coverage)


def _emit_opaque(builder: Builder, node: Any, name: str, args: Any, kwargs: Any, output: int, value: Any,
                 coverage: dict[str, collections.Counter]) -> Value:
    tensors: list[Any] = []
    text = encode_args(args, kwargs, tensors)
    if len(tensors) > MAX_ARITY:
        raise TorchImportError(f"{name} at {_where(node)}: {len(tensors)} tensor arguments (opaque ops take "
                               f"at most {MAX_ARITY})")
    try:
        dtype = dtypes.name_of(value.dtype)
    except dtypes.DtypeError as err:  # complex (FNet's FFT): no kernel, no opaque op, no plan can carry it
        raise TorchImportError(f"{name} at {_where(node)}: not supported: {err}") from None
    operands = [builder.tensor(t) for t in tensors]
    coverage[name]["opaque"] += 1
    try:
        return builder.op(opaque_name(len(operands)), *operands, aten=name, args=text, output=output,
                          shape=tuple(int(s) for s in value.shape), dtype=dtype)
    except GraphError as err:
        raise TorchImportError(f"{name} at {_where(node)}: {err}") from None
