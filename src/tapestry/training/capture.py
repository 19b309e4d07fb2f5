"""Trace one training step (forward, backward, update) into an ATen graph and translate it.

Every tensor the module holds enters the trace as an argument, never closed over: trainable parameters, the
optimizer state, the step count and learning rate, and the buffers (rotary `inv_freq`, masks) and frozen
parameters. As arguments they become graph inputs (floating point, `static`: the same every step) or constants
(integer buffers, folded). A real tensor the step reaches otherwise (a cached index) is held as a constant, unless it
is one of the module's own tensors or requires grad: refused, since it would be frozen with no gradient.
Tied parameters (an embedding shared with the output head) are one tensor: one input, read by both uses.
Random draws (dropout's masks) become inputs drawn afresh every call (training/draws.py). In-place ops stay in
the trace (translated as their functional twins); a step that writes into a view is retraced through torch's
functionalization first, so the write reaches the view's base (`_functionalized`).

A buffer the step writes in place (batch norm's running statistics and `num_batches_tracked` in training mode) is
training state like Adam's moments: an input, never static or folded, whose value after the step is the output
`new.<buffer>`, carried to it. Batch norm is decomposed into its reductions (mean and variance over the batch) and a
`copy_` into each running statistic, so a plan that splits the batch reduces the statistics over the whole global
batch (SyncBatchNorm's semantics, and a single-device torch run's).
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import torch
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel

from tapestry.importer.capture import TorchImportError, modules_stay_put
from tapestry.importer.rewrites import exact_rewrites
from tapestry.importer.translate import Placeholder, Translation, by_schema, functional_twin, translate
from tapestry.training import LR, Training, state_name, updated
from tapestry.training.draws import FACTORIES, FILLS, Draw, random_input


def _var_mean(x: torch.Tensor, dim: list[int] | None = None, *, correction: float | None = None,
              keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """aten.var_mean as two passes of sums (kernels a plan splits by batch; torch's own decomposition is prims)."""
    dims = list(range(x.dim())) if dim is None else [d % x.dim() for d in dim]
    count = 1
    for d in dims:
        count *= x.shape[d]
    mean = torch.mean(x, dims, keepdim=True)
    deviation = x - mean
    var = torch.sum(deviation * deviation, dims, keepdim=keepdim) / (count - (1 if correction is None else correction))
    return var, mean if keepdim else torch.squeeze(mean, dims)


# batch norm in training mode as its reductions (sums: kernels a plan splits by batch) and a `copy_` into each
# running statistic: native_batch_norm itself writes them as a side effect the import cannot carry. Attention's
# fused CPU kernel stays whole (kernels/flash.py), not decomposed into matmuls and a softmax.
FUSED_ATTENTION_OPS = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                       torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
DECOMPOSITIONS = {**{op: fn for op, fn in core_aten_decompositions().items() if op not in FUSED_ATTENTION_OPS},
                  **get_decompositions([torch.ops.aten.native_batch_norm]),
                  torch.ops.aten.var_mean.correction: _var_mean}


class _LossOf(torch.nn.Module):
    """`loss(module, *args)` as a module, so that functional_call swaps the traced parameters in."""

    def __init__(self, module: torch.nn.Module, loss: Any) -> None:
        super().__init__()
        self.module, self.loss = module, loss

    def forward(self, *args: Any) -> torch.Tensor:
        return self.loss(self.module, *args)


@dataclass(frozen=True)
class StepLayout:
    """The traced step's arguments in order, by graph input name: trainable parameters (one per distinct
    tensor, by the first path that reaches it), their optimizer state slot by slot, the step count, the
    learning rate, then the module's other tensors (buffers and frozen parameters) and the user's arguments."""

    paths: tuple[str, ...]
    training: Training
    held: tuple[str, ...]  # buffers and frozen parameters, by module path
    mutated: tuple[str, ...] = ()  # the held buffers the step writes in place, known once traced

    @classmethod
    def of(cls, module: torch.nn.Module, training: Training) -> StepLayout:
        trainable = tuple(name for name, p in module.named_parameters() if p.requires_grad)
        frozen = (name for name, p in module.named_parameters() if not p.requires_grad)
        return cls(trainable, training, (*frozen, *(name for name, _ in module.named_buffers())))

    @property
    def optimized(self) -> tuple[str, ...]:
        """The parameters, their optimizer state and the step count: the arguments before the learning rate."""
        family, step = self.training.family, self.training.step_input
        slots = (state_name(slot, p, family) for slot in self.training.slots for p in self.paths)
        return (*self.paths, *slots, *([step] if step else []))

    @property
    def state(self) -> tuple[str, ...]:
        """Inputs the step updates: each has an output `new.<name>` carried to it."""
        return (*self.optimized, *self.mutated)

    @property
    def nonnegative(self) -> tuple[str, ...]:
        """State never negative: Adam's second moments (mean squares) and the step count. Random check inputs
        must be so too: a negative moment makes `beta2 * v + (1 - beta2) * g**2` cancel to near zero, and the
        update divides by its root, so a gradient summed in another order moves the check's result by 1e-2."""
        family = self.training.family
        moments = (state_name(slot, p, family) for slot in ("v", "max_v") if slot in self.training.slots
                   for p in self.paths)
        return (*moments, *([self.training.step_input] if self.training.step_input else []))

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.optimized, LR, *self.held)

    def split(self, flat: tuple[torch.Tensor, ...]) -> Iterator[Any]:
        """The traced step's arguments as (params, state by slot, step, lr, held, user args)."""
        n = len(self.paths)
        yield list(flat[:n])
        at = n
        state = {}
        for slot in self.training.slots:
            state[slot], at = list(flat[at: at + n]), at + n
        yield state
        if self.training.step_input:
            yield flat[at]
            at += 1
        else:
            yield None
        yield flat[at]
        yield list(flat[at + 1: at + 1 + len(self.held)])
        yield flat[at + 1 + len(self.held):]


@contextmanager
def _grouped_mm_fallback_unless_bfloat16() -> Iterator[None]:
    """transformers' MoE experts call torch's `_grouped_mm`, whose fake kernel takes bfloat16 alone (a float32
    Mixtral's training step failed to trace: "Expected inputs of BF16 type"); for other dtypes transformers has
    its own grouped mm and backward (`transformers::grouped_mm_fallback`, the same sums expert by expert,
    imported as grouped_mm and grouped_mm_k), which it takes only under torch.compile: taken here too. Nothing
    changes where transformers' MoE module was never imported."""
    moe = sys.modules.get("transformers.integrations.moe")
    usable = getattr(moe, "_can_use_grouped_mm", None)
    if usable is None:
        yield
        return
    moe._can_use_grouped_mm = lambda x, weight, offs: weight.dtype == torch.bfloat16 and usable(x, weight, offs)
    try:
        yield
    finally:
        moe._can_use_grouped_mm = usable


@contextmanager
def _transformers_caches_bypassed() -> Iterator[None]:
    """transformers' `compile_compatible_method_lru_cache` (BEiT's relative position index, DETR's and SAM's
    position tables) bypasses its cache while torch.compile traces; here too. Otherwise a tensor cached by an
    earlier eager call reaches the trace, and a fake tensor made by the trace is cached, which the next eager
    call then returns (an eager BEiT's loss came back a FakeTensor after an import). Nothing changes where
    transformers was never imported."""
    utils = sys.modules.get("transformers.pytorch_utils")
    compiling = getattr(utils, "is_torchdynamo_compiling", None)
    if compiling is None:
        yield
        return
    utils.is_torchdynamo_compiling = lambda: True
    try:
        yield
    finally:
        utils.is_torchdynamo_compiling = compiling


@contextmanager
def _without_mkldnn() -> Iterator[None]:
    """mkldnn off while tracing (torch.backends.mkldnn.flags would warn about TF32 on every capture)."""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def capture(module: torch.nn.Module, args: tuple[Any, ...], training: Training, strict: bool) -> Translation:
    _refuse_cumulative_batch_norm(module)
    layout = StepLayout.of(module, training)
    wrapper = _LossOf(module, training.loss)

    def step(*flat: torch.Tensor) -> list[torch.Tensor]:
        params, state, count, lr, held, user = layout.split(flat)
        with torch.enable_grad():
            swapped = {f"module.{k}": t for k, t in [*zip(layout.paths, params), *zip(layout.held, held)]}
            loss = torch.func.functional_call(wrapper, swapped, tuple(user))
            if loss.dim() != 0:
                raise TorchImportError(f"the loss must be a scalar; it has shape {list(loss.shape)}")
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        unused = [p for p, g in zip(layout.paths, grads) if g is None]
        if unused:
            raise TorchImportError(f"parameter(s) {', '.join(unused)} do not reach the loss (no gradient); "
                                   f"set requires_grad=False on them to train the rest")
        new_params, new_state, new_count = training.update(params, list(grads), state, count, lr)
        return [loss, *new_params, *(t for slot in training.slots for t in new_state[slot]),
                *([new_count] if training.step_input else [])]

    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    params = [tensors[p].detach().clone().requires_grad_() for p in layout.paths]
    flat = [*params, *(torch.zeros_like(p) for _ in training.slots for p in params),
            *([torch.zeros((), dtype=torch.float32)] if training.step_input else []),
            torch.tensor(training.lr, dtype=torch.float64), *(tensors[h].detach() for h in layout.held), *args]
    try:
        # attention as torch's fused CPU kernel and its backward (kernels/flash.py), where torch can fuse it; the
        # math backend (matmuls and a softmax) where it cannot: dropout (its draws are cut out as inputs, below),
        # value features other than the query's. mkldnn off: torch's LSTM decomposition then steps cells of plain
        # ops (kernels), not mkldnn_rnn_layer, whose uint8 workspace output no graph value can hold
        with warnings.catch_warnings(), sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]), \
                _grouped_mm_fallback_unless_bfloat16(), _transformers_caches_bypassed(), modules_stay_put(), \
                exact_rewrites(import_modules=False), _without_mkldnn():
            warnings.simplefilter("ignore", FutureWarning)
            traced = make_fx(step, decomposition_table=DECOMPOSITIONS, tracing_mode="fake")(*_fakes(flat))
            _refuse_module_tensors_closed_over(traced, module)
            # the buffers it writes, read before functionalization makes a write into part of one whole (refused)
            layout = replace(layout, mutated=_updated_buffers(traced.graph, _held(traced.graph, layout), module))
            if _writes_through_aliases(traced.graph):
                traced = _functionalized(traced, flat)
    except TorchImportError:
        raise
    except Exception as err:  # tracing raises many types; the user needs the first line
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise TorchImportError(f"could not trace a training step of {type(module).__name__}: "
                               f"{type(err).__name__}: {first}") from None
    holders = [node for node in traced.graph.nodes if node.op == "placeholder"]
    held = _held(traced.graph, layout)
    roles = {h.name: _role(name, flat[i], user=i >= len(layout.names), mutated=name in layout.mutated)
             for i, (h, name) in enumerate(zip(holders, [*layout.names, *(f"arg{i}" for i in range(len(args)))]))}
    cut = _cut_random_draws(traced.graph, module)
    roles.update({holder: Placeholder("random", name) for name, (holder, _) in cut.items()})
    (returned,) = [node.args[0] for node in traced.graph.nodes if node.op == "output"]
    by_name = {name: h for h, name in held.items()}
    # a mutated buffer's placeholder resolves, once translated, to the last value written into it
    finals = [*returned[1:], *(by_name[name] for name in layout.mutated)]
    outputs = [("loss", returned[0]), *((updated(name), node) for name, node in zip(layout.state, finals))]
    translation = replace(translate(traced.graph, roles, outputs, strict),
                          draws={name: draw for name, (_, draw) in cut.items()})
    for name in layout.state:  # the step repeats: plans keep each weight and state tensor where it was placed
        translation.graph.carry(updated(name), name)
    translation.graph.static.update(name for name in layout.held
                                    if name in translation.graph and name not in layout.mutated)
    translation.graph.nonnegative.update(name for name in layout.nonnegative if name in translation.graph)
    return translation


def _held(graph: torch.fx.Graph, layout: StepLayout) -> dict[torch.fx.Node, str]:
    """The placeholders of the module's buffers and frozen parameters, with their paths."""
    holders = [node for node in graph.nodes if node.op == "placeholder"]
    return {h: name for h, name in zip(holders, layout.names) if name in layout.held}


def _writes_through_aliases(graph: torch.fx.Graph) -> bool:
    """Does an in-place op write into a view, or into a tensor that has views? The translation rebinds a mutated
    tensor to the op's result (translate's `_call`), which its aliases never see: Longformer's
    `scores[:, :-1, :, w:] = ...` into slices of a new tensor was lost, so the step read zeros there."""
    base = {node: _viewed(node) for node in graph.nodes}
    has_views = {b for node, b in base.items() if b is not node}
    return any(base[arg] is not arg or arg in has_views
               for node in graph.nodes for _, arg in _written(node) if isinstance(arg, torch.fx.Node))


def _written(node: torch.fx.Node) -> Iterator[tuple[int, Any]]:
    """(position, argument) of each argument `node` writes into in place (none for a functional op)."""
    if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
        for position, (arg, spec) in enumerate(zip(node.args, node.target._schema.arguments)):
            if spec.alias_info is not None and spec.alias_info.is_write:
                yield position, arg


def _functionalized(traced: torch.fx.GraphModule, flat: list[Any]) -> torch.fx.GraphModule:
    """The traced step retraced through torch's functionalization: every write into a view becomes its scatter
    (`slice_scatter`, `select_scatter`, `index_put`) on the base, read by every alias after it; writes into the
    step's inputs (batch norm's running statistics) become one whole `copy_` each, at the end. The ops' source
    locations are kept for error messages."""
    def run(*args: Any) -> Any:
        return torch.fx.Interpreter(traced).run(*args)

    plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in flat]
    with torch.fx.traceback.preserve_node_meta():
        return make_fx(torch.func.functionalize(run), decomposition_table=DECOMPOSITIONS,
                       tracing_mode="fake")(*_fakes(plain))


def _fakes(flat: list[Any]) -> list[Any]:
    """The step's arguments as fake tensors to trace with, those on the meta device as fake CPU tensors: torch
    picks attention's fused kernel by device, so a module built on meta traces as its real twin does. Real
    tensors the step reaches outside its arguments (an index a `functools.lru_cache` kept from an eager call, as
    BEiT's was before `_transformers_caches_bypassed`) are allowed: the trace holds each as a constant, as
    torch.export lifts them; `_refuse_module_tensors_closed_over` refuses those that are the module's own."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.device.type != "meta":
            return mode.from_tensor(t)
        made = FakeTensor(mode, t.detach(), torch.device("cpu"))
        return made.requires_grad_() if t.requires_grad else made

    return [fake(t) for t in flat]


def _cut_random_draws(graph: torch.fx.Graph, module: torch.nn.Module) -> dict[str, tuple[str, Draw]]:
    """Each random op (dropout's mask in training mode) becomes a new placeholder, its draw recorded to be made
    afresh every call (training/draws.py): graph input name -> (placeholder, Draw), in the order the step draws.
    A random op whose draw cannot be repeated is refused, naming it and the module's dropouts: imported as it
    stands, its one traced draw would be folded into a constant that every step reuses."""
    cut: dict[str, tuple[str, Draw]] = {}
    first = next(node for node in graph.nodes if node.op != "placeholder")
    for node in list(graph.nodes):
        if not _draws(node):
            continue
        draw = Draw.of(node)
        if draw is None:
            _refuse(node, module)
        name = random_input(len(cut))
        with graph.inserting_before(first):
            holder = graph.placeholder(name.replace(".", "_"))
        holder.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(holder)
        graph.erase_node(node)
        cut[name] = (holder.name, draw)
    if cut:
        graph.eliminate_dead_code()  # the tensors the fills wrote into
    return cut


def _draws(node: torch.fx.Node) -> bool:
    """Does the op draw random numbers: a seeded op, except attention's fused kernels without dropout (tagged
    seeded for their dropout, which the capture never lets them run: see `capture`)."""
    if not (isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags):
        return False
    if node.target not in FUSED_ATTENTION_OPS:
        return True
    args, kwargs = by_schema(node.target, node.args, node.kwargs)
    named = {**dict(zip((a.name for a in node.target._schema.arguments), args)), **kwargs}
    return bool(named.get("dropout_p", 0.0))


def _refuse(drawn: torch.fx.Node, module: torch.nn.Module) -> NoReturn:
    dropouts = [name for name, m in module.named_modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)
                and m.training and m.p > 0]
    trace = (drawn.meta.get("stack_trace") or "").strip().splitlines()
    line = next((t.strip() for t in reversed(trace) if t.strip().startswith("File ")), "")
    raise TorchImportError(
        f"the training step of {type(module).__name__} draws random numbers with {drawn.target}"
        + (f" ({line})" if line else "") + ", which Tapestry cannot draw afresh each step (it repeats "
        f"{', '.join(sorted(FILLS | FACTORIES))}): traced once, the draw would be the same at every step. Draw "
        "otherwise, or set the dropout probabilities to 0 or put the dropout modules in eval mode"
        + (f" ({', '.join(dropouts[:4])}{', ...' if len(dropouts) > 4 else ''})" if dropouts else ""))


def _refuse_module_tensors_closed_over(traced: torch.fx.GraphModule, module: torch.nn.Module) -> None:
    """A real tensor the trace holds as a constant is one the step reached outside its arguments. A cached index
    is fine (the same every step), but one of the module's parameters or buffers reached that way (a module keeping
    another's weight as a plain attribute) would be frozen at its traced value, with no gradient: refused, naming
    it, as is any constant that requires grad."""
    storages = {t.untyped_storage().data_ptr(): name for name, t in
                [*module.named_parameters(), *module.named_buffers()]
                if t.device.type != "meta" and t.untyped_storage().data_ptr()}
    for node in traced.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(traced, str(node.target), None)
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
            continue
        held = storages.get(value.untyped_storage().data_ptr()) if value.device.type != "meta" else None
        if held is not None or value.requires_grad:
            what = (f"the module's tensor {held}" if held
                    else f"a tensor of shape {list(value.shape)} that requires grad")
            raise TorchImportError(
                f"the training step of {type(module).__name__} reads {what}"
                " outside its parameters and buffers (held as a plain attribute or closed over), so the traced step "
                "would freeze it at its current value with no gradient; register it as a parameter or buffer of the "
                "module that reads it")


def _refuse_cumulative_batch_norm(module: torch.nn.Module) -> None:
    """Batch norm with momentum=None keeps a cumulative average: its forward reads `num_batches_tracked` as a
    Python float, which a traced step cannot (every step would reuse the traced count). Refused, naming them."""
    cumulative = [name for name, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)
                  and m.training and m.track_running_stats and m.momentum is None]
    if cumulative:
        raise TorchImportError(
            f"batch norm with momentum=None ({', '.join(cumulative[:4])}{', ...' if len(cumulative) > 4 else ''}) "
            "averages its running statistics over all steps, reading num_batches_tracked as a Python number, "
            "which a traced step cannot; give it a momentum (0.1 is torch's default) or put it in eval mode")


def _updated_buffers(graph: torch.fx.Graph, held: dict[Any, str], module: torch.nn.Module) -> tuple[str, ...]:
    """The buffers the step writes in place, in the module's order. Each must be written whole, by an
    in-place op with a functional twin (`add_`, `copy_`: translated as the twin, the result rebound to the
    buffer); a write into a view of a buffer, or by an op the import cannot map, would be lost: refused."""
    buffers = {name for name, _ in module.named_buffers()}  # a frozen parameter written in place: refused
    written: dict[str, None] = {}
    refused: dict[str, str] = {}
    for node in graph.nodes:
        for position, arg in _written(node):
            base = _viewed(arg)
            if base not in held:
                continue
            if base is arg and held[base] in buffers and position == 0 and functional_twin(node.target):
                written[held[base]] = None
            else:
                refused.setdefault(held[base], str(node.target))
    norms = [f"{name}.{stat}" for name, m in module.named_modules()  # lost if batch norm ran undecomposed
             if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
             for stat in ("running_mean", "running_var") if f"{name}.{stat}" not in written]
    refused.update({name: "batch norm in training mode" for name in norms})
    if refused:
        listed = ", ".join(f"{name} by {op}" for name, op in list(refused.items())[:4])
        raise TorchImportError(
            f"the training step of {type(module).__name__} updates buffers in place in a way the import cannot "
            f"carry ({listed}{', ...' if len(refused) > 4 else ''}): only whole-buffer in-place ops (add_, copy_, "
            "mul_, ...) are carried to the next step. Write the buffer whole, or put those modules in eval mode")
    return tuple(name for name in held.values() if name in written)


def _viewed(node: Any) -> Any:
    """The tensor `node` is a view of (through view, alias, slice, ...), or `node` itself."""
    while (isinstance(node, torch.fx.Node) and isinstance(node.target, torch._ops.OpOverload) and node.args
           and node.target._schema.returns and node.target._schema.returns[0].alias_info is not None
           and not node.target._schema.returns[0].alias_info.is_write):
        node = node.args[0]
    return node


def _role(name: str, value: Any, user: bool, mutated: bool) -> Placeholder:
    """Module tensors are inputs ("state"; the learning rate too) except integer buffers the step only reads,
    which are constants (position ids, folded at import as in inference); the user's arguments are "user" inputs."""
    if user:
        return Placeholder("user", name)
    if not mutated and isinstance(value, torch.Tensor) and not (value.dtype.is_floating_point
                                                                or value.dtype.is_complex):
        return Placeholder("constant", name, value)
    return Placeholder("state", name)
