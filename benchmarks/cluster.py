"""Cluster benchmark (issue 24): LLaMA and Mixtral at real widths, built on meta, planned for H100 clusters.

Per case (model width, layers, inference or one Adam training step, mesh): import time and peak RSS, optimize
time, the result's status and gap, the whole-space floor (cost.floor) and the gap to it, predicted step time and
MFU, peak memory per device, what the plan splits
(token ids, weights; for training how each weight lives between steps), beside the hand-built plans
(tapestry.training.plans.baselines: the hand plans the optimizer's floor keeps its plan under) priced by the same
cost model on the case's own mesh.

Each case runs in a fresh process (spawned, so its peak RSS, /proc VmHWM, is its own). The whole model's import
(32 layers) is measured alone, as the optimizer cannot plan it within its default budget yet (issue 24, item 2).
Writes the "Cluster" section of docs/benchmarks.md.

    python benchmarks/cluster.py                      # 7B: 2 layers on 8, 2x4, 8x8; import of 32 layers
    python benchmarks/cluster.py --quick              # one small case, to check the script
    python benchmarks/cluster.py --from-json ROWS.json --floors --json OUT.json --no-write
                                                      # saved rows' floors (graph, mesh, profile: no optimize)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from typing import Any

from _report import write_section

PROFILE = "gpu-h100-cluster"
WIDTHS = {  # hidden, MLP hidden (per expert), heads, KV heads: LLaMA-2 configs, and Mixtral 8x7B's
    "7B": (4096, 11008, 32, 32),
    "13B": (5120, 13824, 40, 40),
    "70B": (8192, 28672, 64, 8),
    "Mixtral": (4096, 14336, 32, 8),
    "tiny-GQA": (64, 128, 8, 2),  # a check in small (benchmarks/hand_plans_embedded.py), not a cluster size
}
EXPERTS = {"Mixtral": (8, 2)}  # experts, and how many each token is routed to
HAND = ("DP", "ZeRO-3", "FSDP", "TP", "DPxTP", "EP", "DPxEP", "DPxEP seq whole", "DPx(TP+EP)",
        "DPx(TP+EP) outer whole", "DPxEP group", "DPx(TP+EP) group")
HAND_NAMES = {"data parallel": "DP", "ZeRO-3": "ZeRO-3", "FSDP": "FSDP", "tensor parallel": "TP",  # baselines' names
              "data and tensor parallel": "DPxTP", "expert parallel": "EP", "data and expert parallel": "DPxEP",
              "data and expert parallel, sequence whole": "DPxEP seq whole",
              "data, tensor and expert parallel": "DPx(TP+EP)",
              "data, tensor and expert parallel, outer whole": "DPx(TP+EP) outer whole"}
EXPERT_WEIGHTS = (".experts.gate_up_proj", ".experts.down_proj")  # [E, ...]: split by expert in EP


@dataclass(frozen=True)
class Case:
    model: str
    layers: int
    mode: str  # "inference" | "training"
    mesh: str  # "8", "2x4", "8x8"
    batch: int
    seq: int
    vocab: int = 32000
    arch: str = "hf"  # "hf": transformers' LlamaForCausalLM; "block": a stack of importer.zoo.LlamaBlock (no rotary,
    # embedding or head: a graph the hand plans of training/plans.py can split, see the section's note)
    fold: bool | None = None  # tapestry.optimize's `layers`: repeated layers planned once (graph.layers)
    memory_budget: int | None = None  # tapestry.optimize's: bytes per device

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.mesh.split("x"))


def peak_rss() -> int:
    """This process's peak resident set, in bytes (VmHWM: ru_maxrss would carry a forking parent's over)."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def build(case: Case) -> Any:
    """The case's module on the meta device (bfloat16, as such models train and serve) and its import."""
    import torch
    import transformers

    import tapestry

    hidden, mlp, heads, kv = WIDTHS[case.model]
    if case.arch == "block":
        if case.model in EXPERTS:
            raise ValueError(f"{case.model}: no block arch for a mixture of experts; use --arch hf")
        return build_blocks(case, hidden, mlp, heads)
    widths = dict(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=case.layers,
                  num_attention_heads=heads, num_key_value_heads=kv, vocab_size=case.vocab,
                  max_position_embeddings=max(4096, case.seq))
    if case.model in EXPERTS:
        experts, top = EXPERTS[case.model]
        config = transformers.MixtralConfig(**widths, num_local_experts=experts, num_experts_per_tok=top)
        architecture = transformers.MixtralForCausalLM
    else:
        config, architecture = transformers.LlamaConfig(**widths), transformers.LlamaForCausalLM
    with torch.device("meta"):
        module = architecture(config).to(torch.bfloat16)
    ids = torch.zeros(case.batch, case.seq, dtype=torch.int64, device="meta")
    if case.mode == "inference":
        return tapestry.from_torch(module.eval(), (ids,), {"use_cache": False}, verbose=False)

    def loss(m: Any, ids: Any, labels: Any) -> Any:
        return m(ids, labels=labels, use_cache=False).loss

    training = tapestry.Training(loss=loss, optimizer="adam", lr=1e-4)
    return tapestry.from_torch(module, (ids, ids), training=training, verbose=False)


def build_blocks(case: Case, hidden: int, mlp: int, heads: int) -> Any:
    """`case.layers` LLaMA blocks (RMSNorm, causal SDPA, SiLU-gated MLP) on meta in bfloat16; training: MSE."""
    import torch

    import tapestry
    from tapestry.importer.zoo import LlamaBlock

    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(LlamaBlock(hidden, heads, mlp) for _ in range(case.layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    with torch.device("meta"):
        module = Blocks().to(torch.bfloat16)
    x = torch.zeros(case.batch, case.seq, hidden, dtype=torch.bfloat16, device="meta")
    if case.mode == "inference":
        return tapestry.from_torch(module.eval(), (x,), verbose=False)

    def loss(m: Any, x: Any, y: Any) -> Any:
        return torch.nn.functional.mse_loss(m(x), y)

    return tapestry.from_torch(module, (x, x), training=tapestry.Training(loss=loss, optimizer="adam", lr=1e-4),
                               verbose=False)


def distinct_blocks(layout: Any) -> int:
    return len(set(layout.blocks))


def degrees(plan: Any, arguments: tuple[str, ...]) -> dict[str, Any]:
    """What the plan splits: the token ids' and the weights' Place layouts (distinct blocks), the devices a step's
    experts are split over (EP: expert parallel, `Compute.exchange`) and a ring attention's (CP, `Compute.ring`),
    and for a training step how many weights live replicated (R), sharded and gathered on use (G), sharded in
    place (S)."""
    from collections import Counter

    from tapestry.plan import Place
    from tapestry.training.strategy import GATHERED, IN_PLACE, REPLICATED, storage

    import math

    from tapestry.plan import Compute

    places = {s.input: s.layout for s in plan.steps if isinstance(s, Place)}
    weights = [distinct_blocks(layout) for name, layout in places.items()
               if name.endswith((".weight", ".experts.gate_up_proj", ".experts.down_proj"))
               and not name.startswith(("adam.", "new."))]
    found: dict[str, Any] = {
        "ids split": max((distinct_blocks(places[a]) for a in arguments if a in places), default=1),
        "weights split (max)": max(weights, default=1),
        "weights split": sum(w > 1 for w in weights), "weights": len(weights),
        "EP": max((math.prod(plan.mesh.shape[a] for a in s.exchange) for s in plan.steps
                   if isinstance(s, Compute) and s.exchange), default=1),
        "CP": max((math.prod(plan.mesh.shape[a] for a in s.ring) for s in plan.steps
                   if isinstance(s, Compute) and s.ring), default=1),
    }
    if plan.graph.carried:
        short = {REPLICATED: "R", GATHERED: "G", IN_PLACE: "S"}
        counts = Counter(short[s.strategy] for name, s in storage(plan).items() if not name.startswith("adam."))
        found["storage"] = " ".join(f"{n}{k}" for k, n in sorted(counts.items()))
    return found


def time_by_kind(plan: Any, model: Any) -> dict[str, float]:
    """Seconds of `plan` per phase and kind (cost.breakdown), keyed "phase/kind", and "model" for its FLOPs at
    the bfloat16 peak."""
    from tapestry.cost.breakdown import breakdown

    found = breakdown(plan, model, model.profile.device)
    return {**{f"{phase}/{kind}": s for (phase, kind), s in found.seconds.items()}, "model": found.model_seconds}


def hand_plans(imported: Any, case: Case, model: Any, errors: dict[str, str],
               breakdowns: dict[str, Any] | None = None) -> dict[str, tuple[float, int]]:
    """The hand plans on the case's own mesh, priced by `model`: for a training step the ones the optimizer's floor
    builds and keeps its plan under (training.plans.baselines, named by HAND_NAMES), for inference data and tensor
    parallel over every device (Megatron's pairs found by structure, `tensor_parallel_seeds` of its parameters),
    expert parallel for a MoE, and on 2 or more axes the n-D DPxTP (and DPxEP); for a MoE whose experts a node's
    devices do not divide, "DPxEP group" and "DPx(TP+EP) group" (`expert_group_parallel`: on the same devices as
    another mesh, so not among the optimizer's hand plans); a strategy that cannot be priced is NaN, and `errors`
    says why; `breakdowns` gets each priced plan's time_by_kind."""
    import math

    import tapestry
    from tapestry.cost import peak_memory, plan_cost
    from tapestry.plan.build import expand_linears
    from tapestry.training.plans import (baselines, data_expert_parallel, data_parallel, data_tensor_parallel,
                                         expert_group_mesh, expert_group_parallel, expert_parallel, expert_weights,
                                         megatron, step_arguments, tensor_parallel_seeds)

    graph = imported.graph
    mesh = tapestry.Mesh(*case.shape)
    if graph.carried:
        refused: dict[str, str] = {}
        built = {HAND_NAMES[name]: plan for name, plan in baselines(graph, mesh, refused).items()}
        for name, why in refused.items():  # a strategy that cannot apply says why, not a blank
            errors[HAND_NAMES.get(name, name)] = why
            print(f"  {HAND_NAMES.get(name, name)}: refused: {why}", flush=True)
        builders = {name: lambda plan=plan: plan for name, plan in built.items()}
        arguments, experts = step_arguments(graph), expert_weights(graph)
    else:
        arguments = imported.translation.user_inputs
        weights = [n.name for n in graph.inputs if n.name not in arguments]  # Megatron's pairs found as training's
        # are (by structure: Falcon's and Phi-3's fused linears have no LLaMA names, and TP priced all-replicated)
        expanded = expand_linears(graph)
        hidden = tensor_parallel_seeds(expanded, mesh.size, weights)
        experts = {n.name: 0 for n in graph.inputs if n.name.endswith(EXPERT_WEIGHTS)}
        builders = {"DP": lambda: data_parallel(graph, mesh, arguments), "TP": lambda: megatron(graph, mesh, hidden),
                    **({"EP": lambda: expert_parallel(graph, mesh, arguments, experts)} if experts else {})}
        if mesh.ndim >= 2:  # the training floor's n-D recipes, weights whole
            inner = tensor_parallel_seeds(expanded, mesh.shape[-1], weights)
            builders["DPxTP"] = lambda: data_tensor_parallel(graph, mesh, arguments, inner)
            if experts:
                builders["DPxEP"] = lambda: data_expert_parallel(graph, mesh, arguments, {}, experts)
    if any(expert_group_mesh(mesh, graph[name].shape[dim]) for name, dim in experts.items()):  # not the optimizer's
        parameters = None if graph.carried else weights  # (on another mesh): tensor parallel's as the n-D recipes'
        builders["DPxEP group"] = lambda: expert_group_parallel(graph, mesh, arguments, experts)
        builders["DPx(TP+EP) group"] = lambda: expert_group_parallel(graph, mesh, arguments, experts, True, parameters)
    priced: dict[str, tuple[float, int]] = {}
    for name, make in builders.items():
        try:
            plan = make()
            priced[name] = (plan_cost(plan, model), max(peak_memory(plan)))
            if breakdowns is not None:
                breakdowns[name] = time_by_kind(plan, model)
        except Exception as err:  # a strategy that cannot split this graph: say so in the table
            priced[name] = (math.nan, 0)
            errors[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            print(f"  {name}: {errors[name]}", flush=True)
    return priced


def tensor_parallel_dims(names: list[str]) -> dict[str, int]:
    """Megatron's split per weight: column-parallel (q, k, v, gate, up: output features, dim 0) and row-parallel
    (o, down: input features, dim 1) linears; a MoE's experts likewise (gate_up_proj [E, 2F, D] on its 2F,
    down_proj [E, D, F] on its F; the router, mlp.gate, whole)."""
    found = {}
    for name in names:
        if name.startswith("adam."):
            continue
        if re.search(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|q|k|v|gate|up)\.weight$", name) \
                and name.removesuffix("gate.weight") + "experts.gate_up_proj" not in names:
            found[name] = 0
        elif re.search(r"\.(o_proj|down_proj|o|down)\.weight$", name) or name.endswith(".experts.gate_up_proj"):
            found[name] = 1
        elif name.endswith(".experts.down_proj"):
            found[name] = 2
    return found


def run_case(case: Case, budget_seconds: float, time_limit: float, queue: Any, hand: bool = True,
             profile_name: str = PROFILE) -> None:
    """One case in its own process: import, optimize, price under `profile_name` (and the hand plans, unless not
    `hand`: on 512 devices their peak memory is most of a case's time); the result as a dict on `queue`."""
    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.importer.report import model_flops
    from tapestry.optimizer import SearchCutWarning

    started, cpu = time.perf_counter(), time.process_time()
    imported = build(case)
    row: dict[str, Any] = {"case": asdict(case), "import_s": time.perf_counter() - started,
                           "import_cpu_s": time.process_time() - cpu, "ops": len(imported.graph.ops),
                           "load": os.getloadavg()[0]}
    row["import_rss"] = peak_rss()
    if case.mesh:
        profile = load_profile(profile_name)
        model = DefaultCostModel(profile)
        mesh = tapestry.Mesh(*case.shape)
        flops = model_flops(imported.graph)
        row["profile"], row["hand_errors"], row["hand_breakdown"] = profile_name, {}, {}
        cpu = time.process_time()
        row["hand"] = {name: (t, m, profile.device.mfu(flops, t, mesh.size, "bfloat16") if t == t else float("nan"))
                       for name, (t, m) in (hand_plans(imported, case, model, row["hand_errors"],
                                                       row["hand_breakdown"]) if hand else {}).items()}
        row["hand_cpu_s"] = time.process_time() - cpu  # building, pricing and the peak memory of every hand plan
        started, cpu = time.perf_counter(), time.process_time()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", SearchCutWarning)
                result = tapestry.optimize(imported.graph, mesh, cost_model=model, time_limit=time_limit,
                                           budget=tapestry.Budget(seconds=budget_seconds), layers=case.fold,
                                           memory_budget=case.memory_budget)
        except Exception as err:  # the row says what failed, and the hand plans are still priced
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            row["traceback"] = traceback.format_exc()  # where: a 70B case takes a CPU hour to fail again
            row["optimize_s"] = time.perf_counter() - started
        else:
            row.update({
                "optimize_s": time.perf_counter() - started, "optimize_cpu_s": time.process_time() - cpu,
                "status": result.status, "gap": result.gap, "extractor": result.selection.extractor,
                # the gap's bound of plan.cost (egraph.plan_bound), what it cost, and the extractor's own gap
                "bound": result.bound.seconds, "bound_why": result.bound.why, "bound_weight": result.bound.weight,
                "bound_lps": result.bound.lps, "bound_cpu_s": result.bound.cpu_s, "extractor_gap": result.selection.gap,
                "extractor_stopped_by": result.selection.stopped_by,  # "nodes": no bound, gap None (extract.ilp)
                "floor": result.floor, "gap_to_floor": result.gap_to_floor,
                "seconds": result.plan.cost, "warned": any(issubclass(w.category, SearchCutWarning) for w in caught),
                "undone": result.stats.undone, "periodic": result.plan.notes.get("periodic"),
            })
            reported = {  # what the row reads off the plan, each timed: the report's CPU is not the optimizer's
                "peak_memory": lambda: result.peak_memory, "replicated": lambda: result.replicated_share,
                "degrees": lambda: degrees(result.plan, imported.translation.user_inputs),
                "breakdown": lambda: time_by_kind(result.plan, model)}
            row["report_cpu_s"] = {}
            for key, read in reported.items():
                cpu = time.process_time()
                row[key] = read()
                row["report_cpu_s"][key] = time.process_time() - cpu
            row["mfu"] = profile.device.mfu(flops, result.plan.cost, mesh.size, "bfloat16")
    row["rss"] = peak_rss()
    queue.put(row)


def measure(case: Case, budget_seconds: float, time_limit: float, hand: bool = True,
            profile: str = PROFILE) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=run_case, args=(case, budget_seconds, time_limit, queue, hand, profile))
    process.start()
    row: dict[str, Any] = {"case": asdict(case)}
    while process.is_alive() or not queue.empty():  # a crashed child puts nothing: do not wait for it forever
        try:
            row = queue.get(timeout=5)
            break
        except Exception:
            continue
    process.join()
    if process.exitcode:
        row.setdefault("error", f"exit code {process.exitcode}")
    return row


def add_floor(row: dict[str, Any]) -> None:
    """`row` (a saved case) with the whole-space floor of its graph on its mesh under its profile and the gap of its
    plan to it (cost.floor.step_floor: no optimize; the import is made again), and the CPU seconds of each."""
    import tapestry
    from tapestry.cost import DefaultCostModel, load_profile
    from tapestry.cost.floor import gap_to_floor, step_floor

    case = Case(**row["case"])
    cpu = time.process_time()
    graph = build(case).graph
    row["floor_import_cpu_s"], cpu = time.process_time() - cpu, time.process_time()
    row["floor"] = step_floor(graph, tapestry.Mesh(*case.shape),
                              DefaultCostModel(load_profile(row.get("profile", PROFILE))))
    row["floor_cpu_s"] = time.process_time() - cpu
    row["gap_to_floor"] = gap_to_floor(row["seconds"], row["floor"]) if "seconds" in row else None


def floor_ms(row: dict[str, Any]) -> str:
    """The table's "floor ms (gap)": the floor and the plan's gap to it ("—" for rows measured before it)."""
    if row.get("floor") is None:
        return "—"
    return f"{row['floor'] * 1e3:.2f}" + ("" if row.get("gap_to_floor") is None else f" ({row['gap_to_floor']:.0%})")


def floor_table(rows: list[dict[str, Any]]) -> str:
    """The floors of rows that have one beside their plans' times, gaps and best hand plans (--floors)."""
    lines = ["| model | step | mesh | status | gap | predicted ms | floor ms | gap to floor | best hand ms "
             "| floor CPU s |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("floor") is None:
            continue
        c, hands = r["case"], [t for t, _, _ in r.get("hand", {}).values() if t == t]
        gap = "—" if r.get("gap") is None else f"{r['gap']:.1%}"
        lines.append(f"| {c['model']} | {c['mode']} | {c['mesh']} | {r['status'].split(' (')[0]} | {gap} | "
                     f"{r['seconds'] * 1e3:.2f} | {r['floor'] * 1e3:.2f} | {r['gap_to_floor']:.1%} | "
                     f"{min(hands) * 1e3 if hands else float('nan'):.2f} | {r.get('floor_cpu_s', float('nan')):.2f} |")
    below = [f"{r['case']['model']} {r['case']['mode']} {r['case']['mesh']}" for r in rows if r.get("floor") is not None
             and any(t < r["floor"] for t in [r["seconds"], *(t for t, _, _ in r.get("hand", {}).values() if t == t)])]
    return "\n".join([*lines, "", "Rows whose plan or a hand plan is priced below the floor: "
                                   f"{', '.join(below) or 'none'}."])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def warns(row: dict[str, Any]) -> bool:
    """Whether the row's result raises SearchCutWarning under the current threshold (runs before it recorded
    the warning under an older one)."""
    from tapestry.optimizer import REPLICATED_WARNING

    return row["status"].startswith("stopped") and row["replicated"] >= REPLICATED_WARNING


def against_best_hand(row: dict[str, Any]) -> str:
    """The search's predicted time over the fastest hand plan's, and which that is ("—" without hand plans)."""
    priced = [(t, name) for name, (t, _, _) in row.get("hand", {}).items() if t == t]
    if not priced:
        return "—"
    best, name = min(priced)
    return f"{row['seconds'] / best:.2f} ({name})"


def order(row: dict[str, Any]) -> tuple[Any, ...]:
    """Rows by model, architecture, step and mesh size."""
    import math

    c = row["case"]
    return (list(WIDTHS).index(c["model"]), c.get("arch", "hf"), c["mode"] != "training",
            math.prod(Case(**c).shape) if c["mesh"] else 0, c["mesh"])


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | layers | step | batch x seq | mesh | import s | RSS GiB | optimize s (CPU) | status | gap | "
            "floor ms (gap) | "
            "predicted ms | MFU | GiB/device | replicated | ids / weights split | EP / CP | weights live | "
            + " | ".join(f"{h} ms (MFU)" for h in HAND) + " | vs best hand |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        c = r["case"]
        model = c["model"] + (" blocks" if c.get("arch") == "block" else "")
        first = (f"| {model} | {c['layers']} | {c['mode']} | {c['batch']}x{c['seq']} | {c['mesh'] or '—'} | "
                 f"{r['import_s']:.1f} | {gib(r['rss'])} |" if "import_s" in r else
                 f"| {model} | {c['layers']} | {c['mode']} | {c['batch']}x{c['seq']} | {c['mesh']} | — | — |")
        hand = [f"{r['hand'][h][0] * 1e3:.1f} ({r['hand'][h][2]:.1%})" if h in r.get("hand", {}) and
                r["hand"][h][0] == r["hand"][h][0] else "—" for h in HAND]
        if "error" in r:
            spent = f" {r['optimize_s']:.0f} |" if "optimize_s" in r else " — |"
            lines.append(first + spent + f" **{r['error']}** |" + " |" * 9 + f" {' | '.join(hand)} | — |")
            continue
        if not c["mesh"]:
            lines.append(first + " import only |" + " |" * (head.count("|") - 9))
            continue
        d = r["degrees"]
        gap = "—" if r["gap"] is None else f"{r['gap']:.1%}"
        spent = f"{r['optimize_s']:.0f}" + (f" ({r['optimize_cpu_s']:.0f})" if "optimize_cpu_s" in r else "")
        lines.append(first + f" {spent} | {r['status']}{' (warns)' if warns(r) else ''} | {gap} | {floor_ms(r)} | "
                     f"{r['seconds'] * 1e3:.1f} | {r['mfu']:.1%} | {gib(r['peak_memory'])} | {r['replicated']:.0%} | "
                     f"{d['ids split']} / {d['weights split']} of {d['weights']} (max {d['weights split (max)']}) | "
                     f"{d.get('EP', '—')} / {d.get('CP', '—')} | "
                     f"{d.get('storage', '—')} | {' | '.join(hand)} | {against_best_hand(r)} |")
    errors = sorted({f"{name}: {why}" for r in rows for name, why in r.get("hand_errors", {}).items()})
    if errors:
        lines += ["", "Hand plans that could not be priced: " + "; ".join(errors) + "."]
    return "\n".join(lines)


def breakdown_tables(rows: list[dict[str, Any]], only: str = "") -> str:
    """Per training case on 64 devices or more (its last row), where its plans' time goes (cost.breakdown): ms per
    phase and kind, the search's plan beside the hand plans'. `only`: the cases to show, as model/arch/mesh
    (`7B/block/8x8,70B/block/8x8x8`); empty: all."""
    import math

    out = []
    last = {json.dumps(r["case"], sort_keys=True): r for r in rows if "breakdown" in r}
    chosen = set(filter(None, only.split(",")))
    for r in last.values():
        if r["case"]["mode"] != "training" or math.prod(Case(**r["case"]).shape) < 64:
            continue
        if chosen and f"{r['case']['model']}/{r['case'].get('arch', 'hf')}/{r['case']['mesh']}" not in chosen:
            continue
        c = r["case"]
        plans = {"search": r["breakdown"], **{h: b for h, b in r.get("hand_breakdown", {}).items()}}
        keys = sorted({k for b in plans.values() for k in b if k != "model"},
                      key=lambda k: (["forward", "backward", "update", "step"].index(k.split("/")[0]), k))
        keys = [k for k in keys if any(abs(b.get(k, 0.0)) >= 5e-6 for b in plans.values())]
        model = c["model"] + (" blocks" if c.get("arch") == "block" else "")
        out += [f"\n{model}, {c['layers']} layers, {c['mode']}, {c['batch']}x{c['seq']} on {c['mesh']} (ms):\n",
                "| phase / kind | " + " | ".join(plans) + " |", "|---|" + "---:|" * len(plans)]
        out += [f"| {k} | " + " | ".join(f"{b.get(k, 0.0) * 1e3:.2f}" for b in plans.values()) + " |" for k in keys]
        out.append("| **total** | " + " | ".join(f"{sum(v for k, v in b.items() if k != 'model') * 1e3:.2f}"
                                                for b in plans.values()) + " |")
        out.append("| FLOPs at the bf16 peak | " + " | ".join(f"{b['model'] * 1e3:.2f}" for b in plans.values())
                   + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="7B")
    parser.add_argument("--arch", default="hf", choices=("hf", "block"))
    parser.add_argument("--layers", type=int, default=2, help="layers of the planned slices")
    parser.add_argument("--meshes", default="8,2x4,8x8", help="'' for none: the import-only rows alone")
    parser.add_argument("--modes", default="inference,training")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=30.0, help="Budget.seconds (the default)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="extraction's (the default)")
    parser.add_argument("--full-layers", type=int, default=32, help="layers of the import-only rows (0: none)")
    parser.add_argument("--provenance", default="", help="with --from-json: which runs made the rows, for the doc")
    parser.add_argument("--breakdowns", default="", help="the training cases whose breakdown tables to write, as "
                        "model/arch/mesh (7B/block/8x8,...); default: every one on 64 devices or more")
    parser.add_argument("--profile", default=PROFILE, help="device profile that prices every plan (MFU is against "
                        "its spec-sheet peak whichever it is; docs/cost-models.md, \"Which profile\")")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    fold = parser.add_mutually_exclusive_group()
    fold.add_argument("--fold", action="store_true", help="plan three or more repeated layers once (optimize's "
                      "layers=True; by default only from optimizer.FOLD_FROM_COPIES)")
    fold.add_argument("--no-fold", action="store_true", help="plan repeated layers one by one (layers=False)")
    parser.add_argument("--memory-budget", type=float, help="optimize's memory_budget, GB (10**9 bytes) per device")
    parser.add_argument("--no-hand", action="store_true", help="leave the hand plans out (their columns empty)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--floors", action="store_true", help="with --from-json: add the whole-space floor to the "
                        "saved rows that lack one (their graphs imported again, not optimized); --json writes them")
    parser.add_argument("--from-json", help="write the section from the rows runs saved (--json; several: a,b), "
                        "the last row of each case (by file, then run order), without measuring")
    args = parser.parse_args()
    cases = []
    if args.from_json:
        pass
    elif args.quick:
        cases = [Case("7B", 1, "inference", "2x4", 1, 128, vocab=512)]
    else:
        for model in args.models.split(","):
            for mode in args.modes.split(","):
                cases += [Case(model, args.layers, mode, mesh, args.batch, args.seq, arch=args.arch,
                               fold=True if args.fold else False if args.no_fold else None,
                               memory_budget=None if args.memory_budget is None else int(args.memory_budget * 10**9))
                          for mesh in filter(None, args.meshes.split(","))]
                if args.full_layers:
                    cases.append(Case(model, args.full_layers, mode, "", args.batch, args.seq, arch=args.arch))
    saved_rows: dict[str, dict[str, Any]] = {}  # by case: a later row (file, or run in a file) replaces an earlier
    for saved in filter(None, (args.from_json or "").split(",")):
        with open(saved) as f:
            for row in json.load(f):
                # the case with its defaults (rows saved before a field existed lack it), less `fold`: the table
                # has no fold column (a row's `periodic` says whether it was folded): one row per case
                case = asdict(Case(**row["case"]))
                key = json.dumps({k: v for k, v in case.items() if k != "fold"}, sort_keys=True)
                saved_rows.pop(key, None)
                saved_rows[key] = row
    rows = list(saved_rows.values())
    for row in rows if args.floors else ():
        if row["case"]["mesh"] and "seconds" in row and "floor" not in row:
            add_floor(row)
            print(f"{row['case']}: floor {floor_ms(row)} ms in {row['floor_cpu_s']:.1f} CPU s", flush=True)
    for case in cases:
        print(f"{case} ...", flush=True)
        rows.append(measure(case, args.budget, args.time_limit, not args.no_hand, args.profile))
        print(json.dumps(rows[-1], default=str), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    rows.sort(key=order)
    if args.floors:
        print(floor_table(rows), flush=True)
    others = sorted({r.get("profile", PROFILE) for r in rows} - {args.profile})  # rows from before it was recorded:
    if others:  # the default's
        raise ValueError(f"rows priced under {', '.join(others)} cannot go in a section that says {args.profile}")
    models = sorted({r["case"]["model"] for r in rows}, key=list(WIDTHS).index)
    body = "\n".join([
        f"Models: `{', '.join(models)}` (LLaMA-2 widths; `Mixtral`: Mixtral 8x7B's, hidden 4096, each expert's "
        "MLP 14336, 32 heads, 8 KV heads, 8 experts, top-2), a slice of `layers` layers of each, built under "
        f"`torch.device(\"meta\")` in bfloat16, planned by `tapestry.optimize` with the `{args.profile}` profile "
        f"(NVLink inside 8-GPU nodes, InfiniBand across), its default budget ({args.budget:g} CPU s) and extraction "
        f"time limit ({args.time_limit:g} s: CPU-second shares and CP-SAT work, docs/extraction.md). Plain "
        "names: transformers' `LlamaForCausalLM` / "
        "`MixtralForCausalLM` (embedding, rotary, head; training: its cross-entropy loss); `blocks`: a stack of "
        "`importer.zoo.LlamaBlock` at that width (no rotary, embedding or head; training loss MSE; full "
        "multi-head attention, so `70B blocks` has 64 KV heads where LLaMA-2 70B has 8). Training: one Adam step. "
        "Numbers from a loaded 2-core machine shared with other jobs: wall times follow the load (`optimize s "
        "(CPU)`: wall, and the process's CPU seconds in brackets). MFU (`DeviceProfile.mfu`): the imported graph's "
        "FLOPs over predicted time x devices x the spec sheet's bfloat16 peak (989 TFLOP/s), whichever profile "
        "priced the plan. Hand plans: for training, the ones the optimizer's floor builds and keeps its plan under "
        "(training/plans.py `baselines`, on the case's own mesh; before 2026-11-28's ndfloor row the 2-D and 3-D "
        "recipes were priced on flattened meshes), by the same cost model. DP, ZeRO-3 and TP (Megatron, its "
        "weights' splits found from the graph's structure) split every device, the mesh's axes taken as one; DP "
        "and ZeRO-3 only where the batch divides every device, else FSDP (the state split over every device, the "
        "batch over the axes it divides, the sequence over the rest). `DPxTP`: TP over the last axis (a node, "
        "NVLink) and over the outer axes the batch as far as it divides (at batch 8 on 4x8x8: 4 ways) and the "
        "sequence over the rest. A MoE's expert-parallel hand plans (`Compute.exchange` steps: rows moved to their "
        "experts' devices by all-to-all): `EP` splits the batch and the experts over every device (DeepSpeed-MoE; "
        "the tokens' dispatch and combine, the experts' grouped mms and their weight gradients exchange rows; "
        "it needs the experts to divide among the devices), `DPxEP` is DPxTP with the experts split by expert "
        "over the last axis and attention whole there, `DPx(TP+EP)` with attention TP there beside them (their "
        "grouped mms and weight gradients exchanging rows in the node, "
        "the dispatch and combine across the outer axis). `replicated`: share of compute steps every device "
        "runs whole; `ids / weights split`: distinct blocks of the token ids' layout (the DP degree), and how many "
        "weights are split (max: into how many blocks); `EP / CP`: devices a step's experts are split over "
        "(`Compute.exchange`), and a ring attention's (`Compute.ring`); PP is 1 on every row (`tapestry.optimize` "
        "plans one SPMD program; pipeline stages are `tapestry.pipeline`'s, section \"Pipeline\"); `weights "
        "live`: R replicated, G gathered on use, S sharded in place; `vs best hand`: predicted time over the "
        "fastest hand plan's. `gap`: (predicted - bound) / predicted, the bound one of plan_cost over every plan of "
        "the e-graph searched (`OptimizeResult.bound`, egraph.plan_bound; rows measured before 2026-11-28 bound "
        "the extractor's node-cost sum instead). `floor ms (gap)`: a floor under every plan of the graph on the "
        "mesh under the same model, not only those the search made (`OptimizeResult.floor`, cost.floor: each "
        "matmul's, attention's and other library kernel's FLOPs spread evenly over every device at the dtype's "
        "peak, plus a launch; no "
        "communication; docs/cost-models.md), and (predicted - floor) / predicted: what `gap` cannot say where a "
        "budget cut the search. A status `stopped by ...` is a search a budget cut (docs/cost-models.md, "
        "\"Budgets\"); `(warns)`: so cut a search with so replicated a plan raises SearchCutWarning.",
        *([f"\n{args.provenance}"] if args.provenance else []),
        "",
        table(rows),
        breakdown_tables(rows, args.breakdowns),
    ])
    if not args.no_write:
        command = "python benchmarks/cluster.py" + (" --quick" if args.quick else "") + (
            f" --models {args.models}" if args.models != "7B" else "") + (
            f" --profile {args.profile}" if args.profile != PROFILE else "") + (
            f" --from-json {args.from_json}" if args.from_json else "") + (" --floors" if args.floors else "") + (
            f" --breakdowns {args.breakdowns}" if args.breakdowns else "")
        write_section("Cluster", command, body)
    print(body)


if __name__ == "__main__":
    main()
