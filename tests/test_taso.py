"""Substitution parity: TASO's 133 generated substitutions, with concrete shapes, are proven by the shipped rule
files (rules/ and rules/taso/); deliberately wrong variants of them are not; the shipped compound rules follow
from simpler ones."""
from __future__ import annotations

import functools
import time

import pytest

import tapestry
from tapestry.egraph.driver import Budget
from tapestry.egraph.rules import BUILTIN_DIR, TASO_DIR
from tapestry.evaluator import evaluate, random_inputs
from tapestry.graph import Graph, GraphError
from tapestry.testing.taso import Substitution, substitutions, wrong_variant
from tapestry.verify import error

SUBSTITUTIONS = substitutions()
BUDGET = Budget(seconds=10, iterations=12)
# A few of each family for make test: ew algebra, matmul, conv, concat, two-output merges.
SAMPLE = ["converted.txt:1", "converted.txt:6", "converted.txt:26", "converted.txt:32", "converted.txt:47",
          "converted.txt:77", "converted.txt:92", "converted.txt:103", "converted_multi.txt:9",
          "converted_multi.txt:17"]


def agree(a: Graph, b: Graph, seed: int = 0) -> bool:
    inputs = random_inputs(a, seed)
    got, want = evaluate(b, inputs), evaluate(a, inputs)
    return all(got[k].shape == want[k].shape and error(got[k], want[k], "float32").ok for k in want)


def by_name(name: str) -> Substitution:
    return next(s for s in SUBSTITUTIONS if s.name == name)


def test_all_133_substitutions_instantiate_and_their_sides_agree_numerically():
    assert len(SUBSTITUTIONS) == 133
    assert sum(len(s.lhs) == 2 for s in SUBSTITUTIONS) == 13
    for sub in SUBSTITUTIONS:
        assert agree(*sub.graphs()), sub


@pytest.mark.parametrize("name", SAMPLE)
def test_a_sample_of_the_substitutions_is_proven_by_the_shipped_rules(name: str):
    result = tapestry.equivalent(*by_name(name).graphs(), budget=BUDGET)
    assert result.proven, result


@functools.cache
def wrong_variants() -> list[Substitution]:
    """Variants that type-check and whose sides really differ (a swap can be harmless, or ill-typed)."""
    found = []
    for sub in SUBSTITUTIONS:
        variant = wrong_variant(sub)
        try:
            if variant is not None and not agree(*variant.graphs()):
                found.append(variant)
        except GraphError:
            continue
    return found


def test_wrong_variants_exist_for_almost_every_substitution():
    assert len(wrong_variants()) >= 120


@pytest.mark.parametrize("index", [0, 20, 40, 60, 80, 100, 120])
def test_a_sample_of_wrong_variants_is_not_proven(index: int):
    variant = wrong_variants()[index]
    assert not tapestry.equivalent(*variant.graphs(), budget=BUDGET).proven, variant


@pytest.mark.slow
def test_at_least_90_percent_of_the_133_are_proven_within_10_seconds_each():
    proven = []
    for sub in SUBSTITUTIONS:
        started = time.perf_counter()
        result = tapestry.equivalent(*sub.graphs(), budget=BUDGET)
        assert time.perf_counter() - started < 15, f"{sub.name} took too long"  # 10 s budget + one last round
        if result.proven:
            proven.append(sub.name)
    assert len(proven) >= 0.9 * len(SUBSTITUTIONS), sorted({s.name for s in SUBSTITUTIONS} - set(proven))


@pytest.mark.slow
def test_no_wrong_variant_is_proven():
    proven = [v.name for v in wrong_variants() if tapestry.equivalent(*v.graphs(), budget=BUDGET).proven]
    assert proven == []


def qkv(merged: bool) -> Graph:
    g = Graph()
    x = g.input("x", (8, 16))
    ws = [g.input(f"w{n}", (16, size)) for n, size in enumerate((4, 6, 5))]
    if not merged:
        for n, w in enumerate(ws):
            g.output(f"y{n}", g.matmul(x, w))
        return g
    y = g.matmul(x, g.concat(g.concat(ws[0], ws[1], axis=1), ws[2], axis=1))
    for n, (start, stop) in enumerate([(0, 4), (4, 10), (10, 15)]):
        g.output(f"y{n}", g.slice(y, axis=1, start=start, stop=stop))
    return g


def test_the_qkv_merge_is_proven_by_merge_egg():
    rules = [BUILTIN_DIR, TASO_DIR / "merge.egg"]
    assert tapestry.equivalent(qkv(False), qkv(True), rules=rules, budget=BUDGET).proven


def test_merge_egg_follows_from_the_concat_rules_and_slice_of_concat():
    """The two-output GEMM merge is a compound rule: TASO's concat algebra and substitution.egg's slice of a
    concat derive it without merge.egg."""
    rules = [BUILTIN_DIR / "substitution.egg", TASO_DIR / "concat.egg"]
    assert tapestry.equivalent(qkv(False), qkv(True), rules=rules, budget=BUDGET).proven


def test_substitution_egg_matmul_associativity_follows_from_taso_matmul_algebra():
    def chain(left: bool) -> Graph:
        g = Graph()
        a, b, c = (g.input(n, s) for n, s in (("a", (3, 4)), ("b", (4, 5)), ("c", (5, 2))))
        g.output("y", g.matmul(g.matmul(a, b), c) if left else g.matmul(a, g.matmul(b, c)))
        return g

    assert tapestry.equivalent(chain(True), chain(False), rules=[TASO_DIR / "matmul_algebra.egg"]).proven
