"""The garbage collector held off while planning.

Planning makes millions of small objects that live until it ends (e-nodes, layouts, priced steps), and almost
none of them are garbage cycles: Python's collector at its default thresholds (700, 10, 10) swept them again and
again (17-26% of the CPU seconds of the 2-layer LLaMA's saturation and pricing on Mesh(2, 2)), and at the
thresholds (100_000, 50, 100) its young-generation sweeps still took 5% of Qwen2-MoE's optimize on Mesh(2, 2)
and freed 2,058 objects (docs/benchmarks.md, "Planning time of tiny zoo models"). `explore` and
`Explored.extract` collect nothing while they run; the caller's collector is back on when they return, and its
next sweep takes what cycles they left. `optimize` holds it off across both: turned on between them, its first
sweep went over all that saturation made (0.6 of Phi's 6.3 CPU s on Mesh(2, 2)). And what planning leaves alive
(the pricing caches, the plan) goes to the oldest generation unswept (`gc.freeze` then `gc.unfreeze`, unless the
caller froze objects of its own): a young sweep when `optimize` returned went over all of it (0.24 CPU s of
Phi's), and the few cycles planning leaves wait for the next full collection.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_collections() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()
