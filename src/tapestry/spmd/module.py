"""`tapestry.parallelize(module, example_args, mesh=...)`: a module served by Tapestry's plan, on every rank.

    dist.init_process_group("gloo")              # or none under torchrun; or inside tapestry.launch(fn, nproc)
    model = tapestry.parallelize(module, (x,), mesh=tapestry.Mesh(2, 2))
    y = model(x2)                                # torch tensors in, the module's outputs out, on every rank

Every rank imports the module (tapestry.from_torch, for inference) and the plan is made once on rank 0 (or read
from the plan cache) and shared (spmd.planning); each rank then places the module's weights once and compiles its
program (spmd.program.ParallelProgram). Shapes are static: a call whose tensor inputs differ in shape or dtype from
the example arguments is refused with an error naming the input, the expected and the given shape (plan again
with another example for another shape; the plan cache makes a return to a planned shape cheap).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tapestry.sharding import Mesh
from tapestry.spmd.planning import shared_plan
from tapestry.spmd.program import ParallelProgram, join_group


_TENSOR = object()  # where the module's outputs hold a tensor (the other leaves, None or ints, are kept as they are)


class ParallelModule(torch.nn.Module):
    """The parallel counterpart of a module for inference: forward takes what the module takes (new tensors every
    call; every rank passes the same) and returns the module's outputs, whole, on every rank."""

    def __init__(self, module: torch.nn.Module, program: ParallelProgram, names: tuple[str, ...],
                 outputs: tuple[str, ...], out_spec: Any, out_leaves: list[Any]) -> None:
        super().__init__()
        self.program = program
        self._names, self._outputs, self._out_spec = names, outputs, out_spec
        self._out_leaves = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in out_leaves]
        self._module_name = type(module).__name__

    @property
    def plan(self) -> Any:
        return self.program.plan

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if len(leaves) != len(self._names):
            raise TypeError(f"{self._module_name}: expected {len(self._names)} tensor argument(s) "
                            f"({', '.join(self._names)}), got {len(leaves)}")
        got = self.program(**dict(zip(self._names, leaves)))
        values = iter(got[name] for name in self._outputs)
        return tree_unflatten([next(values) if leaf is _TENSOR else leaf for leaf in self._out_leaves], self._out_spec)

    def extra_repr(self) -> str:
        return f"{self._module_name} on mesh {self.program.plan.mesh}, rank {self.program.rank}"


def parallelize(module: torch.nn.Module, example_args: tuple[Any, ...] | Any, example_kwargs: dict[str, Any] | None
                = None, *, mesh: Mesh | int = 1, compile: bool = True, cache: bool = True, verbose: bool = True,
                **options: Any) -> ParallelModule:
    """`module` (as it is: call .eval() for inference) sharded over `mesh` by Tapestry's plan. Collective: every
    rank calls it, with the same module and examples. `options` go to tapestry.optimize (rules, budget,
    cost_model, time_limit, memory_budget, outputs...); `cache=False` plans afresh; `compile=False` runs eager."""
    from tapestry.importer import from_torch

    mesh = Mesh(mesh) if isinstance(mesh, int) else mesh
    join_group(mesh.size)
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    imported = from_torch(module, args, example_kwargs, verbose=verbose and _rank() == 0)
    translation = imported.translation
    if len(translation.outputs) != len(set(translation.outputs)):
        raise ValueError(f"{type(module).__name__}: an output appears twice among the module's outputs")
    plan = shared_plan(imported.graph, mesh, cache, verbose and _rank() == 0, **options)
    current = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    state = {name: current[name].detach() for name in translation.state}
    program = ParallelProgram(plan, state, deliver=translation.outputs, compile=compile)
    with torch.no_grad():
        out_leaves, out_spec = tree_flatten(module(*args, **(example_kwargs or {})))
    tensors = sum(isinstance(leaf, torch.Tensor) for leaf in out_leaves)
    if tensors != len(translation.outputs):
        raise ValueError(f"{type(module).__name__}: {tensors} tensor output(s), the import has "
                         f"{len(translation.outputs)}")
    return ParallelModule(module, program, translation.user_inputs, translation.outputs, out_spec, out_leaves)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
