"""Pipeline parallelism found by cost: layers cut into stages over one mesh axis, micro-batches run under a
schedule (GPipe, 1F1B, interleaved 1F1B), recomputation per layer and mixed precision in the memory model.

    graph = pipeline.layer_step(block, x)          # one layer's training step, its input's gradient included
    result = tapestry.plan_pipeline(graph, layers=80, mesh=Mesh(8, 8), global_batch=512, cost_model=model)
    print(result.plan.describe()); result.plan.draw("schedule.png")

Layers: schedule and model are pure; layer prices a plan; planner runs the optimizer on each stage's sub-mesh.
"""
from __future__ import annotations

import importlib
from typing import Any

# Names load on first use: a rank that runs a pipelined step (spmd.pipelined) needs the schedule, not the planner
# and the optimizer it imports.
_LAZY = {"first_step": "layer", "last_step": "layer", "layer_cost": "layer", "layer_step": "layer",
         "ModelSteps": "layer", "model_steps": "layer",
         "BF16": "model", "MIXED": "model", "Ends": "model", "LayerCost": "model", "Precision": "model",
         "partition": "model", "price": "model", "PipelinePlan": "planner", "PipelineResult": "planner",
         "plan_pipeline": "planner", "stage_mesh": "planner", "SCHEDULES": "schedule", "Schedule": "schedule",
         "Timeline": "schedule", "simulate": "schedule"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BF16", "MIXED", "SCHEDULES", "Ends", "LayerCost", "ModelSteps", "PipelinePlan", "PipelineResult",
           "Precision", "Schedule", "Timeline", "first_step", "last_step", "layer_cost", "layer_step", "model_steps",
           "partition", "plan_pipeline", "price", "simulate", "stage_mesh"]
