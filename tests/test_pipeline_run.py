"""Pipelined training steps (tapestry.parallelize_step with pipeline=, spmd/pipelined.py) on gloo ranks: the
stages, micro-batches and schedules of a plan run with torch.distributed.pipelining, and a step equals torch on
one device (the losses and the updated weights)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

import tapestry
from tapestry.models import llama_decoder
from tapestry.pipeline import MIXED, LayerCost, PipelinePlan, Schedule
from tapestry.plan import Place, Plan
from tapestry.spmd.launch import launch
from tapestry.testing.reference import torch_losses
from tapestry.spmd.pipelined import chunk_layers, split_points

VOCAB, BATCH, SEQ = 64, 8, 16
SGD = (torch.optim.SGD, {"lr": 0.1})  # gradients scaled wrongly show in the weights (Adam would normalise them away)
# Adam's first update is lr * g / (|g| + eps): with torch's eps of 1e-8 a gradient near zero turns a rounding
# difference (summed micro-batches against one batch) into up to lr; eps 1e-4 bounds that at lr / eps times it
ADAMW = (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-4})
Optimizer = tuple[type[torch.optim.Optimizer], dict[str, float]]
# a layer's cost, for plans made by hand (the runtime reads a plan's schedule, chunks and stage plan, not its price)
COST = LayerCost(forward=1.0, backward=2.0, update=0.0, params=1, state=2, slots=2, activations=2, boundary=1,
                 working=0, flops=1.0)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)) for _ in range(steps)]


def on_one_device(layers: int, steps: int, optimizer: Optimizer, dim: int = 32, max_norm: float | None = None
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = llama_decoder(VOCAB, dim=dim, layers=layers)
    make, options = optimizer
    optimizer = make(model.parameters(), **options)
    losses = []
    for ids, labels in batches(steps):
        optimizer.zero_grad()
        loss = cross_entropy(model(ids), labels)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def pipelined(schedule: Schedule | PipelinePlan, layers: int, steps: int, optimizer: Optimizer, dim: int = 32,
              ranks: int | None = None, max_norm: float | None = None
              ) -> tuple[list[float], dict[str, torch.Tensor], str]:
    """On each rank: `steps` pipelined steps from the same initial weights; the losses and the gathered weights."""
    torch.manual_seed(0)
    model = llama_decoder(VOCAB, dim=dim, layers=layers)
    data = batches(steps)
    step = tapestry.parallelize_step(model, cross_entropy, data[0], optimizer=optimizer[0], **optimizer[1],
                                     pipeline=schedule, mesh=ranks, max_norm=max_norm)
    held = held_blocks(step, schedule, model)
    losses = [float(step(ids, labels)) for ids, labels in data]
    return losses, step.module_state_dict(), repr(step), held


def held_blocks(step: Any, plan: Schedule | PipelinePlan, model: torch.nn.Module) -> dict[str, bool]:
    """Under a stage plan, before the first step: per weight of this rank's layers, whether it holds exactly
    the block of `model`'s weight that the stage plan gives its device (the rank's index on the stage's mesh)."""
    if not isinstance(plan, PipelinePlan) or plan.layer_plan is None:
        return {}
    device = dist.get_rank() % plan.stage_mesh.size
    planned = {s.input: s.layout.blocks[device] for s in plan.layer_plan.steps if isinstance(s, Place)}
    held = {}
    for name, p in step.parameters.items():
        path = name.split(".", 2)
        if path[0] == "layers":
            local = p.to_local() if isinstance(p, DTensor) else p
            held[name] = torch.equal(local, model.get_parameter(name)[planned[f"layer.{path[2]}"].slices()])
    return held


def check_against_torch(schedule: Schedule | PipelinePlan, layers: int, optimizer: Optimizer, steps: int = 2,
                        dim: int = 32, replicas: int = 1, max_norm: float | None = None) -> list[str]:
    """The ranks' losses and weights against torch's on one device, and under a stage plan the weights' blocks
    held against the plan's; each rank's repr of its step."""
    want_losses, want = on_one_device(layers, steps, optimizer, dim, max_norm)
    world = schedule.mesh.size if isinstance(schedule, PipelinePlan) else schedule.stages * replicas
    ranks = launch(pipelined, schedule, layers, steps, optimizer, dim, world, max_norm, nproc=world, timeout=300)
    for losses, weights, _, held in ranks:
        assert losses == pytest.approx(want_losses, abs=1e-5)
        assert set(weights) == set(want)
        for name, value in weights.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)
        assert all(held.values()), [name for name, kept in held.items() if not kept]
    return [described for _, _, described, _ in ranks]


def test_a_1f1b_step_on_two_ranks_equals_torch_on_one_device() -> None:
    check_against_torch(Schedule("1f1b", 2, 4), layers=4, optimizer=SGD)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [Schedule("gpipe", 2, 4), Schedule("gpipe", 4, 8), Schedule("1f1b", 4, 8),
                                      Schedule("interleaved", 2, 4, 2), Schedule("interleaved", 4, 4, 2)],
                         ids=lambda s: f"{s.name}-{s.stages}x{s.chunks}-m{s.micro_batches}")
def test_pipelined_steps_equal_torch_on_one_device(schedule: Schedule) -> None:
    check_against_torch(schedule, layers=8, optimizer=SGD)
    if schedule.name != "gpipe":
        check_against_torch(schedule, layers=8, optimizer=ADAMW)


@pytest.mark.slow
def test_data_parallel_replicas_of_a_pipeline_with_clipping_equal_torch() -> None:
    """4 ranks: 2 stages x 2 replicas, each replica half the batch; gradients clipped by the whole model's norm
    (max_norm 0.5 binds: the first step's gradient norm is 0.58)."""
    check_against_torch(Schedule("1f1b", 2, 2), layers=4, optimizer=SGD, replicas=2, max_norm=0.5)


@pytest.mark.slow
def test_stages_of_unequal_layer_counts_equal_torch() -> None:
    check_against_torch(Schedule("1f1b", 2, 4), layers=5, optimizer=SGD)


@pytest.mark.slow
def test_a_plan_from_plan_pipeline_runs_with_the_embedding_first_and_the_head_last() -> None:
    """plan_pipeline prices the embedding and the head with the layers (the model cut by pipeline.model_steps as
    the runtime cuts it); its plan's chunks run as planned."""
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.pipeline import model_steps

    dim = 64
    steps = model_steps(llama_decoder(VOCAB, dim=dim, layers=4), batches(1)[0], cross_entropy)
    assert steps.layers == 4
    result = tapestry.plan_pipeline(steps.layer, steps.layers, tapestry.Mesh(2), global_batch=BATCH,
                                    cost_model=DefaultCostModel(load_profile("gpu-h100-cluster")), stages=(2,),
                                    micro_batch_sizes=(BATCH // 4,), schedules=("1f1b", "gpipe"),
                                    memory_budget=None, pareto_points=1, budget=tapestry.Budget(seconds=20),
                                    first=steps.first, last=steps.last)
    plan = result.plan
    assert plan.ends.first is not None and plan.ends.last is not None
    assert plan.ends.last.params == dim * VOCAB + 2 * dim  # the head, the final norm and the input gate
    assert "+ last (head, loss)" in plan.describe()
    described = check_against_torch(plan, layers=4, optimizer=SGD, dim=dim)
    assert f"{plan.schedule.name}, 2 stages, {plan.schedule.micro_batches} micro-batches" in described[0]


def test_model_steps_needs_the_models_list_of_layers() -> None:
    from tapestry.pipeline import model_steps

    with pytest.raises(ValueError, match="LlamaDecoder.head is not a ModuleList of layers"):
        model_steps(llama_decoder(VOCAB, layers=2), batches(1)[0], cross_entropy, layers="head")


def test_chunks_come_from_the_plan_or_split_the_layers_evenly() -> None:
    assert chunk_layers(Schedule("1f1b", 2, 4), 5) == ((0, 1), (2, 3, 4))
    assert chunk_layers(Schedule("interleaved", 2, 4, 2), 8) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert list(split_points(((0, 1), (2, 3, 4)), "layers")) == ["layers.2"]
    with pytest.raises(ValueError, match="in order, each once"):
        split_points(((0, 2), (1,)), "layers")


def test_a_pipelined_step_refuses_a_mesh_that_is_not_a_multiple_of_its_stages() -> None:
    model = llama_decoder(VOCAB, layers=2)
    with pytest.raises(ValueError, match="runs 2 stages on a mesh of 2 devices .* got mesh 3"):
        tapestry.parallelize_step(model, cross_entropy, batches(1)[0], mesh=tapestry.Mesh(3),
                                  pipeline=Schedule("1f1b", 2, 4))
    with pytest.raises(TypeError, match="options of a planned step"):
        tapestry.parallelize_step(model, cross_entropy, batches(1)[0], pipeline=Schedule("1f1b", 2, 4),
                                  time_limit=5)


def save_after_one_step(schedule: Schedule | PipelinePlan, path: str, ranks: int | None = None) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    data = batches(1)
    step = tapestry.parallelize_step(llama_decoder(VOCAB, layers=4), cross_entropy, data[0],
                                     optimizer=ADAMW[0], **ADAMW[1], pipeline=schedule, mesh=ranks)
    step(*data[0])
    dcp.save(step.state_dict(), checkpoint_id=path)


def resume_for_one_step(schedule: Schedule | PipelinePlan, path: str) -> tuple[float, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(5)  # other initial weights: the checkpoint must replace them
    data = batches(2)
    step = tapestry.parallelize_step(llama_decoder(VOCAB, layers=4), cross_entropy, data[0],
                                     optimizer=ADAMW[0], **ADAMW[1], pipeline=schedule)
    state = copy.deepcopy(step.state_dict())  # dcp.load fills it in place: a copy leaves the step to load_state_dict
    dcp.load(state, checkpoint_id=path)
    step.load_state_dict(state)
    return step(*data[1]).item(), step.module_state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_checkpoint_saved_by_one_cut_resumes_under_another(tmp_path, replicas: int) -> None:  # noqa: ANN001
    """Saved with torch.distributed.checkpoint from 1F1B on 2 ranks (2 layers each; or 2 replicas of that on 4),
    loaded into interleaved on 2 ranks (4 chunks of 1: each rank holds other layers than it saved): the next step
    equals torch's second."""
    want_losses, want = on_one_device(4, 2, ADAMW)
    launch(save_after_one_step, Schedule("1f1b", 2, 2 if replicas > 1 else 4), str(tmp_path / "ckpt"),
           2 * replicas, nproc=2 * replicas, timeout=300)
    for loss, weights in launch(resume_for_one_step, Schedule("interleaved", 2, 4, 2), str(tmp_path / "ckpt"),
                                nproc=2, timeout=300):
        assert loss == pytest.approx(want_losses[1], abs=1e-5)
        for name, value in weights.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)


def forwards_per_layer(plan: PipelinePlan) -> tuple[dict[str, int], list[float], dict[str, torch.Tensor]]:
    """One step of `plan`: how often each of this rank's layers ran its forward, the loss, the weights."""
    torch.manual_seed(0)
    data = batches(1)
    step = tapestry.parallelize_step(llama_decoder(VOCAB, layers=4), cross_entropy, data[0], optimizer=SGD[0],
                                     **SGD[1], pipeline=plan)
    calls: dict[str, int] = {}
    for stage in step.stages:
        for i in step.chunks[stage.stage_index]:
            name = f"layers.{i}"
            calls[name] = 0
            stage.submod.get_submodule(f"{name}.q").register_forward_hook(
                lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    losses = [step(*data[0]).item()]
    return calls, losses, step.module_state_dict()


@pytest.mark.slow
def test_the_layers_a_plan_recomputes_run_their_forward_again_in_the_backward() -> None:
    plan = PipelinePlan(tapestry.Mesh(2), 0, Schedule("1f1b", 2, 4), ((0, 1), (2, 3)), (True, False, False, True),
                        MIXED, BATCH // 4, COST, None, 0.0, 0.0, (0.0, 0.0))
    want_losses, want = on_one_device(4, 1, SGD)
    ranks = launch(forwards_per_layer, plan, nproc=2, timeout=300)
    assert {**ranks[0][0], **ranks[1][0]} == {"layers.0": 8, "layers.1": 4, "layers.2": 4, "layers.3": 8}
    for _, losses, weights in ranks:
        assert losses == pytest.approx(want_losses, abs=1e-5)
        for name, value in weights.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)


class Logits(torch.nn.Module):
    """transformers' causal LM with its logits as the output (the pipeline's last stage hands them to the loss)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def hf_llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      use_cache=False)
    return Logits(transformers.LlamaForCausalLM(config).eval())


def train_hf(schedule: Schedule | None, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`steps` AdamW steps of transformers' LLaMA, pipelined (or, with no schedule, in torch on this process)."""
    model, data = hf_llama(), batches(steps)
    if schedule is None:
        losses = torch_losses(model, ADAMW[0](model.parameters(), **ADAMW[1]), cross_entropy, data)
        return losses, {name: p.detach().clone() for name, p in model.named_parameters()}
    step = tapestry.parallelize_step(model, cross_entropy, data[0], optimizer=ADAMW[0], **ADAMW[1],
                                     pipeline=schedule, layers="model.model.layers")
    return [step(ids, labels).item() for ids, labels in data], step.module_state_dict()


class Shared(torch.nn.Module):
    """Layers (those of `readers`) that read a tensor made before the first of them, as transformers' rotary
    tables are."""

    def __init__(self, readers: tuple[int, ...] = (0, 1, 2, 3)) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.readers = readers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        table = h.sin()
        for i, layer in enumerate(self.layers):
            h = layer(h) * table if i in self.readers else layer(h)
        return h


@pytest.mark.parametrize("readers", [(0, 1, 2, 3), (3,)])
def test_a_tensor_made_before_the_layers_is_handed_on_by_each_stage_between(readers: tuple[int, ...]) -> None:
    """After neighbours_only every stage reads only the stage before it (or the model's input), as torch's
    schedules require, whether the stages between read the tensor or not, and the stages still compute the
    module."""
    import operator

    from torch.distributed import pipelining

    from tapestry.spmd.pipelined import neighbours_only

    torch.manual_seed(0)
    model, x = Shared(readers), torch.randn(2, 4)
    pipe = pipelining.pipeline(model, mb_args=(x,), split_spec=split_points(((0,), (1,), (2,), (3,)), "layers"))

    def makers() -> list[set[int]]:
        stages = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
        found = []
        for stage in stages:
            made = set()
            for arg in stage.args:
                while arg.op == "call_function" and arg.target is operator.getitem:
                    arg = arg.args[0]
                if arg in stages:
                    made.add(stages.index(arg))
            found.append(made)
        return found

    assert makers()[3] == {0, 2}  # the tracer's cut: the last stage reads the table from stage 0
    neighbours_only(pipe.split_gm)
    assert makers() == [set(), {0}, {1}, {2}]
    torch.testing.assert_close(pipe(x)[0], model(x), rtol=0, atol=0)



def train_shared(schedule: Schedule | None, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`steps` SGD steps of Shared, pipelined (or, with no schedule, in torch on this process)."""
    torch.manual_seed(0)
    model, generator = Shared(), torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 4, generator=generator), torch.randn(8, 8, generator=generator)) for _ in range(steps)]
    mse = torch.nn.functional.mse_loss
    if schedule is None:
        losses = torch_losses(model, SGD[0](model.parameters(), **SGD[1]), mse, data)
        return losses, {name: p.detach().clone() for name, p in model.named_parameters()}
    step = tapestry.parallelize_step(model, mse, data[0], optimizer=SGD[0], **SGD[1], pipeline=schedule)
    return [step(x, y).item() for x, y in data], step.module_state_dict()


def test_the_gradient_of_a_tensor_handed_on_between_stages_reaches_the_stage_that_made_it() -> None:
    """Shared's table depends on the embedding's weights: its gradient from every later layer flows back through
    the stages that hand it on (interleaved, 4 chunks on 2 ranks) and the step equals torch's."""
    want_losses, want = train_shared(None, 2)
    for losses, weights in launch(train_shared, Schedule("interleaved", 2, 2, chunks=2), 2, nproc=2, timeout=120):
        assert losses == pytest.approx(want_losses, abs=1e-6)
        for name, value in weights.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=1e-6, msg=name)

@pytest.mark.slow
@pytest.mark.parametrize("schedule, ranks", [
    (Schedule("1f1b", 2, 4), 2),
    (Schedule("1f1b", 4, 4), 4),
    (Schedule("interleaved", 2, 4, chunks=2), 2),
])
def test_transformers_llama_pipelined_equals_torch(schedule: Schedule, ranks: int) -> None:
    """Rotary tables and the causal mask, made before the first layer, reach every stage: on 2 stages the tracer
    sends them with the hidden states; on more, each stage hands them on to the next (torch's schedules send
    only between neighbours)."""
    want_losses, want = train_hf(None, 3)
    for losses, weights in launch(train_hf, schedule, 3, nproc=ranks, timeout=600):
        assert losses == pytest.approx(want_losses, abs=1e-5)
        assert set(weights) == set(want)
        for name, value in weights.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_the_pipeline_example_plans_and_trains() -> None:
    """examples/pipeline_torchrun.py --plan on 2 ranks: plan_pipeline's plan, with the embedding and the head
    placed, runs; the losses are finite and printed by rank 0."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(root / "examples" / "pipeline_torchrun.py"), "--nproc", "2",
                           "--steps", "2", "--plan"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "+ last (head, loss)" in done.stdout
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)


# -- stages of several devices, each laid out by its stage plan (spmd/stage_plan.py) -----------------------------


def layer_plan(strategy: str, dim: int = 32) -> Plan:
    """training.plans' `strategy` for one llama_decoder block's step (pipeline.layer_step) on a stage of 2."""
    from tapestry.importer.zoo import LlamaBlock
    from tapestry.pipeline import layer_step
    from tapestry.training import plans

    graph = layer_step(LlamaBlock(dim, 4, 64), torch.zeros(BATCH // 4, SEQ, dim))
    if strategy == "megatron":  # column-parallel q, k, v, gate, up; row-parallel o, down
        cut = {"q": 0, "k": 0, "v": 0, "o": 1, "gate": 0, "up": 0, "down": 1}
        return plans.megatron(graph, tapestry.Mesh(2), {f"layer.{name}.weight": d for name, d in cut.items()})
    arguments = [n.name for n in graph.inputs if n.name not in graph.carried.values() and n.name != "lr"
                 and n.name not in graph.constants]
    return getattr(plans, strategy)(graph, tapestry.Mesh(2), arguments)


def on_stages_of_two(stage_plan: Plan, schedule: Schedule, layers: int) -> PipelinePlan:
    """`schedule` over mesh axis 0 of 2x2: 2 stages of 2 devices each, every layer laid out by `stage_plan`."""
    return PipelinePlan(tapestry.Mesh(2, 2), 0, schedule, chunk_layers(schedule, layers), (False,) * layers, MIXED,
                        BATCH // schedule.micro_batches, COST, stage_plan, 0.0, 0.0, (0.0, 0.0))


@pytest.mark.slow
@pytest.mark.parametrize("strategy, schedule, layers, placed", [
    ("megatron", Schedule("1f1b", 2, 4), 4, {"q.weight": (Shard(0),), "o.weight": (Shard(1),),
                                             "down.weight": (Shard(1),), "read q.weight": (Shard(0),),
                                             "input": (Replicate(),)}),
    ("data_parallel", Schedule("interleaved", 2, 4, 2), 8, {"q.weight": (Replicate(),), "input": (Shard(0),)}),
    ("zero3", Schedule("interleaved", 2, 4, 2), 4, {"q.weight": (Shard(0),), "read q.weight": (Replicate(),),
                                                    "input": (Shard(0),)}),
], ids=["megatron-1f1b", "data-parallel-interleaved", "zero3-interleaved"])
def test_stages_of_two_devices_run_their_stage_plan_and_equal_torch(strategy: str, schedule: Schedule, layers: int,
                                                                     placed: dict[str, Any]) -> None:
    """4 gloo ranks, 2 stages x 2 devices: each layer's weights are DTensors in the stage plan's layouts (each
    rank holds the block the plan gives its device), read as the plan's forward reads them (ZeRO-3: gathered),
    its input in the plan's (tensor parallel: whole; data parallel and ZeRO-3: the micro-batch split), and the
    step equals torch on one device: SGD, AdamW (its moments sharded with the weights), clipping by the whole
    model's norm and recomputed layers."""
    from dataclasses import replace

    from tapestry.spmd.stage_plan import layer_placements

    plan = on_stages_of_two(layer_plan(strategy), schedule, layers)
    if strategy == "zero3":  # the first and last layers recompute their forward, gathering their weights again
        plan = replace(plan, recompute=(True, False, False, True))
    layouts = layer_placements(plan.layer_plan, llama_decoder(VOCAB, layers=1).layers[0])
    read = {f"read {path}": computed for path, computed in layouts.computed.items()}
    assert {**layouts.weights, **read, "input": layouts.activation}.items() >= placed.items()
    described = check_against_torch(plan, layers, SGD, max_norm=0.5 if strategy == "zero3" else None)
    assert "2 stages, each stage on 2 devices by its plan" in described[0]
    if strategy == "megatron":
        check_against_torch(plan, layers, ADAMW)


@pytest.mark.slow
def test_a_plan_pipeline_plan_on_2x2_runs_each_stage_under_the_stage_plan_it_chose() -> None:
    """plan_pipeline over axis 0 of 2x2 plans the layer on a stage's 2 devices (at width 512 the optimizer shards
    the weights); the plan runs as chosen, each rank holding the blocks the stage plan gives its device."""
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.pipeline import model_steps

    dim = 512
    steps = model_steps(llama_decoder(VOCAB, dim=dim, layers=4), batches(1)[0], cross_entropy)
    result = tapestry.plan_pipeline(steps.layer, steps.layers, tapestry.Mesh(2, 2), global_batch=BATCH,
                                    cost_model=DefaultCostModel(load_profile("gpu-h100-cluster")), stages=(2,),
                                    micro_batch_sizes=(BATCH // 4,), schedules=("1f1b", "interleaved"),
                                    memory_budget=None, pareto_points=1, budget=tapestry.Budget(seconds=20),
                                    first=steps.first, last=steps.last)
    plan = result.plan
    assert plan.stage_mesh == tapestry.Mesh(2) and plan.layer_plan is not None
    described = check_against_torch(plan, layers=4, optimizer=SGD, dim=dim)
    assert "each stage on 2 devices by its plan" in described[0]


def test_a_stage_plan_that_cannot_run_in_a_stage_is_refused_naming_what_is_missing() -> None:
    """What a stage of several devices does not run is refused before any rank starts: stages over an inner
    mesh axis, a plan with no stage plan, another mesh, a weight laid out with no DTensor form, a stage plan for
    another layer."""
    from dataclasses import replace

    from tapestry.importer.zoo import LlamaBlock
    from tapestry.sharding import Layout
    from tapestry.spmd.stage_plan import layer_placements
    from tapestry.training.plans import placed
    from tapestry.zspace import ZRange

    megatron = layer_plan("megatron")
    plan = on_stages_of_two(megatron, Schedule("1f1b", 2, 4), 4)

    def run(pipeline: PipelinePlan, mesh: tapestry.Mesh = tapestry.Mesh(2, 2)) -> None:
        tapestry.parallelize_step(llama_decoder(VOCAB, layers=4), cross_entropy, batches(1)[0], mesh=mesh,
                                  pipeline=pipeline)

    with pytest.raises(ValueError, match="stages over mesh axis 1 of 2x2: stages over an inner axis .* do not run"):
        run(replace(plan, axis=1))
    with pytest.raises(ValueError, match="each stage on 2 .* has no stage plan"):
        run(replace(plan, stage_plan=None))
    with pytest.raises(ValueError, match="planned for mesh 2x2 .* given mesh 2$"):
        run(plan, tapestry.Mesh(2))
    uneven = Layout((ZRange([0, 0], [10, 32]), ZRange([10, 0], [32, 32])))
    with pytest.raises(ValueError, match=r"lays weight 'layer.q.weight' out as .* no DTensor form"):
        layer_placements(placed(megatron, {"layer.q.weight": uneven}), LlamaBlock(32, 4, 64))
    with pytest.raises(ValueError, match=r"'layer.attn_norm.weight' has shape \[32\]; the layer's attn_norm.weight "
                                         r"has \[64\]: it was planned for another layer"):
        layer_placements(megatron, LlamaBlock(64, 4, 64))


@pytest.mark.slow
def test_a_checkpoint_of_stages_under_a_stage_plan_resumes_one_rank_per_stage_and_back(tmp_path: Path) -> None:
    """Saved (torch.distributed.checkpoint) from 2 stages x 2 devices under the Megatron stage plan (weights and
    AdamW moments as DTensors, split) and loaded into 1F1B on 2 ranks (whole tensors); and the other way round:
    the next step equals torch's second either way."""
    want_losses, want = on_one_device(4, 2, ADAMW)
    planned = on_stages_of_two(layer_plan("megatron"), Schedule("1f1b", 2, 4), 4)
    plain = Schedule("1f1b", 2, 4)

    def ranks(pipeline: Schedule | PipelinePlan) -> int:
        return pipeline.mesh.size if isinstance(pipeline, PipelinePlan) else pipeline.stages

    for k, (saved, loaded) in enumerate(((planned, plain), (plain, planned))):
        path = str(tmp_path / f"checkpoint{k}")
        launch(save_after_one_step, saved, path, ranks(saved), nproc=ranks(saved), timeout=300)
        for loss, weights in launch(resume_for_one_step, loaded, path, nproc=ranks(loaded), timeout=300):
            assert loss == pytest.approx(want_losses[1], abs=1e-5)
            for name, value in weights.items():
                torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)
