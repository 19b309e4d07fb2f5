"""tapestry.parallelize_step: a training step run persistently on gloo ranks equals torch.optim on one device,
its state saves and loads with torch.distributed.checkpoint (sharded as DTensor), and resumes on another plan."""
from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from tapestry.sharding import Mesh
from tapestry.spmd.state import local_block, placements
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
