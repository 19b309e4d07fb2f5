"""Running a script under several PYTHONHASHSEED values, shared by the tests that a plan does not depend on the
hash seed (test_hash_seed, test_layers_fold, test_experts)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def plans_under_seeds(script: str, seeds: list[int]) -> dict[int, str]:
    """The last stdout line of `script` run under each PYTHONHASHSEED (concurrently), or its error."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    runs = {seed: subprocess.Popen([sys.executable, "-c", script], env={**env, "PYTHONHASHSEED": str(seed)},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in seeds}
    found = {}
    for seed, run in runs.items():
        out, err = run.communicate(timeout=600)
        found[seed] = out.strip().splitlines()[-1] if run.returncode == 0 else f"failed: {err.strip()[-600:]}"
    return found
