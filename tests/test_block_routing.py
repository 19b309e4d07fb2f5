"""MoE routing block by block (importer/block_routing.py): the rewrite computes what transformers' batch-wide
grouped experts compute, and its gradients theirs (uneven routings, an expert no token chooses); its graph
evaluates to eager's and a training step to torch's; its kernels split expert parallel equal the unsplit ones
for any routing; and its plans on 2x2 split the batch through the MoE layer and simulate to eager's answer."""
from __future__ import annotations

import copy
from functools import partial

import numpy as np
import pytest
import torch
from experts_helpers import Favour, zoo_mixtral_on_gloo_ranks

import tapestry
from tapestry.importer import from_torch
from tapestry.graph import Graph
from tapestry.importer.block_routing import experts_by_block, grouped_mm_blocks
from tapestry.importer.errors import TorchImportError
from tapestry.importer.rewrites import BATCH_WIDE_REWRITES, ROUTING_BY_BLOCK, exact_rewrites
from tapestry.importer.zoo import FAMILIES
from tapestry.cost import plan_cost
from tapestry.optimizer import default_cost_model
from tapestry.plan import Compute, Plan, build_plan
from tapestry.plan.simulate import simulate
from tapestry.plan.validate import plan_problems
from tapestry.sharding import Mesh
from tapestry.sharding.partition import candidate_partitions, is_partial, make_partition
from tapestry.training.plans import baselines

transformers = pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")


def mixtral_experts(experts: int = 4, width: int = 8, inner: int = 12) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=width, intermediate_size=inner, num_local_experts=experts,
                                        num_experts_per_tok=2)
    module = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
    torch.nn.init.normal_(module.gate_up_proj)
    torch.nn.init.normal_(module.down_proj)
    return module


# (blocks of 3 tokens, top 2 of 4 experts): block 0 sends every pair to experts 0 and 1, block 1 all but one to
# expert 2; no token chooses expert 3
UNEVEN = torch.tensor([[0, 1], [1, 0], [0, 1], [2, 0], [2, 1], [2, 2]])


RANDOM = torch.randint(0, 4, (6, 2), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("top_k_index", [UNEVEN, RANDOM], ids=["uneven, expert 3 empty", "random"])
def test_routing_by_block_computes_what_the_batch_wide_grouped_experts_compute(top_k_index):
    experts = mixtral_experts()
    hidden = torch.randn(2, 3, 8)
    weights = torch.rand(6, 2)
    want = moe.grouped_mm_experts_forward(experts, hidden.reshape(6, 8), top_k_index, weights)
    got = experts_by_block(experts, hidden, top_k_index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k_index", [UNEVEN, RANDOM], ids=["uneven, expert 3 empty", "random"])
def test_routing_by_blocks_gradients_are_the_batch_wide_grouped_experts_gradients(top_k_index):
    """The custom op's backward (grouped_mm_blocks for the rows, grouped_mm_blocks_k for the weights): the
    hidden states', the routing weights' and both expert weights' gradients equal those of transformers' own."""
    hidden, weights, cotangent = torch.randn(2, 3, 8), torch.rand(6, 2), torch.randn(6, 8)
    grads = []
    for forward in (lambda e, h, w: moe.grouped_mm_experts_forward(e, h.reshape(6, 8), top_k_index, w),
                    lambda e, h, w: experts_by_block(e, h, top_k_index, w)):
        experts, h, w = mixtral_experts(), hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        (forward(experts, h, w) * cotangent).sum().backward()
        grads.append([h.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad])
    for got, want in zip(*reversed(grads)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_blocks_grouped_mm_uses_each_blocks_own_ends_and_leaves_rows_past_them_zero():
    x, w = torch.randn(2, 4, 3), torch.randn(2, 3, 5)
    ends = torch.tensor([[1, 3], [0, 4]])  # block 0: expert 0 row 0, expert 1 rows 1-2, row 3 past the ends
    out = grouped_mm_blocks(x, w, ends)
    want = torch.stack([torch.cat([x[0, :1] @ w[0], x[0, 1:3] @ w[1], torch.zeros(1, 5)]), x[1] @ w[1]])
    torch.testing.assert_close(out, want)


def test_experts_routing_by_block_does_not_cover_raise_naming_what_differs():
    experts = mixtral_experts()
    experts.has_bias = True
    with pytest.raises(TorchImportError, match="has_bias"):
        experts_by_block(experts, torch.randn(1, 2, 8), torch.zeros(2, 2, dtype=torch.long), torch.rand(2, 2))


# -- the kernels expert parallel: each block's rows sent to their experts' device -----------------------------------
BLOCKS, ROWS, DIM, OUT, EXPERTS = 2, 12, 3, 5, 4
# each block's routing (its experts' end rows): even, uneven with empty experts and rows past the ends, every row
# to one expert, falling ends (overlapping spans: no sort makes them, the kernel's meaning covers them)
BLOCK_ENDS = [[[3, 6, 9, 12], [0, 1, 11, 11]], [[2, 2, 2, 7], [12, 12, 12, 12]], [[0, 0, 0, 12], [9, 2, 12, 4]]]


def experts_graph(kernel: str) -> Graph:
    """grouped_mm_blocks (x[B, R, D] by w[E, D, F]) or its weight gradient grouped_mm_blocks_k (x by dy[B, R, F])."""
    g = Graph()
    x, ends = g.input("x", (BLOCKS, ROWS, DIM)), g.input("ends", (BLOCKS, EXPERTS), "int64")
    other = g.input("w", (EXPERTS, DIM, OUT)) if kernel == "grouped_mm_blocks" else g.input("dy", (BLOCKS, ROWS, OUT))
    g.output("y", g.op(kernel, x, other, ends, name="mm"))
    return g


def exchanged_plan(kernel: str, mesh: Mesh, axis: int, others: tuple = ()) -> Plan:
    """The kernel's rows and experts split together over mesh axis `axis`, the other axes as `others` says."""
    g = experts_graph(kernel)
    sig = g.signature("mm")
    axes = tuple(None if a == axis else (others[a] if a < len(others) else None) for a in range(mesh.ndim))
    return build_plan(g, mesh, partitions={"mm": make_partition(sig, mesh, axes, exchange=(axis,))})


EXCHANGES = [(Mesh(4), 0, ()), (Mesh(2), 0, ()), (Mesh(2, 2), 1, ("block",)), (Mesh(2, 2), 0, (None, "block")),
             (Mesh(2, 2), 1, ("row",)), (Mesh(2, 2), 0, (None, "n"))]


@pytest.mark.parametrize("ends", BLOCK_ENDS)
@pytest.mark.parametrize("kernel", ["grouped_mm_blocks", "grouped_mm_blocks_k"])
@pytest.mark.parametrize("mesh, axis, others", EXCHANGES, ids=str)
def test_the_block_kernels_expert_parallel_equal_the_unsharded_ones_for_any_routing(kernel, mesh, axis, others,
                                                                                     ends):
    """Rows and experts split together (blocks, rows or features over the other axis: data or tensor parallel):
    each block's rows go to their experts' device, and come back (the experts) or are summed there (their weight
    gradient, partial over an axis splitting the blocks or rows)."""
    dims = experts_graph(kernel).signature("mm").dims
    plan = exchanged_plan(kernel, mesh, axis, tuple(None if d is None else dims.index(d) for d in others))
    assert not plan_problems(plan)
    (step,) = [s for s in plan.steps if isinstance(s, Compute)]
    assert step.exchange == (axis,) and bool(step.layout.partial) == (
        kernel.endswith("_k") and bool({"block", "row"} & set(others)))
    rng = np.random.default_rng(7)
    given = {"x": rng.standard_normal((BLOCKS, ROWS, DIM)), "ends": np.array(ends, np.int64),
             "w": rng.standard_normal((EXPERTS, DIM, OUT)), "dy": rng.standard_normal((BLOCKS, ROWS, OUT))}
    given = {node.name: given[node.name].astype(np.float32) if node.name != "ends" else given[node.name]
             for node in plan.graph.inputs}
    np.testing.assert_allclose(simulate(plan, given)["y"], tapestry.evaluate(plan.graph, given)["y"], rtol=1e-5,
                               atol=1e-5)


def test_the_block_kernels_candidates_include_expert_parallel_by_itself_beside_data_or_tensor_parallel():
    """On 2x2 either axis exchanges; the other splits the blocks (data parallel, for the weight gradient too:
    partial sums over it), the rows (the weight gradient's only on the outer axis: a group's rows one run), the
    features, or nothing."""
    for kernel, features in (("grouped_mm_blocks", {"n", "row"}), ("grouped_mm_blocks_k", {"m", "n"})):
        sig = experts_graph(kernel).signature("mm")
        names = {p.name(sig) for p in candidate_partitions(sig, Mesh(2, 2)) if p.exchange}
        for other in {"·", "block"} | features:
            assert {f"split(ep:row=expert,{other})", f"split({other},ep:row=expert)"} <= names, (kernel, names)
        assert "split(row,ep:row=expert)" in names
        data = make_partition(sig, Mesh(2, 2), (sig.dims.index("block"), None), exchange=(1,))
        assert is_partial(sig, data) == kernel.endswith("_k")


# -- routing by block as the default, and in a training step -------------------------------------------------------
def tiny_mixtral(batch: int = 2) -> tuple[torch.nn.Module, torch.Tensor]:
    """A 1-layer causal Mixtral (4 experts, top 2; float32) and token ids of `batch` sequences of 8."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    return (transformers.AutoModelForCausalLM.from_config(config).eval(),
            torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(1)))


def lm_loss(module: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return module(input_ids=ids, labels=labels, use_cache=False).loss


def routed_step(model: torch.nn.Module, ids: torch.Tensor) -> tapestry.TorchImport:
    """One SGD step of `model` (routed by block: the default)."""
    training = tapestry.Training.from_torch_optimizer(torch.optim.SGD, lm_loss, lr=0.1)
    return tapestry.from_torch(model, (ids, ids), training=training, verbose=False)


def kernels(imported: tapestry.TorchImport) -> set[str]:
    return {node.op for node in imported.graph.ops}


def test_inference_and_training_route_by_block_by_default_and_batch_wide_when_told():
    model, ids = tiny_mixtral()
    inference = partial(tapestry.from_torch, model, (ids,), {"use_cache": False}, verbose=False)
    by_block = kernels(inference())
    assert "grouped_mm_blocks" in by_block and "grouped_mm" not in by_block
    with exact_rewrites(BATCH_WIDE_REWRITES):
        batch_wide = kernels(inference())
    assert "grouped_mm" in batch_wide and "grouped_mm_blocks" not in batch_wide
    step = routed_step(model, ids)
    assert {"grouped_mm_blocks", "grouped_mm_blocks_k"} <= kernels(step) and "grouped_mm" not in kernels(step)
    with exact_rewrites(BATCH_WIDE_REWRITES):
        step = routed_step(model, ids)
    assert {"grouped_mm", "grouped_mm_k"} <= kernels(step) and "grouped_mm_blocks" not in kernels(step)


def test_a_training_step_routed_by_block_has_its_weight_gradients_as_kernels_and_equals_torch():
    """The backward of the experts imports as grouped_mm_blocks and grouped_mm_blocks_k (no opaque op), and the
    step's loss and every updated weight are torch's."""
    model, ids = tiny_mixtral()
    imported = routed_step(model, ids)
    assert {"grouped_mm_blocks", "grouped_mm_blocks_k"} <= kernels(imported) and "grouped_mm" not in kernels(imported)
    assert not imported.opaque, imported.translation.declined
    ours = imported.outputs(tapestry.evaluate(imported.graph, imported.inputs(ids, ids)))
    reference = copy.deepcopy(model)
    loss = lm_loss(reference, ids, ids)
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert abs(float(ours["loss"]) - loss.item()) <= 1e-5 * abs(loss.item())
    for path, value in reference.named_parameters():
        np.testing.assert_allclose(ours["parameters"][path], value.detach().numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=path)


EXPERT_STEPS = ("grouped_mm_blocks", "grouped_mm_blocks_k")  # the kernels `Favour` prices out unless exchanged


@pytest.mark.slow
@pytest.mark.parametrize("mesh, favour", [(Mesh(2, 2), ()), (Mesh(4), EXPERT_STEPS), (Mesh(2, 2), EXPERT_STEPS)],
                         ids=["priced on 2x2", "exchanged on 4", "exchanged on 2x2"])
def test_a_training_step_routed_by_block_plans_and_simulates_to_the_evaluator(mesh, favour):
    """As priced: no dearer than any hand plan (at this width the search's plan runs the expert steps whole), and
    with every expert step and weight gradient
    expert parallel where that is cheaper (`Favour` prices the others out; the hand plans EP and DP x EP seed the
    exchanged runs): each plan valid and computing what the evaluator computes."""
    model, ids = tiny_mixtral(batch=4)
    imported = routed_step(model, ids)
    priced = {"cost_model": Favour(kernels=favour)} if favour else {}
    plan = tapestry.optimize(imported.graph, mesh, **priced).plan
    assert not plan_problems(plan)
    experts = [s for s in plan.steps if isinstance(s, Compute) and s.kernel.startswith("grouped_mm_blocks")]
    assert sorted(s.kernel for s in experts) == ["grouped_mm_blocks"] * 4 + ["grouped_mm_blocks_k"] * 2
    if favour:
        assert all(s.exchange for s in experts)
    cost = priced.get("cost_model", default_cost_model())
    assert plan.cost <= min(plan_cost(hand, cost) for hand in baselines(imported.graph, mesh).values()) * (1 + 1e-9)
    given = imported.inputs(ids, ids)
    got, want = simulate(plan, given), tapestry.evaluate(imported.graph, given)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("favour", [(), ("grouped_mm_blocks",)], ids=["priced", "exchanged"])
def test_a_batch_of_one_is_one_block_whose_experts_run_whole_as_priced_or_expert_parallel_and_match_eager(favour):
    """One sequence is one block: no batch to split through the MoE layer. As priced at this width, its expert
    steps run whole, as batch-wide routing's do; its experts and their rows can still split by exchange (here
    forced), each row sent to its expert's device inside the one block. Both plans compute eager's logits."""
    model, ids = tiny_mixtral(batch=1)
    imported = tapestry.from_torch(model, (ids,), {"use_cache": False}, verbose=False)
    priced = {"cost_model": Favour(kernels=favour)} if favour else {}
    plan = tapestry.optimize(imported.graph, Mesh(4), **priced).plan
    experts = [s for s in plan.steps if isinstance(s, Compute) and s.kernel == "grouped_mm_blocks"]
    assert len(experts) == 2 and all(bool(s.exchange) == bool(favour) for s in experts)
    if not favour:
        assert all(len(set(s.blocks)) == 1 for s in experts)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits.numpy()
    got = imported.outputs(simulate(plan, imported.inputs(ids, use_cache=False)))[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def sparse_block(family: str) -> torch.nn.Module:
    """A held-back family's sparse MoE block alone (4 experts, top 2, width 8), every weight drawn normal."""
    torch.manual_seed(0)
    common = {"hidden_size": 8, "num_experts_per_tok": 2}
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=12, num_experts=4, **common)
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    elif family == "granitemoe":
        config = transformers.GraniteMoeConfig(intermediate_size=12, num_local_experts=4, **common)
        block = transformers.models.granitemoe.modeling_granitemoe.GraniteMoeMoE(config)
    else:
        config = transformers.JambaConfig(intermediate_size=12, num_experts=4, **common)
        block = transformers.models.jamba.modeling_jamba.JambaSparseMoeBlock(config)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter)
    return block.eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "granitemoe", "jamba"])
def test_qwen3_moes_granitemoes_and_jambas_sparse_blocks_routed_by_block_compute_what_their_own_forwards_do(family):
    block = sparse_block(family)
    hidden = torch.randn(3, 5, 8)
    with torch.no_grad():
        want = block(hidden)
        with exact_rewrites():
            assert type(block).forward in {rewrite.forward for rewrite in ROUTING_BY_BLOCK}
            got = block(hidden)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


MOE_FAMILIES = ["mixtral", "olmoe", "qwen2_moe"]  # the zoo's decoders whose sparse MoE blocks are rewritten


def eager_hidden(module: torch.nn.Module, args: tuple, kwargs: dict) -> np.ndarray:
    with torch.no_grad():
        return module(*args, **kwargs).last_hidden_state.numpy()


def routed(family: str):
    """The zoo family imported (routed by block: the default), its inputs, and eager's (unrewritten) hidden
    states."""
    module, args, kwargs = FAMILIES[family].build()
    module.eval()
    imported = from_torch(module, args, kwargs, verbose=False)
    return imported, imported.inputs(*args, **kwargs), eager_hidden(module, args, kwargs)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_zoo_moe_routed_by_block_imports_without_a_batch_wide_sort_and_evaluates_to_eager(family):
    module, args, kwargs = FAMILIES[family].build()
    module.eval()
    imported = from_torch(module, args, kwargs, verbose=False)  # routed by block unless told otherwise
    ops = [node.op for node in imported.graph.nodes]
    assert ops.count("grouped_mm_blocks") == 4 and "grouped_mm" not in ops and "opaque" not in ops  # 2 layers
    (batch, tokens), choices = args[0].shape, 2
    sorts = [imported.graph[node.args[0]].shape for node in imported.graph.nodes if node.op == "topk"]
    assert (batch, tokens * choices) in sorts and (batch * tokens * choices,) not in sorts  # per sequence
    shuffled = args[0].flatten()[torch.randperm(args[0].numel(), generator=torch.Generator().manual_seed(5))]
    for ids in (args[0], shuffled.reshape(args[0].shape)):  # the capture's ids, and others: another routing
        got = imported.outputs(tapestry.evaluate(imported.graph, imported.inputs(ids, **kwargs)))[0]
        np.testing.assert_allclose(got, eager_hidden(module, (ids,), kwargs), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_zoo_moe_routed_by_block_plans_on_2x2_split_its_experts_by_batch_and_simulate_to_eager(family):
    imported, given, want = routed(family)
    plan = tapestry.optimize(imported.graph, mesh=tapestry.Mesh(2, 2)).plan
    experts = [s for s in plan.steps if isinstance(s, Compute) and s.kernel == "grouped_mm_blocks"]
    assert len(experts) == 4 and all(len(set(s.blocks)) > 1 for s in experts)
    got = imported.outputs(simulate(plan, given))[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_the_tiny_mixtral_routed_by_block_runs_on_four_gloo_ranks_as_eager_does():
    for split, _, _ in zoo_mixtral_on_gloo_ranks(tapestry.Mesh(2, 2)):
        assert split.count("grouped_mm_blocks") == 4, split
