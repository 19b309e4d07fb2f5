"""A pipeline stage's layers run under its stage plan: the plan's layouts as DTensor placements on the stage's devices.

`plan_pipeline` plans one layer's training step (`pipeline.layer_step`: the layer behind an input gate, its loss
the output's product with an incoming gradient) on the sub-mesh a stage gets, and every stage runs that plan for
each of its layers. Under torch's pipeline schedules a stage's forward and its backward are separate calls per
micro-batch and the update one more per step, so the plan's rank programs (one program for the whole step) are
not what runs; its layouts are, mapped onto `torch.distributed.tensor` placements on the stage's DeviceMesh
(`spmd.state.placements`: a block per device that is a Shard/Replicate cut of the tensor):

- each weight of each layer is a DTensor laid out as the plan places that weight (`layer.<path>` in the plan's
  graph); torch.optim keeps its state beside it in the same placements. Where the plan's first reader of the
  weight (its forward) takes it in another layout (ZeRO-3: stored split, gathered whole for the compute), the
  forward reads it redistributed so, and the backward reduces its gradient back to the stored layout;
- each layer takes its input in the layout the plan places the layer's input in (the step's first argument) and
  hands its output on in that layout (the next layer's input); between two layers of one chunk it stays a
  DTensor, and a chunk's ends take and give whole tensors, which torch's schedules send point to point between
  the ranks of one index on neighbouring stages' meshes;
- the ops between run on DTensors: torch's sharding propagation chooses their layouts and collectives from the
  weights' and the input's, not the plan's per-op choice; each linear's and norm's input is laid out to meet its
  weight as the plan reads it (`_meeting_weights`). For a tensor-parallel plan the two coincide: column- then
  row-parallel linears, one all-reduce after each row-parallel one;
- gradients leave the backward in the placement DTensor's propagation gives them (a replicated weight read by
  batch-split activations: partial sums) and are reduced to the weight's own placement before the update
  (`settle_gradients`).

Not followed: the plan's layouts of the optimizer state (it follows the weight's) and of values inside the layer
but the above. On the CPU attention runs as its math decomposition (`_attention_dtensor_runs`). Layouts with no
DTensor form (uneven blocks, partial sums, devices left out) are refused, naming the tensor.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_map

from tapestry.plan import Compute, Place, Plan, Reshard
from tapestry.sharding import Layout, Mesh
from tapestry.spmd.state import placements
from tapestry.training import LR
from tapestry.zspace import ZRange

LAYER = "layer."  # the prefix of the layer's weights in a `pipeline.layer_step` graph


@dataclass(frozen=True)
class LayerPlacements:
    """Where a stage plan puts one layer: each weight's placements between steps (`weights`, by its path in the
    layer) and as the forward reads it (`computed`: where they differ, gathered or re-cut for each use, as
    ZeRO-3 gathers), and the layer's input's (its output's too: the next layer's input)."""

    weights: Mapping[str, tuple[Placement, ...]]
    computed: Mapping[str, tuple[Placement, ...]]
    activation: tuple[Placement, ...]


def layer_placements(plan: Plan, layer: nn.Module) -> LayerPlacements:
    """The placements of `plan` (a `layer_step` plan on a stage's mesh) for `layer`'s weights and input; an error
    naming the tensor where the plan has no weight of that name and shape, or lays it out in no DTensor form."""
    placed = {s.input: s for s in plan.steps if isinstance(s, Place)}
    weights: dict[str, tuple[Placement, ...]] = {}
    computed: dict[str, tuple[Placement, ...]] = {}
    for path, weight in layer.named_parameters():
        step = placed.get(LAYER + path)
        if step is None:
            raise ValueError(f"the stage plan has no weight '{LAYER}{path}' (the layer's {path}, shape "
                             f"{list(weight.shape)}): it was planned for another layer")
        if tuple(step.shape) != tuple(weight.shape):
            raise ValueError(f"the stage plan's '{LAYER}{path}' has shape {list(step.shape)}; the layer's {path} "
                             f"has {list(weight.shape)}: it was planned for another layer")
        weights[path] = _placements(step.shape, step.layout, plan.mesh, f"weight '{LAYER}{path}'")
        computed[path] = _placements(step.shape, first_read(plan, step.out), plan.mesh,
                                     f"weight '{LAYER}{path}' (as its first reader takes it)")
    graph = plan.graph
    arguments = [n.name for n in graph.inputs if n.name in placed and n.name not in graph.carried.values()
                 and n.name not in graph.static and n.name not in graph.constants and n.name != LR and n.shape]
    if not arguments:
        raise ValueError("the stage plan places no argument of the layer step (its input activation)")
    first = placed[arguments[0]]
    return LayerPlacements(weights, computed, _placements(first.shape, first.layout, plan.mesh,
                                                          f"the layer's input '{arguments[0]}'"))


def first_read(plan: Plan, value: str) -> Layout:
    """The layout the plan's first step reading `value` takes it in (a move's destination, or a kernel's
    argument layout), through transposes (a linear's weight is transposed before its matmul reads it): for a
    weight, the forward's. The value's own where nothing reads it."""
    dims = list(range(len(plan.by_id[value].shape)))  # the value's dim of each dim of `current`
    current = value
    while True:
        step = next((s for s in plan.steps if isinstance(s, Reshard) and s.src == current
                     or isinstance(s, Compute) and current in s.args), None)
        if step is None:
            return plan.layout_of(value)
        if isinstance(step, Compute) and step.kernel == "transpose" and len(step.args) == 1:
            perm = dict(step.params).get("perm") or tuple(reversed(range(len(dims))))
            dims, current = [dims[p] for p in perm], step.out
            continue
        read = step.layout if isinstance(step, Reshard) else step.arg_layouts[step.args.index(current)]
        return Layout(tuple(None if b is None else _in_dims(b, dims) for b in read.blocks), read.partial)


def _in_dims(block: ZRange, dims: list[int]) -> ZRange:
    """`block` of a transposed value as a block of the value itself (`dims`: the value's dim of each of its)."""
    start, end = [0] * len(dims), [0] * len(dims)
    for mine, theirs in enumerate(dims):
        start[theirs], end[theirs] = block.start[mine], block.end[mine]
    return ZRange(start, end)


def _placements(shape: tuple[int, ...], layout: Layout, mesh: Mesh, what: str) -> tuple[Placement, ...]:
    found = None if layout.partial else placements(shape, layout.blocks, mesh)
    if found is None:
        raise ValueError(f"the stage plan lays {what} out as {list(layout.blocks)}"
                         f"{' (partial sums)' if layout.partial else ''} on {mesh}: a layout with no DTensor "
                         f"form (each mesh axis replicating it or cutting one dim in even pieces) does not run in a "
                         f"pipeline stage yet")
    return found


def shard_layer(layer: nn.Module, original: nn.Module, placed: LayerPlacements, mesh: DeviceMesh,
                hands_on_dtensor: bool) -> None:
    """Make `layer` (a stage's copy of `original`, traced: the same weights on every rank of `mesh`) run as
    `placed` says: its weights become DTensors on `mesh` (each rank keeps its block), each linear and norm reads
    its input laid out to meet its weight (`_meeting_weights`), and its forward takes its input (a whole tensor,
    or a DTensor from the layer before) in the plan's input layout and returns its output in it, as a DTensor
    for a next layer (`hands_on_dtensor`) or whole. Other tensor arguments are replicated."""
    for path, param in list(layer.named_parameters()):
        owner, _, name = path.rpartition(".")
        module = layer.get_submodule(owner) if owner else layer
        shard = distribute_tensor(param.detach(), mesh, placed.weights[path], src_data_rank=None)
        setattr(module, name, nn.Parameter(shard, requires_grad=param.requires_grad))
    _meeting_weights(layer, original, placed.computed, mesh)
    forward = layer.forward
    replicated = (Replicate(),) * mesh.ndim

    def laid_out(value: Any, wanted: tuple[Placement, ...]) -> Any:
        if isinstance(value, DTensor):
            return value.redistribute(mesh, wanted)
        if isinstance(value, torch.Tensor):
            return DTensor.from_local(value, mesh, replicated, run_check=False).redistribute(mesh, wanted)
        return value

    def sharded(x: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(lambda a: laid_out(a, replicated), (args, kwargs))  # rotary tables, say
        with _attention_dtensor_runs(mesh), _weights_as_computed(layer, placed.computed, mesh):
            out = forward(laid_out(x, placed.activation), *args, **kwargs)
        if not isinstance(out, DTensor):
            raise TypeError(f"a layer run under a stage plan returns one tensor; {type(layer).__name__} returned "
                            f"{type(out).__name__}")
        out = out.redistribute(mesh, placed.activation)
        return out if hands_on_dtensor else out.full_tensor()

    layer.forward = sharded


def _meeting_weights(layer: nn.Module, original: nn.Module, computed: Mapping[str, tuple[Placement, ...]],
                     mesh: DeviceMesh) -> None:
    """Before each linear and norm of `layer` (by `original`'s module types) its input is laid out to meet its
    weight as the plan reads it: the input dims the weight's dims meet (a linear's last, contracted with the
    weight's dim 1; a norm's normalized dims) cut where the weight's dim is cut and whole where it is not; the
    other dims (the batch's, the sequence's) stay as they are. DTensor's propagation would otherwise meet a
    replicated norm weight with a hidden-split input by a split reduction it cannot finish in place (torch
    2.13: "in-place operations that require placement changes are not supported")."""
    for path, kind in original.named_modules():
        if isinstance(kind, nn.Linear):
            meets = {1: -1}
        elif isinstance(kind, nn.RMSNorm | nn.LayerNorm) and kind.weight is not None:
            meets = {d: d - kind.weight.ndim for d in range(kind.weight.ndim)}
        else:
            continue
        try:
            traced = layer.get_submodule(path)
        except AttributeError:  # the forward never calls it: the trace left it out
            continue
        wanted = computed.get(f"{path}.weight" if path else "weight")
        if wanted is None:  # a weight tied to one met before: laid out under that name, left to DTensor here
            continue
        traced.register_forward_pre_hook(
            lambda _, args, meets=meets, wanted=wanted: (_meet(args[0], meets, wanted, mesh), *args[1:]))


def _meet(x: Any, meets: Mapping[int, int], weight: tuple[Placement, ...], mesh: DeviceMesh) -> Any:
    if not isinstance(x, DTensor):
        return x
    met = {d % x.ndim for d in meets.values()}
    wanted = list(x.placements)
    for axis, (mine, theirs) in enumerate(zip(x.placements, weight)):
        if isinstance(theirs, Shard) and theirs.dim in meets:
            wanted[axis] = Shard(meets[theirs.dim] % x.ndim)
        elif isinstance(mine, Shard) and mine.dim % x.ndim in met:
            wanted[axis] = Replicate()
    return x if wanted == list(x.placements) else x.redistribute(mesh, wanted)


@contextlib.contextmanager
def _weights_as_computed(layer: nn.Module, computed: Mapping[str, tuple[Placement, ...]], mesh: DeviceMesh
                         ) -> Iterator[None]:
    """While the layer's forward runs, each weight the plan reads in another layout than it keeps it in is that
    redistribution of it (an all-gather, say: its backward reduce-scatters the gradient back), swapped in where
    the module reads the weight and swapped out after (as FSDP's unshard and reshard do)."""
    swapped = []
    for path, wanted in computed.items():
        owner, _, name = path.rpartition(".")
        module = layer.get_submodule(owner) if owner else layer
        kept = module._parameters[name]
        if isinstance(kept, DTensor) and tuple(kept.placements) != wanted:
            module._parameters[name] = kept.redistribute(mesh, wanted)  # type: ignore[assignment]
            swapped.append((module, name, kept))
    try:
        yield
    finally:
        for module, name, kept in swapped:
            module._parameters[name] = kept


def _attention_dtensor_runs(mesh: DeviceMesh) -> contextlib.AbstractContextManager[None]:
    """On the CPU, attention as its math decomposition (matmuls, softmax; its causal mask a whole tensor, taken
    as replicated): DTensor has no sharding strategy for torch's CPU flash kernel
    (`_scaled_dot_product_flash_attention_for_cpu`); on a GPU its flash and efficient kernels have one."""
    if mesh.device_type != "cpu":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
    stack.enter_context(implicit_replication())
    return stack


def layers_feeding_layers(chunk: fx.GraphModule, layers: Iterable[str]) -> set[str]:
    """Of the layers (module paths) called in `chunk`'s graph, those whose output only other layers of it read."""
    paths = set(layers)
    return {node.target for node in chunk.graph.nodes if node.op == "call_module" and node.target in paths
            and node.users and all(u.op == "call_module" and u.target in paths for u in node.users)}


def settle_gradients(parameters: Iterable[nn.Parameter]) -> None:
    """Each DTensor weight's gradient in the weight's own placements (partial sums reduced, as the plan's
    gradient reductions are): what the optimizer, clipping and a checkpoint expect."""
    for p in parameters:
        if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A weight (or its state) whole: gathered from its stage's ranks where it is a DTensor. Collective there."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def squared_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of every gradient, whole (a DTensor's summed over its stage's ranks)."""
    parts = [whole(g.pow(2).sum()) for g in grads]
    return torch.stack(parts).sum() if parts else torch.zeros(())


def like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (a whole tensor or a DTensor) laid out as `param` is: the block this rank holds."""
    if not isinstance(param, DTensor):
        return whole(value)
    if isinstance(value, DTensor):
        return value.redistribute(param.device_mesh, param.placements)
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)


__all__ = ["LayerPlacements", "layer_placements", "layers_feeding_layers", "like", "settle_gradients",
           "shard_layer", "squared_norm", "whole"]
