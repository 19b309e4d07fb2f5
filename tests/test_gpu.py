"""On a CUDA GPU: plans run on nccl with inductor's triton kernels, give tapestry.evaluate's answer, and time their
steps with CUDA events. Skipped where there is no GPU, as in CI; docs/running.md says where they last ran."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import tapestry
from tapestry.cli import main
from tapestry.cost import load_profile
from tapestry.graph import Graph
from tapestry.lower import shard_function
from tapestry.models import mlp, seeds_example
from tapestry.plan import build_plan
from tapestry.runtime import default_backend, run_plan
from tapestry.runtime.launch import check_backend
from tapestry.sharding import Mesh

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_nccl_is_the_default_only_with_a_gpu_for_every_rank() -> None:
    gpus = torch.cuda.device_count()
    assert default_backend(gpus + 1) == "gloo"
    assert default_backend(1) == ("nccl" if gpus else "gloo")
    with pytest.raises(ValueError, match="nccl needs one GPU per rank"):
        check_backend("nccl", gpus + 1)


@needs_gpu
def test_a_compiled_plan_on_one_gpu_gives_the_reference_answer_and_times_each_step() -> None:
    g = mlp(depth=2, batch=64, width=32)
    result = run_plan(build_plan(g, Mesh(1)), backend="nccl", compile=True, warmup=1, repeat=3, timeout=300)
    want = tapestry.evaluate(g, tapestry.random_inputs(g))
    np.testing.assert_allclose(result.outputs["y"], want["y"], rtol=1e-4, atol=1e-4)
    steps = [t for t in result.ranks[0].steps if t.kind != "place"]
    assert steps and all(t.seconds >= 0 for t in steps)
    assert sum(t.seconds for t in steps) <= 1.5 * result.seconds  # events split the run's own span


@needs_gpu
def test_a_fused_float64_kernel_reading_a_transposed_view_runs_compiled_on_the_gpu() -> None:
    g = Graph()
    x, w, b = g.input("x", (8, 16), "float64"), g.input("w", (8, 12), "float64"), g.input("b", (12,), "float64")
    g.output("y", g.linear_relu(g.transpose(x, perm=(1, 0)), w, b))
    inputs = tapestry.random_inputs(g, seed=3)
    result = run_plan(build_plan(g, Mesh(1)), inputs, backend="nccl", compile=True, timeout=300)
    assert result.outputs["y"].dtype == np.float64
    np.testing.assert_allclose(result.outputs["y"], tapestry.evaluate(g, inputs)["y"], rtol=1e-12, atol=1e-12)


@needs_gpu
def test_a_compiled_shard_reads_slices_at_unaligned_offsets_of_a_gpu_buffer() -> None:
    """A shard's reads are slices of the buffers a rank holds, at any offset; inductor's kernels assume aligned
    inputs unless told otherwise, so the first call's blocks must be what it compiles for."""
    held = torch.randn(4, 37, device="cuda")
    a, b = held[1:3, 1:34], held[2:4, 3:36]
    fn = shard_function("add", (), True)
    torch.testing.assert_close(fn(a, b), a + b)
    torch.testing.assert_close(fn(a, b), a + b)  # compiled once, called again with the same blocks


@needs_gpu
def test_a_bfloat16_plan_runs_compiled_on_the_gpu() -> None:
    g = seeds_example(64, 32, 48, dtype="bfloat16")
    result = run_plan(build_plan(g, Mesh(1)), backend="nccl", compile=True, timeout=300)
    want = tapestry.evaluate(g, tapestry.random_inputs(g))["y"].astype(np.float32)
    got = result.outputs["y"].astype(np.float32)
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


@needs_gpu
def test_calibrate_measures_the_gpu_into_a_loadable_profile(tmp_path: Path) -> None:
    path = tmp_path / "gpu-test.json"
    assert main(["calibrate", "-o", str(path), "--device", "cuda", "--quick"]) == 0
    profile = load_profile(path)
    assert profile.name == "gpu-test" and profile.device.cores == 0
    assert profile.device.peak_flops > 0 and profile.device.mem_bandwidth > 0 and profile.device.launch_overhead > 0
    assert "--device cuda" in profile.provenance["command"] and profile.provenance["cuda"]


@needs_gpu
def test_the_training_example_on_one_gpu_runs_compiled_resumes_and_equals_torch(tmp_path: Path) -> None:
    """The persistent runtime on nccl: one torchrun rank on the GPU, its program compiled by inductor (with CUDA
    graphs), trains 5 of 8 AdamW steps, checkpoints with torch.distributed.checkpoint and resumes. The losses equal
    torch on one CPU within 1e-4 relative (the GPU's kernels sum in other orders over the 8 steps)."""
    from test_examples import assert_example_losses_equal_torch, torchrun_example

    first, _ = torchrun_example(tmp_path, "--stop", "5", nproc=1, eager=False)
    resumed, _ = torchrun_example(tmp_path, "--resume", nproc=1, eager=False)
    assert sorted(first) == [0, 1, 2, 3, 4] and sorted(resumed) == [3, 4, 5, 6, 7]
    assert_example_losses_equal_torch(first, resumed, rtol=1e-4)
