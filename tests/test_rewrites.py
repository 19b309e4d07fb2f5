"""Capture-time rewrites (importer/rewrites.py) compute what the code they replace computes, for inputs other than
the example they were captured with, and refuse what they cannot express."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import LongformerConfig, LongformerModel, SwitchTransformersConfig
from transformers.models.switch_transformers.modeling_switch_transformers import (
    SwitchTransformersExperts, SwitchTransformersSparseMLP, SwitchTransformersTop1Router)

import tapestry
from tapestry.importer import TorchImportError, from_torch
from tapestry.importer.rewrites import exact_rewrites, grouped_switch_experts
from tapestry.importer.zoo import FAMILIES


def _close(got: torch.Tensor | np.ndarray, want: torch.Tensor) -> bool:
    got, want = np.asarray(got, np.float64), want.detach().numpy().astype(np.float64)
    return got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * max(np.abs(want).max(), 1.0)


SWITCH = SwitchTransformersConfig(d_model=16, d_ff=24, num_experts=4, dropout_rate=0.0, expert_capacity=3)


def _experts() -> SwitchTransformersExperts:
    torch.manual_seed(0)
    return SwitchTransformersExperts(SWITCH).eval()


def _routing(tokens: int = 12, experts: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-1 routing where tokens 1 and 5 are dropped (over capacity: rows of zeros) and expert 1 gets none."""
    chosen = torch.tensor([0, 0, 2, 2, 2, 0, 3, 3, 0, 2, 0, 0])[:tokens]
    one_hot = torch.nn.functional.one_hot(chosen, experts)
    one_hot[[1, 5]] = 0
    return torch.randn(tokens, 16), one_hot, torch.rand(tokens, 1)


def test_switchs_grouped_experts_match_its_loop_with_dropped_tokens_and_an_expert_that_gets_none():
    experts = _experts()
    hidden, one_hot, weights = _routing()
    hidden[5] = math.inf  # a dropped token: the loop never reads it, so its row is 0 whatever the expert makes of it
    with torch.no_grad():
        want = experts(hidden, one_hot[:, None, :], weights)
        got = grouped_switch_experts(experts, hidden, one_hot, weights)
    assert want[5].abs().max() == 0 and torch.isfinite(got).all()
    assert _close(got.numpy(), want)


def test_switchs_sparse_mlp_under_the_rewrite_matches_eager_where_capacity_drops_tokens():
    torch.manual_seed(0)
    mlp = SwitchTransformersSparseMLP(SWITCH).eval()
    hidden = torch.randn(2, 12, 16)  # 12 tokens a sequence, 4 experts of capacity 3: some go over
    with torch.no_grad():
        want = mlp(hidden)
        with exact_rewrites():
            got = mlp(hidden)
        assert (mlp.router(hidden)[0].sum(-1) == 0).any()  # some token was dropped
    assert _close(got.numpy(), want)


def test_switch_experts_that_compute_differently_are_refused_naming_the_expert():
    experts = _experts()
    experts["expert_2"].act = torch.nn.Tanh()
    with pytest.raises(TorchImportError, match="expert_2's activation Tanh"):
        grouped_switch_experts(experts, *_routing())


def test_switch_expert_dropout_in_training_mode_is_refused():
    experts = _experts().train()
    experts["expert_0"].dropout.p = 0.1
    with pytest.raises(TorchImportError, match="expert_0's dropout"):
        grouped_switch_experts(experts, *_routing())


def test_a_switch_mlp_with_another_router_is_refused():
    class TopTwo(SwitchTransformersTop1Router):
        """A router that may choose two experts a token: the grouped form would drop the second."""

    mlp = SwitchTransformersSparseMLP(SWITCH).eval()
    mlp.router = TopTwo(SWITCH)
    with exact_rewrites(), pytest.raises(TorchImportError, match="routes with TopTwo"):
        mlp(torch.randn(2, 12, 16))


def test_the_rewrites_are_undone_after_the_capture():
    forward = SwitchTransformersSparseMLP.forward
    with exact_rewrites():
        assert SwitchTransformersSparseMLP.forward is not forward
    assert SwitchTransformersSparseMLP.forward is forward


def _longformer(window: int = 4) -> LongformerModel:
    config = LongformerConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=40, attention_window=[window, window],
                              pad_token_id=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return LongformerModel(config).eval()


def _masks(batch: int, tokens: int, globals_at: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    mask = torch.ones(batch, tokens, dtype=torch.int64)
    mask[1, tokens - 3:] = 0
    global_mask = torch.zeros(batch, tokens, dtype=torch.int64)
    for row, at in globals_at.items():
        global_mask[row, at] = 1
    return {"attention_mask": mask, "global_attention_mask": global_mask}


@pytest.mark.parametrize("tokens, globals_at", [(8, {}), (8, {0: [0], 1: [0, 3], 3: [7]}), (7, {2: [1, 2, 6]})],
                         ids=["local-only", "global-in-three-rows", "padded-to-the-window"])
def test_longformers_static_attention_matches_both_branches_of_the_original(tokens, globals_at):
    model = _longformer()
    ids = torch.randint(2, 64, (4, tokens))
    masks = _masks(4, tokens, globals_at)
    with torch.no_grad():
        want = model(ids, **masks).last_hidden_state
        with exact_rewrites():
            got = model(ids, **masks).last_hidden_state
    assert _close(got.numpy(), want)


def test_longformer_with_attention_outputs_is_refused_with_what_to_do():
    model = _longformer()
    with exact_rewrites(), pytest.raises(TorchImportError, match="output_attentions=False"):
        model(torch.randint(2, 64, (2, 8)), output_attentions=True)


def test_longformer_imported_without_global_tokens_computes_inputs_with_them_as_eager_does():
    """The graph holds no branch chosen at capture: imported with a mask of no global tokens, it computes a mask
    with global tokens as the original's global branch does (the old capture would have taken the local branch)."""
    model = _longformer()
    ids = torch.randint(2, 64, (4, 8))
    imported = from_torch(model, (ids,), _masks(4, 8, {}), verbose=False)
    for masks in (_masks(4, 8, {}), _masks(4, 8, {0: [0], 1: [0, 3], 3: [7]})):
        with torch.no_grad():
            want = model(ids, **masks).last_hidden_state
        got = imported.outputs(tapestry.evaluate(imported.graph, imported.inputs(ids, **masks)))[0]
        assert _close(got, want)


def test_switch_imported_on_one_routing_computes_another_as_eager_does():
    """Capacity 3 of 8 tokens drops some; new ids route (and drop) other tokens through the same graph."""
    module, args, kwargs = FAMILIES["switch_transformers"].build()
    imported = from_torch(module, args, kwargs, verbose=False)
    for ids in (args[0], torch.randint(0, module.config.vocab_size, args[0].shape)):
        with torch.no_grad():
            want = module(ids, **kwargs).last_hidden_state
        got = imported.outputs(tapestry.evaluate(imported.graph, imported.inputs(ids, **kwargs)))[0]
        assert _close(got, want)


def test_a_training_step_through_switchs_rewritten_experts_matches_torch_optim():
    """The rewrite holds in a training step's capture too: the grouped mms' backward gives each expert the
    gradient of its own rows, and an expert that gets no token keeps its weights, as SGD leaves them in eager."""
    torch.manual_seed(0)
    mlp = SwitchTransformersSparseMLP(SwitchTransformersConfig(**{**SWITCH.to_dict(), "router_jitter_noise": 0.0}))
    x, y = torch.randn(2, 12, 16), torch.randn(2, 12, 16)

    def loss(module, a, b):
        return torch.nn.functional.mse_loss(module(a), b)

    imported = from_torch(mlp, (x, y), training=tapestry.Training(loss=loss, optimizer="sgd", lr=0.5), verbose=False)
    ours = imported.outputs(tapestry.evaluate(imported.graph, imported.inputs(x, y)))
    want = loss(mlp, x, y)
    want.backward()
    torch.optim.SGD(mlp.parameters(), lr=0.5).step()
    assert abs(float(ours["loss"]) - want.item()) <= 1e-5 * max(1.0, want.item())
    for name, param in mlp.named_parameters():
        assert _close(ours["parameters"][name], param), name


def _nothing(self, x):  # noqa: ANN001, ANN202
    return x


def test_a_rewrites_module_is_imported_and_a_missing_one_or_class_raises_never_a_silent_no_op(tmp_path, monkeypatch):
    from tapestry.importer.rewrites import Rewrite

    (tmp_path / "tapestry_rewrite_probe.py").write_text(
        "import torch\n\nclass Probe(torch.nn.Module):\n    def forward(self, x):\n        return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "tapestry_rewrite_probe", raising=False)
    probe = Rewrite("tapestry_rewrite_probe", "Probe", _nothing)
    with exact_rewrites((probe,), import_modules=False):  # a capture's: the module not loaded, no model holds it
        assert "tapestry_rewrite_probe" not in __import__("sys").modules
    with exact_rewrites((probe,)):  # a model built inside the block (a lazy library's import) is rewritten too
        from tapestry_rewrite_probe import Probe

        assert Probe()(torch.ones(1)).item() == 1
    assert Probe()(torch.ones(1)).item() == 2  # restored on the way out
    with pytest.raises(TorchImportError, match="has no class 'Gone'"):  # a library version it was not written for
        with exact_rewrites((Rewrite("tapestry_rewrite_probe", "Gone", _nothing),), import_modules=False):
            pass
    with pytest.raises(TorchImportError, match="cannot import its module"):
        with exact_rewrites((Rewrite("tapestry_no_such_module", "Probe", _nothing),)):
            pass
