"""The reference evaluator, unsharded and sharded, in numpy.

Sharded evaluation is the seeds' "application" level: each shard reads the
input blocks its index block selects (zeros outside a tensor, which is how
padding works), and output blocks are added into a zeroed result. Adding is
scattering for a partition that tiles the output, and summing partials for one
that splits a reduction dim, so one rule serves both.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from tapestry import dtypes, zspace
from tapestry.graph import Graph, GraphError
from tapestry.kernels import Signature
from tapestry.sharding.partition import non_additive_issues, split_reductions
from tapestry.zspace import ZRange

Partition = Sequence[ZRange]


def read_block(array: np.ndarray, region: ZRange) -> np.ndarray:
    """The cells of `region`, taken from `array` (held at the origin); zeros outside it."""
    whole = ZRange.from_shape(array.shape)
    inside = whole.intersection(region)
    if inside is not None and inside == region:
        return np.asarray(array[region.slices()])
    block = np.zeros(region.shape, dtype=array.dtype)
    if inside is not None and not inside.is_empty:
        block[inside.relative_to(region)] = array[inside.slices()]
    return block


def run_block(sig: Signature, args: Sequence[np.ndarray], index_block: ZRange) -> tuple[ZRange, np.ndarray]:
    """Compute one index block: (the output region it writes, its values)."""
    blocks = [read_block(a, p.apply(index_block)) for a, p in zip(args, sig.projections)]
    region = sig.output.apply(index_block)
    value = sig.compute(blocks, index_block)
    if value.shape != region.shape:
        raise AssertionError(f"{sig.kernel.name} returned shape {value.shape} for block {region}")
    return region, value


def check_partition(sig: Signature, parts: Partition, where: str = "") -> None:
    """Reject a partition with a gap or an overlap (asked of islpy), or one splitting a non-additive
    reduction. Every index point runs exactly once here, so unlike a device assignment there are no replicas."""
    problems = zspace.partition_problems(list(parts), sig.index)
    if problems:
        raise GraphError(f"{where}: not a partition of the index space {sig.index}: {'; '.join(problems)}")
    issues = non_additive_issues(sig, split_reductions(sig, parts))
    if issues:
        raise GraphError(f"{where}: {'; '.join(issues)}")


def run_sharded(sig: Signature, args: Sequence[np.ndarray], parts: Partition) -> np.ndarray:
    out = np.zeros(sig.output_shape, dtype=dtypes.to_numpy(sig.dtype))
    for part in parts:
        if part.is_empty:
            continue
        region, value = run_block(sig, args, part)
        out[region.slices()] += value
    return out


def _check_inputs(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    values: dict[str, np.ndarray] = {}
    for node in graph.inputs:
        if node.name not in inputs:
            raise GraphError(f"input {node.name!r} was not supplied")
        array = dtypes.cast(inputs[node.name], node.dtype)
        if array.shape != node.shape:
            raise GraphError(f"input {node.name!r}: expected shape {list(node.shape)}, found {list(array.shape)}")
        values[node.name] = array
    return values


def evaluate_sharded(
    graph: Graph, inputs: Mapping[str, np.ndarray], partitions: Mapping[str, Partition]
) -> dict[str, np.ndarray]:
    """Evaluate with each op run over its partition (ops not named run whole)."""
    values = _check_inputs(graph, inputs)
    for node in graph.ops:
        sig = graph.signature(node.name)
        parts = partitions.get(node.name)
        if parts is None:
            parts = [sig.index]  # run whole: trivially a partition, so `evaluate` needs no islpy
        else:
            check_partition(sig, parts, f"op {node.name!r} ({node.op})")
        values[node.name] = run_sharded(sig, [values[a] for a in node.args], parts)
    return {name: values[target] for name, target in graph.outputs.items()}


def evaluate(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The meaning of a graph: every op run whole."""
    return evaluate_sharded(graph, inputs, {})


def random_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs reproducible from `seed`: the graph's constants and example values (`Graph.example`) as they are,
    standard-normal floats (their magnitudes for `Graph.nonnegative` inputs), random booleans, and integers that index every table they are used to index (an
    embedding's rows), else in [0, 4)."""
    rng = np.random.default_rng(seed)
    values = {}
    given = {**graph.examples, **graph.constants}
    for node in graph.inputs:
        if node.name in given:
            values[node.name] = given[node.name]
        else:
            values[node.name] = dtypes.random_array(rng, node.shape, node.dtype, index_bound(graph, node.name),
                                                    node.name in graph.nonnegative)
    return values


def index_bound(graph: Graph, name: str) -> int | None:
    """The tightest index bound among the ops that read input `name`."""
    bounds = [graph.signature(op.name).index_bound(slot)
              for op in graph.ops for slot, arg in enumerate(op.args) if arg == name]
    return min((b for b in bounds if b is not None), default=None)
