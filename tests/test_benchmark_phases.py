"""benchmarks/profile_optimize.py's --fold-phases names functions by "module:attribute": each must still exist, or
the profiler fails at start (`Explored._fused`, removed from the optimizer, crashed it)."""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_optimize.py"


def test_every_phase_the_profiler_folds_names_a_function_that_exists() -> None:
    spec = importlib.util.spec_from_file_location("profile_optimize", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    missing = []
    for name in script.FOLD_PHASES:
        module_name, attribute = name.split(":")
        owner: object = importlib.import_module(module_name)
        for part in attribute.split("."):
            owner = getattr(owner, part, None)
        if owner is None:
            missing.append(name)
    assert missing == []
