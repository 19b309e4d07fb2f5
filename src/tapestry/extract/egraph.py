"""A serialized e-graph (egraph-serialize JSON) as flat, integer-indexed tuples.

Extractors loop over tens of thousands of nodes, so classes and nodes are
numbered once here and every hot loop works on tuples of ints and floats.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import operator
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")
# what `EGraph.by_costs` keeps per structure: an extraction's ILP calls run on up to 4 graphs (plain and fused
# prices, two overlap weights), and their warm start, reduction, contracted bound, LP pass and CP-SAT runs that found
# nothing (`cpsat.SKIP_TIGHTER`) are 5 entries each
BY_COSTS_KEPT = 20


class EGraphError(ValueError):
    """The e-graph is malformed or cannot be extracted from."""


class NoFiniteChoiceError(EGraphError):
    """A class that must be extracted has no node with a finite, acyclic choice below it."""


@dataclass(frozen=True)
class Node:
    """One e-node as other Tapestry code describes it: children are e-class ids."""

    id: str
    op: str
    eclass: str
    cost: float = 1.0
    children: tuple[str, ...] = ()
    subsumed: bool = False


@dataclass(frozen=True)
class EGraph:
    """Classes and nodes numbered 0..n-1; `node_children` holds child *class* indices, duplicates kept."""

    class_ids: tuple[str, ...]
    node_ids: tuple[str, ...]
    node_ops: tuple[str, ...]
    node_class: tuple[int, ...]
    node_cost: tuple[float, ...]
    node_children: tuple[tuple[int, ...], ...]
    node_subsumed: tuple[bool, ...]
    roots: tuple[int, ...]
    class_nodes: tuple[tuple[int, ...], ...] = field(repr=False)
    class_data: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # What is derived from the structure alone (`child_sets`, `parents`), computed once and shared by every copy
    # `with_costs` makes: a training step's extraction reprices one graph several times (pins, overlap weights).
    # Not an init field, so `dataclasses.replace` starts a copy with its own.
    _structure: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    # What is derived from the costs too (`priced`), computed once for this graph; each `with_costs` copy its own.
    _priced: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_classes(self) -> int:
        return len(self.class_ids)

    @property
    def num_nodes(self) -> int:
        return len(self.node_ids)

    @property
    def child_sets(self) -> tuple[tuple[int, ...], ...]:
        """Distinct child classes per node: DAG cost and constraints ignore repeated children."""
        if "child_sets" not in self._structure:
            self._structure["child_sets"] = tuple(ch if len(ch) < 2 else tuple(dict.fromkeys(ch))  # most: one child
                                                  for ch in self.node_children)
        return self._structure["child_sets"]

    @property
    def child_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """`child_sets` flat, for numpy: (each node's count of distinct child classes, the classes node by node)."""
        if "child_arrays" not in self._structure:
            sets = self.child_sets
            self._structure["child_arrays"] = (
                np.fromiter(map(len, sets), dtype=np.int64, count=len(sets)),
                np.fromiter(itertools.chain.from_iterable(sets), dtype=np.int64, count=sum(map(len, sets))))
        return self._structure["child_arrays"]

    @property
    def parents(self) -> tuple[tuple[int, ...], ...]:
        """Per class, the nodes that have it as a (distinct) child."""
        if "parents" not in self._structure:
            result: list[list[int]] = [[] for _ in range(self.num_classes)]
            for node, children in enumerate(self.child_sets):
                for child in children:
                    result[child].append(node)
            self._structure["parents"] = tuple(tuple(p) for p in result)
        return self._structure["parents"]

    def priced(self, key: str, make: Callable[[EGraph], T]) -> T:
        """`make(self)`, made once for this graph: a folded step's fallback finalizes up to four mirrored choices
        per extraction on one graph (egraph.layered), each needing its tree choice."""
        if key not in self._priced:
            self._priced[key] = make(self)
        return self._priced[key]

    def by_costs(self, key: Any, make: Callable[[EGraph], T]) -> T:
        """`make(self)`, made once per `key` among this graph and every `with_costs` copy at the same costs (kept with
        the structure they share; the last BY_COSTS_KEPT kept): the ILP's work before its budget and start matter,
        which a leaner plan's extraction did again per call on the graphs the fastest plan's had solved."""
        digest = self.priced("cost_digest", lambda g: hashlib.blake2b(array("d", g.node_cost).tobytes()).digest())
        made: dict[Any, Any] = self._structure.setdefault("by_costs", {})
        entry = (digest, key)
        value = made.pop(entry) if entry in made else make(self)
        made[entry] = value  # put back last: the least recently asked go first
        while len(made) > BY_COSTS_KEPT:
            del made[next(iter(made))]
        return value

    def selectable(self, node: int) -> bool:
        """Subsumed and infinite-cost nodes are never chosen."""
        return not self.node_subsumed[node] and math.isfinite(self.node_cost[node])

    @property
    def selectable_nodes(self) -> tuple[bool, ...]:
        """`selectable` of every node, made once per graph: the extractors' hot loops read it per node (a folded
        7B step's graph has 200,000 nodes, extracted 20 times)."""
        return self.priced("selectable", lambda g: tuple(
            map(operator.and_, map(operator.not_, g.node_subsumed), map(math.isfinite, g.node_cost))))

    @property
    def child_counts(self) -> tuple[int, ...]:
        """Distinct child classes per node: the lightest-derivation searches' count of children left, per search."""
        if "child_counts" not in self._structure:
            self._structure["child_counts"] = tuple(map(len, self.child_sets))
        return self._structure["child_counts"]

    def with_costs(self, costs: Sequence[float]) -> EGraph:
        """Same structure, new per-node costs (indexed like `node_ids`): how custom cost models plug in. The copy
        shares what is derived from the structure (`_structure`)."""
        if len(costs) != self.num_nodes:
            raise EGraphError(f"expected {self.num_nodes} costs, got {len(costs)}")
        repriced = replace(self, node_cost=_checked_costs(self.node_ids, costs))
        object.__setattr__(repriced, "_structure", self._structure)
        return repriced

    @classmethod
    def from_nodes(
        cls, nodes: Sequence[Node], roots: Sequence[str], class_data: Mapping[str, Any] | None = None
    ) -> EGraph:
        """Build from in-memory nodes; classes are numbered in order of first mention."""
        return cls.from_columns([n.id for n in nodes], [n.op for n in nodes], [n.eclass for n in nodes],
                                [n.cost for n in nodes], [n.children for n in nodes], roots,
                                [n.subsumed for n in nodes], class_data)

    @classmethod
    def from_columns(
        cls, ids: Sequence[str], ops: Sequence[str], classes: Sequence[str], costs: Sequence[float],
        children: Sequence[Sequence[str]], roots: Sequence[str], subsumed: Sequence[bool] | None = None,
        class_data: Mapping[str, Any] | None = None,
    ) -> EGraph:
        """`from_nodes` from one sequence per field of the nodes, with no Node made: the decoder's extraction graphs
        (~80,000 nodes on a 2x2 decoder) took as long to make as Nodes and read back as the rest of their pricing."""
        class_index = {c: i for i, c in enumerate(dict.fromkeys(classes))}
        node_class = tuple(map(class_index.__getitem__, classes))
        members: list[list[int]] = [[] for _ in class_index]
        for i, c in enumerate(node_class):
            members[c].append(i)
        try:
            node_children = tuple(tuple(map(class_index.__getitem__, ch)) for ch in children)
        except KeyError as err:
            first = next(i for i, ch in enumerate(children) if err.args[0] in ch)  # the first node with any
            raise EGraphError(f"node {ids[first]!r} has child class {err.args[0]!r}, which has no nodes") from None
        missing_roots = [r for r in roots if r not in class_index]
        if missing_roots:
            raise EGraphError(f"root class {missing_roots[0]!r} has no nodes")
        if len(set(ids)) != len(ids):
            raise EGraphError("node ids are not unique")
        return cls(
            class_ids=tuple(class_index),
            node_ids=tuple(ids),
            node_ops=tuple(ops),
            node_class=node_class,
            node_cost=_checked_costs(ids, costs),
            node_children=node_children,
            node_subsumed=(False,) * len(ids) if subsumed is None else tuple(map(bool, subsumed)),
            roots=tuple(dict.fromkeys(class_index[r] for r in roots)),
            class_nodes=tuple(map(tuple, members)),
            class_data=dict(class_data or {}),
        )

    @classmethod
    def from_json(cls, data: Any) -> EGraph:
        """Parse the egraph-serialize dict: node children are node ids, mapped here to their classes."""
        if not isinstance(data, Mapping) or not isinstance(data.get("nodes"), Mapping):
            raise EGraphError("expected a JSON object with a 'nodes' object")
        raw = data["nodes"]
        try:
            node_class = {nid: str(spec["eclass"]) for nid, spec in raw.items()}
            nodes = [
                Node(
                    id=nid,
                    op=str(spec.get("op", "")),
                    eclass=node_class[nid],
                    cost=float(spec.get("cost", 1.0)),
                    children=tuple(node_class[c] for c in spec.get("children", ())),
                    subsumed=bool(spec.get("subsumed", False)),
                )
                for nid, spec in raw.items()
            ]
        except KeyError as err:
            raise EGraphError(f"missing key or unknown child node {err.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise EGraphError(f"malformed node: {err}") from None
        roots = data.get("root_eclasses")
        if not isinstance(roots, list):
            raise EGraphError("missing 'root_eclasses' list")
        return cls.from_nodes(nodes, [str(r) for r in roots], data.get("class_data") or {})

    @classmethod
    def load(cls, path: str | Path) -> EGraph:
        """Read a JSON file; every failure is an EGraphError naming the file and the cause."""
        try:
            with open(path) as f:
                data = json.load(f)
            return cls.from_json(data)
        except OSError as err:
            raise EGraphError(f"{path}: cannot read: {err.strerror or err}") from None
        except json.JSONDecodeError as err:
            raise EGraphError(f"{path}: malformed JSON: {err}") from None
        except EGraphError as err:
            raise EGraphError(f"{path}: {err}") from None


def _checked_costs(ids: Sequence[str], costs: Sequence[float]) -> tuple[float, ...]:
    """Every cost as a float, checked at once (`_check_cost` raises for the first bad one)."""
    array = np.fromiter(map(float, costs), dtype=np.float64, count=len(costs))
    bad = np.flatnonzero(np.isnan(array) | (array < 0))
    if bad.size:
        _check_cost(ids[bad[0]], costs[bad[0]])
    return tuple(array.tolist())


def _check_cost(node_id: str, cost: float) -> float:
    cost = float(cost)
    if math.isnan(cost) or cost < 0:
        raise EGraphError(f"node {node_id!r} has cost {cost}; costs must be >= 0 (inf = not selectable)")
    return cost
