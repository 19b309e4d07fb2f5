"""Every model family of the tiny zoo imports, optimizes on Mesh(4) and Mesh(2, 2), and its plan computes what
eager PyTorch computes; a family that does not yet is marked with its reason (strict: it fails once fixed)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import tapestry
from tapestry.cli import main
from tapestry.importer import from_torch
from tapestry.importer.report import import_report
from tapestry.importer.zoo import FAMILIES
from tapestry.plan.simulate import simulate

MESHES = {"4": tapestry.Mesh(4), "2x2": tapestry.Mesh(2, 2)}
FAST = {("t5", "4"), ("qwen2", "4"), ("topk_moe", "4"), ("roberta", "4"),  # the default suite's share: one case
        ("vit", "4"), ("cnn", "4"), ("whisper_encoder", "4"), ("gru", "2x2"),  # of each kind issue 25 names
        ("lstm", "4"), ("unet", "4"), ("dlrm", "4"), ("conv_autoencoder", "4")}  # (~2-6 s each)


def eager(module, args, kwargs) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*args, **kwargs)
    return [t.numpy() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def cases():
    for name, family in FAMILIES.items():
        for mesh in MESHES:
            marks = [] if (name, mesh) in FAST else [pytest.mark.slow]
            if family.fails:
                marks.append(pytest.mark.xfail(reason=family.fails, strict=True))
            yield pytest.param(name, mesh, marks=marks, id=f"{name}-{mesh}")


@pytest.mark.parametrize("name, mesh", cases())
def test_the_family_imports_optimizes_and_its_plan_matches_eager(name, mesh):
    module, args, kwargs = FAMILIES[name].build()
    imported = from_torch(module, args, kwargs, verbose=False)
    plan = tapestry.optimize(imported.graph, mesh=MESHES[mesh]).plan
    want = eager(module, args, kwargs)
    for got in (imported.outputs(tapestry.evaluate(imported.graph, imported.inputs(*args, **kwargs))),
                imported.outputs(simulate(plan, imported.inputs(*args, **kwargs)))):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and np.isfinite(g).all()
            assert np.abs(g.astype(np.float64) - w).max() <= 1e-4 * max(np.abs(w).max(), 1.0)


class _Opaque(torch.nn.Module):
    """A linear head over two ops that run opaque: cumprod (no converter) and histc (its converter declines)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(torch.cumprod(x, 1)), torch.histc(x, 4)


def test_the_report_names_each_opaque_op_with_its_reason_and_counts_its_flops_as_unshardable():
    report = import_report("opaque", from_torch(_Opaque(), (torch.randn(32, 16),), verbose=False), tapestry.Mesh(4))
    why = {op.aten: op.why for op in report.opaque}
    assert sorted(why) == ["aten.cumprod.default", "aten.histc.default"]
    assert "no converter" in why["aten.cumprod.default"]
    assert why["aten.histc.default"].startswith("the converter declined:") and "min and max" in why["aten.histc.default"]
    assert report.made["opaque"] == 2 and report.kernels["linear"] == 1
    assert 0 < report.shardable_flops < report.flops  # the linear head shards; the opaque ops do not


class _Prepared(torch.nn.Module):
    """x @ (C @ w): the product of a constant C and the weight w is the same every run (a prepared step)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (torch.full((16, 16), 0.5) @ self.w)


def test_the_plans_share_counts_the_flops_each_run_pays_and_reports_the_prepared_ones_beside_it():
    imported = from_torch(_Prepared(), (torch.randn(32, 16),), verbose=False)
    plan = tapestry.optimize(imported.graph, tapestry.Mesh(4), extractor="greedy-dag").plan
    report = import_report("prepared", imported, tapestry.Mesh(4), plan)
    assert report.plan_flops == 2 * 32 * 16 * 8  # x @ (C @ w), every run
    assert report.plan_prepared_flops == 2 * 16 * 16 * 8  # C @ w, once ahead of time
    assert report.plan_sharded == report.plan_sharded_flops / report.plan_flops
    assert "4.1e+03 more prepared once" in report.text()


def test_import_report_reads_a_zoo_family_and_a_model_script(tmp_path: Path, capsys):
    script = tmp_path / "mlp.py"
    script.write_text("import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())\n"
                      "example_inputs = (torch.randn(4, 8),)\n")
    assert main(["import-report", "lstm", str(script), "--mesh", "2x2"]) == 0
    out = capsys.readouterr().out
    assert "lstm: " in out and "opaque: aten.lstm" not in out  # a loop of cells now (kernels)
    assert f"{script}: 2 ATen ops -> 2 kernels" in out and "can shard on 2x2: 100.0%" in out


def test_import_report_refuses_a_name_that_is_neither_script_nor_family(capsys):
    assert main(["import-report", "no_such_family"]) == 2
    assert "neither a .py model script nor a zoo family" in capsys.readouterr().err
