"""Where a weightless training-step import spends its CPU, and how it grows with depth (issue 24, item 1).

    python benchmarks/import_profile.py --model 7B --layers 4,8,16,32
    python benchmarks/import_profile.py --model 70B --layers 80

LLaMA-2 widths on the meta device in bfloat16 (benchmarks/cluster.py's build), one Adam step at batch 8 x
sequence 2048, all in one process after a one-layer warm-up, so the first imports of torch, transformers and
tapestry are counted once, apart. Per depth, CPU seconds of the calling thread: the whole `from_torch`, torch's
trace (`make_fx`), within it the backward (`torch.autograd.grad`), the optimizer update (`Training.update`) and
the retrace through functionalization (training/capture.py `_functionalized`, which only a step that writes into a
view pays), and the translation into a Tapestry graph. CPU time, not wall time: the machine is shared
(docs/benchmarks.md, "Import time at scale").
"""
from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

started = time.thread_time()
import torch  # noqa: E402
import transformers  # noqa: E402,F401

import tapestry  # noqa: E402
import tapestry.importer  # noqa: E402,F401  (before training.capture, which it imports: a cycle otherwise)
import tapestry.training.capture as capture  # noqa: E402
from cluster import Case, build  # noqa: E402

IMPORTS = time.thread_time() - started


def timed(spent: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, adding its CPU time to spent[key] once per outermost call: the tracer's torch-function mode calls
    `torch.autograd.grad` (this wrapper) again from inside it."""
    active: set[str] = set()

    def run(*args: Any, **kwargs: Any) -> Any:
        if key in active:
            return fn(*args, **kwargs)
        active.add(key)
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.thread_time() - start
            active.discard(key)

    return run


@contextlib.contextmanager
def phases(spent: dict[str, float]) -> Iterator[None]:
    """Time the trace, backward, update and translation of the imports made inside."""
    make_fx, translate = capture.make_fx, capture.translate
    grad, update = torch.autograd.grad, tapestry.Training.update
    functionalized = getattr(capture, "_functionalized", None)  # the retrace of a step that writes into views
    capture.make_fx = lambda *a, **k: timed(spent, "trace", make_fx(*a, **k))
    capture.translate = timed(spent, "translate", translate)
    torch.autograd.grad = timed(spent, "backward", grad)
    tapestry.Training.update = timed(spent, "update", update)
    if functionalized is not None:
        capture._functionalized = timed(spent, "functionalized", functionalized)
    try:
        yield
    finally:
        capture.make_fx, capture.translate = make_fx, translate
        torch.autograd.grad, tapestry.Training.update = grad, update
        if functionalized is not None:
            capture._functionalized = functionalized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="7B")
    parser.add_argument("--layers", default="4,8,16,32")
    args = parser.parse_args()
    build(Case(args.model, 1, "training", "", 8, 2048))
    print(f"first imports of torch, transformers, tapestry: {IMPORTS:.1f} s CPU")
    print("| model | layers | ops | from_torch CPU s | trace | of it backward | of it update | of it retraced "
          "through functionalization | translate |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layers in (int(n) for n in args.layers.split(",")):
        spent: dict[str, float] = {}
        with phases(spent):
            start = time.thread_time()
            imported = build(Case(args.model, layers, "training", "", 8, 2048))
            total = time.thread_time() - start
        print(f"| {args.model} | {layers} | {len(imported.graph.ops):,} | {total:.1f} | {spent['trace']:.1f} | "
              f"{spent['backward']:.1f} | {spent['update']:.1f} | "
              f"{'not retraced' if 'functionalized' not in spent else format(spent['functionalized'], '.1f')} | "
              f"{spent['translate']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
