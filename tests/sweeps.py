"""How the long property tests split their sweeps between make test and make test-all: fewer hypothesis draws
(`draws`), each stride-th pair of a case (`strided`); the full sweep of each is marked slow."""
from __future__ import annotations

from collections.abc import Iterable

import pytest


def draws(fast: int, full: int) -> pytest.MarkDecorator:
    """A hypothesis test's `examples`: `fast` draws in make test, `full` in make test-all (the `full` case is
    marked slow)."""
    return pytest.mark.parametrize("examples", [pytest.param(fast, id=f"{fast}-draws"),
                                                pytest.param(full, id=f"{full}-draws", marks=pytest.mark.slow)])


def strided(cases: Iterable[tuple], strides: dict[str, int]) -> list:
    """Parameters for tests over every pair of a case's layouts: each case with a stride of 1 (every pair), or,
    where `strides` names its id (its parts as str, joined by '-'), that stride in make test and every pair in
    the slow set."""
    params = []
    for case in cases:
        name = "-".join(map(str, case))
        every = strides.get(name, 1)
        params.append(pytest.param(*case, every, id=name if every == 1 else f"{name}-every{every}"))
        if every > 1:
            params.append(pytest.param(*case, 1, id=f"{name}-all", marks=pytest.mark.slow))
    return params

