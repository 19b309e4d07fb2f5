"""The persistent SPMD runtime: each rank's program as one compiled function, run in the user's process group.

A layer above plan, lower, runtime.launch, importer and the optimizer; nothing below imports it. Its modules:

- `trace`: the engine. `RankFunction.of(lowered, rank, make_groups(lowered))` is one rank's steps as a pure
  `fn({buffer: block}) -> {buffer: block}`, shard kernels through their torch lowering and every communication
  step a functional collective; `compiled(fn)` makes it one FX graph compiled whole by inductor (no dynamo); `place`
  slices a rank's blocks from whole tensors.
- `program`: `ParallelProgram(plan, state, deliver=, carry=, compile=)`, made once per rank: state placed once,
  prepared steps run once, called with new whole inputs, the delivered outputs whole on every rank, carried
  outputs left where the plan puts them (a training step's weights and optimizer state); `join_group`.
- `planning`: `shared_plan(graph, mesh, **optimize_options)`: planned on rank 0 (or read from the plan cache)
  and broadcast as plan JSON.
- `module`: `parallelize(module, example_args, mesh=)` -> `ParallelModule` (inference).
- `launch`: `launch(fn, *args, nproc=N)`: local gloo ranks for scripts and notebooks, supervised.
- `faults`: outside `launch` (torchrun), a rank's stop names the rank, its call and the local ranks already gone,
  even when torchrun's SIGTERM finds it blocked in a collective.
- `check`: `check_collectives(lowered)`: every rank's function traced on meta tensors under torch's fake process
  group, in one process, and its collectives matched across ranks (`tapestry lower PLAN --check-collectives`).
"""
from tapestry.spmd.trace import RankFunction, buffer_dtypes, compiled, make_groups, place

__all__ = ["RankFunction", "buffer_dtypes", "compiled", "make_groups", "place"]
