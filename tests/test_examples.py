"""The examples run as documented."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_custom_cost_model_example_drives_the_optimizer(capsys):
    runpy.run_path(str(EXAMPLES / "custom_cost_model.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    optimised = next(line for line in lines if line.strip().startswith("optimised"))
    assert optimised.split(":")[1].split()[0] == "0", "moving nothing is optimal when only bytes moved count"


def test_mlp_example_defines_a_graph():
    assert len(runpy.run_path(str(EXAMPLES / "mlp.py"))["graph"].ops) == 8


def test_gpt2_example_defines_a_model_for_the_cli():
    scope = runpy.run_path(str(EXAMPLES / "gpt2.py"))
    assert scope["model"].config.n_layer == 2 and scope["example_inputs"][0].dtype.is_floating_point is False


def test_train_mlp_example_runs_steps_on_two_ranks_and_matches_torch(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["train_mlp.py", "--steps", "2", "--nproc", "2"])
    scope = runpy.run_path(str(EXAMPLES / "train_mlp.py"))
    assert scope["main"]() == 0
    out = capsys.readouterr().out
    assert "after 2 steps on 2 ranks" in out  # run back to back on the ranks, the state carried where it was placed
    assert "0.weight: " in out  # how the steady plan keeps each parameter between steps


@pytest.mark.slow
def test_train_torchrun_example_resumes_from_its_checkpoint_as_if_uninterrupted(tmp_path):
    """Two torchrun ranks train 5 of 8 steps and stop (a checkpoint at step 3); a second run resumes there. The
    losses equal torch.optim.AdamW with clipping on one device under the same schedule and batches."""
    def torchrun(*args: str) -> dict[int, float]:
        source = os.pathsep.join(filter(None, [str(EXAMPLES.parent / "src"), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "TAPESTRY_PLAN_CACHE": str(tmp_path / "plans"), "PYTHONPATH": source}
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               str(EXAMPLES / "train_torchrun.py"), "--steps", "8", "--save-every", "3", "--eager",
                               "--checkpoint", str(tmp_path / "ckpt"), *args],
                              capture_output=True, text=True, env=env, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [line.split() for line in done.stdout.splitlines() if line.startswith("step ")]
        return {int(words[1]): float(words[3]) for words in lines}

    first = torchrun("--stop", "5")
    resumed = torchrun("--resume")
    assert sorted(first) == [0, 1, 2, 3, 4] and sorted(resumed) == [3, 4, 5, 6, 7]
    example = runpy.run_path(str(EXAMPLES / "train_torchrun.py"))
    model = example["build_model"]()
    opt = torch.optim.AdamW(model.parameters(), lr=example["PEAK_LR"], weight_decay=0.01)
    for i, (ids, labels) in enumerate(example["loader"](0, 8)):
        for group in opt.param_groups:
            group["lr"] = example["lr_at"](i, 8)
        opt.zero_grad()
        loss = example["loss_fn"](model(ids), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for run in (first, resumed):
            if i in run:
                assert abs(run[i] - loss.item()) <= 1e-5 * abs(loss.item()), (i, run[i], loss.item())
