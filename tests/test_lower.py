"""Lowering a plan gives each rank its exact local work: shard reads, and the collective each reshard is."""
from __future__ import annotations

from dataclasses import replace

import pytest
from lower_helpers import CASES, MESH, chain

from tapestry.cli import main
from tapestry.lower import (
    AllGather, AllReduce, AllToAll, Comm, Gather, Local, Piece, PlaceBlock, RankStep, ReduceScatter, SendRecv,
    ShardCompute, lower,
)
from tapestry.plan import Plan, build_plan
from tapestry.zspace import ZRange


def comm_kinds(plan: Plan, rank: int = 0) -> list[str]:
    return [s.kind for s in lower(plan).ranks[rank].steps if isinstance(s, Comm)]


@pytest.mark.parametrize("name", CASES)
def test_every_rank_runs_the_same_collective_sequence(name: str) -> None:
    """SPMD: collectives line up across ranks, even on ranks with nothing to give or take."""
    program = lower(CASES[name]())
    collectives = (AllGather, AllReduce, ReduceScatter, AllToAll)
    sequences = [[(s.step, s.kind) for s in r.steps if isinstance(s, collectives)] for r in program.ranks]
    assert all(seq == sequences[0] for seq in sequences)


@pytest.mark.parametrize("name", CASES)
def test_on_a_line_of_ranks_no_step_needs_a_group_of_its_own(name: str) -> None:
    """Groups short of the whole mesh come from meshes of more axes; a step that moves nothing names none."""
    program = lower(CASES[name]())
    assert program.groups == []
    assert all(s.group is None for r in program.ranks for s in r.steps if isinstance(s, Comm))


def test_a_split_batch_needs_no_communication_until_the_output_is_gathered() -> None:
    assert comm_kinds(CASES["seeds split on batch"]()) == ["gather"]


def test_moves_to_a_single_rank_are_one_gather_that_every_rank_joins() -> None:
    program = lower(CASES["seeds split on out"]())
    gathers = [r.steps[-1] for r in program.ranks]
    assert all(isinstance(g, Gather) and g.root == 0 for g in gathers)
    assert gathers[0].sizes == (0, 24) and gathers[0].recv == (Piece(1, ZRange((0, 3), (8, 6))),)
    assert gathers[1].out_block is None and gathers[1].send == (Piece(0, ZRange((0, 3), (8, 6))),)


def test_a_read_of_a_whole_held_block_is_marked_whole() -> None:
    linear = next(s for s in lower(CASES["seeds split on batch"]()).ranks[1].steps if isinstance(s, ShardCompute))
    assert [r.whole for r in linear.reads] == [True, True, True]
    conv = next(s for s in lower(CASES["conv2d split on rows"]()).ranks[0].steps
                if isinstance(s, ShardCompute) and s.kernel == "conv2d")
    assert conv.reads[0].whole and conv.reads[0].pad == ((0, 0), (0, 0), (1, 0), (1, 1))  # padded after reading


def test_a_shard_reads_exactly_its_rows_of_x_and_all_of_w() -> None:
    rank1 = lower(CASES["seeds split on batch"]()).ranks[1]
    place_x, place_w, _, linear = rank1.steps[:4]
    assert place_x == PlaceBlock(0, "v0", "x", ZRange((4, 0), (8, 4)))
    assert place_w.block == ZRange((0, 0), (4, 6))
    assert isinstance(linear, ShardCompute) and linear.index == ZRange((4, 0), (8, 6))
    assert [r.box for r in linear.reads] == [ZRange((0, 0), (4, 4)), ZRange((0, 0), (4, 6)), ZRange((0,), (6,))]


def test_splitting_a_contraction_all_reduces_partial_sums() -> None:
    assert comm_kinds(CASES["matmul split on k, then whole"]())[0] == "all_reduce"
    step = next(s for s in lower(CASES["matmul split on k, then whole"]()).ranks[1].steps if isinstance(s, AllReduce))
    assert step.region == ZRange((0, 0), (6, 5))


def test_partial_sums_into_one_part_of_them_on_every_rank_all_reduce_that_part() -> None:
    """Issue 24: each rank slices its addend of the part and the ranks all-reduce it (they traded their addends
    point to point: p - 1 received per rank)."""
    step = next(s for s in lower(CASES["matmul split on k, then half of it whole"]()).ranks[1].steps
                if isinstance(s, Comm))
    assert isinstance(step, AllReduce)
    assert step.src_block == ZRange((0, 0), (6, 10)) and step.region == step.out_block == ZRange((0, 0), (6, 5))


def test_partial_sums_into_a_split_reduce_scatter() -> None:
    step = next(s for s in lower(CASES["matmul split on k, then rows"]()).ranks[0].steps if isinstance(s, Comm))
    assert isinstance(step, ReduceScatter)
    assert step.out_blocks == (ZRange((0, 0), (3, 5)), ZRange((3, 0), (6, 5)))


def test_rows_to_columns_is_an_all_to_all_of_exact_blocks() -> None:
    rank0 = lower(CASES["chain of different splits"]()).ranks[0]
    swap = next(s for s in rank0.steps if isinstance(s, AllToAll))
    assert swap.send == (Piece(1, ZRange((0, 3), (4, 6))),)
    assert swap.recv == (Piece(1, ZRange((4, 0), (8, 3))),)
    assert swap.local == ZRange((0, 0), (4, 3))


def test_columns_to_replicated_is_an_all_gather() -> None:
    assert comm_kinds(CASES["chain of different splits"]())[:2] == ["all_to_all", "all_gather"]


def test_an_input_only_padding_reads_is_placed_nowhere_and_read_as_zeros_of_its_dtype() -> None:
    plan = CASES["float64 reads of padding only"]()
    assert plan.steps[0].layout.blocks == (None, None)
    conv = next(s for s in lower(plan).ranks[0].steps if isinstance(s, ShardCompute))
    assert conv.reads[0].box is None and conv.reads[0].dtype == "float64"


@pytest.mark.parametrize("name", CASES)
def test_every_buffer_but_the_outputs_is_dropped_once_after_its_last_reader(name: str) -> None:
    program = lower(CASES[name]())
    outputs = set(program.outputs.values())
    rank0 = program.ranks[0]
    dead = rank0.dead_after(outputs)
    dropped = [n for names in dead for n in names]
    assert {s.out for s in rank0.steps} - outputs <= set(dropped)
    assert len(dropped) == len(set(dropped)) and not outputs & set(dropped)
    for k, names in enumerate(dead):
        later = rank0.steps[k + 1 :]
        read_later = {r.buffer for s in later if isinstance(s, ShardCompute) for r in s.reads if r.box is not None}
        read_later |= {s.src for s in later if isinstance(s, Comm)}
        assert not read_later & set(names)


def test_uneven_blocks_keep_their_own_sizes() -> None:
    rank1 = lower(CASES["uneven sizes"]()).ranks[1]
    swap = next(s for s in rank1.steps if isinstance(s, AllToAll))
    assert swap.out_block == ZRange((0, 3), (7, 5)) and swap.recv == (Piece(0, ZRange((0, 3), (4, 5))),)
    gather = next(s for s in rank1.steps if isinstance(s, AllGather))
    assert gather.blocks == (ZRange((0, 0), (7, 3)), ZRange((0, 3), (7, 5)))


def test_a_row_split_conv_trades_halo_rows_point_to_point() -> None:
    program = lower(CASES["conv2d split on rows"]())
    halo = [s for s in program.ranks[0].steps if isinstance(s, SendRecv)][0]
    assert halo.recv == (Piece(1, ZRange((0, 0, 5, 0), (1, 2, 6, 6))),)  # one row below its own 5
    conv = next(s for s in program.ranks[0].steps if isinstance(s, ShardCompute) and s.kernel == "conv2d")
    assert conv.reads[0].pad == ((0, 0), (0, 0), (1, 0), (1, 1))  # zero padding is read, not computed


def test_outputs_are_gathered_to_rank_0_only() -> None:
    program = lower(CASES["seeds split on out"]())
    gather = program.ranks[0].steps[-1]
    assert program.outputs == {"y": gather.out} and gather.out_block == ZRange((0, 0), (8, 6))
    assert program.ranks[1].steps[-1].out_block is None


def test_a_replicated_value_needs_no_move_to_be_split() -> None:
    plan = build_plan(chain(8, 4, 6), MESH, {"linear_0": (None,), "relu_0": (0,)})
    assert comm_kinds(plan)[0] == "local"
    assert isinstance(next(s for s in lower(plan).ranks[1].steps if isinstance(s, Comm)), Local)


def test_a_rank_program_prints_one_line_per_step() -> None:
    text = str(lower(CASES["chain of different splits"]()).ranks[0])
    assert text.splitlines()[0] == "rank 0 of 2"
    assert "v4[0:8, 0:3] = all_to_all v3[0:4, 0:6]  send zr[0:4, 3:6]->1, recv zr[4:8, 0:3]<-1" in text


def test_the_lower_command_prints_one_rank(tmp_path, capsys) -> None:
    CASES["chain of different splits"]().save(tmp_path / "plan.json")
    assert main(["lower", str(tmp_path / "plan.json"), "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 1 of 2") and "rank 0" not in out


def _without_pieces(step: RankStep | None) -> RankStep | None:
    if isinstance(step, AllGather):
        return replace(step, take=())
    if isinstance(step, AllToAll):
        return replace(step, send=(), recv=())
    return step


@pytest.mark.parametrize("name", CASES)
def test_without_pieces_every_rank_has_the_same_steps_less_all_gathers_takes_and_all_to_alls_moves(name: str):
    """What cost.memory lowers: every step and block as `lower` makes them, send_recv's moves included (who joins
    one depends on them), without the pieces that grow as a group's size squared."""
    plan = CASES[name]()
    for full, bare in zip(lower(plan).ranks, lower(plan, pieces=False).ranks):
        assert bare.steps == tuple(map(_without_pieces, full.steps))
