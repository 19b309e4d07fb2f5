"""Finding repeated layers (egraph.repeat) reads a shared static value by what makes it, also where the e-graph
makes it from itself (an e-class cycle)."""
from __future__ import annotations

from types import SimpleNamespace

from tapestry.egraph.decode import DNode
from tapestry.egraph.repeat import find_repetition


def decoder(runs: dict[str, list[list[str]]], placed: list[str], static: set[str]) -> SimpleNamespace:
    """A decoder of one layout per value: `runs` value -> its producers' arguments, `placed` the inputs; every
    class named c<value>, the output Delivered from value "out"."""
    nodes = [DNode(f"p{v}", "Place", f"c{v}", (), v, "R", v) for v in placed]
    nodes += [DNode(f"r{v}{i}", "Run", f"c{v}", tuple(f"c{a}" for a in args), "kernel", "R", v)
              for v, producers in runs.items() for i, args in enumerate(producers)]
    nodes.append(DNode("d", "Deliver", "root", ("cout",), "", ""))
    classes = {n.eclass: n.value for n in nodes if n.value}
    return SimpleNamespace(nodes=nodes, class_value=classes, class_layout={c: "R" for c in classes},
                           static_classes=frozenset(f"c{v}" for v in static), interner=SimpleNamespace(priced_as={}))


def test_a_static_value_the_egraph_makes_from_itself_is_read():
    """s1 is made from s2 and s2 from s1 (as x = view(view(x)) puts x's class in a cycle): LLaMA's training step at
    16 x 4096 on 8x8 ended in RecursionError here."""
    runs = {"s1": [["s0"], ["s2"]], "s2": [["s1"]], "out": [["x", "s2"]]}
    assert find_repetition(decoder(runs, ["x", "s0"], {"s0", "s1", "s2"}), ["root"]) is None
