"""Pricing only the moves extraction chooses: the other moves cost their floor.

Pricing every move between a value's layouts was the largest phase of planning the small zoo models on a 2-D
mesh, yet a plan uses a handful of those moves (docs/benchmarks.md, "Extraction prices the moves it chooses"). So
the moves that `Decoder.priced` prices on demand (not out of a replicated layout, not between seed plans'
layouts) start at their floor (`reshard_floors` of the cost model: a lower bound on the price, no move planned);
extraction runs on those costs; the floored moves its selection uses are priced, and where one costs more than
its floor it extracts again on the new costs, until a selection uses no move above its floor. That selection's
cost is then its true cost, and whatever the extractor proved of it holds: its bound was made on costs at most
the prices, over every move.

No move is dropped for a cheaper route (`decode.dominated_moves`, which `Decoder.priced` applies): that compares
a move's price with routes of priced moves, and a floor, below the price, is rarely beaten by the few moves
priced here. Runs that a kept run of the same op and priced moves beat are dropped (`decode.dominated_runs`),
and stay so as more moves get priced.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from tapestry.clock import clock
from tapestry.egraph.decode import Decoder, PricingStats, dominated_runs
from tapestry.extract import EGraph as ExtractGraph
from tapestry.extract import Selection

# Extractions on floors before every move left is priced (the next extraction, on prices alone, is then the
# last): each is a whole extraction, and where the moves a selection uses cost their floors the first is the last.
ROUNDS = 3


class FloorPriced:
    """The extraction graph with every optional move at its floor until extraction chooses it (module doc)."""

    @classmethod
    def made(cls, decoder: Decoder, roots: Sequence[str], cost: Any, reshards: float) -> FloorPriced | None:
        """The floored graph, or None where moves cannot wait for extraction: the cost model has no floors
        (`reshard_floors`), or a pricing budget (`reshards`, a count of optional moves, `Decoder.priced`) would
        leave some unpriced in its own order."""
        if not hasattr(cost, "reshard_floors"):
            return None
        if reshards < sum(n.op == "Reshard" for n in decoder.nodes):  # at most one key each (mostly fewer)
            optional = {decoder.price_key(n) for n in decoder.nodes
                        if decoder.optional(n) and not decoder.prepared(n)}
            if reshards < len(optional):
                return None
        return cls(decoder, roots, cost)

    def __init__(self, decoder: Decoder, roots: Sequence[str], cost: Any) -> None:
        started = clock()
        self.decoder, self.cost = decoder, cost
        costs, self.prices, self.optional = decoder.always_priced(cost)
        keys = list(self.optional)
        floors = cost.reshard_floors([decoder.priced_step(decoder.nodes[self.optional[k][0]]) for k in keys],
                                     decoder.mesh)
        self.floors: dict[Hashable, float] = dict(zip(keys, floors.tolist()))
        self.key_of = {i: key for key, members in self.optional.items() for i in members}
        for i, key in self.key_of.items():
            costs[i] = self.floors[key]
        moves = {(n.children[0], n.eclass): i for i, n in enumerate(decoder.nodes) if n.op == "Reshard"}
        runs = dominated_runs(decoder.ops(costs), {pair: c for pair, i in moves.items()
                                                   if i not in self.key_of and (c := costs[i]) < math.inf})
        for i in runs:
            costs[i] = math.inf
        self.graph = decoder.graph(costs, roots)
        self._runs_dropped = len(runs)
        self._rounds = 0  # extractions repriced
        self._seconds = clock() - started
        self._record()

    def repriced(self, egraph: ExtractGraph, selection: Selection) -> ExtractGraph | None:
        """`egraph` (this graph, or one made from it by changing costs of other nodes than moves: outputs
        restricted) with the floored moves `selection` uses priced; None where each of them costs its floor,
        so the selection's cost is its true cost and nothing needs extracting again. After ROUNDS such
        extractions, every move is priced where one more is needed. ValueError where a price is below its floor
        (the floor was no lower bound: the bound extraction proved would not hold)."""
        started = clock()
        self._rounds += 1
        costs = list(egraph.node_cost)
        again = self._priced({self.key_of[i] for i in selection.choice.values() if i in self.key_of}, costs)
        if again and self._rounds >= ROUNDS:
            self._priced(self.optional.keys(), costs)
        self._seconds += clock() - started
        self._record()
        return egraph.with_costs(costs) if again else None

    def _priced(self, keys: Iterable[Hashable], costs: list[float]) -> bool:
        """Prices `keys` not priced yet into `costs` (each key's nodes: dropped ones stay dropped); whether any
        costs more than its floor."""
        above = False
        for key in sorted(set(keys) - self.prices.keys(), key=lambda k: self.optional[k][0]):
            node = self.decoder.nodes[self.optional[key][0]]
            self.prices[key] = price = self.decoder.price(self.cost, node)
            floor = self.floors[key]
            if price < floor * (1 - 1e-9):
                raise ValueError(f"FloorPriced.repriced: reshard {node.id} ({key}) costs {price:.6g} s, below its "
                                 f"floor {floor:.6g} s: the cost model's reshard_floors is no lower bound")
            above |= price > floor * (1 + 1e-9)
            for i in self.optional[key]:
                if costs[i] < math.inf:
                    costs[i] = price
        return above

    def _record(self) -> None:
        """What was priced so far, as `Decoder.pricing` says it (`PricingStats.moves_floored`: the optional keys
        extraction never asked for)."""
        floored = sum(1 for key in self.optional if key not in self.prices)
        self.decoder.pricing = PricingStats(self._seconds, len(self.prices), 0, 0, self._runs_dropped,
                                            moves=len(self.optional), moves_floored=floored)
