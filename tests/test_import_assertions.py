"""The program's `aten._assert_*` checks are decided at import (importer/assertions.py), never dropped unchecked."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from tapestry.evaluator import evaluate
from tapestry.importer import TorchImportError, from_torch
from tapestry.importer.capture import export
from tapestry.importer.translate import translate_program


class CountedCast(torch.nn.Module):
    """A cast (export checks its input's dtype: `_assert_tensor_metadata`) scaled by a count read from an integer
    buffer, a constant, that the forward checks (`torch._check`: `_assert_scalar`)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("counts", torch.tensor([3, 1, 2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.counts.sum().item()
        torch._check(n >= 3)
        return x.to(torch.float64) * n


X = torch.randn(4, 3)


def _exported() -> torch.export.ExportedProgram:
    return export(CountedCast(), (X,), {})


def _node(program: torch.export.ExportedProgram, target: object) -> torch.fx.Node:
    return next(n for n in program.graph.nodes if n.target is target)


def test_checks_that_hold_import_and_are_counted() -> None:
    imported = from_torch(CountedCast(), X, verbose=False)
    assert imported.coverage["aten._assert_tensor_metadata.default"] == {"dropped": 1}
    assert imported.coverage["aten._assert_scalar.default"] == {"dropped": 1}
    out = evaluate(imported.graph, imported.inputs(X))
    np.testing.assert_allclose(next(iter(out.values())), (X.double() * 6).numpy())


def _tamper_dtype(program: torch.export.ExportedProgram) -> None:
    node = _node(program, torch.ops.aten._assert_tensor_metadata.default)
    node.args = (node.args[0], None, None, torch.float64)


def _tamper_condition(program: torch.export.ExportedProgram) -> None:
    check = _node(program, torch.ops.aten._assert_scalar.default)
    compare = check.args[0]
    compare.args = (compare.args[0], 100)  # the counts sum to 6


def _check_a_run_time_value(program: torch.export.ExportedProgram) -> None:
    x = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == "x")
    with program.graph.inserting_after(x):
        program.graph.call_function(torch.ops.aten._assert_async.msg, (x, "x is nonzero"))


@pytest.mark.parametrize("tamper, says", [
    (_tamper_dtype, r"aten\._assert_tensor_metadata\.default \(node '_assert_tensor_metadata'\) at .*: the check "
                    r"fails: dtype float32, expected float64"),
    (_tamper_condition, r"aten\._assert_scalar\.default \(node '_assert_scalar_default'\) at .*: the check fails: "
                        r"Runtime assertion failed for expression u0 >= 3"),
    (_check_a_run_time_value, r"aten\._assert_async\.msg \(node '_assert_async_msg'\) at .*: checks graph value 'x' "
                              r"\(shape \[4, 3\], float32\), known only at run time"),
])
def test_a_check_that_fails_or_cannot_be_decided_stops_the_import(
        tamper: Callable[[torch.export.ExportedProgram], None], says: str) -> None:
    program = _exported()
    translate_program(program, strict=False)  # untampered, it imports
    tamper(program)
    with pytest.raises(TorchImportError, match=says):
        translate_program(program, strict=False)
