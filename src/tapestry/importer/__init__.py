"""Real PyTorch models in: `tapestry.from_torch(module, args)` -> a TorchImport holding a Tapestry Graph.

    imported = tapestry.from_torch(model, (input_ids,), {"use_cache": False})
    result = tapestry.optimize(imported.graph, mesh=tapestry.Mesh(4))
    values = tapestry.evaluate(imported.graph, imported.inputs(input_ids, use_cache=False))
    outputs = imported.outputs(values)          # the module's outputs, flattened in order

See docs/importing.md for how import works, what maps to which kernel, and what is folded.
"""
from __future__ import annotations

import collections
import itertools
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tapestry import dtypes
from tapestry.graph import Graph
from tapestry.importer.capture import TorchImportError, export
from tapestry.importer.translate import Translation, translate_program
from tapestry.training import LR, Training, state_name, updated
from tapestry.training.draws import draw_all

__all__ = ["TorchImport", "TorchImportError", "from_torch"]


@dataclass(frozen=True)
class TorchImport:
    """An imported module: its graph, and the maps between the module's values and the graph's."""

    module: torch.nn.Module
    translation: Translation
    training: Training | None = None

    @property
    def graph(self) -> Graph:
        return self.translation.graph

    @property
    def coverage(self) -> Mapping[str, Mapping[str, int]]:
        """ATen op -> {what it became: count}: kernel names, "folded", "dropped" or "opaque"."""
        return self.translation.coverage

    @property
    def opaque(self) -> dict[str, int]:
        return {op: made["opaque"] for op, made in self.coverage.items() if made.get("opaque")}

    def inputs(self, *args: Any, state: Mapping[str, Any] | None = None, lr: float | None = None,
               **kwargs: Any) -> dict[str, np.ndarray]:
        """Every graph input by name: the module's current parameters and buffers (or, for a training step,
        `state`: the `outputs()` of the step before), the optimizer state (zeros at the first step), the learning
        rate (`lr`, training only; the Training's own by default), the constants folded at import, the tensors
        among `args`/`kwargs` (flattened as torch.export does), and a training step's random draws (dropout's
        masks), drawn afresh from torch's default generator as eager torch draws them (training/draws.py)."""
        if lr is not None and self.training is None:
            raise TorchImportError("lr= is an input of a training step; this import is a forward")
        module_state = {**dict(self.module.named_parameters(remove_duplicate=False)),
                        **dict(self.module.named_buffers(remove_duplicate=False))}  # every path of a tied weight
        carried = self._carried(state) if state is not None else {}
        optimizer = self._optimizer_state()
        values: dict[str, np.ndarray] = {}
        for name in self.translation.state:
            node = self.graph[name]
            if name in carried:
                values[name] = dtypes.cast(carried[name], node.dtype)
            elif name == LR and self.training is not None:
                values[name] = np.asarray(self.training.lr if lr is None else lr, dtypes.to_numpy(node.dtype))
            elif name in module_state:
                values[name] = dtypes.from_tensor(module_state[name])
            elif name in optimizer:  # before the first step
                values[name] = np.zeros(node.shape, dtypes.to_numpy(node.dtype))
            else:
                raise TorchImportError(f"graph input {name!r} is module state, but {type(self.module).__name__} "
                                       f"has no parameter or buffer of that name (was the module changed since "
                                       f"import?)")
        values.update(self.graph.constants)
        leaves = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        names = self.translation.user_inputs
        if len(leaves) != len(names):
            raise TorchImportError(f"expected {len(names)} tensor argument(s) ({', '.join(names)}), got {len(leaves)}")
        values.update({name: dtypes.from_tensor(t) for name, t in zip(names, leaves)})
        values.update({name: dtypes.from_tensor(t) for name, t in draw_all(self.translation.draws).items()})
        return values

    def _optimizer_state(self) -> set[str]:
        """The graph inputs a training step declares as optimizer state (its slots, per parameter, and the step
        count): the only inputs that may start from zeros."""
        if self.training is None or not self.training.step_input:
            return set()
        family, slots = self.training.family, self.training.slots
        return {self.training.step_input, *(state_name(s, p, family) for s in slots for p in self.trained)}

    def outputs(self, values: Mapping[str, np.ndarray]) -> Any:
        """The module's outputs, flattened in order, from a plan's or the evaluator's output dict. For a training
        step: {"loss", "parameters": {path: new value}, "optimizer_state": {slot: {path: value}, "step": n},
        "buffers": {path: new value}} (the buffers the step writes: batch norm's running statistics)."""
        if self.training is None:
            return [values[name] for name in self.translation.outputs]
        training, paths = self.training, self.trained
        state: dict[str, Any] = {slot: {p: values[updated(state_name(slot, p, training.family))] for p in paths}
                                 for slot in training.slots}
        if training.step_input:
            state["step"] = values[updated(training.step_input)]
        return {"loss": values["loss"], "parameters": {p: values[updated(p)] for p in paths}, "optimizer_state": state,
                "buffers": {b: values[updated(b)] for b in self.updated_buffers}}

    @property
    def trained(self) -> tuple[str, ...]:
        """The trainable parameters' paths, one per distinct tensor (a tied weight by its first name)."""
        return tuple(name for name, p in self.module.named_parameters() if p.requires_grad)

    @property
    def updated_buffers(self) -> tuple[str, ...]:
        """The buffers a training step writes (batch norm's running statistics), by path: carried like weights."""
        carried = self.graph.carried.values()
        return tuple(name for name, _ in self.module.named_buffers() if name in carried)

    def _carried(self, previous: Mapping[str, Any]) -> dict[str, Any]:
        """A training step's outputs() as the next step's inputs, by graph input name."""
        if self.training is None:
            raise TorchImportError("state= is the outputs() of a training step; this import is a forward")
        carried = {**previous["parameters"], **(previous["buffers"] if self.updated_buffers else {})}
        for slot, values in previous["optimizer_state"].items():
            if slot == "step":
                carried[self.training.step_input] = values
            else:
                carried.update({state_name(slot, p, self.training.family): v for p, v in values.items()})
        return carried

    def summary(self) -> str:
        """One line: how many ATen ops became kernels, were folded or dropped, or run opaque (and which)."""
        totals: collections.Counter = collections.Counter()
        for made in self.coverage.values():
            for kind, n in made.items():
                totals[kind if kind in ("folded", "dropped", "opaque") else "kernels"] += n
        opaque = ", ".join(f"{op} x{n}" for op, n in sorted(self.opaque.items()))
        what = f"one {self.training.optimizer} training step of " if self.training else ""
        return (f"imported {what}{type(self.module).__name__}: {sum(totals.values())} ATen ops -> "
                f"{totals['kernels']} as kernels, {totals['folded']} folded, {totals['dropped']} dropped, "
                f"{totals['opaque']} opaque" + (f" ({opaque})" if opaque else "") + f"; graph: {len(self.graph.ops)} ops")


def _record_examples(imported: TorchImport, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """The example values of the integer and bool arguments go into the graph (Graph.example): offsets, indices
    and masks have contracts random draws break (EmbeddingBag's offsets start at 0), so checks use these instead.
    Only the call's own tensors are read (module state may be weightless: built on the meta device)."""
    graph = imported.graph
    leaves = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    for name, value in zip(imported.translation.user_inputs, leaves):
        if not dtypes.is_float(graph[name].dtype) and value.device.type != "meta":
            graph.example(name, dtypes.from_tensor(value))


def _beside_weights(module: torch.nn.Module, call: Any) -> Any:
    """The call's tensors moved to the meta device when the module's are there (built weightless, its batch made
    on the CPU): tracing needs one device, and reads only shapes. The examples keep the call's own values."""
    state = itertools.chain(module.parameters(), module.buffers())
    if not any(t.device.type == "meta" for t in state):
        return call
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), call)


def from_torch(module: torch.nn.Module, args: tuple[Any, ...] | Any = (), kwargs: dict[str, Any] | None = None,
               *, training: Training | None = None, strict: bool = False, verbose: bool = True) -> TorchImport:
    """Import `module` as called with `args`/`kwargs`: its forward (as it is: call .eval() for inference), or with
    `training`, one whole training step (docs/training.md). strict=True raises on the first ATen op with no
    Tapestry kernel instead of running it opaque. Prints the op-coverage line unless verbose=False."""
    args = args if isinstance(args, tuple) else (args,)
    traced_args, traced_kwargs = _beside_weights(module, (args, dict(kwargs or {})))
    if training is not None:
        if kwargs:
            raise TorchImportError("a training step takes positional arguments only: loss(module, *args)")
        from tapestry.training.capture import capture  # it builds on this package: imported here, not above

        translation = capture(module, traced_args, training, strict)
    else:
        translation = translate_program(export(module, traced_args, traced_kwargs), strict)
    imported = TorchImport(module, translation, training)
    _record_examples(imported, args, kwargs or {})
    if verbose:
        print(imported.summary(), file=sys.stderr)
    return imported
