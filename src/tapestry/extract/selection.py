"""The result every extractor returns, and the one place where a choice becomes a valid selection."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tapestry.clock import clock
from tapestry.extract.egraph import EGraph
from tapestry.extract.structure import cyclic_components
from tapestry.extract.tree import TreeChoice


@dataclass(frozen=True)
class Selection:
    """One chosen node per class reachable from the roots; `gap` is (cost - bound) / cost. `seconds` are CPU
    seconds (`tapestry.clock`). `stopped_by` says which budget ended an unproven ILP search, if one did: "work"
    (CP-SAT's deterministic time) or "nodes" (no work left to model the graph or a part), both counts, so the same
    selection on any machine load; or "seconds (safety net)" (`clock.SAFETY_NET_STOP`, proven or not: the CPU or
    wall clock stopped a phase long past its count, and the selection may depend on the load)."""

    choice: Mapping[int, int] = field(repr=False)
    dag_cost: float
    extractor: str
    seconds: float
    status: str = "heuristic"
    bound: float | None = None
    gap: float | None = None
    stopped_by: str | None = None

    def node_ids(self, egraph: EGraph) -> dict[str, str]:
        """The choice in the e-graph's own ids: class id -> node id."""
        return {egraph.class_ids[c]: egraph.node_ids[n] for c, n in self.choice.items()}


def reachable_choice(egraph: EGraph, choice: Sequence[int]) -> dict[int, int]:
    """Restrict a per-class choice (-1 = none) to the classes the roots reach through it."""
    result: dict[int, int] = {}
    stack = list(egraph.roots)
    child_sets = egraph.child_sets
    while stack:
        c = stack.pop()
        if c in result:
            continue
        node = choice[c]
        if node < 0:
            raise ValueError(f"class {egraph.class_ids[c]!r} is reachable but has no chosen node")
        result[c] = node
        stack.extend(d for d in child_sets[node] if d not in result)
    return result


def dag_cost(egraph: EGraph, choice: Mapping[int, int]) -> float:
    """Each distinct chosen node counts once, however many parents share it."""
    costs = egraph.node_cost
    return float(sum(costs[n] for n in choice.values()))


def finalize(
    egraph: EGraph,
    preferred: Sequence[int],
    tree: TreeChoice,
    extractor: str,
    started: float,
) -> Selection:
    """Make `preferred` acyclic and complete, then price it.

    Greedy DAG choices can close cycles (extraction-gym issue 27). A class on a cycle
    falls back to its tree choice, whose children were all finalized earlier, so each
    round removes at least one non-fallback class from every cycle and the loop ends.
    """
    choice = [p if p >= 0 else t for p, t in zip(preferred, tree.node)]
    while True:
        reach = reachable_choice(egraph, choice)
        cycles = cyclic_components(reach, lambda c: egraph.child_sets[choice[c]])
        if not cycles:
            break
        for component in cycles:
            movable = [c for c in component if choice[c] != tree.node[c]]
            worst = max(movable, key=tree.rank.__getitem__)
            choice[worst] = tree.node[worst]
    return Selection(
        choice=reach,
        dag_cost=dag_cost(egraph, reach),
        extractor=extractor,
        seconds=clock() - started,
    )


def children_first(egraph: EGraph, choice: Mapping[int, int]) -> list[int]:
    """Post-order of an acyclic choice: every class after all of its chosen children."""
    done: set[int] = set()
    result: list[int] = []
    for root in egraph.roots:
        stack = [(root, False)]
        while stack:
            c, expanded = stack.pop()
            if expanded:
                result.append(c)
                continue
            if c in done:
                continue
            done.add(c)
            stack.append((c, True))
            stack.extend((d, False) for d in egraph.child_sets[choice[c]] if d not in done)
    return result
