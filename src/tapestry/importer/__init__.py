"""Real PyTorch models in: `tapestry.from_torch(module, args)` -> a TorchImport holding a Tapestry Graph.

    imported = tapestry.from_torch(model, (input_ids,), {"use_cache": False})
    result = tapestry.optimize(imported.graph, mesh=tapestry.Mesh(4))
    values = tapestry.evaluate(imported.graph, imported.inputs(input_ids, use_cache=False))
    outputs = imported.outputs(values)          # the module's outputs, flattened in order

See docs/importing.md for how import works, what maps to which kernel, and what is folded.
"""
from __future__ import annotations

import collections
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

__all__ = ["TorchImport", "TorchImportError", "from_torch"]


@dataclass(frozen=True)
class TorchImport:
    """An imported module: its graph, and the maps between the module's values and the graph's."""

    module: torch.nn.Module
    translation: Translation

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

    def inputs(self, *args: Any, **kwargs: Any) -> dict[str, np.ndarray]:
        """Every graph input by name: the module's current parameters and buffers, constants folded at import,
        and the tensors among `args`/`kwargs` (flattened as torch.export flattens them)."""
        state = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        values = {path: dtypes.from_tensor(state[path]) for path in self.translation.state}
        values.update(self.graph.constants)
        leaves = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        names = self.translation.user_inputs
        if len(leaves) != len(names):
            raise TorchImportError(f"expected {len(names)} tensor argument(s) ({', '.join(names)}), got {len(leaves)}")
        values.update({name: dtypes.from_tensor(t) for name, t in zip(names, leaves)})
        return values

    def outputs(self, values: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The module's outputs, flattened in order, from a plan's or the evaluator's output dict."""
        return [values[name] for name in self.translation.outputs]

    def summary(self) -> str:
        """One line: how many ATen ops became kernels, were folded or dropped, or run opaque (and which)."""
        totals: collections.Counter = collections.Counter()
        for made in self.coverage.values():
            for kind, n in made.items():
                totals[kind if kind in ("folded", "dropped", "opaque") else "kernels"] += n
        opaque = ", ".join(f"{op} x{n}" for op, n in sorted(self.opaque.items()))
        return (f"imported {type(self.module).__name__}: {sum(totals.values())} ATen ops -> {totals['kernels']} "
                f"as kernels, {totals['folded']} folded, {totals['dropped']} dropped, {totals['opaque']} opaque"
                + (f" ({opaque})" if opaque else "") + f"; graph: {len(self.graph.ops)} ops")


def from_torch(module: torch.nn.Module, args: tuple[Any, ...] | Any = (), kwargs: dict[str, Any] | None = None,
               *, strict: bool = False, verbose: bool = True) -> TorchImport:
    """Import `module` as called with `args`/`kwargs` (its eval-mode forward). strict=True raises on the first
    ATen op with no Tapestry kernel instead of running it opaque. Prints the op-coverage line unless
    verbose=False."""
    args = args if isinstance(args, tuple) else (args,)
    program = export(module, args, dict(kwargs or {}))
    imported = TorchImport(module, translate_program(program, strict))
    if verbose:
        print(imported.summary(), file=sys.stderr)
    return imported
