"""Write one benchmark's section of docs/benchmarks.md, leaving the others alone."""
from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEach section is written by the script it names; rerun the command to reproduce it.\n"


def write_section(name: str, command: str, body: str, doc: Path = DOC) -> None:
    """Replace the section called `name` of `doc` (or append it) with `body` and the command that made it."""
    text = doc.read_text() if doc.exists() else HEADER
    block = (
        f"<!-- BEGIN {name} -->\n## {name}\n\nCommand: `{command}`\n\n{body.rstrip()}\n<!-- END {name} -->"
    )
    pattern = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def mib(n: int | None) -> str:
    """Bytes as MiB for a table cell; a dash for a plan that was not found."""
    return "—" if n is None else f"{n / 2**20:,.1f}"


def us(t: float | None, digits: int = 1) -> str:
    """Seconds as microseconds for a table cell; a dash for a plan that was not found."""
    return "—" if t is None else f"{t * 1e6:,.{digits}f}"


Measured = tuple[float, int]  # (predicted seconds, peak bytes per device)


def best_hand(hand: dict[str, Measured], budget: int | None) -> tuple[str, float] | None:
    """The fastest hand-built plan within `budget`: (its name, its seconds); None when none fits."""
    fitting = [(t, name) for name, (t, peak) in hand.items() if budget is None or peak <= budget]
    return None if not fitting else min(fitting)[::-1]


def worse_than_hand(found: Measured | None, hand: dict[str, Measured], budget: int | None) -> bool:
    """Whether the optimizer's plan (None: it found none) is slower than the best hand plan within `budget`."""
    best = best_hand(hand, budget)
    return best is not None and (found is None or found[0] > best[1] * (1 + 1e-9))


def grid_rows(cases: Iterable[Any], rows_for: Callable[[Any, float], list[Any]],
              time_limit: float) -> tuple[list[Any], float]:
    """Every case's rows, each case's progress printed as it ends; and when the grid started (perf_counter)."""
    started = time.perf_counter()
    rows: list[Any] = []
    for case in cases:
        rows += rows_for(case, time_limit)
        print(f"{case}: {time.perf_counter() - started:.0f} s", flush=True)
    return rows, started


def worse_summary(rows: list[Any], started: float) -> str:
    """How many rows (each with `.worse`) lose to the best hand plan within their budget, and the seconds taken."""
    worse = [r for r in rows if r.worse]
    return (f"{len(rows)} rows, {len(worse)} where the optimizer is slower than the best hand plan that fits "
            f"the same budget{' (flagged **WORSE**)' if worse else ''}; "
            f"{time.perf_counter() - started:.0f} s on this machine.")
