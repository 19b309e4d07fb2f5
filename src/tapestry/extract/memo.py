"""Selections made once per extraction graph and arguments.

An extraction under a memory budget first tries the plan chosen without it, for each objective it fits, as the
extraction without a budget had; a pipeline layer's leaner plans made each again per budget (18 CPU s apiece on the
70B layer on 8x8, docs/benchmarks.md "Pipeline"). Graphs made from one decoder share their structure and differ in
node costs alone, so a digest of the costs and the other arguments names what a selection is made of.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tapestry.extract.egraph import EGraph
from tapestry.extract.selection import Selection

# an extraction fits up to four objectives (plain, fused, two overlap weights), a folded graph's each with a greedy
# start: the selections a memo keeps serve them all
KEPT = 8
# greedy-dag's steady picks, the ILP's warm starts (`Explored._warm_starts`), are kept in a memo of their own: an
# extraction on 8 devices or more makes 9 (free and pinned two ways, of one run's costs and of the plain and fused
# graphs it solves), which in one memo evicted its selections without a budget, and each leaner plan's extraction
# then ran those ILPs again (`Explored._unbound`: 4 ILP runs, 51 of the 70B pipeline step's 391 CPU s; docs/
# benchmarks.md, "pipe70b"). Room for 5 graphs' picks: those 3 and the overlap sweep's 2 weights.
PICKS_KEPT = 16


def selection_key(egraph: EGraph, hands: Sequence[Selection], *args: Any) -> bytes:
    """A digest of what a selection is made of: the graph's node costs and subsumed flags, the hand plans'
    choices (warm starts) and the other arguments (their repr)."""
    digest = hashlib.blake2b(array("d", egraph.node_cost).tobytes(), digest_size=32)
    digest.update(array("b", egraph.node_subsumed).tobytes())
    for hand in hands:
        digest.update(array("q", [len(hand.choice), *(x for item in sorted(hand.choice.items()) for x in item)]))
    digest.update(repr((egraph.num_nodes, egraph.roots, *args)).encode())
    return digest.digest()


@dataclass
class SelectionMemo:
    """The last `kept` selections made, by `selection_key` and the object that priced them (a cost model ranks a
    folded graph's candidates; one that cannot be hashed is keyed by its id and kept, so the id is not reused)."""

    kept: int = KEPT
    _made: dict[tuple[bytes, Any], tuple[Any, Selection]] = field(default_factory=dict, repr=False)

    def get(self, egraph: EGraph, hands: Sequence[Selection], args: tuple[Any, ...], priced_by: Any,
            make: Callable[[], Selection]) -> Selection:
        """The selection `make()` returns for these arguments, made once while kept."""
        try:
            hash(priced_by)
            by = priced_by
        except TypeError:
            by = id(priced_by)
        key = (selection_key(egraph, hands, *args), by)
        made = self._made.pop(key, None)  # put back last: the least recently asked go first
        if made is None:
            made = priced_by, make()
        self._made[key] = made
        while len(self._made) > self.kept:
            del self._made[next(iter(self._made))]
        return made[1]
