"""Connected components of linked items, in a deterministic order (no hash-seed dependence)."""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

T = TypeVar("T", bound=Hashable)


def connected_groups(items: Iterable[T], links: Iterable[tuple[T, T]]) -> list[list[T]]:
    """The items joined by `links` (union-find), each group in `items`' order, groups in order of their first."""
    order = list(items)
    parent = {item: item for item in order}

    def root(item: T) -> T:
        while parent[item] != item:
            parent[item] = parent[parent[item]]
            item = parent[item]
        return item

    for a, b in links:
        parent[root(a)] = root(b)
    groups: dict[T, list[T]] = {}
    for item in order:
        groups.setdefault(root(item), []).append(item)
    return list(groups.values())
