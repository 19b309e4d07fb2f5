"""The 64-rank collective check: a Mesh(8, 8) data x tensor parallel Adam step's rank programs traced under the
fake process group on meta tensors, every collective matched across ranks; a corrupted program is caught."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tapestry.cli import main
from tapestry.lower import lower
from tapestry.lower.program import Gather, LoweredProgram, Piece
from tapestry.plan.validate import validate_plan
from tapestry.sharding import Mesh
from tapestry.spmd.check import CollectiveMismatch, CollectiveReport, check_collectives, match, trace_rank
from tapestry.training.plans import data_tensor_parallel
from training_helpers import ARGUMENTS, HIDDEN, adam_step


@pytest.fixture(scope="module")
def program() -> LoweredProgram:
    imported, _ = adam_step(64, 256, 64)
    plan = data_tensor_parallel(imported.graph, Mesh(8, 8), ARGUMENTS, HIDDEN)
    validate_plan(plan)
    return lower(plan)


@pytest.fixture(scope="module")
def report(program: LoweredProgram) -> CollectiveReport:
    return check_collectives(program)


def test_every_collective_of_a_64_rank_training_step_matches_across_ranks(report: CollectiveReport) -> None:
    assert len(report.traced) == 64
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
