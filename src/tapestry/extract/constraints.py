"""What a selection must keep besides its cost: a memory budget per device, and ties (pairs of nodes chosen
together or not at all), as the ILP (`ilp.py`, `cpsat.py`) models them and checks its warm starts against them."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceBudget:
    """Linear per-device memory constraints: `resident[n]` (bytes per device) is held for the whole program by
    every chosen node n, and `transient[m]` on top of it while chosen node m runs; neither may pass `limit`. (A
    tuple's entries may stand for sets of devices alike, the most of theirs: `egraph.budget.alike_devices`.)
    Each of `groups` (bytes per node, on one device) is a set of nodes whose chosen members' bytes may not pass
    `limit` together either: what a caller learnt held memory at once (the optimizer's cuts)."""

    limit: int
    resident: Mapping[int, tuple[int, ...]]
    transient: Mapping[int, tuple[int, ...]]
    groups: tuple[Mapping[int, int], ...] = ()

    def usage(self, choice: Mapping[int, int]) -> tuple[int, ...]:
        """Per device, the bytes the constraints charge a selection (at its worst node)."""
        nodes = set(choice.values())
        devices = len(next(iter((*self.resident.values(), *self.transient.values())), ()))
        return tuple(
            sum(self.resident[n][d] for n in nodes if n in self.resident)
            + max((self.transient[n][d] for n in nodes if n in self.transient), default=0)
            for d in range(devices)
        )

    def fits(self, choice: Mapping[int, int]) -> bool:
        nodes = set(choice.values())
        return all(u <= self.limit for u in self.usage(choice)) and all(
            sum(b for n, b in group.items() if n in nodes) <= self.limit for group in self.groups)


Ties = Sequence[tuple[int, int]]  # node pairs whose x must be equal


def tied_nodes(ties: Ties) -> frozenset[int]:
    return frozenset(n for pair in ties for n in pair)


def ties_hold(choice: Mapping[int, int], ties: Ties) -> bool:
    """Every tied pair is chosen together or not at all."""
    chosen = set(choice.values())
    return all((a in chosen) == (b in chosen) for a, b in ties)
