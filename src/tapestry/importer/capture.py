"""Capture a module as an ATen graph with torch.export, at the level Tapestry imports.

Why `run_decompositions({})` (functional ATen) and not core ATen: the functional
graph removes in-place ops but keeps `linear`, `layer_norm`, `gelu`, `conv2d`
and `scaled_dot_product_attention` whole. Core ATen splits a linear into a
weight permute, merge views and `addmm`, and attention into a dozen views,
bmm and a NaN guard; the structure Tapestry shards (one signature per linear,
heads of one attention) would have to be pattern-matched back. Core ATen's
SDPA decomposition also fails on some strides in torch 2.13 (pytorch#136543),
so SDPA must stay whole anyway.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from tapestry.importer.errors import TorchImportError
from tapestry.importer.rewrites import exact_rewrites


def export(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.export.ExportedProgram:
    """The module's functional ATen graph (non-strict export, so plain Python in forward is traced through)."""
    try:
        with warnings.catch_warnings():  # torch 2.13's own pytree deprecation warnings, not the user's
            warnings.simplefilter("ignore", FutureWarning)
            with modules_stay_put(), exact_rewrites(import_modules=False):
                program = torch.export.export(module, args, kwargs, strict=False)
    except TorchImportError:
        raise
    except Exception as err:  # torch.export raises many types; the user needs the first line and a hint
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        hint = ""
        if "DynamicCache" in str(err) or "pytree" in str(err):
            hint = " (a Hugging Face model: pass use_cache=False)"
        raise TorchImportError(
            f"torch.export could not capture {type(module).__name__}: {type(err).__name__}: {first}{hint}"
        ) from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return program.run_decompositions({})


@contextlib.contextmanager
def modules_stay_put() -> Iterator[None]:
    """While tracing, `Module.to` to the dtype and device a module already has returns it unchanged.

    Why: Hugging Face code casts modules inside forward (Switch Transformers' router runs
    `self.classifier = self.classifier.to(self.dtype)` on every call). In eager that is a no-op when the dtype
    already matches, but torch.export swaps the parameters and fails (`_apply(): Couldn't swap Linear.weight`).
    A forward that really changes a module's dtype or device would change the weights the graph reads, which a
    captured graph cannot express: it raises, naming the module and the change.
    """
    to = torch.nn.Module.to

    def stay(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            casts = dtype is not None and (tensor.is_floating_point() or tensor.is_complex()) and tensor.dtype != dtype
            moves = device is not None and tensor.device != torch.device(device)
            if casts or moves or memory_format is not None:
                change = f"dtype {tensor.dtype} -> {dtype}" if casts else (
                    f"device {tensor.device} -> {device}" if moves else f"memory format -> {memory_format}")
                raise TorchImportError(
                    f"{type(self).__name__}.to(...) inside forward changes {name}: {change}; a captured graph "
                    f"cannot change its weights, so cast or move the module before importing it")
        return self

    torch.nn.Module.to = stay  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.to = to  # type: ignore[method-assign]
