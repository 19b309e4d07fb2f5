"""A pytest plugin: each test's CPU seconds (setup, call and teardown), appended to a TSV file as it ends.

    PYTHONPATH=src:benchmarks CPU_PER_TEST=out.tsv python -m pytest -q -n 0 -p no:cacheprovider -p cpu_per_test \
        tests/...
    sort -rn out.tsv | head -30

A column each: CPU s (user+sys of the pytest process, its threads and the children it waited for), wall s, node
id. Wall times follow the machine's load; CPU s do not (docs/benchmarks.md, "Test suite time"). Not counted: the
processes a test leaves to others to wait for (a forkserver's ranks: benchmarks/tree_cpu.py counts the whole tree
of a run). Where a module fixture or a first import is paid, the first test using it carries it.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

OUT_ENV = "CPU_PER_TEST"


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    cpu, wall = _cpu(), time.monotonic()
    yield
    with open(os.environ.get(OUT_ENV, "cpu_per_test.tsv"), "a") as out:
        out.write(f"{_cpu() - cpu:.2f}\t{time.monotonic() - wall:.2f}\t{item.nodeid}\n")
