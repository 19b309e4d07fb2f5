"""Launching ranks from any kind of program, and stopping them: nothing of a run may be left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import tapestry
from tapestry.cli import main
from tapestry.plan import Plan, build_plan
from tapestry.runtime import run_plan
from tapestry.runtime.launch import Surroundings, _rank_context
from tapestry.sharding import Mesh

ROOT = Path(__file__).resolve().parent.parent
TAPESTRY = str(Path(sys.executable).parent / "tapestry")

# No `if __name__ == "__main__":` guard: spawned ranks must not run this again.
SCRIPT = """
import tapestry
from tapestry.plan import build_plan
g = tapestry.Graph()
g.output("y", g.relu(g.matmul(g.input("a", (8, 6)), g.input("b", (6, 4)))))
plan = build_plan(g, tapestry.Mesh(2), {"matmul_0": (0,), "relu_0": (None,)})
print("ran", tapestry.run_plan(plan, compile=False, timeout=120).outputs["y"].shape)
"""


def _python(*args: str, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=300, cwd=cwd)


# One way in make test: the launcher hides __main__ from the ranks however the program started (launch.py
# `_main_module_hidden`); stdin and `python -c` (a process and two ranks each, 18-20 s in CI) in make test-all.
@pytest.mark.parametrize("how", ["script", *(pytest.param(how, marks=pytest.mark.slow) for how in ("stdin", "-c"))])
def test_a_plan_runs_on_two_ranks_from_a_script_without_a_main_guard(tmp_path: Path, how: str):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    done = {"script": lambda: _python(str(script), cwd=tmp_path),
            "stdin": lambda: _python("-", stdin=SCRIPT, cwd=tmp_path),
            "-c": lambda: _python("-c", SCRIPT, cwd=tmp_path)}[how]()
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("ran (8, 4)") == 1  # once: the ranks never ran the script


def _session(leader: int) -> list[int]:
    """Every live process in the session `leader` started (its own pid is the session id)."""
    return list(_session_parents(leader))


def _session_parents(leader: int) -> dict[int, int]:
    """The live processes of the session `leader` started, each with its parent's pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == leader and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, session
                found[int(entry.name)] = int(fields[1])
    return found


def _ranks(launcher: int) -> list[int]:
    """The ranks of a run: the processes the launcher's forkserver forked (the launcher's own children are the
    forkserver and multiprocessing's resource tracker)."""
    return [pid for pid, parent in _session_parents(launcher).items() if launcher not in (pid, parent)]


def _slow_plan(path: Path) -> Path:
    """Seconds of work a rank (60 matmuls of 512x1024 by 1024x1024): long enough that both ranks are seen alive
    (40 exps of 256x256 matmuls ended in milliseconds, and once in CI before a poll saw both), short enough that
    after SIGKILL they end by themselves well within the wait below."""
    g = tapestry.Graph()
    value, weight = g.input("x", (1024, 1024)), g.input("w", (1024, 1024))
    for _ in range(60):
        value = g.tanh(g.matmul(value, weight))
    g.output("y", value)
    build_plan(g, Mesh(2), {op.name: (0,) for op in g.ops}).save(path)
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
# SIGINT unwinds the launcher through the same cleanup as SIGTERM (`reaped`), by Python's KeyboardInterrupt: make
# test-all (each case is a `tapestry run` process and its forkserver, some 40 s of wall at load).
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGKILL])
def test_after_sigterm_sigint_or_sigkill_no_process_of_a_run_is_left(tmp_path: Path, sig: signal.Signals):
    """SIGKILL leaves the launcher no cleanup: its ranks end by themselves (their parent, the forkserver, outlives
    the launcher while they run)."""
    plan = _slow_plan(tmp_path / "plan.json")
    run = subprocess.Popen([TAPESTRY, "run", str(plan), "--no-compile", "--timeout", "300"], start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(_ranks(run.pid)) < 2 and time.monotonic() < deadline:  # both ranks are up
            time.sleep(0.05)
        if len(_ranks(run.pid)) < 2 and run.poll() is not None:  # seen once in CI (2026-11-28): say how it ended
            pytest.fail(f"the run ended (exit {run.returncode}) before both ranks were seen; stderr: "
                        f"{run.stderr.read().decode()[-2000:]}")
        assert len(_ranks(run.pid)) == 2, f"the ranks never started: {_session_parents(run.pid)}"
        run.send_signal(sig)
        run.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _session(run.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _session(run.pid) == [], f"left running after {sig.name}: {_session(run.pid)}"
        assert run.returncode != 0
    finally:
        for pid in _session(run.pid):
            os.kill(pid, signal.SIGKILL)


def test_zero_ranks_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    g = tapestry.Graph()
    g.output("y", g.relu(g.input("x", (4, 4))))
    plan = build_plan(g, Mesh(1), {"relu_0": (None,)})
    with pytest.raises(ValueError, match="nproc must be at least 1, got 0"):
        run_plan(plan, nproc=0)
    plan.save(tmp_path / "plan.json")
    with pytest.raises(SystemExit):
        main(["run", str(tmp_path / "plan.json"), "--nproc", "0"])
    assert "--nproc: must be at least 1, got 0" in capsys.readouterr().err


def test_verify_passes_where_both_sides_are_nan_and_inputs_from_npy_files_raise_no_warning(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    """In process (the ranks' stderr is this process's): the sigterm tests above spawn `tapestry run`."""
    g = tapestry.Graph()
    g.output("y", g.log(g.input("x", (8, 4))))  # log of negative inputs: NaN on both sides
    plan = build_plan(g, Mesh(2), {"log_0": (0,)})
    plan.save(tmp_path / "plan.json")
    x = tapestry.random_inputs(g)["x"]
    assert np.isnan(tapestry.evaluate(g, {"x": x})["y"]).any()
    (tmp_path / "in").mkdir()
    np.save(tmp_path / "in" / "x.npy", x)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = main(["run", str(tmp_path / "plan.json"), "--no-compile", "--verify",
                       "--inputs", str(tmp_path / "in")])
    done = capfd.readouterr()
    assert status == 0, done.out + done.err
    assert "verify y:" in done.out and "ok" in done.out
    hidden_by_default = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
    assert [str(w.message) for w in caught if not issubclass(w.category, hidden_by_default)] == []
    assert "not writable" not in done.err and "Warning" not in done.err, done.err
    Plan.load(tmp_path / "plan.json")


def _echo(surroundings: Surroundings, name: str) -> None:
    """In a rank forked from the forkserver: the variable `name` as the rank sees it, on its stderr."""
    surroundings.take_on()
    os.write(2, f"{name}={os.environ.get(name)}\n".encode())


def test_a_rank_takes_the_launchers_environment_and_stderr_as_they_are_when_it_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The forkserver keeps the environment and descriptors it started with; a rank must see the launcher's now
    (a variable set since, a test's captured stderr)."""
    ctx = _rank_context()
    started = ctx.Process(target=_echo, args=(Surroundings(dict(os.environ)), "TAPESTRY_ECHO"))
    started.start()  # the forkserver runs from here on (or already did)
    started.join()
    monkeypatch.setenv("TAPESTRY_ECHO", "set after the server started")
    saved = os.dup(2)
    with open(tmp_path / "stderr", "w") as err:
        os.dup2(err.fileno(), 2)
        try:
            rank = ctx.Process(target=_echo, args=(Surroundings(dict(os.environ)), "TAPESTRY_ECHO"))
            rank.start()
            rank.join(timeout=120)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    assert rank.exitcode == 0
    assert (tmp_path / "stderr").read_text() == "TAPESTRY_ECHO=set after the server started\n"
