"""FSDP's peak bytes per device on the 3-layer test Llama step (batch 2, sequence 8) on meshes the batch does not
divide: the figure the update on the stored shards (hand24c) lowers. Run from the repository root:
PYTHONPATH=src python benchmarks/fsdp_update_peak.py"""
from __future__ import annotations

import sys

sys.path.insert(0, "tests")

from test_layers_fold import llama_step  # noqa: E402

from tapestry.cost import peak_memory  # noqa: E402
from tapestry.sharding import Mesh  # noqa: E402
from tapestry.training.plans import fsdp, step_arguments  # noqa: E402

if __name__ == "__main__":
    step = llama_step(3)
    for shape in [(2, 2, 2), (4, 2)]:
        print("x".join(map(str, shape)), max(peak_memory(fsdp(step, Mesh(*shape), step_arguments(step)))))
