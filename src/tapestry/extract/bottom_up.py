"""Bottom-up extraction: the cheapest tree per class, then priced as a DAG (extraction-gym "bottom-up")."""
from __future__ import annotations

from tapestry.clock import clock
from tapestry.extract.egraph import EGraph
from tapestry.extract.selection import Selection, finalize
from tapestry.extract.tree import solvable_tree


def extract_bottom_up(egraph: EGraph) -> Selection:
    """Fast and acyclic by construction, but pays for shared subterms once per use when choosing."""
    started = clock()
    tree = solvable_tree(egraph)
    return finalize(egraph, tree.node, tree, "bottom-up", started)
