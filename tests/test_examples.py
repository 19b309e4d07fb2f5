"""The examples run as documented."""
from __future__ import annotations

import os
import re
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


def torchrun_example(folder: Path, *args: str, killed_after: int | None = None, nproc: int = 2, eager: bool = True
                     ) -> tuple[dict[int, float], str]:
    """examples/train_torchrun.py on `nproc` torchrun ranks, 8 steps, a checkpoint every 3, in `folder`: rank 0's
    loss by step, and torchrun's stderr. `killed_after`: SIGKILL rank 1 once rank 0 has printed that step (the run
    then fails); otherwise the run must succeed. `eager`: the ranks' programs run eager (not compiled)."""
    import signal

    source = os.pathsep.join(filter(None, [str(EXAMPLES.parent / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TAPESTRY_PLAN_CACHE": str(folder / "plans"), "PYTHONPATH": source}
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                            str(EXAMPLES / "train_torchrun.py"), "--steps", "8", "--save-every", "3",
                            *(["--eager"] if eager else []), "--checkpoint", str(folder / "ckpt"), *args],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out = []
        for line in run.stdout:
            out.append(line)
            if killed_after is not None and line.startswith(f"step {killed_after} "):
                os.kill(torchrun_ranks(run.pid)[1], signal.SIGKILL)
                break
        rest, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert (run.returncode != 0) == (killed_after is not None), err[-3000:]
    lines = [line.split() for line in ("".join(out) + rest).splitlines() if line.startswith("step ")]
    return {int(words[1]): float(words[3]) for words in lines}, err


def torchrun_ranks(agent: int) -> dict[int, int]:
    """The pid of each rank torchrun's agent (process `agent`) started, by rank (Linux: /proc)."""
    ranks = {}
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_text().split("\0")
        ranks[int(next(kv for kv in environ if kv.startswith("RANK="))[5:])] = int(child)
    return ranks


def assert_example_losses_equal_torch(*runs: dict[int, float], rtol: float = 1e-5) -> None:
    """Each run's loss at each step equals torch.optim.AdamW with clipping on one CPU under the example's
    schedule and batches, within `rtol` relative."""
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
        for run in runs:
            if i in run:
                assert abs(run[i] - loss.item()) <= rtol * abs(loss.item()), (i, run[i], loss.item())


@pytest.mark.slow
def test_train_torchrun_example_resumes_from_its_checkpoint_as_if_uninterrupted(tmp_path):
    """Two torchrun ranks train 5 of 8 steps and stop (a checkpoint at step 3); a second run resumes there. The
    losses equal torch.optim.AdamW with clipping on one device under the same schedule and batches."""
    first, _ = torchrun_example(tmp_path, "--stop", "5")
    resumed, _ = torchrun_example(tmp_path, "--resume")
    assert sorted(first) == [0, 1, 2, 3, 4] and sorted(resumed) == [3, 4, 5, 6, 7]
    assert_example_losses_equal_torch(first, resumed)


@pytest.mark.slow
def test_train_torchrun_example_with_a_rank_killed_resumes_from_its_last_whole_checkpoint(tmp_path):
    """Issue 26's kill-and-resume: rank 1 of 2 is SIGKILLed after step 4 (during step 5 or the save after it,
    which then leaves a folder without .metadata); rank 0 says where it stopped; a second run, on 4 ranks (another
    plan: DCP reshards), resumes from the last whole checkpoint, and every loss equals torch on one device."""
    first, err = torchrun_example(tmp_path, killed_after=4)
    assert re.search(r"tapestry: rank 0 stopped by \w+ (in|after) call \d of its parallel program; rank 1 \(pid "
                     r"\d+ on this host\) had already exited", err), err[-3000:]
    whole = max(int(p.parent.name.split("-")[1]) for p in (tmp_path / "ckpt").glob("step-*/.metadata"))
    resumed, _ = torchrun_example(tmp_path, "--resume", nproc=4)
    assert whole in (3, 6) and sorted(resumed) == list(range(whole, 8)) and set(first) >= set(range(5))
    assert_example_losses_equal_torch(first, resumed)


def test_train_torchrun_example_resumes_from_the_last_checkpoint_every_rank_finished(tmp_path):
    """A rank killed during dcp.save leaves a step folder without the .metadata written last: not a checkpoint."""
    latest = runpy.run_path(str(EXAMPLES / "train_torchrun.py"))["latest"]
    for step, whole in ((3, True), (6, True), (9, False)):
        (tmp_path / f"step-{step}").mkdir()
        if whole:
            (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"")
    assert latest(tmp_path) == tmp_path / "step-6"
