"""One layer's training step as a pipeline stage runs it, and what its plan costs (`LayerCost`).

A stage runs, per micro-batch, its layers' forward and their backward down to the gradient of its input (the
stage before needs it), and once per step the optimizer update. `layer_step` imports exactly that for one
layer; `layer_cost` reads a plan of it step by step: forward (what the loss needs), update (what reads the
optimizer state or the learning rate), the weight gradients' reductions (run once per step on the accumulated
gradients) and the rest, the backward.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tapestry import dtypes
from tapestry.cost import CostModel, peak_memory, resident_bytes
from tapestry.cost.breakdown import phase_times
from tapestry.cost.memory import layout_bytes
from tapestry.cost.overlap import forward_outputs, upstream
from tapestry.graph import Graph
from tapestry.importer.report import model_flops
from tapestry.pipeline.boundary import boundary_inputs
from tapestry.pipeline.model import LayerCost
from tapestry.plan import Compute, Place, Plan
from tapestry.training import LR

OPTIMIZER_STATE = ("adam.", "sgd.")  # prefixes of optimizer-state inputs (tapestry.training.state_name)


def layer_step(layer: Any, example: Any, optimizer: str = "adam", lr: float = 1e-4) -> Graph:
    """The training step of one `layer` (a torch module mapping a tensor to one of the same shape, as a
    transformer block does) on input `example` (one micro-batch; the meta device is fine), with its input's
    gradient computed: the layer reads its input through a trainable gate of ones (one elementwise product
    and one reduction more than the layer), and the loss is the output's dot product with an incoming
    gradient, so the backward is the stage's backward given dL/d(output)."""
    import torch

    import tapestry

    def loss(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return (module(x) * grad).sum()

    grad = torch.zeros_like(example)  # its own tensor: the capture makes one input of a tensor passed twice
    training = tapestry.Training(loss=loss, optimizer=optimizer, lr=lr)
    return tapestry.from_torch(_gated("layer", layer, example), (example, grad), training=training, verbose=False).graph


def first_step(first: Any, example: Any, optimizer: str = "adam", lr: float = 1e-4) -> Graph:
    """The training step of what a model runs before its first layer (`first`, e.g. its token embedding) on one
    micro-batch `example` (token ids), given the gradient of its output: the loss is the output's dot product with
    an incoming gradient, as in `layer_step`. Its input has no gradient (ids), so it has no gate."""
    import torch

    import tapestry

    with torch.no_grad():
        out = first(example)

    def loss(module: torch.nn.Module, ids: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return (module(ids) * grad).sum()

    grad = torch.zeros(out.shape, dtype=out.dtype, device=out.device)
    training = tapestry.Training(loss=loss, optimizer=optimizer, lr=lr)
    return tapestry.from_torch(first, (example, grad), training=training, verbose=False).graph


def last_step(last: Any, example: Any, target: Any, loss_fn: Any, optimizer: str = "adam",
              lr: float = 1e-4) -> Graph:
    """The training step of what a model runs after its last layer (`last`: the final norm and the LM head) and
    the loss, `loss_fn(last(x), target)`, on one micro-batch `example` of the last layer's output, with its
    input's gradient computed (through a trainable gate of ones, as in `layer_step`): the stage's backward
    starts here."""
    import torch

    import tapestry

    def loss(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(module(x), y)

    training = tapestry.Training(loss=loss, optimizer=optimizer, lr=lr)
    return tapestry.from_torch(_gated("last", last, example), (example, target), training=training, verbose=False).graph


def _gated(name: str, inner: Any, example: Any) -> Any:
    """A module running `inner` (registered as `name`, which prefixes its weights' names) on its input times a
    trainable gate of ones (`input_gate`), so that a training step computes the input's gradient."""
    import torch

    class Gated(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.add_module(name, inner)
            self.input_gate = torch.nn.Parameter(torch.ones(example.shape[-1], dtype=example.dtype,
                                                            device=example.device))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return getattr(self, name)(x * self.input_gate)

    return Gated()


@dataclass(frozen=True)
class ModelSteps:
    """A model's pieces as `plan_pipeline` takes them: builders from a micro-batch size (sequences) to the
    training step of one of its `layers` repeated layers, of what runs before the first (`first`) and of what
    runs after the last with the loss (`last`)."""

    layer: Callable[[int], Graph]
    first: Callable[[int], Graph]
    last: Callable[[int], Graph]
    layers: int


def model_steps(module: Any, example_batch: Sequence[Any], loss_fn: Callable[..., Any], layers: str = "layers",
                optimizer: str = "adam", lr: float = 1e-4) -> ModelSteps:
    """Cut `module` where a pipelined step cuts it (torch.distributed.pipelining's tracer, before its first
    layer and after its last; `layers` names its ModuleList) into the steps `plan_pipeline` prices:

        steps = pipeline.model_steps(model, (ids, labels), loss_fn)
        tapestry.plan_pipeline(steps.layer, steps.layers, mesh, global_batch, cost_model,
                               micro_batch_sizes=(1, 2), first=steps.first, last=steps.last)

    The layers must be alike (the first is imported for all). `example_batch` is (input, target) of any batch
    size; each step is imported on zeros of the micro-batch's size, once per size. The module is copied first
    (cheap under the meta device), so it can still be pipelined."""
    import copy

    import torch
    from torch.distributed import pipelining

    stack = module.get_submodule(layers)
    if not isinstance(stack, torch.nn.ModuleList) or not len(stack):
        raise ValueError(f"model_steps: {type(module).__name__}.{layers} is not a ModuleList of layers")
    inputs, target = example_batch

    def sized(t: Any, b: int) -> Any:
        return torch.zeros((b, *t.shape[1:]), dtype=t.dtype, device=t.device)

    cuts = {f"{layers}.0": pipelining.SplitPoint.BEGINNING, f"{layers}.{len(stack) - 1}": pipelining.SplitPoint.END}
    # torch's tracer leaves the module it cuts unfit to be traced again (as the pipelined step will): cut a copy
    pipe = pipelining.pipeline(copy.deepcopy(module), mb_args=(inputs[:1],), split_spec=cuts)
    if pipe.num_stages != 3:
        raise ValueError(f"model_steps: cutting {type(module).__name__} before {layers}.0 and after its last layer "
                         f"gave {pipe.num_stages} pieces, not 3 (nothing runs before or after the layers?)")
    before, after = pipe.get_stage_module(0), pipe.get_stage_module(2)

    def activations(b: int) -> Any:
        with torch.no_grad():
            return torch.zeros_like(before(sized(inputs, b)))

    def cached(build: Callable[[int], Graph]) -> Callable[[int], Graph]:
        made: dict[int, Graph] = {}
        return lambda b: made[b] if b in made else made.setdefault(b, build(b))

    return ModelSteps(
        layer=cached(lambda b: layer_step(stack[0], activations(b), optimizer, lr)),
        first=cached(lambda b: first_step(before, sized(inputs, b), optimizer, lr)),
        last=cached(lambda b: last_step(after, activations(b), sized(target, b), loss_fn, optimizer, lr)),
        layers=len(stack))


def _most(per_device: Iterable[int]) -> int:
    return max(per_device, default=0)


def layer_cost(plan: Plan, model: CostModel) -> LayerCost:
    """What one micro-batch and one step of the layer cost on the plan's mesh, per device (module docstring).
    The weight gradients' reductions are paid once per step, hidden behind one micro-batch's backward compute
    as far as it lasts (cost.overlap's credit, applied to the last micro-batch)."""
    graph = plan.graph
    if not graph.carried:
        raise ValueError("layer_cost prices a training step (a graph with carried weights); this one has none: "
                         "import it with training=tapestry.Training(...) (pipeline.layer_step does)")
    by_id = plan.by_id

    def args(value: str) -> tuple[str, ...]:
        step = by_id[value]
        return step.args if isinstance(step, Compute) else () if isinstance(step, Place) else (step.src,)

    forward = upstream(forward_outputs(plan.outputs, graph.carried), args)
    places = {s.input: s for s in plan.steps if isinstance(s, Place)}
    readers: dict[str, list[str]] = {}
    for step in plan.steps:
        for a in args(step.out):
            readers.setdefault(a, []).append(step.out)
    per_run = [s for s in plan.steps if not isinstance(s, Place) and s.out not in plan.prepared]
    times = phase_times(plan, model, (LR,))
    carried_inputs = set(graph.carried.values())
    weights = [s for name, s in places.items() if name in carried_inputs and not name.startswith(OPTIMIZER_STATE)]
    state = [s for name, s in places.items() if name.startswith(OPTIMIZER_STATE) and name in carried_inputs
             and s.shape]  # the step count is a scalar
    elements = [sum(b.size for b in (s.layout.blocks[d] for s in group) if b is not None)
                for group in (weights, state) for d in range(plan.mesh.size)]
    params_per_device = _most(elements[:plan.mesh.size])
    state_per_device = _most(elements[plan.mesh.size:])
    arguments = [places[name] for name in boundary_inputs(graph) if name in places]
    inputs = arguments[:1]  # x; the step's other argument is the incoming gradient, which arrives in the backward
    made = [s for s in per_run if s.out in forward] + inputs  # placed weights are resident, not activations
    kept = [s for s in made if any(r not in forward for r in readers.get(s.out, ()))]
    activations = _most(map(sum, zip(*(layout_bytes(s.layout, plan.dtypes[s.out]) for s in kept)))) if kept else 0
    boundary = _most(map(sum, zip(*(layout_bytes(s.layout, plan.dtypes[s.out]) for s in inputs)))) if inputs else 0
    working = max(0, max(peak_memory(plan)) - max(resident_bytes(plan)) - activations)
    itemsize = dtypes.itemsize(plan.dtypes[weights[0].out]) if weights else 4
    return LayerCost(
        forward=times.forward, backward=times.backward, update=times.update,
        params=params_per_device, state=state_per_device,
        slots=len(state) // len(weights) if weights else 0,
        activations=activations, boundary=boundary, working=working,
        flops=model_flops(graph), itemsize=itemsize, reduce=times.reduce)
