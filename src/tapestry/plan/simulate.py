"""Run a plan in numpy the way the devices would, to check it means what its graph means.

Each simulated device keeps only its own blocks, and every cell it uses comes
from a Place, its own compute, or a transfer of `sharding.comm.transfers`. So
`simulate(plan, x) == evaluate(plan.graph, x)` tests the plan itself, not a
whole-tensor shortcut. Partial sums are added in device order on every
receiver, as a deterministic all-reduce does, so replicas agree bit for bit.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tapestry import dtypes

from tapestry.evaluator import read_block
from tapestry.kernels.ring import gradient_parts_numpy, pack_gradients, ring_numpy
from tapestry.plan import exchange, ring
from tapestry.plan.plan import Compute, Place, Plan, Reshard
from tapestry.plan.validate import PlanError
from tapestry.sharding import Layout, Mesh
from tapestry.sharding.comm import transfers
from tapestry.zspace import ZRange


@dataclass(frozen=True)
class Shard:
    """The block of a value one device holds, and its cells: all a device ever has of a value."""

    block: ZRange
    cells: np.ndarray


Device = dict[str, Shard]  # value id -> this device's shard of it


def simulate(plan: Plan, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The plan's outputs, computed device by device from `inputs` (graph input name -> array)."""
    devices: list[Device] = [{} for _ in plan.mesh.devices]
    for step in plan.steps:
        if isinstance(step, Place):
            _place(plan, step, inputs, devices)
        elif isinstance(step, Reshard):
            _reshard(step, devices, plan.dtypes[step.src])
        elif step.exchange:
            _exchange(step, devices, plan.dtypes, plan.mesh)
        elif step.ring:
            _ring(step, devices, plan.dtypes, plan.mesh)
        else:
            _compute(step, devices, plan.dtypes)
    return {name: assemble(plan.by_id[value].layout, plan.by_id[value].shape, devices, value, plan.dtypes[value])
            for name, value in plan.outputs.items()}


def _place(plan: Plan, step: Place, inputs: Mapping[str, np.ndarray], devices: list[Device]) -> None:
    array = dtypes.cast(inputs[step.input], plan.graph[step.input].dtype)
    if array.shape != step.shape:
        raise PlanError(f"input {step.input!r}: expected shape {list(step.shape)}, got {list(array.shape)}")
    for device, block in zip(devices, step.layout.blocks):
        if block is not None:
            device[step.out] = Shard(block, read_block(array, block).copy())


def _read(devices: list[Device], k: int, value: str, region: ZRange, shape: tuple[int, ...], dtype: str,
          where: str) -> np.ndarray:
    """`region` of a tensor from the block device k holds; cells outside the tensor are zero."""
    inside = ZRange.from_shape(shape).intersection(region)
    needed = inside is not None and not inside.is_empty
    if value not in devices[k]:
        if needed:
            raise PlanError(f"{where} reads {inside} of {value} but holds none of it")
        return np.zeros(region.shape, dtype=dtypes.to_numpy(dtype))  # a block wholly in the padding
    held = devices[k][value]
    if needed and not held.block.contains(inside):
        raise PlanError(f"{where} reads {inside} of {value} but holds only {held.block}")
    return read_block(held.cells, region.translate([-s for s in held.block.start]))


def _compute(step: Compute, devices: list[Device], value_dtypes: Mapping[str, str]) -> None:
    sig = step.signature
    for k, (index_block, out_block) in enumerate(zip(step.blocks, step.layout.blocks)):
        if index_block is None:
            continue
        where = f"step {step.out} ({step.kernel}) on device {k}"
        args = [
            _read(devices, k, arg, projection.apply(index_block), shape, value_dtypes[arg], where)
            for arg, projection, shape in zip(step.args, sig.projections, step.input_shapes)
        ]
        value = sig.compute(args, index_block)
        region = sig.output.apply(index_block)
        if value.shape != region.shape:
            raise PlanError(f"{where}: {step.kernel} returned shape {value.shape} for block {region}")
        if out_block is not None:
            devices[k][step.out] = Shard(out_block, value[out_block.relative_to(region)])


def _exchange(step: Compute, devices: list[Device], value_dtypes: Mapping[str, str], mesh: Mesh) -> None:
    """An expert-parallel step (plan.exchange): in each group, every member picks its routes from what it holds,
    sends each route's rows of its travelling inputs, the experts' member computes them with what it holds, and
    the results land in the rows' output block (or, where the output does not follow the rows, are summed in
    the experts' member's); the rows no expert owns stay zero, as the kernel leaves them."""
    sig = step.signature
    along, out_rows = exchange.travels(sig), exchange.out_rows(sig)
    for group in exchange.members(step, mesh):
        blocks = [step.blocks[k] for k in group]
        if any(b is None for b in blocks):
            raise PlanError(f"step {step.out} ({step.kernel}): an exchange member idles: {blocks}")
        outs = {k: np.zeros(step.layout.blocks[k].shape, dtype=dtypes.to_numpy(sig.dtype)) for k in group}
        for src, k in enumerate(group):
            where = f"step {step.out} ({step.kernel}) on device {k}"
            held = [_read(devices, k, arg, projection.apply(blocks[src]), shape, value_dtypes[arg], where)
                    for arg, projection, shape in zip(step.args, sig.projections, step.input_shapes)]
            for route in exchange.routes_from(sig, src, blocks, held):
                dst = group[route.dst]
                there = f"step {step.out} ({step.kernel}), rows from device {k} to {dst}"
                args = [np.take(block, route.positions, axis=dim) if dim is not None else
                        _read(devices, dst, arg, projection.apply(route.index), shape, value_dtypes[arg], there)
                        for block, dim, arg, projection, shape
                        in zip(held, along, step.args, sig.projections, step.input_shapes)]
                if out_rows is None:  # the rows' sums stay with the experts
                    outs[dst] += sig.compute(args, route.index)
                    continue
                placed: list[Any] = [slice(None)] * len(sig.output_shape)
                placed[out_rows] = list(route.positions)
                outs[k][tuple(placed)] += sig.compute(args, route.index)  # a row may meet several members
        for k in group:
            devices[k][step.out] = Shard(step.layout.blocks[k], outs[k])


def _ring(step: Compute, devices: list[Device], value_dtypes: Mapping[str, str], mesh: Mesh) -> None:
    """A ring-attention step (plan.ring): each member meets every member's key blocks in ring order, read from the
    device that holds them (its own queries and unkeyed inputs from itself), merged by log-sum-exp."""
    sig = step.signature
    keys, passing = ring.keys(step, mesh), ring.travelling(step)
    outs = {}
    for group in ring.members(step, mesh):
        dq: dict[int, Any] = {}  # a gradient ring's (the backward's) sums: dq at the queries, dk and dv at the keys
        dkv: dict[int, tuple[Any, ...]] = {}
        values = {}
        for member, k in enumerate(group):
            block = step.blocks[k]
            if block is None:
                raise PlanError(f"step {step.out} ({step.kernel}): ring member {k} of {group} idles")
            sources = [group[src] for src in ring.rounds(len(group), member)]
            blocks = []
            for src in sources:
                where = f"step {step.out} ({step.kernel}) on device {k}, keys of device {src}"
                blocks.append([_read(devices, src if moves else k, arg, region, shape, value_dtypes[arg], where)
                               for arg, region, shape, moves
                               in zip(step.args, ring.reads(step, k, keys[src]), step.input_shapes, passing)])
            if not sig.kernel.ring.gradients:
                values[k] = ring_numpy(sig, blocks, [keys[src][0] for src in sources], sig.call_kwargs(block))
                continue
            for src, args in zip(sources, blocks):  # this member's part of key block src's dk, dv goes to src
                part_q, *part_kv = gradient_parts_numpy(sig, args, keys[src][0], sig.call_kwargs(block))
                dq[k] = part_q if k not in dq else dq[k] + part_q
                dkv[src] = tuple(part_kv) if src not in dkv else tuple(a + b for a, b in zip(dkv[src], part_kv))
        for k in group:
            value = values[k] if k in values else pack_gradients(sig, dq[k], *dkv[k])
            out = step.layout.blocks[k]
            outs[k] = Shard(out, value[out.relative_to(sig.output.apply(step.blocks[k]))])
    for k, shard in outs.items():  # after every member has read: a step's output may not overwrite its inputs
        devices[k][step.out] = shard


def _reshard(step: Reshard, devices: list[Device], dtype: str) -> None:
    """Every receiver builds its new block from what it kept and what it was sent, and fails if a cell it needs
    never arrives (plain source), or if a holder's partial sum of it never arrives (partial source): the moves
    come from sharding.comm.transfers, the needs from the layouts alone."""
    incoming: dict[int, list[tuple[int, ZRange]]] = {k: [] for k in range(len(devices))}
    for t in transfers(step.src_layout, step.layout):
        incoming[t.dst].append((t.src, t.region))
    received = {}
    partial = step.src_layout.partial
    for k, need in enumerate(step.layout.blocks):
        if need is None:
            continue
        own = step.src_layout.blocks[k]
        local = own.intersection(need) if own is not None else None
        pieces = incoming[k] + ([(k, local)] if local is not None and not local.is_empty else [])
        cells = np.zeros(need.shape, dtype=dtypes.to_numpy(dtype))
        arrived = {src: np.zeros(need.shape, dtype=bool) for src in range(len(devices))}
        for src, region in sorted(pieces, key=lambda p: p[0]):
            held = devices[src][step.src]
            part = held.cells[region.relative_to(held.block)]
            if partial:
                cells[region.relative_to(need)] += part
            else:
                cells[region.relative_to(need)] = part
            arrived[src][region.relative_to(need)] = True
        _check_arrivals(step, k, need, arrived)
        received[k] = Shard(need, cells)
    for k, held in received.items():
        devices[k][step.out] = held


def _check_arrivals(step: Reshard, k: int, need: ZRange, arrived: Mapping[int, np.ndarray]) -> None:
    where = f"step {step.out} (reshard of {step.src}) on device {k}"
    if not step.src_layout.partial:
        missing = ~np.logical_or.reduce(list(arrived.values()))
        if missing.any():
            cell = [int(i) + s for i, s in zip(np.argwhere(missing)[0], need.start)]
            raise PlanError(f"{where}: cell {cell} of {need} never arrives")
        return
    for src, block in enumerate(step.src_layout.blocks):
        inside = None if block is None else block.intersection(need)
        if inside is not None and not inside.is_empty and not arrived[src][inside.relative_to(need)].all():
            raise PlanError(f"{where}: device {src}'s partial sums of {inside} never arrive")


def assemble(layout: Layout, shape: tuple[int, ...], devices: list[Device], value: str, dtype: str) -> np.ndarray:
    """The tensor a layout's blocks mean: plain blocks must agree where they overlap (to rounding:
    replicas may have run different BLAS paths; NaN agrees with NaN, as a batch norm of a negative variance
    gives on every replica); partial ones add up."""
    result = np.zeros(shape, dtype=dtypes.to_numpy(dtype))
    seen = np.zeros(shape, dtype=bool)
    for k, (device, block) in enumerate(zip(devices, layout.blocks)):
        if block is None:
            continue
        cells = device[value].cells
        if layout.partial:
            result[block.slices()] += cells
            continue
        earlier = seen[block.slices()]
        if not np.allclose(result[block.slices()][earlier], cells[earlier], rtol=1e-6, atol=1e-6, equal_nan=True):
            raise PlanError(f"value {value}: device {k}'s block {block} disagrees with another holder")
        result[block.slices()] = cells
        seen[block.slices()] = True
    if not layout.partial and not seen.all():
        raise PlanError(f"value {value}: no device holds some cells of the result")
    return result
