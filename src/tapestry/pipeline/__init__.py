"""Pipeline parallelism found by cost: layers cut into stages over one mesh axis, micro-batches run under a
schedule (GPipe, 1F1B, interleaved 1F1B), recomputation per layer and mixed precision in the memory model.

    graph = pipeline.layer_step(block, x)          # one layer's training step, its input's gradient included
    result = tapestry.plan_pipeline(graph, layers=80, mesh=Mesh(8, 8), global_batch=512, cost_model=model)
    print(result.plan.describe()); result.plan.draw("schedule.png")

Layers: schedule and model are pure; layer prices a plan; planner runs the optimizer on each stage's sub-mesh.
"""
from __future__ import annotations

from tapestry.pipeline.layer import layer_cost, layer_step
from tapestry.pipeline.model import BF16, MIXED, LayerCost, Precision, partition, price
from tapestry.pipeline.planner import PipelinePlan, PipelineResult, plan_pipeline, stage_mesh
from tapestry.pipeline.schedule import SCHEDULES, Schedule, Timeline, simulate

__all__ = ["BF16", "MIXED", "SCHEDULES", "LayerCost", "PipelinePlan", "PipelineResult", "Precision", "Schedule",
           "Timeline", "layer_cost", "layer_step", "partition", "plan_pipeline", "price", "simulate", "stage_mesh"]
