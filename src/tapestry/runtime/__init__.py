"""Running plans on torch.distributed: spawn or torchrun launch, rank execution, the `run` command."""
from tapestry.runtime.execute import InputError, InputSource, RankReport, StepFailed, StepTime
from tapestry.runtime.launch import (
    Job, RankFailure, RunResult, default_backend, run_plan, run_plans,
    run_torchrun, spawn,
)

__all__ = ["InputError", "InputSource", "Job", "RankFailure", "RankReport", "RunResult", "StepFailed", "StepTime",
           "default_backend", "run_plan", "run_plans", "run_torchrun", "spawn"]
