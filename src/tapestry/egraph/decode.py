"""From the e-graph to an extractable graph with costs, and from a selection back to a plan.

Only the distributed layer is extracted: Run, Reshard and Place e-nodes (whose
children are distributed classes), and Deliver nodes under each output's root.
`At` and `Result` only name classes, so they are never candidates. Each node's
cost is local (its layouts are part of its class), so plan cost is a sum.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from tapestry.egraph.distributed import Interner
from tapestry.egraph.schema import run_constructors
from tapestry.extract import EGraph as ExtractGraph
from tapestry.extract import Selection
from tapestry.graph import Graph
from tapestry.plan import Place, Plan, Reshard, Step
from tapestry.sharding import Mesh


@dataclass(frozen=True)
class DNode:
    """A distributed e-node, as the decoder needs it."""

    id: str
    op: str
    eclass: str
    children: tuple[str, ...]  # distributed child classes
    key: str  # run key, target layout key, or input name
    layout: str  # layout key of the node's own class ("" for Deliver)


def distributed_nodes(data: Mapping[str, Any]) -> tuple[list[DNode], list[str], dict[str, str]]:
    """(nodes, root classes in output order, output name per root class)."""
    raw = data["nodes"]
    runs = run_constructors()
    at: dict[str, str] = {}
    for spec in raw.values():
        if spec["op"] == "At":
            at[spec["eclass"]] = raw[spec["children"][1]]["op"].strip('"')
    nodes, roots = [], {}
    for nid, spec in raw.items():
        op, kids, eclass = spec["op"], spec["children"], spec["eclass"]
        lit = lambda i: raw[kids[i]]["op"].strip('"')  # noqa: E731
        if op in runs:
            nodes.append(DNode(nid, op, eclass, tuple(raw[k]["eclass"] for k in kids[:-1]), lit(-1), at[eclass]))
        elif op == "Reshard":
            nodes.append(DNode(nid, op, eclass, (raw[kids[0]]["eclass"],), lit(1), at[eclass]))
        elif op == "Place":
            nodes.append(DNode(nid, op, eclass, (), lit(0), lit(1)))
        elif op == "Deliver":
            nodes.append(DNode(nid, op, eclass, (raw[kids[1]]["eclass"],), lit(0), ""))
        elif op == "Result":
            roots[eclass] = lit(0)
    return nodes, list(roots), roots


class Decoder:
    """Turns distributed e-nodes into plan steps (for costs) and selections into plans."""

    def __init__(self, nodes: list[DNode], interner: Interner, mesh: Mesh, input_dtypes: Mapping[str, str]) -> None:
        self.nodes = nodes
        self.interner = interner
        self.mesh = mesh
        self.class_layout = {n.eclass: n.layout for n in nodes if n.layout}
        self.class_dtype = self._dtypes(input_dtypes)

    def step(self, node: DNode, out: str = "?", args: tuple[str, ...] = ()) -> Step | None:
        if node.op == "Place":
            shape, layout = self.interner.layouts[node.layout]
            return Place(out, node.key, shape, layout)
        if node.op == "Reshard":
            shape, layout = self.interner.layouts[node.key]
            src = self.interner.layouts[self.class_layout[node.children[0]]][1]
            return Reshard(out, args[0] if args else "?", shape, src, layout, self.class_dtype[node.eclass])
        if node.op == "Deliver":
            return None
        run = self.interner.runs[node.key]
        return replace(run, out=out, args=args or run.args)

    def _dtypes(self, input_dtypes: Mapping[str, str]) -> dict[str, str]:
        """The dtype of each class: a placed input's, a kernel's result, or a move's source's."""
        found = {n.eclass: self.interner.runs[n.key].signature.dtype for n in self.nodes
                 if n.op not in ("Place", "Reshard", "Deliver")}
        found.update((n.eclass, input_dtypes[n.key]) for n in self.nodes if n.op == "Place")
        moves = [n for n in self.nodes if n.op == "Reshard"]
        while moves:
            left = [n for n in moves if n.children[0] not in found]
            found.update((n.eclass, found[n.children[0]]) for n in moves if n.children[0] in found)
            if len(left) == len(moves):
                break
            moves = left
        return found

    def serialized(self, roots: list[str], cost: Any) -> dict[str, Any]:
        """The distributed layer with costs, as egraph-serialize JSON (what `tapestry extract` reads)."""
        first = {}
        for n in self.nodes:
            first.setdefault(n.eclass, n.id)
        nodes = {}
        for node in self.nodes:
            step = self.step(node)
            nodes[node.id] = {"op": node.op, "eclass": node.eclass, "children": [first[c] for c in node.children],
                              "cost": 0.0 if step is None else float(cost.step_cost(step, self.mesh))}
        return {"nodes": nodes, "root_eclasses": roots, "class_data": {}}

    def extraction_graph(self, roots: list[str], cost: Any) -> ExtractGraph:
        return ExtractGraph.from_json(self.serialized(roots, cost))

    def plan(self, egraph: ExtractGraph, selection: Selection, graph: Graph, root_names: dict[str, str]) -> Plan:
        chosen = {egraph.class_ids[c]: self.nodes[n] for c, n in selection.choice.items()}
        steps: list[Step] = []
        value: dict[str, str] = {}

        def emit(root: str) -> str:
            """Post-order over the chosen nodes with an explicit stack: a 10,000-op chain is as deep."""
            stack = [root]
            while stack:
                eclass = stack[-1]
                if eclass in value:
                    stack.pop()
                    continue
                node = chosen[eclass]
                pending = [c for c in node.children if c not in value]
                if pending:
                    stack.extend(reversed(pending))
                    continue
                stack.pop()
                args = tuple(value[c] for c in node.children)
                if node.op == "Deliver":
                    value[eclass] = args[0]
                else:
                    value[eclass] = out = f"v{len(steps)}"
                    steps.append(self.step(node, out, args))  # type: ignore[arg-type]
            return value[root]

        outputs = {root_names[egraph.class_ids[r]]: emit(egraph.class_ids[r]) for r in egraph.roots}
        ordered = {name: outputs[name] for name in graph.outputs}
        return Plan(self.mesh, graph, tuple(steps), ordered, cost=selection.dag_cost,
                    notes={"extractor": selection.extractor, "extract_seconds": round(selection.seconds, 3),
                           "status": selection.status, "gap": selection.gap})
