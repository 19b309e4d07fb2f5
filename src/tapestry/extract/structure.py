"""Graph algorithms shared by the extractors: strongly connected components over class indices."""
from __future__ import annotations

from collections.abc import Callable, Iterable


def strongly_connected_components(
    vertices: Iterable[int], successors: Callable[[int], Iterable[int]]
) -> list[list[int]]:
    """Tarjan's algorithm without recursion (e-graphs are deeper than Python's stack)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    components: list[list[int]] = []
    for start in vertices:
        if start in index:
            continue
        work = [(start, iter(successors(start)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(successors(w))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                components.append(component)
    return components


def cyclic_components(
    vertices: Iterable[int], successors: Callable[[int], Iterable[int]]
) -> list[list[int]]:
    """Components that contain a cycle: more than one vertex, or one vertex with a self-edge."""
    return [
        comp
        for comp in strongly_connected_components(vertices, successors)
        if len(comp) > 1 or comp[0] in successors(comp[0])
    ]
