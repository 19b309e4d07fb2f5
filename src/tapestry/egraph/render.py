"""A picture of a (small) e-graph: e-classes as clusters, e-nodes inside, edges to child classes."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import graphviz

HIDDEN = {"Rank", "Dim"}  # shape facts: many rows, no insight


def egraph_to_dot(data: Mapping[str, Any], max_nodes: int = 400) -> graphviz.Digraph:
    raw = data["nodes"]
    shown = {nid: s for nid, s in raw.items() if not nid.startswith("primitive-") and s["op"] not in HIDDEN}
    if len(shown) > max_nodes:
        raise ValueError(f"the e-graph has {len(shown)} e-nodes; pictures are limited to {max_nodes} (raise max_nodes)")
    members: dict[str, list[str]] = defaultdict(list)
    for nid, spec in shown.items():
        members[spec["eclass"]].append(nid)
    dot = graphviz.Digraph("egraph", graph_attr={"compound": "true", "rankdir": "TB"},
                           node_attr={"fontname": "Helvetica", "fontsize": "10", "shape": "box", "style": "rounded"})
    for eclass, nids in members.items():
        with dot.subgraph(name=f"cluster_{eclass}") as sub:
            sub.attr(label=eclass, style="dashed", color="#888888", fontsize="9")
            for nid in nids:
                spec = raw[nid]
                literals = [raw[k]["op"] for k in spec["children"] if k.startswith("primitive-")]
                sub.node(nid, " ".join([spec["op"], *literals]))
    for nid, spec in shown.items():
        for kid in spec["children"]:
            if kid in shown:
                dot.edge(nid, kid, lhead=f"cluster_{raw[kid]['eclass']}")
    return dot
