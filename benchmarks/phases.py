"""Seconds per optimizer phase (saturation, pricing, extraction) for a transformer stack, one case per run.

    .venv/bin/python benchmarks/phases.py --mesh 2x4 --layers 12 [--rules fusion,substitution] [--budget 30]
        [--extractor greedy-dag] [--time-limit 10] [--optimize] [--model stack|gpt2|bert|FAMILY|HELD_BACK]

Prints one JSON line: wall seconds per phase and, as `*_cpu`, this process's CPU seconds (all its threads), which a
loaded machine inflates far less. With --optimize it times `tapestry.optimize` whole instead (validation and the
plan's meaning check included), prints a hash of the plan (`plan_sha`), to compare plans across hash seeds and
trees, and `optimize_main_cpu`, the main thread's CPU seconds alone (the rest is other threads': CP-SAT's workers,
and OpenBLAS's, which wait spinning after each product it threads). It uses only APIs older trees have too, so the
same file can time an older checkout side by side (PYTHONPATH=OLD/src .venv/bin/python benchmarks/phases.py ...).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import resource
import time
from collections import Counter

from tapestry.egraph.driver import Budget
from tapestry.egraph.rules import BUILTIN_DIR
from tapestry.extract import extract
from tapestry.importer.zoo import EXTRA, FAMILIES
from tapestry.models import transformer_stack
from tapestry.optimizer import default_cost_model, explore, optimize
from tapestry.sharding import Mesh

from heldback_zoo import MODELS as HELD_BACK  # benchmarks/, this script's folder

FUSED = {"linear_relu", "linear_gelu", "add_relu"}
# the importer zoo's tiny models, as benchmarks/zoo_sweep.py names them, and benchmarks/heldback_zoo.py's
ZOO = {**EXTRA, **FAMILIES, **HELD_BACK}


def model(name: str, layers: int):
    """The graph to time: Tapestry's transformer stack, or GPT-2 or BERT imported from transformers (random
    weights, no download) at the stack's sizes."""
    if name == "stack":
        return transformer_stack(layers, 4, 256, 1024, 16)
    if name in ZOO:  # the importer zoo's tiny model (its own layer count: 2 for the decoders)
        from tapestry.importer import from_torch

        module, args, kwargs = ZOO[name].build()
        return from_torch(module, args, kwargs, verbose=False).graph
    import torch
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

    from tapestry.importer import from_torch
    torch.manual_seed(0)
    ids = torch.randint(0, 2048, (4, 256))
    if name == "gpt2":
        module = GPT2Model(GPT2Config(n_layer=layers, n_embd=1024, n_head=16, vocab_size=2048, n_positions=256,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        return from_torch(module.eval(), (ids,), {"use_cache": False}, verbose=False).graph
    module = BertModel(BertConfig(hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
                                  intermediate_size=4096, vocab_size=2048, max_position_embeddings=256,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), add_pooling_layer=False)
    return from_torch(module.eval(), (ids,), verbose=False).graph


def plan_sha(plan) -> str:
    """The plan's steps, outputs and cost, hashed: equal across runs (hash seeds, trees) when the plans are."""
    data = plan.to_json()
    return hashlib.sha256(json.dumps({k: data[k] for k in ("steps", "outputs", "cost")}).encode()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--rules", default="", help="rule files by name (default: all shipped)")
    parser.add_argument("--budget", type=float, default=30.0, help="Budget(seconds=...)")
    parser.add_argument("--extractor", default="greedy-dag")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--optimize", action="store_true", help="time tapestry.optimize end to end")
    zoo = [f for f in ZOO if f not in ("gpt2", "bert")]
    parser.add_argument("--model", choices=("stack", "gpt2", "bert", *zoo),
                        default="stack",
                        help="stack, gpt2, bert at the stack's sizes, or a tiny importer zoo family (FAMILIES, EXTRA) "
                             "or held-back zoo model")
    args = parser.parse_args()
    mesh = Mesh.parse(args.mesh)
    rules = [BUILTIN_DIR / f"{r}.egg" for r in args.rules.split(",")] if args.rules else None
    graph = model(args.model, args.layers)
    start, start_cpu, start_main = time.perf_counter(), time.process_time(), time.thread_time()
    if args.optimize:
        result = optimize(graph, mesh, rules, Budget(seconds=args.budget), extractor=args.extractor,
                          time_limit=args.time_limit)
        kernels = Counter(getattr(step, "kernel", "") for step in result.plan.steps)
        print(json.dumps({
            "model": args.model, "mesh": args.mesh, "layers": args.layers, "rules": args.rules or "all",
            "budget": args.budget, "optimize_s": round(time.perf_counter() - start, 2),
            "optimize_cpu": round(time.process_time() - start_cpu, 2),
            "optimize_main_cpu": round(time.thread_time() - start_main, 2),
            "stopped_by": result.stats.stopped_by, "undone": getattr(result.stats, "undone", ""),
            "enodes": result.stats.enodes, "cost": result.plan.cost, "extractor": args.extractor, "status": result.selection.status,
            "gap": result.selection.gap, "fused_kernels": sum(n for k, n in kernels.items() if k in FUSED),
            "plan_sha": plan_sha(result.plan),
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        }), flush=True)
        return
    explored = explore(graph, mesh, rules, Budget(seconds=args.budget))
    saturated, saturated_cpu = time.perf_counter(), time.process_time()
    egraph = explored.decoder.extraction_graph(list(explored.roots), default_cost_model(),
                                               *([explored.priced_moves] if hasattr(explored, "priced_moves")
                                                 else []))
    priced, priced_cpu = time.perf_counter(), time.process_time()
    selection = extract(egraph, args.extractor, args.time_limit)
    done, done_cpu = time.perf_counter(), time.process_time()
    stats = explored.stats
    plan = explored.decoder.plan(egraph, selection, graph, explored.names)
    kernels = Counter(getattr(step, "kernel", "") for step in plan.steps)
    print(json.dumps({
        "model": args.model, "mesh": args.mesh, "layers": args.layers, "rules": args.rules or "all",
        "budget": args.budget, "saturate_s": round(saturated - start, 2), "price_s": round(priced - saturated, 2),
        "extract_s": round(done - priced, 2), "total_s": round(done - start, 2),
        "saturate_cpu": round(saturated_cpu - start_cpu, 2), "price_cpu": round(priced_cpu - saturated_cpu, 2),
        "extract_cpu": round(done_cpu - priced_cpu, 2), "total_cpu": round(done_cpu - start_cpu, 2),
        "stopped_by": stats.stopped_by, "stopped_in": getattr(stats, "stopped_in", ""),
        "undone": getattr(stats, "undone", ""), "enodes": stats.enodes,
        "extraction_nodes": len(explored.decoder.nodes), "cost": selection.dag_cost,
        "extractor": args.extractor, "status": selection.status, "gap": selection.gap,
        "extract_stopped_by": getattr(selection, "stopped_by", None),
        "fused_kernels": sum(n for k, n in kernels.items() if k in FUSED),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }), flush=True)


if __name__ == "__main__":
    main()
