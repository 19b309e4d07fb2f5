"""A training step run as a pipeline over the ranks: `tapestry.parallelize_step(..., pipeline=...)`.

    plan = tapestry.plan_pipeline(...).plan                  # or pipeline.Schedule("1f1b", stages=4, micro_batches=8)
    step = tapestry.parallelize_step(model, loss_fn, (ids, labels), mesh=tapestry.Mesh(4), pipeline=plan)
    loss = step(ids, labels, lr=lr)                           # the mean micro-batch loss, on every rank

The module is cut before the layers where the plan's chunks begin (`layers` names its ModuleList of repeated
layers) by torch.distributed.pipelining's tracer (`pipeline` with `SplitPoint.BEGINNING`), so whatever the
module's forward runs before its first layer (the embedding) goes to the first chunk and whatever it runs after
its last (the final norm, the head) to the last chunk; a tensor made before the first layer and read by later
chunks (transformers' rotary tables and mask) is handed on by each chunk between (`neighbours_only`), since
torch's schedules send only between neighbours. Chunk c runs on rank c % S; torch's schedules
(`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`) run the micro-batches, sending activations and
gradients between ranks point to point, and the loss (`loss_fn(output, target)`, per micro-batch) on the last
chunk. Each rank's optimizer then updates its own chunks' parameters: a step equals one step of the module on
one device over the whole batch when `loss_fn` is a mean over the batch (torch's schedule averages the
micro-batches' gradients). The tracer leaves the module unfit to be traced again: a module makes one step.

Each stage's layers run eagerly. A bare schedule on a mesh of D times its stages runs D data-parallel replicas of
the pipeline: rank r is pipeline position r // D of replica r % D (the pipeline over the outer index, as
plan_pipeline lays stages over mesh axis 0), each replica takes its D-th of the batch, and each stage's replicas
average their gradients (one all-reduce per step among them) before the update.

A plan whose stages span several devices (`plan.stage_mesh`, e.g. 8 stages of 8 GPUs on 8x8) runs each stage on
its own devices under the plan's stage plan: rank r is pipeline position r // D on the stage's mesh at index
r % D (a DeviceMesh of shape (stages, *stage_mesh) over the ranks, row-major, so the stages are contiguous
blocks of mesh axis 0), and each layer's weights are DTensors on the stage's mesh in the stage plan's layouts,
its input and output in the plan's input layout (spmd/stage_plan.py says what follows the plan and what not).
Torch's schedules send whole activations between the ranks of one index on neighbouring stages. Refused, with
the missing piece named: stages over another axis than 0, a plan with no stage plan, a mesh other than the
plan's, layouts with no DTensor form. The layers a plan recomputes (`plan.recompute`) run under activation
checkpointing.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed import pipelining
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.checkpoint import checkpoint

from tapestry.pipeline.model import partition
from tapestry.pipeline.schedule import Schedule
from tapestry.plan import Plan
from tapestry.sharding import Mesh
from tapestry.spmd import faults
from tapestry.spmd.program import join_group
from tapestry.spmd.stage_plan import (
    LayerPlacements, layer_placements, layers_feeding_layers, like, settle_gradients, shard_layer, squared_norm,
    whole,
)

if TYPE_CHECKING:  # the planner imports the optimizer; a rank running a step needs neither
    from tapestry.pipeline.planner import PipelinePlan

SCHEDULE_CLASSES = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
                    "interleaved": pipelining.ScheduleInterleaved1F1B}


def chunk_layers(pipeline: PipelinePlan | Schedule, layers: int) -> tuple[tuple[int, ...], ...]:
    """The layer indices of each chunk: the plan's, or for a bare schedule an even split in order."""
    if isinstance(pipeline, Schedule):
        return partition([1.0] * layers, pipeline.stages * pipeline.chunks)
    chunks = pipeline.chunks
    if sum(map(len, chunks)) != layers:
        raise ValueError(f"the pipeline plan places {sum(map(len, chunks))} layers; the module has {layers}")
    return chunks


def _stage_plan(pipeline: PipelinePlan, mesh: Mesh) -> Plan | None:
    """The plan a stage's layers run under where its stages span several devices (None: one device each); an
    error naming what is missing where such a plan cannot run here."""
    devices = pipeline.stage_mesh
    if devices.size == 1:
        return None
    where = f"the pipeline plan runs each stage on {devices} ({devices.size} devices)"
    if pipeline.axis != 0:
        raise ValueError(f"{where} with its stages over mesh axis {pipeline.axis} of {pipeline.mesh}: stages over "
                         f"an inner axis (each stage's devices strided over the ranks) do not run yet; plan the "
                         f"pipeline over axis 0")
    if mesh.size != pipeline.mesh.size:
        raise ValueError(f"{where}: it is planned for mesh {pipeline.mesh} ({pipeline.mesh.size} devices), given "
                         f"mesh {mesh}")
    plan = pipeline.layer_plan
    if plan is None:
        raise ValueError(f"{where} but has no stage plan (stage_plan is None: the layer's cost was given, not "
                         f"planned) to lay each stage's layers out by: plan it with tapestry.plan_pipeline, or give "
                         f"a Plan of pipeline.layer_step's graph on {devices}")
    if plan.mesh.shape != devices.shape:
        raise ValueError(f"{where}; its stage plan is for mesh {plan.mesh}")
    return plan


def split_points(chunks: Sequence[Sequence[int]], layers: str) -> dict[str, pipelining.SplitPoint]:
    """Where torch's tracer cuts: before the first layer of every chunk but the first."""
    if [i for chunk in chunks for i in chunk] != list(range(sum(map(len, chunks)))):
        raise ValueError(f"pipeline chunks must hold the layers in order, each once; got {list(map(list, chunks))}")
    return {f"{layers}.{chunk[0]}": pipelining.SplitPoint.BEGINNING for chunk in chunks[1:]}


class PipelinedStep:
    """One training step of `module` pipelined over the ranks of a one-axis mesh (module docstring). Every rank
    constructs it and calls it alike; each holds only its own chunks' parameters and optimizer state."""

    def __init__(self, module: nn.Module, loss_fn: Callable[..., torch.Tensor], example_batch: Sequence[Any],
                 mesh: Mesh | int | None, optimizer: type[torch.optim.Optimizer],
                 pipeline: PipelinePlan | Schedule, *, layers: str = "layers", max_norm: float | None = None,
                 **optimizer_options: Any) -> None:
        schedule = pipeline if isinstance(pipeline, Schedule) else getattr(pipeline, "schedule", None)
        if not isinstance(schedule, Schedule):
            raise TypeError(f"pipeline= takes a PipelinePlan (tapestry.plan_pipeline(...).plan) or a "
                            f"tapestry.pipeline.Schedule; got {type(pipeline).__name__}")
        world = dist.get_world_size() if dist.is_initialized() else None
        mesh = Mesh(mesh) if isinstance(mesh, int) else mesh if mesh is not None else Mesh(world or schedule.stages)
        self.stage_plan = None if isinstance(pipeline, Schedule) else _stage_plan(pipeline, mesh)
        if mesh.size % schedule.stages or (self.stage_plan is None and not isinstance(pipeline, Schedule)
                                           and mesh.size != schedule.stages):
            raise ValueError(f"a pipelined step runs {schedule.stages} stages on a mesh of {schedule.stages} devices "
                             f"(one stage per rank), or for a bare schedule of a multiple of that (data-parallel "
                             f"replicas of the pipeline); got mesh {mesh}")
        join_group(mesh.size)
        self.per_position = mesh.size // schedule.stages  # ranks of one pipeline position: replicas or a stage's
        self.replicas = 1 if self.stage_plan is not None else self.per_position
        # the module itself is not kept: a rank holds only its own chunks' parameters once the caller lets it go
        self.model_name, self.mesh, self.schedule, self.max_norm = type(module).__name__, mesh, schedule, max_norm
        self.rank = dist.get_rank()
        batch = tuple(example_batch)
        if len(batch) != 2:
            raise TypeError(f"a pipelined step takes (input, target) batches, loss_fn(module(input), target); the "
                            f"example batch has {len(batch)} tensor(s)")
        self.shapes = tuple(tuple(t.shape) for t in batch)
        pieces = self.replicas * schedule.micro_batches
        if batch[0].shape[0] % pieces:
            raise ValueError(f"the batch of {batch[0].shape[0]} does not split into {self.replicas} replica(s) x "
                             f"{schedule.micro_batches} micro-batches of one size")
        stack = _layer_list(module, layers)
        self.chunks = chunk_layers(pipeline, len(stack))
        micro = batch[0].tensor_split(pieces)[0]
        try:
            pipe = pipelining.pipeline(module, mb_args=(micro,), split_spec=split_points(self.chunks, layers))
        except Exception as err:  # torch.export's errors name the op it could not trace
            raise RuntimeError(f"torch.distributed.pipelining could not trace {type(module).__name__} to cut it "
                               f"into {len(self.chunks)} chunks: {err}") from err
        if pipe.num_stages != len(self.chunks):
            raise RuntimeError(f"the tracer cut {type(module).__name__} into {pipe.num_stages} pieces, not "
                               f"{len(self.chunks)}: are the layers of '{layers}' called in order in forward?")
        neighbours_only(pipe.split_gm)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        # every rank makes every group, in one order: ranks of one replica (the pipeline's sends), of one stage
        d, s = self.per_position, schedule.stages
        self.position, self.replica = divmod(self.rank, d)
        self.pipe_group = self.stage_group = None  # one replica: the whole group is the pipeline
        self.stage_mesh: DeviceMesh | None = None  # the stage's devices, where a stage plan spans several
        self.layouts: dict[str, LayerPlacements] = {}  # each layer this rank holds, as it runs under a stage plan
        if self.stage_plan is not None:  # pipeline positions over the outer dim, each stage's mesh the inner ones
            inner = pipeline.stage_mesh.shape
            names = tuple(f"stage{k}" for k in range(len(inner)))
            grid = init_device_mesh(device.type, (s, *inner), mesh_dim_names=("pipeline", *names))
            self.pipe_group, self.stage_mesh = grid["pipeline"].get_group(), grid[names]
        elif d > 1:
            pipes = [dist.new_group([p * d + j for p in range(s)]) for j in range(d)]
            stage_groups = [dist.new_group([p * d + j for j in range(d)]) for p in range(s)]
            self.pipe_group, self.stage_group = pipes[self.replica], stage_groups[self.position]
        self.stages = [pipe.build_stage(c, device, self.pipe_group)
                       for c in range(self.position, len(self.chunks), s)]
        if self.stage_plan is not None:
            self._shard_layers(stack, layers)
        runner = SCHEDULE_CLASSES[schedule.name]
        self.runner = runner(self.stages if schedule.chunks > 1 else self.stages[0],
                             n_microbatches=schedule.micro_batches, loss_fn=loss_fn)
        flags = (False,) * len(stack) if isinstance(pipeline, Schedule) else pipeline.recompute
        for stage in self.stages:
            for i in self.chunks[stage.stage_index]:
                if flags[i]:
                    _recomputed(stage.submod.get_submodule(f"{layers}.{i}"))
        self.parameters = {name: p for stage in self.stages for name, p in stage.submod.named_parameters()}
        self.optimizer = optimizer(list(self.parameters.values()), **optimizer_options)
        self.holds_first = self.position == 0
        self.holds_last = self.position == (len(self.chunks) - 1) % s
        self.calls = 0

    def __call__(self, inputs: torch.Tensor, target: torch.Tensor, lr: float | None = None) -> torch.Tensor:
        """One step on the whole global batch (the same on every rank); the mean micro-batch loss, on every rank."""
        faults.note_call(self.calls)
        for k, (given, expected) in enumerate(zip((inputs, target), self.shapes)):
            if tuple(given.shape) != expected:
                raise ValueError(f"batch tensor {k}: expected shape {list(expected)} (the example batch's: the step "
                                 f"is traced for it), given {list(given.shape)}")
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = float(lr)
        self.optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if self.replicas > 1:  # this replica's share of the batch
            inputs, target = inputs.tensor_split(self.replicas)[self.replica], target.tensor_split(self.replicas)[
                self.replica]
        args = (inputs,) if self.holds_first else ()
        self.runner.step(*args, target=target, losses=losses)
        settle_gradients(self.parameters.values())
        if self.replicas > 1:
            self._average_replicas()
        if self.max_norm is not None:
            self._clip()
        self.optimizer.step()
        # the mean over every micro-batch of every replica: their last stages' losses, summed everywhere
        loss = torch.stack([x.detach() for x in losses]).sum() if self.holds_last else torch.zeros(())
        dist.all_reduce(loss)
        self.calls += 1
        faults.note_done()
        return loss / (self.per_position * self.schedule.micro_batches)

    def _shard_layers(self, stack: nn.ModuleList, layers: str) -> None:
        """Lay every layer this rank holds out on its stage's mesh as the stage plan says (spmd/stage_plan.py)."""
        assert self.stage_plan is not None and self.stage_mesh is not None
        for stage in self.stages:
            paths = {f"{layers}.{i}": i for i in self.chunks[stage.stage_index]}
            handing = layers_feeding_layers(stage.submod, paths)
            for path, i in paths.items():
                layer = stage.submod.get_submodule(path)
                try:
                    placed = layer_placements(self.stage_plan, layer)
                except ValueError as err:
                    raise ValueError(f"rank {self.rank}, {path}: {err}") from err
                shard_layer(layer, stack[i], placed, self.stage_mesh, path in handing)
                self.layouts[path] = placed

    def _average_replicas(self) -> None:
        """Each stage's gradients averaged over its replicas (what DDP's all-reduce does), one all-reduce."""
        grads = [p.grad for p in self.parameters.values() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.stage_group)
        flat /= self.replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _clip(self) -> None:
        """Clip by the norm of every stage's gradients together (torch.nn.utils.clip_grad_norm_ over the model)."""
        grads = [p.grad for p in self.parameters.values() if p.grad is not None]
        squares = squared_norm(grads)  # a stage's DTensor gradients summed over its devices
        dist.all_reduce(squares, group=self.pipe_group)  # every replica's gradients are alike by now
        scale = float((self.max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0))
        for g in grads:
            g.mul_(scale)

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the step's state in the module's names: {"model": {path: tensor}, "optim": {"state":
        {path: {"exp_avg", ..., "step"}}, "param_groups": [...]}} (ParallelStep's form, DCP's convention). The ranks'
        parts have no key in common, so torch.distributed.checkpoint saves them side by side, and loads into a step
        cut otherwise (another schedule, chunks or stage count) by name. Before the first step the optimizer's state
        is made as torch's get_state_dict makes it (a step at lr 0 with zero gradients) with its count set back to
        0, so a fresh step's state_dict() is a template to load a checkpoint into."""
        if not self.optimizer.state:
            _init_optim_state(self.optimizer)
            for entry in self.optimizer.state.values():
                if isinstance(entry.get("step"), torch.Tensor):
                    entry["step"].zero_()
        names = list(self.parameters)
        saved = self.optimizer.state_dict()
        state = {names[index]: dict(entry) for index, entry in saved["state"].items()}
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [names[index] for index in group["params"]]} for group in saved["param_groups"]]
        return {"model": {name: p.detach() for name, p in self.parameters.items()},
                "optim": {"state": state, "param_groups": groups}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a `state_dict()` (this rank's keys of one, as torch.distributed.checkpoint loads it in place)."""
        model, optim = state_dict["model"], state_dict["optim"]
        missing = sorted(set(self.parameters) - set(model))
        if missing:
            raise KeyError(f"rank {self.rank}: the state has no {missing[:4]}{'...' if len(missing) > 4 else ''}")
        with torch.no_grad():
            for name, p in self.parameters.items():
                if tuple(model[name].shape) != tuple(p.shape):
                    raise ValueError(f"state {name!r}: expected shape {list(p.shape)}, given {list(model[name].shape)}")
                p.copy_(like(p, model[name]))
        index = {name: k for k, name in enumerate(self.parameters)}
        # one group of every parameter (as the step makes it): its options from the state, which DCP loads from
        # whichever rank saved them, so its parameter names may be another rank's; a weight's moments laid out
        # as the weight is (a DTensor where a stage plan shards it)
        options = {k: v for k, v in optim["param_groups"][0].items() if k != "params"}
        state = {index[name]: {key: like(self.parameters[name], value) if isinstance(value, torch.Tensor)
                               and tuple(value.shape) == tuple(self.parameters[name].shape) else value
                               for key, value in entry.items()}
                 for name, entry in optim["state"].items() if name in index}
        self.optimizer.load_state_dict({"state": state, "param_groups": [{**options, "params": list(index.values())}]})

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the module, in its own names, gathered from the ranks that hold it. Collective."""
        held = {name: whole(p.detach()).clone() for name, p in self.parameters.items()}  # collective in a stage
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, held)
        return {name: value for part in everyone for name, value in part.items()}

    def __repr__(self) -> str:
        s = self.schedule
        devices = "" if self.stage_mesh is None else f", each stage on {self.stage_mesh.size()} devices by its plan"
        return (f"PipelinedStep({self.model_name}, {s.name}, {s.stages} stages{devices}, {s.micro_batches} "
                f"micro-batches, rank {self.rank} holds chunks {[st.stage_index for st in self.stages]})")


def neighbours_only(split: fx.GraphModule) -> None:
    """Make every tensor a stage reads come from the stage just before it: torch's schedules send only between
    neighbours ("Backward of skip connections not supported yet"). A tensor made by stage j (or passed on by it)
    and read by stage k > j + 1, as transformers' rotary tables and causal mask are by every layer, becomes an
    input and an output of each stage between, which hands it on unchanged (its gradient flows back the same
    way). `split` is the tracer's graph of stage calls (`Pipe.split_gm`), changed in place."""
    stages = [node for node in split.graph.nodes if node.op == "call_module"]
    position = {node: k for k, node in enumerate(stages)}
    latest: dict[fx.Node, tuple[int, fx.Node]] = {}  # value -> the last stage that outputs it, and that output
    for k, stage in enumerate(stages):
        for i, arg in enumerate(stage.args):
            made = _maker(arg, position)
            if made is None or made >= k - 1:
                continue
            held, carried = latest.get(arg, (made, arg))
            example = _inputs(split, stage)[i].meta  # its example value ("val"), which each stage between takes
            while held < k - 1:
                held += 1
                carried = _hand_on(split, stages[held], carried, example)
            latest[arg] = (held, carried)
            stage.update_arg(i, carried)  # stage.args is read again: handing on may have replaced earlier ones
    split.graph.lint()
    split.recompile()


def _maker(value: fx.Node, position: dict[fx.Node, int]) -> int | None:
    """The stage whose output `value` is (through getitem), or None for an input of the whole model."""
    while value.op == "call_function" and value.target is operator.getitem:
        value = value.args[0]
    return position.get(value)


def _inputs(split: fx.GraphModule, stage: fx.Node) -> list[fx.Node]:
    """The placeholders of `stage`'s module, one for each of its arguments in `split`'s graph."""
    return [node for node in split.get_submodule(stage.target).graph.nodes if node.op == "placeholder"]


def _hand_on(split: fx.GraphModule, stage: fx.Node, value: fx.Node, example: dict[str, Any]) -> fx.Node:
    """Make `stage` take `value` (an output of the stage before it) as one more input and return it unchanged as
    one more output; the node of that output in `split`'s graph. `example`: the new input's metadata."""
    module: fx.GraphModule = split.get_submodule(stage.target)
    graph = module.graph
    inputs = _inputs(split, stage)
    if value in stage.args:  # the stage reads it already
        taken = inputs[stage.args.index(value)]
    else:
        with graph.inserting_after(inputs[-1]):
            taken = graph.placeholder(f"handed_on_{len(inputs)}")
        taken.meta = dict(example)
        stage.args = (*stage.args, value)
    output = graph.output_node()
    returned = output.args[0]
    single = not isinstance(returned, (tuple, list))
    output.args = ((*([returned] if single else returned), taken),)
    module.recompile()
    if single:  # its one output was used whole: now its first item
        with split.graph.inserting_after(stage):
            first = split.graph.call_function(operator.getitem, (stage, 0))
        stage.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
    last = max((user for user in stage.users), key=lambda user: user.args[1])
    with split.graph.inserting_after(last):
        return split.graph.call_function(operator.getitem, (stage, len(output.args[0]) - 1))


def _recomputed(layer: nn.Module) -> None:
    """Make `layer` keep only its inputs for the backward and run its forward again there (activation
    checkpointing, torch.utils.checkpoint without reentrancy); its parameters and their names are unchanged."""
    forward = layer.forward

    def again(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = again


def _layer_list(module: nn.Module, path: str) -> nn.ModuleList:
    try:
        found = module.get_submodule(path)
    except AttributeError:
        found = None
    if not path or not isinstance(found, nn.ModuleList):
        lists = [name for name, m in module.named_modules() if isinstance(m, nn.ModuleList)]
        raise ValueError(f"layers={path!r}: {type(module).__name__} has no ModuleList there to cut into stages "
                         f"(its ModuleLists: {lists or 'none'})")
    return found


__all__ = ["PipelinedStep", "chunk_layers", "neighbours_only", "split_points"]
