"""Real PyTorch models go in with tapestry.from_torch, and their plans compute what the module computes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import tapestry
from tapestry import dtypes
from tapestry.cli import main
from tapestry.evaluator import evaluate
from tapestry.importer import TorchImportError, from_torch
from tapestry.importer.zoo import MODELS
from tapestry.plan.plan import Compute
from tapestry.plan.simulate import simulate

RTOL = 1e-4  # relative to the largest output magnitude, float32


def module_outputs(module, args, kwargs) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*args, **kwargs)
    return [t.numpy() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def assert_matches(got: list[np.ndarray], want: list[np.ndarray], rtol: float = RTOL) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert np.isfinite(g).all() and np.isfinite(w).all()
        assert np.abs(g.astype(np.float64) - w).max() <= rtol * np.abs(w).max()


@pytest.fixture(scope="module", params=sorted(MODELS))
def imported(request):
    module, args, kwargs = MODELS[request.param]()
    return request.param, module, args, kwargs, from_torch(module, args, kwargs, verbose=False)


def test_the_imported_graph_computes_what_the_module_computes(imported):
    _, module, args, kwargs, imp = imported
    got = imp.outputs(evaluate(imp.graph, imp.inputs(*args, **kwargs)))
    assert_matches(got, module_outputs(module, args, kwargs))


def test_parameters_and_buffers_are_inputs_named_by_module_path(imported):
    _, module, args, kwargs, imp = imported
    names = {n.name for n in imp.graph.inputs}
    params = {name for name, _ in module.named_parameters()}
    assert params <= names
    values = imp.inputs(*args, **kwargs)
    for name, p in module.named_parameters():
        np.testing.assert_array_equal(values[name], p.detach().numpy())


def assert_plan_is_sharded_and_matches(name, module, args, kwargs, imp, mesh) -> None:
    plan = tapestry.optimize(imp.graph, mesh=mesh).plan
    got = imp.outputs(simulate(plan, imp.inputs(*args, **kwargs)))
    assert_matches(got, module_outputs(module, args, kwargs))
    sharded = [s for s in plan.steps if isinstance(s, Compute) and len(set(s.blocks)) > 1]
    assert sharded, f"{name} on {mesh}: no compute step is split over the devices"


def test_the_plan_on_four_devices_is_sharded_and_matches_the_module(imported):
    assert_plan_is_sharded_and_matches(*imported, tapestry.Mesh(4))


@pytest.mark.slow  # 20-60 s a model (issue 12): two of them run in `make test`, below
def test_the_plan_on_a_2x2_mesh_is_sharded_and_matches_the_module(imported):
    assert_plan_is_sharded_and_matches(*imported, tapestry.Mesh(2, 2))


@pytest.mark.parametrize("name", ["llama_block", "cnn"])
def test_the_plan_on_a_2x2_mesh_matches_for_a_block_and_a_cnn(name):
    module, args, kwargs = MODELS[name]()
    imp = from_torch(module, args, kwargs, verbose=False)
    assert_plan_is_sharded_and_matches(name, module, args, kwargs, imp, tapestry.Mesh(2, 2))


def test_coverage_summary_counts_every_op(imported):
    _, _, _, _, imp = imported
    line = imp.summary()
    assert line.startswith("imported ") and "ATen ops" in line
    assert all(sum(made.values()) > 0 for made in imp.coverage.values())


class Cumulative(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumprod(torch.relu(x), dim=1)


def test_an_op_without_kernel_runs_opaque_and_explain_marks_it():
    x = torch.randn(4, 8)
    imp = from_torch(Cumulative(), (x,), verbose=False)
    assert imp.opaque == {"aten.cumprod.default": 1}
    np.testing.assert_allclose(imp.outputs(evaluate(imp.graph, imp.inputs(x)))[0],
                               Cumulative()(x).numpy(), rtol=1e-6)
    result = tapestry.optimize(imp.graph, mesh=tapestry.Mesh(2))
    assert "opaque: aten.cumprod.default has no Tapestry kernel; it runs whole through torch" in result.explain()


def test_strict_names_the_op_its_source_line_and_module():
    with pytest.raises(TorchImportError, match=r"aten\.cumprod\.default at module.*test_importer\.py"):
        from_torch(Cumulative(), (torch.randn(4, 8),), strict=True, verbose=False)


class DataDependent(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a value: torch.export cannot capture it
            return x * 2
        return x


def test_a_module_that_cannot_be_exported_is_a_clear_error():
    with pytest.raises(TorchImportError, match="torch.export could not capture DataDependent"):
        from_torch(DataDependent(), (torch.randn(3),), verbose=False)


class CastsItself(torch.nn.Module):
    """Like Switch Transformers' router: casts a submodule to a dtype inside forward, on every call."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin, self.cast_to = torch.nn.Linear(4, 4), dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin = self.lin.to(self.cast_to)
        return self.lin(x.to(self.cast_to))


def test_a_forward_casting_a_module_to_the_dtype_it_has_imports_as_the_module_without_the_cast():
    module, x = CastsItself(torch.float32), torch.randn(2, 4)
    imported = from_torch(module, (x,), verbose=False)
    assert_matches(imported.outputs(evaluate(imported.graph, imported.inputs(x))), module_outputs(module, (x,), {}))


def test_a_forward_that_really_changes_a_modules_dtype_is_a_clear_error():
    with pytest.raises(TorchImportError, match=r"Linear\.to\(\.\.\.\) inside forward changes weight: dtype "
                                               r"torch\.float32 -> torch\.float64"):
        from_torch(CastsItself(torch.float64), (torch.randn(2, 4),), verbose=False)


class Fourier(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(x).abs()  # a complex tensor read as complex (only a real part read imports)


def test_a_complex_tensor_is_a_clear_error_naming_the_op_and_its_source_line():
    with pytest.raises(TorchImportError, match=r"aten\.fft_fft\.default at module.*test_importer\.py.*"
                                               r"not supported: dtype 'complex64'"):
        from_torch(Fourier(), (torch.randn(4, 8),), verbose=False)


class Strided(torch.nn.Module):
    """Overlapping windows over a transposed view by as_strided (Longformer's chunking): it reads x.t()'s memory,
    which is x's, not x.t() row-major; with `start`, a slice's offset, which no graph of values has."""

    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.start = start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.t()[self.start:].as_strided((3, 4), (2, 1)) + 1.0


def test_as_strided_over_a_transposed_view_reads_its_memory_order_as_eager_does():
    x = torch.randn(4, 6)
    imp = from_torch(Strided(), (x,), verbose=False)
    got = imp.outputs(tapestry.evaluate(imp.graph, imp.inputs(x)))[0]
    np.testing.assert_array_equal(got, Strided()(x).numpy())


def test_as_strided_of_a_slice_with_an_offset_is_refused_naming_its_layout():
    with pytest.raises(TorchImportError, match=r"aten\.as_strided\.default at .*offset \d+.*dense row-major"):
        from_torch(Strided(start=1), (torch.randn(4, 6),), verbose=False)


def test_coverage_line_is_printed_on_import(capsys):
    from_torch(Cumulative(), (torch.randn(4, 8),))
    assert "1 opaque (aten.cumprod.default x1)" in capsys.readouterr().err


@pytest.mark.parametrize("dtype, rtol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3), (torch.float64, 1e-12)])
def test_half_and_double_models_keep_their_dtype(dtype, rtol):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(dtype).eval()
    x = torch.randn(4, 16, dtype=dtype)
    imp = from_torch(module, (x,), verbose=False)
    assert {n.dtype for n in imp.graph} == {str(dtype).removeprefix("torch.")}
    (got,) = imp.outputs(evaluate(imp.graph, imp.inputs(x)))
    want = module(x).detach().double().numpy()
    assert np.abs(got.astype(np.float64) - want).max() <= rtol * np.abs(want).max()


def test_token_ids_are_int64_inputs():
    module, args, kwargs = MODELS["gpt2"]()
    imp = from_torch(module, args, kwargs, verbose=False)
    (ids,) = [n for n in imp.graph.inputs if n.name == "input_ids"]
    assert ids.dtype == "int64"


SCRIPT = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
example_inputs = (torch.randn(64, 16),)
"""


def test_cli_optimizes_and_runs_a_script_that_defines_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """In process: `python -m tapestry.cli run` is spawned by test_runtime's optimizer-packages-missing test."""
    script = tmp_path / "model.py"
    script.write_text(SCRIPT)
    plan = tmp_path / "plan.json"
    assert main(["optimize", str(script), "--mesh", "2", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--verify", "--no-compile"]) == 0
    assert "ok" in capsys.readouterr().out


def test_docs_table_names_only_converted_ops():
    import re

    from tapestry.importer import aten  # noqa: F401  (registers the converters)
    from tapestry.importer.translate import CONVERTERS

    doc = (Path(__file__).resolve().parent.parent / "docs" / "importing.md").read_text()
    table = doc.split("## Op coverage")[1].split("\n## ")[0]
    packets = {key.split(".")[1] for key in CONVERTERS}
    named = {name for row in table.splitlines() if row.startswith("| `")
             for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert named and named <= packets, f"documented but not converted: {sorted(named - packets)}"


def test_hugging_face_llama_with_rotary_embeddings_and_grouped_query_attention():
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    module, ids = LlamaModel(config).eval(), torch.randint(0, 128, (2, 12))
    imp = from_torch(module, (ids,), {"use_cache": False}, verbose=False)
    assert not imp.opaque
    assert_plan_is_sharded_and_matches("llama", module, (ids,), {"use_cache": False}, imp, tapestry.Mesh(4))


class Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.add(x, y, alpha=2.5) - torch.sub(y, 1.5, alpha=2) + torch.rsub(x, 3.0, alpha=0.5)


def test_alpha_scales_the_second_operand_of_add_sub_and_rsub():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    imp = from_torch(Scaled(), (x, y), verbose=False)
    assert not imp.opaque
    np.testing.assert_allclose(imp.outputs(evaluate(imp.graph, imp.inputs(x, y)))[0], Scaled()(x, y).numpy(),
                               rtol=1e-6, atol=1e-6)


class _Bags(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag, self.lin = torch.nn.EmbeddingBag(20, 8, mode="sum"), torch.nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(self.bag(ids, offsets)))


def test_the_meaning_check_uses_the_example_offsets_an_embedding_bag_was_imported_with():
    """Random offsets break EmbeddingBag's contract (offsets[0] == 0, rising): integer inputs are checked with
    the example values given to from_torch, which the graph carries."""
    torch.manual_seed(0)
    module = _Bags().eval()
    args = (torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 3, 5, 6]))
    imported = from_torch(module, args, verbose=False)
    assert sorted(imported.graph.examples) == ["ids", "offsets"]
    result = tapestry.optimize(imported.graph, 2)
    assert result.meaning_check == "simulated on every device"
    got = imported.outputs(simulate(result.plan, imported.inputs(*args)))
    assert_matches(got, module_outputs(module, args, {}))


class KeywordOnly(torch.nn.Module):
    """Ops Tapestry has no kernel for, called with keyword-only arguments (`dtype=`, `right=`)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        boundaries = torch.tensor([-1.0, 0.0, 1.0])
        return torch.cumprod(x, 1, dtype=torch.float64), torch.bucketize(x, boundaries, right=True)


def test_opaque_ops_take_their_keyword_only_arguments_by_schema_name():
    x = torch.randn(4, 8)
    imp = from_torch(KeywordOnly(), (x,), verbose=False)
    assert imp.opaque == {"aten.cumprod.default": 1, "aten.bucketize.Tensor": 1}
    got = imp.outputs(evaluate(imp.graph, imp.inputs(x)))
    for g, w in zip(got, KeywordOnly()(x)):
        assert g.dtype == dtypes.to_numpy(dtypes.name_of(w.dtype))
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-12)


def test_arguments_are_normalised_by_the_ops_schema():
    from tapestry.importer.translate import by_schema

    x = object()
    assert by_schema(torch.ops.aten.cumprod.default, (x,), {"dim": 1, "dtype": torch.float64}) == \
        ((x, 1), {"dtype": torch.float64})
    assert by_schema(torch.ops.aten.topk.default, (x, 2), {"largest": False}) == ((x, 2, -1, False), {})
    with pytest.raises(TorchImportError, match="unknown keyword argument.*'axis'"):
        by_schema(torch.ops.aten.cumprod.default, (x, 1), {"axis": 1})


class FullRotary(torch.nn.Module):
    """Phi-3's rotary split when the rotary dim is the whole head: `h[..., d:]` is empty, then concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        rotated, passed = h[..., :8], h[..., 8:]
        return torch.cat((torch.tanh(rotated), passed), dim=-1)


def test_an_empty_slice_becomes_a_constant_so_the_graph_plans_and_matches():
    module, x = FullRotary().eval(), torch.randn(4, 6, 8)
    imp = from_torch(module, (x,), verbose=False)
    assert imp.coverage["aten.slice.Tensor"]["folded"] == 1 and not imp.opaque
    plan = tapestry.optimize(imp.graph, tapestry.Mesh(4)).plan
    (got,) = imp.outputs(simulate(plan, imp.inputs(x)))
    np.testing.assert_allclose(got, module(x).detach().numpy(), rtol=1e-6, atol=1e-7)


def test_an_empty_slices_gradient_written_back_is_dropped_so_the_training_step_plans():
    """The backward of `h[..., 8:]` (empty) writes its empty gradient into zeros of h's shape with slice_scatter over
    columns [8, 8); where h is too large to fold (Phi-3's training step at real widths) the concat it became refused
    the zero-size constant and an opaque op read it, which no plan can place. Writing nothing leaves the zeros."""
    module, x = FullRotary(), torch.randn(2, 8192, 8)  # h: 131,072 cells, over FOLD_CELLS

    def loss(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).pow(2).mean()

    imp = from_torch(module, (x,), training=tapestry.Training(loss=loss, lr=0.1), verbose=False)
    assert not imp.opaque, imp.translation.declined
    imp.graph.check_plannable()
    got = imp.outputs(evaluate(imp.graph, imp.inputs(x)))
    want = loss(module, x)
    want.backward()
    np.testing.assert_allclose(float(got["loss"]), want.item(), rtol=1e-6)
    for path, value in module.named_parameters():
        np.testing.assert_allclose(got["parameters"][path], (value - 0.1 * value.grad).detach().numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=path)


class MaskAndNumber(torch.nn.Module):
    """A bool mask combined with a 0-dim bool constant, as Phi-3's attention mask at real lengths (a mask too large
    to fold) is: logical_and and logical_or have no `_scalar` twin kernel."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mask = x > 0
        yes, no = torch.tensor(True), torch.tensor(False)
        return (torch.where(mask & yes, x, 0.0), torch.where(mask & no, x, 1.0), torch.where(mask | no, x, 2.0),
                torch.where(mask | yes, x, 3.0))


def test_a_mask_and_a_bool_number_import_as_kernels_and_match_eager():
    x = torch.randn(4, 6, 8)
    imp = from_torch(MaskAndNumber(), (x,), verbose=False)
    assert not imp.opaque, imp.translation.declined
    got = imp.outputs(evaluate(imp.graph, imp.inputs(x)))
    for ours, want in zip(got, MaskAndNumber()(x)):
        np.testing.assert_array_equal(ours, want.numpy())
