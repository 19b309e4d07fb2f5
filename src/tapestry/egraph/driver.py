"""The saturation driver: rule rounds on the logical layer, then the distributed layer, under hard budgets.

Rules rewrite only logical terms, so they run first, to a fixpoint, alternating
with passes that name and type new classes (Rank/Dim guards need them). Then the
distributed layer is generated once for the whole logical e-graph. Splitting
the phases keeps rule rounds cheap (no distributed layer to rebuild) and means
fusion and substitution never starve. Every phase stops on a count derived from Budget.seconds, so where it
stops, and so the plan, does not depend on the machine's load: rule rounds at `rule_nodes` e-nodes, generation
at `runs_to_generate` sharded runs (or once its layouts make more reshards than pricing prices), making reshards
at `reshards_to_make` reshards, pricing (egraph.decode) at `moves_to_price` moves. The counts are what each
phase did in its share of `seconds` on a quiet machine (RULES_SHARE, GENERATION_SHARE, MOVES_SHARE of it, in
CPU seconds); the clock (`tapestry.clock`) stays only as a safety net, SAFETY_NET times each share, and a stop
by it says "seconds (safety net)". Runs nobody moves between and moves nobody priced make no plan better. A
stopped generation still leaves every node's replicated run, and a stopped pricing every reshard that run
needs, so a plan always exists (docs/cost-models.md, "Budgets").
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tapestry.clock import SAFETY_NET_STOP, clock
from tapestry.egraph.decode import DNode, distributed_nodes
from tapestry.egraph.distributed import Interner
from tapestry.egraph.generate import GenerationStats, Generator, View
from tapestry.egraph.rules import Rule, RuleFile
from tapestry.egraph.session import Session
from tapestry.extract import Selection
from tapestry.graph import Graph
from tapestry.plan import Plan
from tapestry.sharding import Mesh


RULES_SHARE = 0.25  # of Budget.seconds, when rule rounds stop at the latest
GENERATION_SHARE = 0.5  # when generation stops at the latest
MOVES_SHARE = 0.75  # when making reshards stops at the latest (optimizer.explore); pricing has the rest
PAIRS_PER_SECOND = 100_000  # layout pairs whose reshards decode makes and prices per second (a 2x2x2 stack)
PAIRS_DEVICES = 64  # past this many devices a second prices fewer pairs: (PAIRS_DEVICES / devices) ** 2 as many
MOVES_PER_SECOND = 800  # distinct moves (layout pair, dtype) pricing prices per CPU second on PAIRS_DEVICES devices
RULE_NODES_PER_SECOND = 20_000  # e-nodes rule rounds grow the e-graph by per CPU second (RULES_SHARE)
RUNS_PER_SECOND = 1_000  # sharded runs generation makes per CPU second (GENERATION_SHARE), up to PAIRS_DEVICES
RESHARDS_PER_SECOND = 40_000  # reshards decode makes per CPU second (MOVES_SHARE)
SAFETY_NET = 10  # times its share of Budget.seconds, in CPU seconds, a phase runs at most whatever its count says


@dataclass(frozen=True)
class Budget:
    """Saturation stops at the first budget reached; the result says which, and in which phase. `iterations`
    bounds rule rounds; `nodes` rule rounds and generation alike; `seconds` sets each phase's count of work
    (`rule_nodes`, `runs_to_generate`, `reshards_to_make`, `moves_to_price`: what it did in its share of that
    many CPU seconds on a quiet machine) and, SAFETY_NET times that, a CPU-second safety net."""

    nodes: int = 200_000
    seconds: float = 30.0
    iterations: int = 20
    priced_moves: int | None = None  # distinct moves pricing prices beyond those always priced; None: `moves_to_price`


def moves_to_price(budget: Budget, mesh: Mesh) -> int:
    """How many distinct moves (layout pair, dtype) pricing prices beyond the Runs, Places and moves out of a
    replicated layout it always prices: `budget.priced_moves`, or what the last share of `budget.seconds` prices at
    MOVES_PER_SECOND, (PAIRS_DEVICES / devices) ** 2 as many on a smaller mesh (a move works through every device's
    block) and as many on a larger one (past PAIRS_DEVICES a move whose boxes form a grid is counted, not planned:
    8x8x8 priced 10,932 reshards in 10.1 CPU s, 4x8x8 44,270 in 16.7, docs/benchmarks.md "Issue 24, the rest").
    A count, not a clock: with seconds, the moves priced, and so the plan, depended on how many CPU
    seconds the phases before took (Mixtral's training step on 8x8: 59.8, 18.2 and 15.7 ms in three runs)."""
    if budget.priced_moves is not None:
        return budget.priced_moves
    return int(MOVES_PER_SECOND * budget.seconds * (1 - MOVES_SHARE) * max(1.0, PAIRS_DEVICES / mesh.size) ** 2)


def rule_nodes(budget: Budget) -> int:
    """The e-graph size rule rounds stop at: RULES_SHARE of `budget.seconds` at RULE_NODES_PER_SECOND."""
    return int(RULE_NODES_PER_SECOND * budget.seconds * RULES_SHARE)


def runs_to_generate(budget: Budget, mesh: Mesh) -> int:
    """How many sharded runs generation makes at most: GENERATION_SHARE of `budget.seconds` at RUNS_PER_SECOND,
    (PAIRS_DEVICES / devices) as many past PAIRS_DEVICES (a run's blocks are made for every device). A count,
    not a clock: by CPU seconds Mixtral's training step on 8x8 left out 347 and 2,547
    runs in two runs of the same call (docs/benchmarks.md, "Plans that do not depend on the load")."""
    return int(RUNS_PER_SECOND * budget.seconds * GENERATION_SHARE * min(1.0, PAIRS_DEVICES / mesh.size))


def reshards_to_make(budget: Budget) -> int:
    """How many reshards making them (`decode.distributed_nodes`) makes beyond those out of a replicated layout:
    its share of `budget.seconds` (MOVES_SHARE less GENERATION_SHARE) at RESHARDS_PER_SECOND."""
    return int(RESHARDS_PER_SECOND * budget.seconds * (MOVES_SHARE - GENERATION_SHARE))


def safety_net(budget: Budget, share: float) -> float:
    """The CPU seconds after which a phase whose budget ends at `share` of `budget.seconds` stops whatever its
    count: SAFETY_NET times that share, so only a machine many times slower than the counts' calibration ever
    reaches it (then the plan depends on the clock, and the status says so: SAFETY_NET_STOP)."""
    return budget.seconds * share * SAFETY_NET


@dataclass(frozen=True)
class IterationStats:
    iteration: int
    enodes: int
    eclasses: int
    new_logical_nodes: int
    matches: dict[str, int]  # rule (file:line) -> matches
    seconds: float


@dataclass(frozen=True)
class SaturationStats:
    iterations: tuple[IterationStats, ...]  # the rule rounds
    stopped_by: str  # "fixpoint", "nodes", "rule nodes", "iterations", "runs" or SAFETY_NET_STOP: the first reached
    seconds: float
    ill_typed: dict[str, str] = field(default_factory=dict)
    stopped_in: str = ""  # the phase the budget stopped: "rules" or "generation" ("" at a fixpoint)
    generation: GenerationStats | None = None
    values_with_few_moves: int = 0  # values whose reshards the budget cut to those out of a replicated layout
    reshards_stopped_by: str = ""  # what cut them: "reshards" (reshards_to_make) or SAFETY_NET_STOP
    reshards_unpriced: int = 0  # reshard e-nodes pricing left out (set by the extraction that priced them)
    moves_unpriced: int = 0  # the distinct moves (layout pair, dtype) of those
    moves: int = 0  # distinct moves pricing counts against its budget (all but those always priced: Decoder.priced)

    @property
    def enodes(self) -> int:
        if self.generation is not None:
            return self.generation.enodes
        return self.iterations[-1].enodes if self.iterations else 0

    @property
    def eclasses(self) -> int:
        if self.generation is not None:
            return self.generation.eclasses
        return self.iterations[-1].eclasses if self.iterations else 0

    @property
    def undone(self) -> str:
        """What the budgets left out, in words ("" when nothing)."""
        parts = []
        if self.stopped_in == "rules":
            parts.append(f"rule rounds stopped by {self.stopped_by} after {len(self.iterations)} rounds")
        if self.generation is not None and self.generation.stopped_by:
            parts.append(f"generation stopped by {self.generation.stopped_by}: {self.generation.runs_left_out} "
                         f"sharded runs left out"
                         + (f" ({self.generation.layout_pairs:,} layout pairs, more reshards than pricing has time for)"
                            if self.generation.pairs_capped else ""))
        if self.values_with_few_moves:
            parts.append(f"reshards cut by {self.reshards_stopped_by}: {self.values_with_few_moves} values keep only "
                         f"those out of their "
                         f"replicated layout")
        if self.reshards_unpriced:
            parts.append(f"pricing stopped by its count: {self.moves_unpriced:,} of {self.moves:,} distinct moves "
                         f"({self.reshards_unpriced:,} reshards) left unpriced (never chosen)")
        return "; ".join(parts)

    def to_json(self) -> dict:
        return asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def search_cut(stats: SaturationStats) -> str:
    """Every phase a budget cut, in order, each as "phase (budget)" ("rules (nodes), generation (runs) and pricing
    (...)"); "" when the search space was complete. Each phase's stop leaves out options the later phases and
    extraction never see (docs/cost-models.md, "Budgets"): naming only the first hid a later cut (Mixtral on 8x8
    read "making reshards" where pricing also left 66,660 of 72,660 moves unpriced)."""
    cuts = []
    if stats.stopped_in == "rules":
        cuts.append(f"rules ({stats.stopped_by})")
    generation = stats.stopped_by if stats.stopped_in == "generation" else \
        stats.generation.stopped_by if stats.generation is not None else ""
    if generation:  # after rules that stopped too: generation runs on what the rounds made
        cuts.append(f"generation ({generation})")
    if stats.values_with_few_moves:
        cuts.append(f"making reshards ({stats.reshards_stopped_by})")
    if stats.reshards_unpriced:
        cuts.append(f"pricing ({stats.moves_unpriced:,} of {stats.moves:,} moves unpriced)")
    return " and ".join(cuts) if len(cuts) < 3 else ", ".join(cuts[:-1]) + " and " + cuts[-1]


def search_status(stats: SaturationStats, selection: Selection) -> str:
    """The extractor's status where the search space was complete, else "stopped by " and every phase a budget
    cut (`search_cut`)."""
    cut = search_cut(stats)
    return f"stopped by {cut}" if cut else selection.status


def _rule_index(files: Sequence[RuleFile]) -> dict[str, Rule]:
    """Each rule under the names egglog's run report counts its matches by (file:line, see Rule.report_keys)."""
    return {key: rule for f in files for rule in f.rules for key in rule.report_keys}


def saturate(
    graph: Graph,
    mesh: Mesh,
    rule_files: Sequence[RuleFile],
    budget: Budget = Budget(),
    progress: Callable[[IterationStats], None] | None = None,
    seeds: Sequence[Plan] = (),
    twins: Sequence[tuple[str, str]] = (),
) -> tuple[Generator, View, SaturationStats]:
    """Rule rounds, then generation (`Generator.distribute`: every step of the plans `seeds` inserted whatever
    the budget, each pair of `twins` held in the layouts of both), under `budget`'s counts."""
    graph.check_plannable()
    started = clock()
    session = Session(rule_files)
    gen = Generator(session, graph, mesh)
    gen.encode()
    rules = _rule_index(rule_files)
    history: list[IterationStats] = []
    fired: list[Rule] = []
    stopped_by, changed = "iterations", True
    for iteration in range(budget.iterations + 1):
        tick = clock()
        view, new_nodes = gen.refresh(fired, iteration)
        size = session.size()
        matches: dict[str, int] = {}
        stop = _stop_reason(budget, started, size, iteration, new_nodes or changed)
        if stop is None:
            changed = False
            for f in rule_files:
                if f.iterations is not None and iteration >= f.iterations:
                    continue  # a bounded ruleset (merges, algebra) has had its rounds
                found, updated = session.run_ruleset(f.name)
                matches.update(found)
                changed |= updated
            fired = list(dict.fromkeys(rules[k] for k, n in matches.items() if n and k in rules))
        stats = IterationStats(
            iteration, size, len(view.handles) + len(view.at_classes), new_nodes,
            {rules[k].where: n for k, n in matches.items() if k in rules and n}, clock() - tick,
        )
        history.append(stats)
        if progress:
            progress(stats)
        if stop is not None:
            stopped_by = stop
            break
    generation = gen.distribute(started + safety_net(budget, GENERATION_SHARE), budget.nodes,
                                PAIRS_PER_SECOND * budget.seconds * (1 - MOVES_SHARE)
                                * min(1.0, PAIRS_DEVICES / mesh.size) ** 2, runs_to_generate(budget, mesh), seeds,
                                twins)
    stopped_in = "rules" if stopped_by != "fixpoint" else "generation" if generation.stopped_by else ""
    if stopped_in == "generation":
        stopped_by = generation.stopped_by
    return gen, view, SaturationStats(tuple(history), stopped_by, clock() - started,
                                      dict(gen.ill_typed), stopped_in, generation)


def _stop_reason(budget: Budget, started: float, size: int, iteration: int, growing: bool) -> str | None:
    if not growing:
        return "fixpoint"
    if size >= budget.nodes:
        return "nodes"
    if size >= rule_nodes(budget):
        return "rule nodes"
    if clock() - started >= safety_net(budget, RULES_SHARE):
        return SAFETY_NET_STOP
    if iteration >= budget.iterations:
        return "iterations"
    return None


def make_reshards(data: dict[str, Any], interner: Interner, started: float, budget: Budget, stats: SaturationStats
                  ) -> tuple[list[DNode], list[str], dict[str, str], SaturationStats]:
    """The distributed nodes with their reshards (`decode.distributed_nodes`), at most `reshards_to_make` beyond
    those out of a replicated layout, the clock (from `started`, saturation's start) a safety net; `stats` says
    what that left out."""
    nodes, roots, names, cut = distributed_nodes(data, interner, started + safety_net(budget, MOVES_SHARE),
                                                 reshards_to_make(budget))
    return nodes, roots, names, replace(stats, values_with_few_moves=cut.values, reshards_stopped_by=cut.stopped_by)
