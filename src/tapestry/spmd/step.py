"""A training step run persistently on the ranks: `tapestry.parallelize_step`.

    step = tapestry.parallelize_step(module, loss_fn, (x, y), mesh=tapestry.Mesh(4),
                                     optimizer=torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    for i, (x, y) in enumerate(loader):
        loss = step(x, y, lr=schedule(i))     # loss_fn(module(x), y), backward, update; the loss on every rank
    dcp.save(step.state_dict(), checkpoint_id=path)          # sharded as DTensor where the plan's layout allows
    module.load_state_dict(step.module_state_dict())         # full tensors in the module's own names

The step is imported once (one traced graph: forward, backward and torch.optim's update, training/capture.py),
planned once (on rank 0, shared with the rest) and run as a ParallelProgram: the weights, optimizer state, step
count and the buffers the step writes (batch norm's running statistics) are placed once and each call's carried
outputs replace them where they lie; per call only the batch and the learning rate go in and only the loss comes out.
"""
from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tapestry import dtypes
from tapestry.graph import Graph
from tapestry.importer import TorchImport, from_torch
from tapestry.lower.program import PlaceBlock
from tapestry.pipeline.schedule import Schedule
from tapestry.plan import Plan
from tapestry.sharding import Mesh
from tapestry.spmd.pipelined import PipelinedStep
from tapestry.spmd.planning import shared_plan
from tapestry.spmd.program import ParallelProgram, join_group
from tapestry.spmd.state import device_mesh, placements
from tapestry.training import LR, TORCH_STATE, Training, state_name
from tapestry.training.draws import draw_all
from tapestry.zspace import ZRange

if TYPE_CHECKING:  # the planner imports the optimizer; a rank running a step needs neither
    from tapestry.pipeline.planner import PipelinePlan

Planner = Callable[[Graph, Mesh], Plan]  # a graph and mesh -> the plan to run (e.g. training.plans.zero3)
# the options of tapestry.optimize a step passes on (the rest are torch.optim's)
PLANNING_OPTIONS = frozenset({"rules", "budget", "cost_model", "extractor", "time_limit", "memory_budget"})


class _ModelLoss:
    """`loss_fn(module(batch[0]), *batch[1:])` in Training's `loss(module, *batch)` form."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.loss_fn = loss_fn

    def __call__(self, module: torch.nn.Module, first: Any, *rest: Any) -> torch.Tensor:
        return self.loss_fn(module(first), *rest)


class ParallelStep:
    """One training step of `module` (forward, backward, optimizer update) placed on the ranks of a plan and
    called with a new batch each time. See the module docstring; every rank constructs it and calls it alike."""

    def __init__(self, module: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], example_batch: Sequence[Any],
                 mesh: Mesh | int | None = None, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 max_norm: float | None = None, plan: Planner | None = None, compile: bool = True,
                 cache: bool = True, verbose: bool = True, **options: Any) -> None:
        mesh = Mesh(mesh) if isinstance(mesh, int) else mesh if mesh is not None else Mesh(_world_size())
        join_group(mesh.size)
        self.module, self.mesh = module, mesh
        planning = {k: v for k, v in options.items() if k in PLANNING_OPTIONS}
        torch_options = {k: v for k, v in options.items() if k not in PLANNING_OPTIONS}
        self.training = Training.from_torch_optimizer(optimizer, _ModelLoss(loss_fn), max_norm=max_norm,
                                                      **torch_options)
        batch = tuple(example_batch)
        self.imported: TorchImport = from_torch(module, batch, training=self.training, verbose=False)
        graph = self.imported.graph
        if plan is not None and planning:
            raise TypeError(f"{', '.join(sorted(planning))}: options of tapestry.optimize, but plan= is given")
        with torch.random.fork_rng(devices=[]):  # planning (on rank 0 alone) leaves the step's draws as they were
            self.plan = plan(graph, mesh) if plan is not None else \
                shared_plan(graph, mesh, cache, verbose and dist.get_rank() == 0, **planning)
            self.program = ParallelProgram(self.plan, self._initial_state(), deliver=["loss"], carry=graph.carried,
                                           compile=compile)
        self.lr = self.training.lr  # the learning rate of the last call
        self._mesh: DeviceMesh | None = None

    def __call__(self, *batch: Any, lr: float | None = None) -> torch.Tensor:
        """One step on `batch` (the whole global batch, the same on every rank); the loss, on every rank."""
        self.program.begin_call()
        leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
        names = self.imported.translation.user_inputs
        if len(leaves) != len(names):
            raise TypeError(f"{self.program.where}: the step takes {len(names)} tensor(s) in its batch, as its "
                            f"example did; got {len(leaves)}")
        for k, (name, given) in enumerate(zip(names, leaves)):
            expected = self.imported.graph[name].shape
            if tuple(given.shape) != expected:
                raise ValueError(f"{self.program.where}: batch tensor {k} ({name}): expected shape {list(expected)} "
                                 f"(the example batch's: the step is planned for it), given {list(given.shape)}")
        self.lr = self.training.lr if lr is None else float(lr)
        inputs = {**dict(zip(names, leaves)), LR: torch.tensor(self.lr, dtype=torch.float64)}
        return self.program(**inputs, **self._draws())["loss"]

    def _draws(self) -> dict[str, torch.Tensor]:
        """This call's random draws (dropout's masks), whole, from torch's default CPU generator as eager torch
        draws them (training/draws.py); each rank uses its block. The ranks' generators must agree, or the
        ranks would disagree about the masks and the step would be wrong silently: checked every call."""
        draws = self.imported.translation.draws
        if not draws:
            return {}
        state = torch.tensor([zlib.crc32(torch.get_rng_state().numpy().tobytes())], dtype=torch.int64,
                             device=self.program.device)
        every = [torch.empty_like(state) for _ in range(dist.get_world_size())]
        dist.all_gather(every, state)
        if len({int(s) for s in every}) > 1:
            raise RuntimeError(f"{self.program.where}: the ranks' torch random generators differ (the step draws "
                               f"its dropout masks from them, identically on every rank): call torch.manual_seed "
                               f"with the same seed on every rank, and draw no other random numbers on one rank")
        return draw_all(draws)

    # -- state ------------------------------------------------------------------------------------------------
    @property
    def trained(self) -> tuple[str, ...]:
        """The trainable parameters, one path per distinct tensor (a tied weight by its first name)."""
        return self.imported.trained

    def _carried_module_state(self) -> tuple[str, ...]:
        """The module tensors the ranks keep and update: the trainable parameters and the buffers the step writes
        (batch norm's running statistics), by path."""
        return (*self.trained, *self.imported.updated_buffers)

    def _state_inputs(self) -> dict[str, tuple[str, str]]:
        """Graph input -> (parameter path, torch.optim state key) for every carried input but the parameters."""
        family, found = self.training.family, {}
        for slot in self.training.slots:
            found.update({state_name(slot, p, family): (p, TORCH_STATE[slot]) for p in self.trained})
        return found

    def _initial_state(self) -> dict[str, torch.Tensor]:
        """Whole tensors of every input the ranks keep: the module's parameters and buffers, zeros for the
        optimizer state and step count (torch.optim's state before its first step)."""
        graph = self.imported.graph
        tensors = _module_tensors(self.module)
        state = {}
        for name in self.imported.translation.state:
            if name == LR:
                continue
            state[name] = (tensors[name].detach().clone() if name in tensors
                           else torch.zeros(graph[name].shape, dtype=dtypes.to_torch(graph[name].dtype)))
        return state

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """{"model": {path: tensor}, "optim": {"state": {path: {"exp_avg", ..., "step"}}, "param_groups": [...]}}
        in the module's names and torch.optim's keys (DCP's convention, as `get_state_dict` gives it). A tensor the
        plan keeps in a DTensor layout (Shard/Replicate over the plan's mesh axes) is a DTensor of this rank's
        block; others, and all with `full`, are whole tensors. Collective: every rank calls it."""
        model: dict[str, Any] = {p: self._value(p, full) for p in self._carried_module_state()}
        aliases = _aliases(self.module)  # a tied weight's other names are left out: one entry per tensor
        model.update({name: value.detach() for name, value in self.module.state_dict(keep_vars=True).items()
                      if name not in aliases and name not in model})
        by_path: dict[str, dict[str, Any]] = {p: {} for p in self.trained} if self.training.slots else {}
        for name, (path, key) in self._state_inputs().items():
            by_path[path][key] = self._value(name, full)
        if self.training.step_input:
            count = self._value(self.training.step_input, full=True)
            for entry in by_path.values():
                entry["step"] = count
        group = {k: v for k, v in vars(self.training).items() if k not in ("loss", "optimizer", "max_norm")}
        return {"model": model, "optim": {"state": by_path, "param_groups": [{**group, "lr": self.lr,
                                                                                "params": list(self.trained)}]}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take a `state_dict()` (this step's, or another step's loaded by torch.distributed.checkpoint into this
        step's `state_dict()`: DCP reshards on load) into the blocks this rank holds. Collective."""
        model, optim = state_dict["model"], state_dict["optim"]
        values: dict[str, Any] = {p: _given(model, p, "model") for p in self._carried_module_state()}
        per_param = optim.get("state", {})
        for name, (path, key) in self._state_inputs().items():
            values[name] = _given(_given(per_param, path, "optim state"), key, f"optim state of {path!r}")
        if self.training.step_input:
            counts = {float(_whole(per_param[p]["step"])) for p in self.trained if "step" in per_param.get(p, {})}
            if len(counts) != 1:
                raise KeyError(f"optim state: expected one step count for every parameter, found {sorted(counts)}")
            values[self.training.step_input] = torch.tensor(counts.pop(), dtype=torch.float32)
        held = self.program.state()
        for name in sorted(values):  # one order on every rank: full_tensor() below is collective
            value, shape = values[name], self.imported.graph[name].shape
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"state {name!r}: expected shape {list(shape)}, given {list(value.shape)}")
            if not (isinstance(value, DTensor) and value.device_mesh.shape == self.mesh.shape
                    and tuple(value.placements) == placements(shape, self._blocks(name), self.mesh)):
                value = _whole(value)  # laid out otherwise: whole, then this rank's block of it
            if name in held:
                block, buffer = held[name]
                buffer.copy_(value.to_local() if isinstance(value, DTensor) else value[block.slices()])
        if optim.get("param_groups"):
            self.lr = float(optim["param_groups"][0].get("lr", self.lr))

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors in the module's own names, every name of a tied weight included: what
        `module.load_state_dict` takes. Collective."""
        held = {p: self._value(p, full=True) for p in self._carried_module_state()}
        canonical = {**{b: b for b in self.imported.updated_buffers}, **_aliases(self.module)}
        return {name: (held[canonical[name]] if canonical.get(name) in held else value.detach().clone())
                for name, value in self.module.state_dict(keep_vars=True).items()}

    def _value(self, name: str, full: bool) -> torch.Tensor:
        """Graph input `name`'s current value: a DTensor of this rank's block, or the whole tensor."""
        blocks = self._blocks(name)
        shape = self.imported.graph[name].shape
        placed = placements(shape, blocks, self.mesh)
        local = self.program.state().get(name)
        if placed is not None:
            tensor = DTensor.from_local(local[1], self._device_mesh(), placed, run_check=False, shape=torch.Size(shape),
                                        stride=_contiguous_stride(shape))
            return tensor.full_tensor() if full else tensor
        return _assembled(shape, local, self.imported.graph[name].dtype)

    def _blocks(self, name: str) -> list[ZRange | None]:
        """Each rank's block of state input `name`, by rank (None where a rank holds none)."""
        found: list[ZRange | None] = [None] * self.mesh.size
        for rank, program in enumerate(self.program.program.ranks):
            for step in program.steps:
                if isinstance(step, PlaceBlock) and step.input == name:
                    found[rank] = step.block
        return found

    def _device_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            self._mesh = device_mesh(self.mesh, self.program.device.type)
        return self._mesh

    def __repr__(self) -> str:
        return (f"ParallelStep({type(self.module).__name__}, {self.training.optimizer}, mesh {self.mesh}, "
                f"rank {self.program.rank})")


def parallelize_step(module: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], example_batch: Sequence[Any],
                     mesh: Mesh | int | None = None, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
                     pipeline: PipelinePlan | Schedule | None = None, **options: Any) -> ParallelStep | PipelinedStep:
    """A ParallelStep: `step(*batch, lr=...)` trains `module` on the ranks of `mesh` (default: every rank of the
    process group). Collective: every rank calls it alike. `options`: torch.optim's keyword arguments (lr,
    weight_decay, betas, momentum, ...); tapestry.optimize's (time_limit, memory_budget, rules, budget,
    cost_model, extractor); max_norm (gradient clipping); plan (a Planner instead of the optimizer's plan);
    cache=False (plan afresh); compile=False (run eager).

    `pipeline` (a `plan_pipeline(...).plan` or a `pipeline.Schedule`): a PipelinedStep instead, the module cut
    into stages before its layers (`layers=`, the path of its ModuleList, default "layers"), one per rank or,
    for a plan whose stages span several devices, one per stage's devices under its stage plan
    (spmd/pipelined.py); it takes torch.optim's options and max_norm, not the planner's."""
    if pipeline is None:
        return ParallelStep(module, loss_fn, example_batch, mesh, optimizer, **options)
    refused = sorted(set(options) & (PLANNING_OPTIONS | {"plan", "cache", "compile", "verbose"}))
    if refused:
        raise TypeError(f"{', '.join(refused)}: options of a planned step; a pipelined step (pipeline=) runs its "
                        "stages eagerly under torch's pipeline schedules")
    return PipelinedStep(module, loss_fn, example_batch, mesh, optimizer, pipeline, **options)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by every path that reaches it (tied weights under each name)."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def _aliases(module: torch.nn.Module) -> dict[str, str]:
    """Each parameter path -> the first path of its tensor (named_parameters' deduplicated name)."""
    first: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    return {name: first[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}


def _given(mapping: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in mapping:
        raise KeyError(f"{where}: {key!r} is missing (has {sorted(mapping)[:8]}{'...' if len(mapping) > 8 else ''})")
    return mapping[key]


def _whole(value: Any) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else torch.as_tensor(value)


def _assembled(shape: Sequence[int], local: tuple[ZRange, torch.Tensor] | None, dtype: str) -> torch.Tensor:
    """The whole tensor from every rank's block (all_gather_object: layouts with no DTensor form, rare)."""
    blocks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(blocks, None if local is None else (local[0], local[1].cpu()))
    whole = torch.empty(tuple(shape), dtype=dtypes.to_torch(dtype))
    covered = 0
    for item in blocks:
        if item is not None:
            whole[item[0].slices()] = item[1]
            covered += 1
    if not covered:
        raise RuntimeError("no rank holds a block of this state tensor")
    return whole


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


__all__ = ["ParallelStep", "Planner", "parallelize_step"]
