"""Rule files: a bad file is reported as file:line with its cause, and loading is all or nothing."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import tapestry.optimizer
from tapestry.egraph.driver import Budget, saturate
from tapestry.egraph.rules import BUILTIN_DIR, TASO_DIR, RuleFileError, load_rule_file, load_rules
from tapestry.graph import Graph
from tapestry.optimizer import optimize
from tapestry.sharding import Mesh

BAD = Path(__file__).parent / "data" / "rules" / "bad"


@pytest.mark.parametrize(
    ("fixture", "where", "cause"),
    [
        ("unknown_constructor.egg", ":2", "unknown constructor 'Frobnicate'"),
        ("wrong_arity.egg", ":3", "Matmul takes 2 argument(s), found 1"),
        ("unbalanced.egg", ":3", "unclosed '('"),
        ("unbound_rhs.egg", ":2", "variable(s) y are not bound by the left-hand side"),
        ("ruleset_clause.egg", ":2", "do not name a ruleset; the file name 'ruleset_clause' is the ruleset"),
        ("not_a_rewrite.egg", ":2", "expected (rewrite LHS RHS), (birewrite LHS RHS), (rule ((= OUT"),
        ("union_twice.egg", ":5", "output a is unioned twice"),
        ("union_unknown.egg", ":3", "an action is (union OUT RHS) with OUT one of a, found (union c (Relu x))"),
        ("unbound_size.egg", ":3", "variable(s) v are not bound by a pattern"),
        ("bad_iterations.egg", ":3", "expected (iterations N) with N a positive integer, found (iterations 0)"),
        ("not-an-identifier.egg", "", "the file name must be an identifier"),
    ],
)
def test_a_bad_rule_file_is_reported_as_file_line_and_cause(fixture: str, where: str, cause: str):
    with pytest.raises(RuleFileError) as err:
        load_rule_file(BAD / fixture)
    assert str(err.value).startswith(f"{BAD / fixture}{where}: ")
    assert cause in str(err.value)


def test_a_rule_nested_thousands_deep_is_an_error_at_its_file_and_line(tmp_path: Path):
    deep = "(Relu " * 5000 + "x" + ")" * 5000
    path = tmp_path / "deep.egg"
    path.write_text(f"; a rule too deep to walk\n\n(rewrite {deep} x)\n")
    with pytest.raises(RuleFileError, match=rf"^{path}:3: nested deeper than 100 levels"):
        load_rules([path])


def test_two_files_with_one_stem_clash_on_the_ruleset_name(tmp_path: Path):
    shutil.copy(BUILTIN_DIR / "fusion.egg", tmp_path / "fusion.egg")
    with pytest.raises(RuleFileError, match=rf"^{tmp_path}/fusion.egg: ruleset 'fusion' is already defined by .*rules/fusion.egg"):
        load_rules([BUILTIN_DIR, tmp_path])


def test_loading_is_all_or_nothing():
    good = BUILTIN_DIR / "fusion.egg"
    assert [f.name for f in load_rules([good])] == ["fusion"]
    loaded = None
    with pytest.raises(RuleFileError, match="unknown_constructor.egg:2"):
        loaded = load_rules([good, BAD / "unknown_constructor.egg"])
    assert loaded is None


def test_a_missing_rule_path_is_an_error(tmp_path: Path):
    with pytest.raises(RuleFileError, match="no such rule file or directory"):
        load_rules([tmp_path / "absent.egg"])


def small_graph() -> Graph:
    g = Graph()
    g.output("y", g.exp(g.relu(g.input("x", (4, 8)))))
    return g


def test_optimize_rejects_a_bad_rules_dir_before_any_work(monkeypatch: pytest.MonkeyPatch):
    def saturate(*args: object, **kwargs: object) -> None:
        raise AssertionError("saturation started with unloadable rules")

    monkeypatch.setattr(tapestry.optimizer, "saturate", saturate)
    with pytest.raises(RuleFileError, match=r"\.egg"):
        optimize(small_graph(), 1, rules=[BAD])


def test_a_user_rules_dir_adds_its_ruleset(tmp_path: Path):
    (tmp_path / "mine.egg").write_text("; mine\n(rewrite (Exp (Relu x)) (Exp (Relu (Relu x))))\n")
    result = optimize(small_graph(), 1, rules=[BUILTIN_DIR, tmp_path], budget=Budget(iterations=3), extractor="greedy-dag")
    assert [f.name for f in result.rule_files] == ["experts", "fusion", "substitution", "mine"]
    fired = {where for it in result.stats.iterations for where in it.matches}
    assert f"{tmp_path / 'mine.egg'}:2" in fired


def test_a_rule_file_that_is_not_utf8_is_named_with_its_line(tmp_path: Path):
    (tmp_path / "latin.egg").write_bytes(b"; caf\xe9\n(rewrite (Relu x) (Relu x))\n".replace(b"caf", b"\n"))
    with pytest.raises(RuleFileError, match=r"latin\.egg:2: not UTF-8 text \(byte 0xe9\)"):
        load_rule_file(tmp_path / "latin.egg")


def test_a_repeated_rule_is_named_before_egglog_sees_it(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    (tmp_path / "twice.egg").write_text("(birewrite (Relu (Relu x)) (Relu x))\n\n(rewrite (Relu x) (Relu (Relu x)))\n")
    with pytest.raises(RuleFileError, match=r"twice\.egg:3: repeats the rule at line 1"):
        load_rules([tmp_path])
    assert "panicked" not in capfd.readouterr().err


def test_a_rule_with_a_string_literal_shows_in_the_match_counts():
    """egglog reports string literals as '' where the rule file has "": the stats still key it by file:line."""
    g = Graph()
    g.output("y", g.relu(g.transpose(g.transpose(g.input("x", (4, 6))))))
    result = optimize(g, 1, budget=Budget(iterations=3))
    fired = {where for it in result.stats.iterations for where in it.matches}
    assert str(BUILTIN_DIR / "fusion.egg") + ":15" in fired


def two_gemms_sharing_x() -> Graph:
    g = Graph()
    x = g.input("x", (8, 16))
    g.output("a", g.matmul(x, g.input("w1", (16, 4))))
    g.output("b", g.matmul(x, g.input("w2", (16, 6))))
    return g


def test_a_two_output_rule_counts_its_matches_by_file_line_in_its_rounds_only():
    """merge.egg's GEMM merge matches both matmuls at once; (iterations 1) keeps it to round 0."""
    result = optimize(two_gemms_sharing_x(), 1, rules=[BUILTIN_DIR, TASO_DIR], budget=Budget(iterations=4),
                      extractor="greedy-dag")
    merge = str(TASO_DIR / "merge.egg") + ":21"
    rounds = [i for i, it in enumerate(result.stats.iterations) if merge in it.matches]
    assert rounds == [0]
    assert len(result.stats.iterations) > 2  # the other rulesets went on


def test_a_node_made_by_a_two_output_rule_names_it_as_its_origin():
    generator, _, _ = saturate(two_gemms_sharing_x(), Mesh(1), load_rules([TASO_DIR / "merge.egg"]), Budget(iterations=2))
    assert any(origin == "made by merge.egg:21 in round 1" for origin in generator.origins.values())


def test_a_rule_file_may_bound_its_rounds(tmp_path: Path):
    (tmp_path / "once.egg").write_text("(iterations 1)\n(rewrite (Exp (Relu x)) (Exp (Relu (Relu x))))\n")
    (loaded,) = load_rules([tmp_path])
    assert loaded.iterations == 1
    result = optimize(small_graph(), 1, rules=[tmp_path], budget=Budget(iterations=4), extractor="greedy-dag")
    assert [bool(it.matches) for it in result.stats.iterations][:2] == [True, False]
