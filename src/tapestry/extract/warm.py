"""The ILP's warm start: the incumbent built before any solver runs (docs/extraction.md, "Warm start").

Greedy-dag's choice with its local search, cut at WARM_SHARE of the time limit; with a repeated stack, the
best periodic selection (`periodic.py`, solved by the ILP itself on the folded problem in PERIODIC_SHARE of
the limit) when it is cheaper; and `undominate`, which maps a choice onto the nodes the ILP's preprocessing
kept. The ILP returns nothing dearer than this start.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from tapestry.extract.egraph import EGraph, EGraphError
from tapestry.extract.greedy_dag import greedy_dag_choice
from tapestry.extract.periodic import Repeated, Solve, periodic_choice
from tapestry.extract.selection import finalize
from tapestry.extract.tree import TreeChoice
from tapestry.extract.work import Meter

# Of the time limit, the most the greedy warm start's local search may take (the greedy search itself always
# finishes: greedy_dag.py): on a 2x2x2 mesh's 12-layer stack (2 million nodes) greedy-dag with its local search
# took longer than a 10 s limit.
WARM_SHARE = 0.3
# Of the time limit, the most the periodic warm start (periodic.py) may take. The LP pass's window moves on by
# the time it took (up to the deadline), so CP-SAT gives it up first. A 24- or 48-layer stack on 8 devices
# folds to 7,600-10,000 nodes, whose best periodic plan took 0.8-0.9 s unloaded (1 s was too little loaded).
PERIODIC_SHARE = 0.2
# The most of the whole graph a fold may keep to be tried. A fold keeps two copies and what is around them, a
# quarter of a 12-layer stack, which the LP pass proves on its own on 8 and 16 devices (the fold's second only
# delayed it); from about 15 layers on a fold keeps less, and its plan pays (24 and 48 layers on 8 devices).
FOLD_SHARE = 0.2


def warm_start(egraph: EGraph, tree: TreeChoice, meter: Meter, repeated: Repeated | None,
               solve: Solve, nodes_per_second: float) -> tuple[list[int], float]:
    """(A node per class, seconds of work the fold took): greedy-dag's choice, its local search stopped at
    WARM_SHARE of `meter`'s limit (in its tries: `work.Meter`), or with `repeated` the periodic choice where that is
    cheaper. `solve` solves the folded problem (its work charged to `meter`); a fold bigger than `nodes_per_second`
    can model in half its time is not tried."""
    greedy = greedy_dag_choice(egraph, tree, meter.until(WARM_SHARE * meter.limit))
    folding = meter.spent
    if repeated is not None:
        periodic = _periodic(egraph, repeated, solve, PERIODIC_SHARE * meter.limit, nodes_per_second)
        greedy = _cheaper(egraph, tree, greedy, periodic)
    return greedy, meter.spent - folding


def undominate(egraph: EGraph, choice: Sequence[int], replacement: Mapping[int, int]) -> list[int]:
    """Map a choice onto surviving nodes: a dominator (`replacement`) has fewer children and no higher cost."""
    result = list(choice)
    for c, n in enumerate(result):
        while n in replacement:
            n = replacement[n]
        result[c] = n
    return result


def _periodic(egraph: EGraph, repeated: Repeated, solve: Solve, seconds: float,
              nodes_per_second: float) -> list[int] | None:
    """The periodic warm start solved in `seconds`, or None when there is no period to fold, no periodic
    selection, or a folded problem too big: more than it can model in half that time (a 2x4 stack's
    40,000-node fold never bettered greedy-dag in 2.5 s), or over FOLD_SHARE of the whole graph."""
    if seconds <= 0:
        return None
    try:
        return periodic_choice(egraph, repeated, solve, seconds,
                               min(nodes_per_second * seconds / 2, egraph.num_nodes * FOLD_SHARE))
    except EGraphError:  # no periodic selection found in time, or a class whose every node the fold left out
        return None


def _cheaper(egraph: EGraph, tree: TreeChoice, choice: list[int], other: list[int] | None) -> list[int]:
    """Of two choices per class, the one whose finalized selection costs less (`choice` on a tie)."""
    if other is None:
        return choice
    a, b = (finalize(egraph, c, tree, "ilp", 0.0) for c in (choice, other))
    if b.dag_cost >= a.dag_cost:
        return choice
    return [b.choice.get(c, t) for c, t in enumerate(tree.node)]  # a node for every class, as `improve` needs
