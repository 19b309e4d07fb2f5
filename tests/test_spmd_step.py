"""tapestry.parallelize_step: a training step run persistently on gloo ranks equals torch.optim on one device,
its state saves and loads with torch.distributed.checkpoint (sharded as DTensor), and resumes on another plan."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

import tapestry
from tapestry.sharding import Mesh
from tapestry.spmd.launch import launch
from tapestry.spmd.state import local_block, placements
from tapestry.training.plans import data_parallel, zero3
from tapestry.zspace import ZRange



def torch_block(shape: tuple[int, ...], placed: tuple, mesh: Mesh, rank: int) -> ZRange:
    """DTensor's own answer: the local shard's shape and global offset on device `rank`."""
    size, offset = _compute_local_shape_and_global_offset(shape, mesh.shape, list(mesh.coords(rank)), placed)
    return ZRange(offset, [o + s for o, s in zip(offset, size)])


@pytest.mark.parametrize(("shape", "mesh", "want"), [
    ((8, 6), Mesh(2), (Replicate(),)),
    ((8, 6), Mesh(2), (Shard(0),)),
    ((8, 6), Mesh(2, 2), (Shard(1), Replicate())),
    ((8, 6), Mesh(2, 2), (Replicate(), Shard(0))),
    ((8, 6), Mesh(2, 2), (Shard(0), Shard(0))),  # nested: the second axis cuts the first's pieces
    ((8, 6), Mesh(2, 2), (Shard(0), Shard(1))),
    ((7, 6), Mesh(2), (Shard(0),)),  # torch.chunk's uneven pieces: 4 and 3
])
def test_the_blocks_dtensor_gives_are_read_back_as_its_placements(shape, mesh, want):
    blocks = [torch_block(shape, want, mesh, rank) for rank in mesh.devices]
    assert [local_block(shape, want, mesh, rank) for rank in mesh.devices] == blocks
    assert placements(shape, blocks, mesh) == want


def test_blocks_with_no_dtensor_form_are_refused():
    mesh = Mesh(2)
    assert placements((7, 6), [ZRange((0, 0), (3, 6)), ZRange((3, 0), (7, 6))], mesh) is None  # 3 and 4, not 4 and 3
    assert placements((8, 6), [ZRange((0, 0), (8, 6)), None], mesh) is None  # a rank holds none
    assert placements((8, 6), [ZRange((0, 0), (4, 3)), ZRange((4, 3), (8, 6))], mesh) is None  # two dims move


# -- the step on gloo ranks -------------------------------------------------------------------------------------
ARGS = ("arg0", "arg1")  # the step's batch inputs
PLANS = {  # hand-built plans (training/plans.py), so each test knows the layout it checks
    "data_parallel": lambda graph, mesh: data_parallel(graph, mesh, ARGS),
    "zero3": lambda graph, mesh: zero3(graph, mesh, ARGS),
}
OPTIONS = {"lr": 1e-2, "weight_decay": 0.05}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A new batch every step."""
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def schedule(i: int) -> float:
    return OPTIONS["lr"] * (0.5 + 0.5 * (i % 3))


def torch_run(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: torch.optim.AdamW on one device under the same schedule."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), **OPTIONS)
    losses = []
    for i, (x, y) in enumerate(batches(steps)):
        for group in opt.param_groups:
            group["lr"] = schedule(i)
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def make_step(plan: str | None, nproc: int) -> tapestry.spmd.step.ParallelStep:
    return tapestry.parallelize_step(mlp(), mse, batches(1)[0], mesh=tapestry.Mesh(nproc), optimizer=torch.optim.AdamW,
                                     plan=PLANS[plan] if plan else None, compile=False, cache=False, **OPTIONS)


def train(plan: str | None, nproc: int, steps: range, load: str | None = None, save: str | None = None,
          full: bool = False) -> dict:
    """On each rank: a fresh step (resumed from checkpoint `load`, read as whole tensors with `full`), trained on
    `steps`, saved to `save`."""
    step = make_step(plan, nproc)
    if load:
        state = step.state_dict(full=full)  # DTensors share the step's buffers (DCP loads in place); full: copies
        dcp.load(state, checkpoint_id=load)
        step.load_state_dict(state)
    losses = [step(x, y, lr=schedule(i)) for i, (x, y) in enumerate(batches(steps.stop)) if i in steps]
    if save:
        dcp.save(step.state_dict(), checkpoint_id=save)
    placed = {k: tuple(v.placements) if isinstance(v, DTensor) else None for k, v in step.state_dict()["model"].items()}
    return {"losses": losses, "module": step.module_state_dict(), "placements": placed}


def test_ten_adamw_steps_under_a_schedule_on_two_ranks_equal_torch():
    want, weights = torch_run(10)
    for rank, got in enumerate(launch(train, 2, None, 2, range(10))):
        assert all(isinstance(loss, torch.Tensor) and loss.dim() == 0 for loss in got["losses"])
        losses = [float(v) for v in got["losses"]]
        np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-5, err_msg=f"rank {rank}")
        model = mlp()
        model.load_state_dict(got["module"])  # full tensors in the module's own names
        for name, value in weights.items():
            torch.testing.assert_close(got["module"][name], value, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")


def test_a_checkpoint_resumes_on_another_plan_and_mesh_as_if_uninterrupted(tmp_path):
    want, _ = torch_run(10)
    first = launch(train, 2, "zero3", 2, range(5), None, str(tmp_path / "zero3"))
    assert set(first[0]["placements"].values()) == {(Shard(0),)}, "ZeRO-3 keeps its state sharded: saved as shards"
    for plan, nproc, full in (("data_parallel", 2, False), ("zero3", 2, True), ("data_parallel", 1, True)):
        resumed = launch(train, nproc, plan, nproc, range(5, 10), str(tmp_path / "zero3"), None, full)
        got = [float(v) for v in first[0]["losses"] + resumed[0]["losses"]]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"resumed on {plan} x{nproc}")


class TiedLM(torch.nn.Module):
    """An embedding whose weight the output head reuses, and a float buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("shift", torch.randn(8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids) + self.shift))


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


IDS = [torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(k)) for k in range(4)]


def train_tied() -> dict:
    step = tapestry.parallelize_step(TiedLM(), token_loss, (IDS[0], IDS[0]), optimizer=torch.optim.SGD, lr=0.5,
                                     momentum=0.9, compile=False, plan=PLANS["zero3"])  # the tied weight split
    losses = [float(step(ids, ids)) for ids in IDS]
    try:
        step(IDS[0][:2], IDS[0][:2])
    except ValueError as err:
        refused = str(err)
    module = TiedLM()
    module.load_state_dict(step.module_state_dict())  # strict: every name, the tied head's included
    return {"losses": losses, "module": module.state_dict(), "refused": refused,
            "still_tied": module.head.weight is module.embed.weight}


def test_a_tied_model_trains_on_two_ranks_and_its_module_state_loads_into_the_module():
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    want = []
    for ids in IDS:
        opt.zero_grad()
        loss = token_loss(model(ids), ids)
        loss.backward()
        opt.step()
        want.append(loss.item())
    for rank, got in enumerate(launch(train_tied, 2)):
        np.testing.assert_allclose(got["losses"], want, rtol=1e-5, atol=1e-6)
        assert got["still_tied"]
        torch.testing.assert_close(got["module"]["embed.weight"], model.embed.weight.detach(), rtol=1e-5, atol=1e-6)
        assert got["refused"] == (f"rank {rank}, call 4: batch tensor 0 (arg0): expected shape [4, 6] (the example "
                                  "batch's: the step is planned for it), given [2, 6]")


def refuse_on_rank_one(call: int) -> None:
    step = tapestry.parallelize_step(TiedLM(), token_loss, (IDS[0], IDS[0]), optimizer=torch.optim.SGD, lr=0.5,
                                     compile=False, plan=PLANS["data_parallel"])
    for k, ids in enumerate(IDS):
        step(*(ids[:2], ids[:2]) if (k, torch.distributed.get_rank()) == (call, 1) else (ids, ids))


def test_a_batch_refused_on_one_rank_stops_every_rank_naming_the_rank_and_the_call():
    with pytest.raises(tapestry.spmd.launch.RankFailure, match=r"rank 1 failed in call 2 of its parallel program: "
                       r"ValueError: rank 1, call 2: batch tensor 0 \(arg0\): expected shape \[4, 6\]"):
        launch(refuse_on_rank_one, 2, nproc=2, timeout=120)


def train_compiled() -> list[float]:
    step = tapestry.parallelize_step(mlp(), mse, batches(1)[0], mesh=tapestry.Mesh(2), optimizer=torch.optim.AdamW,
                                     plan=PLANS["zero3"], **OPTIONS)  # compile=True: the default
    return [float(step(x, y, lr=schedule(i))) for i, (x, y) in enumerate(batches(3))]


@pytest.mark.slow
def test_the_compiled_step_equals_torch():
    """Each rank's step compiled whole by torch.compile (a cold compile took 191 s on the loaded 2-core machine)."""
    want, _ = torch_run(3)
    for got in launch(train_compiled, nproc=2, timeout=900):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# -- dropout: masks drawn every call, as eager torch draws them ----------------------------------------------------
def dropout_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.GELU(), torch.nn.Linear(32, 4))


def torch_dropout_run(model: torch.nn.Module, loss_fn, data: list, seed: int) -> list[float]:
    """The reference: torch.optim.AdamW on one device, its dropout drawn after torch.manual_seed(seed)."""
    opt = torch.optim.AdamW(model.parameters(), **OPTIONS)
    torch.manual_seed(seed)
    losses = []
    for batch in data:
        opt.zero_grad()
        loss = loss_fn(model(batch[0]), *batch[1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_dropout() -> dict:
    step = tapestry.parallelize_step(dropout_mlp(), mse, batches(1)[0], mesh=tapestry.Mesh(2), compile=False,
                                     cache=False, plan=PLANS["data_parallel"], **OPTIONS)
    torch.manual_seed(3)
    losses = [float(step(x, y)) for x, y in batches(4)]
    if torch.distributed.get_rank() == 1:
        torch.rand(1)  # this rank's generator moves on alone
    try:
        step(*batches(1)[0])
    except RuntimeError as err:
        refused = str(err)
    return {"losses": losses, "module": step.module_state_dict(), "refused": refused}


def test_dropout_trains_on_two_ranks_as_torch_draws_it_and_ranks_whose_generators_differ_are_refused():
    """Each call draws the dropout mask afresh on every rank from torch's default generator, as eager torch draws
    it after the same torch.manual_seed: four AdamW steps equal torch's on one device. A rank whose generator
    moved on alone would use other masks than the rest: refused, every rank, before the step runs."""
    model = dropout_mlp()
    want = torch_dropout_run(model, mse, batches(4), seed=3)
    no_dropout = torch_dropout_run(mlp_without_dropout(), mse, batches(4), seed=3)
    assert not np.allclose(want, no_dropout, rtol=1e-3)  # the masks matter
    for rank, got in enumerate(launch(train_dropout, 2)):
        np.testing.assert_allclose(got["losses"], want, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got["module"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
        assert got["refused"] == (f"rank {rank}, call 4: the ranks' torch random generators differ (the step draws "
                                  "its dropout masks from them, identically on every rank): call torch.manual_seed "
                                  "with the same seed on every rank, and draw no other random numbers on one rank")


def mlp_without_dropout() -> torch.nn.Module:
    model = dropout_mlp()
    model[1].p = 0.0
    return model


def tiny_lm(name: str) -> torch.nn.Module:
    """GPT-2 (0.1 on embeddings, attention weights and residuals) and BERT for masked LM (0.1 on embeddings,
    attention weights, hidden states) with their default dropouts: 7 masks a step each."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":  # attn_implementation="eager": sdpa's fused CPU kernel draws its own mask
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, use_cache=False,
            attn_implementation="eager")).train()
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16, attn_implementation="eager")).train()


def token_loss_of(out, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


TOKENS = [(ids, ids) for ids in (torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(k))
                                 for k in range(3))]


def train_lm(name: str) -> list[float]:
    step = tapestry.parallelize_step(tiny_lm(name), token_loss_of, TOKENS[0], mesh=tapestry.Mesh(2), compile=False,
                                     cache=False, **OPTIONS)  # the optimizer's plan
    torch.manual_seed(3)
    return [float(step(*batch)) for batch in TOKENS]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_a_transformer_with_its_default_dropout_trains_on_two_ranks_as_torch(name):
    want = torch_dropout_run(tiny_lm(name), token_loss_of, TOKENS, seed=3)
    for rank, got in enumerate(launch(train_lm, 2, name, timeout=900)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")


def train_dropout_compiled() -> list[float]:
    step = tapestry.parallelize_step(dropout_mlp(), mse, batches(1)[0], mesh=tapestry.Mesh(2),
                                     plan=PLANS["data_parallel"], **OPTIONS)  # compile=True: the default
    torch.manual_seed(3)
    return [float(step(x, y)) for x, y in batches(4)]


@pytest.mark.slow
def test_dropout_trains_compiled_as_torch():
    """The masks are call inputs of the compiled function, new every call (43 s cold, 12 s with its saved programs)."""
    want = torch_dropout_run(dropout_mlp(), mse, batches(4), seed=3)
    for got in launch(train_dropout_compiled, nproc=2, timeout=900):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def small_cnn() -> torch.nn.Module:
    """ResNet-style: a bias-free convolution, batch norm in training mode, a linear head."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5))


def image_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(6)
    return [(torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


def train_cnn(plan: str) -> dict:
    step = tapestry.parallelize_step(small_cnn(), torch.nn.functional.cross_entropy, image_batches(1)[0],
                                     optimizer=torch.optim.SGD, lr=0.1, momentum=0.9, compile=False,
                                     plan=PLANS[plan])
    losses = [float(step(x, y)) for x, y in image_batches(3)]
    return {"losses": losses, "module": step.module_state_dict(), "model": step.state_dict(full=True)["model"]}


@pytest.mark.parametrize("plan", ["data_parallel", "zero3"])
def test_batch_norm_statistics_over_a_batch_split_on_two_ranks_equal_one_device_torch(plan):
    """Each rank holds half the batch; the running statistics are those of the whole global batch (what
    SyncBatchNorm and a single-device run compute), and both state dicts carry them."""
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    want = []
    for x, y in image_batches(3):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    for got in launch(train_cnn, 2, plan):
        np.testing.assert_allclose(got["losses"], want, rtol=1e-5, atol=1e-6)
        assert got["module"].keys() == model.state_dict().keys()
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got["module"][name], value, rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(got["model"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert int(got["module"]["1.num_batches_tracked"]) == 3
