"""What a memory budget asks of the e-graph's nodes: the bytes per device each value holds, the per-device
constraints every fitting plan meets (`device_budget`), the floor the inputs alone set (`inputs_floor`), the
cuts that exclude an overshooting plan (`memory_cuts`), and the error that says why nothing fits."""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace

from tapestry.cost import RankPeak, layout_bytes, rank_peaks
from tapestry.cost.breakdown import phases
from tapestry.cost.memory import Lowerings, lean_order
from tapestry.egraph.decode import Decoder
from tapestry.egraph.layered import Layered
from tapestry.extract import DeviceBudget, Selection
from tapestry.extract import EGraph as ExtractGraph
from tapestry.extract.selection import dag_cost
from tapestry.graph import Graph
from tapestry.plan import Compute, Place, Plan, Reshard


class MemoryBudgetError(ValueError):
    """No plan found fits the memory budget."""


def held_bytes(decoder: Decoder, graph: Graph, classes: Collection[str] | None = None) -> dict[str, tuple[int, ...]]:
    """E-class -> the bytes each device holds of its value (a placed input's block, or a result's); of `classes`
    alone where given."""
    layouts = decoder.interner.layouts
    placed = {n.eclass: graph[n.key].dtype for n in decoder.nodes if n.op == "Place"}
    return {c: layout_bytes(layouts[decoder.class_layout[c]][1], dtype)
            for c, dtype in {**decoder.class_dtype, **placed}.items() if classes is None or c in classes}


def device_budget(decoder: Decoder, held: Mapping[str, tuple[int, ...]], layered: Layered | None,
                  limit: int) -> DeviceBudget:
    """Bytes per device that every plan containing a node must hold: a Place its block of the input, for the
    whole program; a Run its result (none where it is a view: `always_view`) and its non-input arguments while it
    runs; a Reshard its source and its result, except where the result is a view of the source (cost.memory).
    Lower bounds of the exact peak, so the constraints exclude no plan that fits; they miss other activations live
    at the same time. Devices alike in what they hold all program share their constraints (`alike_devices`)."""
    resident, transient = _charged(decoder, held, layered, range(len(decoder.nodes)))
    return DeviceBudget(limit, *alike_devices(resident, transient))


def chosen_floor(decoder: Decoder, graph: Graph, layered: Layered | None, choice: Mapping[int, int]) -> list[int]:
    """Per device, the least peak of the plan `choice` decodes to in any step order (`device_budget`'s charges
    of the chosen nodes: DeviceBudget.usage), its values' bytes found for the chosen classes alone (an
    extraction that fits asks nothing of `held_bytes`' whole e-graph): a peak over a budget, told undecoded."""
    nodes = decoder.nodes
    classes = {c for n in choice.values() for c in (nodes[n].eclass, *nodes[n].children)}
    held = held_bytes(decoder, graph, classes)
    resident, transient = _charged(decoder, held, layered, set(choice.values()))
    return [sum(r[d] for r in resident.values()) + max((t[d] for t in transient.values()), default=0)
            for d in range(decoder.mesh.size)]


def _charged(decoder: Decoder, held: Mapping[str, tuple[int, ...]], layered: Layered | None,
             chosen: Iterable[int]) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
    """`device_budget`'s resident and transient bytes per device of the `chosen` nodes."""
    layouts, nodes = decoder.interner.layouts, decoder.nodes
    placed = {node.eclass for node in nodes if node.op == "Place"}
    resident, transient = {}, {}
    for n in chosen:
        node = nodes[n]
        if node.op == "Place":
            resident[n] = held[node.eclass]
        elif node.op == "Reshard":
            src, dst = layouts[decoder.class_layout[node.children[0]]][1], layouts[node.key][1]
            transient[n] = tuple(
                0 if need is None else s + (0 if own is not None and own.contains(need) else o)
                for s, o, own, need in zip(held[node.children[0]], held[node.eclass], src.blocks, dst.blocks))
        elif node.op != "Deliver":
            args = [held[c] for c in dict.fromkeys(node.children) if c not in placed]
            if not decoder.views(node):  # a view holds no bytes of its own
                args.append(held[node.eclass])
            transient[n] = tuple(map(sum, zip(*args))) if args else (0,) * decoder.mesh.size
    return (resident if layered is None else layered.resident(resident)), transient


def alike_devices(resident: Mapping[int, tuple[int, ...]], transient: Mapping[int, tuple[int, ...]]
                  ) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
    """The budget's bytes over sets of devices instead of devices: those whose resident bytes are the same at every
    node (their held sums are one), each set's transient bytes at a node the most of its devices'. Exactly the
    same constraints (a set's usage is the most of its devices'), one per node and set rather than per node and
    device: on the 70B layer's 8x8 sub-mesh the ILP's budget was 4.4 million constraints over 64 devices (52 CPU s
    and 1.2 GiB to build, every memory-cut round; docs/benchmarks.md "Pipeline")."""
    devices = len(next(iter((*resident.values(), *transient.values())), ()))
    sets: dict[tuple[int, ...], list[int]] = {}
    for d in range(devices):
        sets.setdefault(tuple(held[d] for held in resident.values()), []).append(d)
    if len(sets) == devices:
        return dict(resident), dict(transient)
    groups = list(sets.values())
    return ({n: tuple(held[g[0]] for g in groups) for n, held in resident.items()},
            {n: tuple(max(map(extra.__getitem__, g)) for g in groups) for n, extra in transient.items()})


def inputs_floor(decoder: Decoder, graph: Graph, layered: Layered | None) -> tuple[int, tuple[tuple[str, int], ...]]:
    """A floor under every plan's peak bytes per device, and what makes it up, largest first: each input a
    step reads (or a step carries) is held for the whole program in one of the layouts the search made for it,
    and the device holding most holds at least the mean over devices of all of them (cost.memory)."""
    layouts = decoder.interner.layouts
    read = {name for name, users in graph.users().items() if users} | set(graph.carried.values())
    places = {n: layout_bytes(layouts[decoder.class_layout[node.eclass]][1], graph[node.key].dtype)
              for n, node in enumerate(decoder.nodes) if node.op == "Place" and node.key in read}
    if layered is not None:  # copy 1's inputs stand for every later layer's
        places = layered.resident(places)
    least: dict[str, float] = {}
    for n, held in places.items():
        name = decoder.nodes[n].key
        least[name] = min(least.get(name, math.inf), sum(held) / len(held))
    ranked = sorted(((name, math.ceil(b)) for name, b in least.items()), key=lambda item: (-item[1], item[0]))
    return math.ceil(sum(least.values())), tuple(ranked)


def budget_error(limit: int, why: str, floor: tuple[int, tuple[tuple[str, int], ...]],
                 devices: int) -> MemoryBudgetError:
    """No plan fits `limit`, for the reason `why` the extraction gave, and what the inputs need of it (`floor`,
    `inputs_floor`'s): the weights, optimizer state and batch alone, split as finely as the search made them
    on `devices` devices, with the largest. Proven where the inputs alone overshoot; else only no plan found
    fits (the memory cuts are heuristic, the ILP's time limited), and the error says so."""
    least, ranked = floor
    largest = ", ".join(f"{name} {held:,}" for name, held in ranked[:3])
    inputs = (f"the {len(ranked)} inputs (weights, optimizer state, batch) alone need at least {least:,} bytes "
              f"per device, each split as finely as the search made it on {devices} devices (largest: "
              f"{largest})")
    if least > limit:
        return MemoryBudgetError(f"no plan fits {limit:,} bytes per device: {inputs}; use more devices or a "
                                 f"larger budget")
    return MemoryBudgetError(f"no plan found fits {limit:,} bytes per device, but none is proven not to: {why}; "
                             f"{inputs}, the only floor proven, so no plan found holds the step's other values in "
                             f"the {limit - least:,} bytes left")


def hand_within(egraph: ExtractGraph, hands: Sequence[Selection], limit: int,
                decoded: Callable[[Selection], tuple[Plan, Sequence[RankPeak]]],
                tried: Sequence[tuple[Plan, Sequence[RankPeak]]], error: Callable[[str], MemoryBudgetError],
                why: str) -> tuple[Plan, Selection]:
    """The cheapest of `hands` (hand plans and warm starts, as selections of `egraph`) whose decoded plan fits
    `limit`, marked "feasible", where the budgeted ILP gave up: a memory cut charges values that were live together
    in another plan, so it can exclude a hand plan that fits (ZeRO-3's at its own peak on Mesh(2, 2)). Else `error`
    of `why` and the leanest plan decoded (the ILP's `tried`, the hands), with what it holds at its peak: where no
    plan found fits, how far the least is over and what makes it up."""
    leanest: tuple[int, str, Plan, Sequence[RankPeak]] | None = None
    for plan, peaks in tried:
        if leanest is None or max(p.bytes for p in peaks) < leanest[0]:
            leanest = max(p.bytes for p in peaks), plan.notes.get("extractor", "ilp"), plan, peaks
    for hand in sorted((replace(h, dag_cost=dag_cost(egraph, h.choice)) for h in hands), key=lambda h: h.dag_cost):
        if not math.isfinite(hand.dag_cost):
            continue
        plan, peaks = decoded(hand)
        peak = max(p.bytes for p in peaks)
        if peak <= limit:
            return replace(plan, notes={**plan.notes, "status": "feasible"}), replace(hand, status="feasible")
        if leanest is None or peak < leanest[0]:
            leanest = peak, hand.extractor, plan, peaks
    if leanest is None:
        raise error(why)
    peak, name, plan, peaks = leanest
    raise error(f"{why}; the leanest plan decoded, {name}'s, needs {peak:,}: {held_at_peak(plan, peaks)}")


def held_at_peak(plan: Plan, peaks: Sequence[RankPeak], shown: int = 4) -> str:
    """What the fullest device holds at its peak: the live bytes by what made them (placed inputs, reshards, each
    kernel's results), largest first, the largest buffers by name, the phase the peak comes in (forward, backward
    or update, `cost.breakdown.phases`, of the newest buffer live then) and the live bytes by phase, the largest
    named: where a budget no plan meets is spent, and whether recomputing activations (forward values live in the
    backward), more devices for the state (placed inputs) or the backward's own values would help."""
    rank = max(range(len(peaks)), key=lambda r: peaks[r].bytes)
    live = peaks[rank].live
    kinds: dict[str, list[int]] = {}  # what made them -> [bytes, buffers]
    for i, size in live.items():
        step = plan.steps[i]
        kind = "placed inputs" if isinstance(step, Place) else "reshards" if isinstance(step, Reshard) else (
            step.kernel if isinstance(step, Compute) else type(step).__name__)
        held = kinds.setdefault(kind, [0, 0])
        held[0] += size
        held[1] += 1
    by_kind = sorted(kinds.items(), key=lambda item: (-item[1][0], item[0]))
    largest = sorted(live.items(), key=lambda item: (-item[1], item[0]))[:shown]
    made = ", ".join(f"{kind} {held:,} ({count} buffers)" for kind, (held, count) in by_kind[:shown])
    buffers = ", ".join(f"{plan.steps[i].out} {size:,}" for i, size in largest)
    phase = phases(plan)
    newest = plan.steps[max(live)].out
    return (f"device {rank} at its peak holds {made}{', ...' if len(by_kind) > shown else ''}; largest: {buffers}; "
            f"the peak comes in the {phase[newest]} (its newest buffer {newest}, step {max(live) + 1} of "
            f"{len(plan.steps)}); {by_phase(plan, live, phase, phase[newest])}")


def by_phase(plan: Plan, live: Mapping[int, int], phase: Mapping[str, str], now: str) -> str:
    """A peak's live bytes (`RankPeak.live`) by phase, largest first: placed inputs (weights, optimizer state,
    batch), forward values (in the backward: the activations kept for it), backward and update values; and what the
    largest share says would shrink it. The search computes each value once: only the recomputed hand plans of an
    unfolded step (`training.recompute`) make activations again."""
    shares: dict[str, int] = {}
    for i, size in live.items():
        step = plan.steps[i]
        name = "placed inputs" if isinstance(step, Place) else phase[step.out] + " values"
        if name == "forward values" and now != "forward":
            name = "activations (forward values kept for the backward)"
        shares[name] = shares.get(name, 0) + size
    ranked = sorted(shares.items(), key=lambda item: (-item[1], item[0]))
    top, held = ranked[0]
    hint = {"placed inputs": "more devices split the weights and optimizer state finer",
            "activations (forward values kept for the backward)": "the search computes each value once (only the "
            "recomputed ZeRO-3/FSDP hand plans of an unfolded step make activations again), so more devices (a finer "
            "batch or sequence split) or a larger budget shrink them"}.get(top, "they are the step's own values then")
    said = ", ".join(f"{name} {size:,}" for name, size in ranked)
    return f"by phase: {said}; the most, {top} ({held / sum(shares.values()):.0%} of the peak): {hint}"


def leaner(plan: Plan, step_nodes: list[int], lowerings: Lowerings | None = None
           ) -> tuple[Plan, list[int], list[RankPeak]]:
    """The plan in its own (children-first) order or in cost.memory.lean_order, whichever peaks lower; with
    the node each step comes from and the peak per device. Its steps are lowered once for both orders (into
    `lowerings`, where given: kept for later plans)."""
    lowerings = Lowerings() if lowerings is None else lowerings
    peaks = rank_peaks(plan, lowerings)
    order = lean_order(plan)
    reordered = replace(plan, steps=tuple(plan.steps[i] for i in order))
    lean = rank_peaks(reordered, lowerings)
    if max(p.bytes for p in lean) < max(p.bytes for p in peaks):
        return reordered, [step_nodes[i] for i in order], lean
    return plan, step_nodes, peaks


def memory_cuts(egraph: ExtractGraph, step_nodes: Sequence[int], peaks: Sequence[RankPeak],
                limit: int) -> list[dict[int, int]]:
    """Per device a plan overshoots `limit` on, a group (DeviceBudget.groups) of the e-classes whose values were
    live at its peak, every node of such a class charged the bytes its value held there: no plan may make all
    of those values. Heuristic: whether values are live together depends on the rest of the plan (their
    readers, the step order), so a plan that holds them at different times is excluded too; only the placed
    inputs' bytes are held in every plan. The plan a cut came from is always excluded by it."""
    cuts: list[dict[int, int]] = []
    for peak in peaks:
        if peak.bytes > limit:
            held: dict[int, int] = {}  # e-class -> bytes
            for step, size in peak.live.items():
                c = egraph.node_class[step_nodes[step]]
                held[c] = held.get(c, 0) + size
            cuts.append({n: size for c, size in held.items() for n in egraph.class_nodes[c]})
    return cuts
