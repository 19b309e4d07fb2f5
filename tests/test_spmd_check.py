"""Proof the rank programs lower at scale (issue 24, item 6): a Mesh(8, 8) data x tensor parallel Adam step's 64
rank programs traced under the fake process group on meta tensors, every collective matched across ranks (a
corrupted program is caught); the same strategy at an eighth of the width runs on 8 gloo ranks as the evaluator.
make test traces the step on Mesh(4, 4) (16 ranks, several groups on each axis; docs/benchmarks.md, "Test suite
time"), make test-all on both meshes."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tapestry import dtypes
from tapestry.cli import main
from tapestry.evaluator import evaluate
from tapestry.lower import lower
from tapestry.lower.program import Gather, LoweredProgram, Piece
from tapestry.plan.validate import validate_plan
from tapestry.sharding import Mesh
from tapestry.spmd import RankFunction, make_groups, place
from tapestry.spmd.check import CollectiveMismatch, CollectiveReport, check_collectives, match, trace_rank
from tapestry.spmd.launch import launch
from tapestry.training.plans import data_tensor_parallel
from training_helpers import ARGUMENTS, HIDDEN, adam_step

WIDTH = (64, 256, 64)  # dim, hidden, batch


@pytest.fixture(scope="module", params=[Mesh(4, 4), pytest.param(Mesh(8, 8), marks=pytest.mark.slow)], ids=str)
def program(request: pytest.FixtureRequest) -> LoweredProgram:
    imported, _ = adam_step(*WIDTH)
    plan = data_tensor_parallel(imported.graph, request.param, ARGUMENTS, HIDDEN)
    validate_plan(plan)
    return lower(plan)


@pytest.fixture(scope="module")
def report(program: LoweredProgram) -> CollectiveReport:
    return check_collectives(program)


def test_every_collective_of_a_16_or_64_rank_training_step_matches_across_ranks(program: LoweredProgram,
                                                                               report: CollectiveReport) -> None:
    assert len(report.traced) == len(program.ranks) == program.plan.mesh.size
    kinds = report.kinds
    assert kinds["all_reduce"] and kinds["all_gather"] and kinds["all_to_all"]
    assert report.collectives == sum(kinds.values())


def _corrupted(program: LoweredProgram, rank: int) -> tuple[LoweredProgram, Gather]:
    """`program` with rank `rank`'s first gather expecting a smaller region from its first peer (and that gather
    as it was)."""
    steps = list(program.ranks[rank].steps)
    k, gather = next((k, s) for k, s in enumerate(steps) if isinstance(s, Gather) and s.recv)
    first = gather.recv[0]
    smaller = replace(first.region, end=(*first.region.end[:-1], first.region.end[-1] - 1))
    steps[k] = replace(gather, recv=(Piece(first.peer, smaller), *gather.recv[1:]))
    ranks = list(program.ranks)
    ranks[rank] = replace(ranks[rank], steps=tuple(steps))
    return replace(program, ranks=tuple(ranks)), gather


def test_a_rank_whose_split_sizes_differ_is_named_with_its_step_and_peer(program: LoweredProgram,
                                                                        report: CollectiveReport) -> None:
    corrupted, gather = _corrupted(program, 0)
    peer, region = gather.recv[0].peer, gather.recv[0].region
    size, smaller = region.size, region.size // region.shape[-1] * (region.shape[-1] - 1)
    with pytest.raises(CollectiveMismatch) as caught:
        match(corrupted, [trace_rank(corrupted, 0), *report.traced[1:]])  # the other ranks trace as before
    message = str(caught.value)
    assert f"step {gather.step} " in message
    assert f"rank {peer} sends {size} elements to rank 0, which expects {smaller} from it" in message


def test_the_lower_command_checks_the_collectives_of_a_saved_plan(tmp_path, capsys) -> None:
    imported, _ = adam_step(8, 16, 8)
    data_tensor_parallel(imported.graph, Mesh(2, 2), ARGUMENTS, HIDDEN).save(tmp_path / "plan.json")
    assert main(["lower", str(tmp_path / "plan.json"), "--check-collectives"]) == 0
    assert capsys.readouterr().out.startswith("collectives match: 4 ranks, ")


def _step_outputs(program: LoweredProgram, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """On each launched rank: the step's outputs, delivered whole to every rank by its traced RankFunction."""
    rank = dist.get_rank()
    got = RankFunction.of(program, rank, make_groups(program))(place(program, rank, inputs))
    return {name: got[buffer].clone() for name, buffer in program.outputs.items()}


def test_the_same_strategy_at_an_eighth_of_the_width_runs_on_eight_gloo_ranks_as_the_evaluator() -> None:
    imported, _ = adam_step(*(n // 8 for n in WIDTH))
    plan = data_tensor_parallel(imported.graph, Mesh(2, 4), ARGUMENTS, HIDDEN)
    program = lower(plan, everywhere=True)
    check_collectives(program)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(WIDTH[2] // 8, WIDTH[0] // 8, generator=gen) for _ in range(2))
    inputs = imported.inputs(x, y)
    want = evaluate(imported.graph, inputs)
    tensors = {name: dtypes.to_tensor(value) for name, value in inputs.items()}
    for rank, got in enumerate(launch(_step_outputs, 8, program, tensors, timeout=300)):
        assert got.keys() == want.keys()
        for name, value in want.items():
            np.testing.assert_allclose(got[name].numpy(), value, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}, {name}")


def test_a_rank_that_skips_a_collective_is_named_with_the_step_its_group_waits_in(program: LoweredProgram,
                                                                                  report: CollectiveReport) -> None:
    traced = [list(rank) for rank in report.traced]
    skipped = next(c for c in traced[1] if c.kind == "all_gather")  # rank 1: first of its group on either mesh
    traced[1].remove(skipped)
    with pytest.raises(CollectiveMismatch) as caught:
        match(program, traced)
    message = str(caught.value)
    among = ",".join(map(str, skipped.group))
    assert skipped.group[0] == 1
    assert message.startswith(f"collective 0 among ranks {among}: rank 1 issues ")  # its group's first
    assert f"all_gather of {program.describe(skipped.step)}" in message  # what the others wait in
