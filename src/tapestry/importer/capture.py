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

import warnings
from typing import Any

import torch


class TorchImportError(ValueError):
    """A module that cannot be imported: the message says why, and where when it is one op."""


def export(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.export.ExportedProgram:
    """The module's functional ATen graph (non-strict export, so plain Python in forward is traced through)."""
    try:
        with warnings.catch_warnings():  # torch 2.13's own pytree deprecation warnings, not the user's
            warnings.simplefilter("ignore", FutureWarning)
            program = torch.export.export(module, args, kwargs, strict=False)
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
