"""The examples run as documented."""
from __future__ import annotations

import runpy
from pathlib import Path

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
