"""check-rules: every shipped rule preserves values; a wrong rule is caught with a shrunk counterexample."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import strategies as st

from tapestry.cli import main
from tapestry.egraph.rules import BUILTIN_DIR, TASO_DIR, EmptyRulesWarning, Rule, load_rule_file, load_rules
from tapestry.testing import rulecheck
from tapestry.testing.rulecheck import check_rule

DATA = Path(__file__).parent / "data" / "rules"
EXAMPLES = 60
# for rules wrong only on a few percent of draws (dtypes.egg:5 at bool, expand_matmul.egg's at a contracted dim
# broadcast from 1): at 60 examples a run missed them about 1 time in 8 (bool) and 3 in 10 (expand_matmul)
RARE_EXAMPLES = 300
FLOOR = 40  # fewer valid examples than this means the generator, not the rule, passed
SHIPPED = [rule for f in load_rules() for rule in f.rules]
# rules/taso/'s conv rules evaluate convs of up to 4,096 cells in numpy: 10-50 s each, so make test-all checks them.
# Two convs sharing an input are drawn well-typed a third to all of the time (34 to 100 of 100 over six runs of
# conv.egg:10), so these get more examples and a lower floor.
TASO = [pytest.param(rule, id=f"taso/{rule.short}", marks=pytest.mark.slow)
        for f in load_rules([TASO_DIR]) for rule in f.rules]
TASO_EXAMPLES, TASO_FLOOR = 100, 25


# substitution.egg:36's guards pin a slice's bounds to the concat's operand sizes, which the generator draws
# rarely (41-53 s); fusion.egg:29 evaluates convs in numpy as TASO's conv rules do (25 s; its mirror image,
# fusion.egg:24, stays): CI's durations, 2026-11-27. make test-all checks them.
SLOW_SHIPPED = {"substitution.egg:36", "fusion.egg:29"}
# The other rules that draw convs (fusion.egg:18, 19 and 24: 10-27 s of wall each at load, docs/benchmarks.md
# "Test suite time", branch maketest) take half the examples and floor in make test, the full count in make test-all.
CONV_EXAMPLES, CONV_FLOOR = EXAMPLES // 2, FLOOR // 2
# The tests that ask whether and where a wrong rule fails take its first failing input (`check_rule(shrink=False)`)
# where any failing input meets their assertions: shrinking took most of their CPU (1-8 s each; a conv's, 8).
# Shrinking is checked where a test reads the shrunk input (test_matmul_commutativity_is_caught_with_a_shrunk_...,
# the dtype and relu-against-exp rules below) and by the CLI's tests, which shrink.


def shipped_cases() -> list:
    """(rule, examples, floor) per shipped rule; a conv rule has a case of fewer examples in make test."""
    cases = []
    for r in SHIPPED:
        slow = r.short in SLOW_SHIPPED
        if "Conv2d" in str(r.lhs) and not slow:
            cases.append(pytest.param(r, CONV_EXAMPLES, CONV_FLOOR, id=f"{r.short}-{CONV_EXAMPLES}-examples"))
            slow = True
        cases.append(pytest.param(r, EXAMPLES, FLOOR, id=r.short, marks=[pytest.mark.slow] * slow))
    return cases


@pytest.mark.parametrize(("rule", "examples", "floor"), shipped_cases())
def test_every_shipped_rule_preserves_values(rule: Rule, examples: int, floor: int):
    verdict = check_rule(rule, examples)
    assert verdict.passed, verdict.counterexample
    assert verdict.examples_run >= floor


@pytest.mark.parametrize("rule", TASO)
def test_every_taso_rule_preserves_values(rule: Rule):
    verdict = check_rule(rule, TASO_EXAMPLES)
    assert verdict.passed, verdict.counterexample
    assert verdict.examples_run >= TASO_FLOOR


def test_matmul_commutativity_is_caught_with_a_shrunk_counterexample():
    (rule,) = load_rule_file(DATA / "wrong" / "commute.egg").rules
    verdict = check_rule(rule, EXAMPLES)
    assert not verdict.passed
    assert verdict.counterexample.startswith(f"{DATA / 'wrong' / 'commute.egg'}:2: ")
    assert "a[" in verdict.counterexample and "b[" in verdict.counterexample and "seed" in verdict.counterexample
    assert "1, 1" in verdict.counterexample  # shrunk: every size that does not matter is 1


def test_a_birewrite_is_checked_both_ways(tmp_path: Path):
    (tmp_path / "assoc.egg").write_text(
        "(birewrite (Matmul (Matmul a b) c) (Matmul a (Matmul b c))\n"
        "  :when ((= (Rank a) 2) (= (Rank b) 2) (= (Rank c) 2)))\n"
    )
    (rule,) = load_rule_file(tmp_path / "assoc.egg").rules
    verdict = check_rule(rule, 30)
    assert verdict.passed and verdict.examples_run >= 2 * 20


def test_a_wrong_value_is_reported_where_the_sides_differ(tmp_path: Path):
    (tmp_path / "exp.egg").write_text("(rewrite (Exp (Relu x)) (Relu (Exp x)))\n")
    verdict = check_rule(load_rule_file(tmp_path / "exp.egg").rules[0], EXAMPLES)
    assert not verdict.passed and "values differ" in verdict.counterexample


def test_cli_exit_status_says_pass_fail_or_unloadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    # experts.egg: one rule, 0.4 CPU s (fusion.egg's convs took 12); every shipped rule is checked one by one above.
    # A folder of one wrong rule: each rule of wrong/ fails in its own test (the whole folder, 25 s, in make test-all)
    assert main(["check-rules", str(BUILTIN_DIR / "experts.egg"), "--examples", "20"]) == 0
    (tmp_path / "commute.egg").write_text((DATA / "wrong" / "commute.egg").read_text())
    assert main(["check-rules", str(tmp_path), "--examples", "20"]) == 1
    assert "commute.egg:2" in capsys.readouterr().out
    assert main(["check-rules", str(DATA / "bad" / "wrong_arity.egg")]) == 2
    assert "wrong_arity.egg:3: Matmul takes 2 argument(s)" in capsys.readouterr().out


@pytest.mark.slow  # 25 s: test_cli_exit_status_says_pass_fail_or_unloadable fails a folder; each rule has its test
def test_cli_fails_every_file_of_the_wrong_rules(capsys: pytest.CaptureFixture[str]):
    assert main(["check-rules", str(DATA / "wrong"), "--examples", "20"]) == 1
    assert "commute.egg:2" in capsys.readouterr().out


@pytest.mark.slow  # 13 CPU s: test_every_shipped_rule_preserves_values checks the same rules in the default suite
def test_cli_passes_the_shipped_rules():
    assert main(["check-rules", str(BUILTIN_DIR), "--examples", "20"]) == 0


@pytest.mark.slow
def test_cli_checks_rules_and_taso_rules_by_default(capsys: pytest.CaptureFixture[str]):
    assert main(["check-rules", "--examples", "20"]) == 0
    assert "conv_merge.egg:7" in capsys.readouterr().out


# Lines 3 and 5 fail the first input found (the note on shrinking at the top): both sides sum alike, so the dtypes
# agree and only values or shapes can differ. Line 7 (relu against exp) is shrunk: its first input can be an int,
# where the sides' dtypes differ, and shrinking draws towards float64.
@pytest.mark.parametrize(("line", "shrink"), [(3, False), (5, False), (7, True)])
def test_a_rule_wrong_only_where_its_guard_holds_is_drawn_there_and_fails(line: int, shrink: bool):
    """Ranks up to 6 and sizes past 7 are drawn, steered by the guard: each rule fails with a real counterexample."""
    rule = next(r for r in load_rule_file(DATA / "wrong" / "guarded.egg").rules if r.line == line)
    verdict = check_rule(rule, EXAMPLES, shrink=shrink)
    assert not verdict.passed
    assert verdict.counterexample.startswith(f"{rule.where}: x[")
    assert "values differ" in verdict.counterexample or "shape" in verdict.counterexample


@pytest.mark.parametrize(("line", "why"), [(4, "does not type-check"), (11, "values differ")])
def test_a_matmul_of_an_expand_that_broadcasts_the_contracted_dim_is_not_the_smaller_matmul_expanded(line: int,
                                                                                                     why: str):
    """substitution.egg's expand(x) @ w = expand(x @ w) holds only where x's contracted dim is w's as it is: without
    that guard, or taking w's first row for a contracted dim broadcast from 1, the checker finds x[..., 1]."""
    rule = next(r for r in load_rule_file(DATA / "wrong" / "expand_matmul.egg").rules if r.line == line)
    verdict = check_rule(rule, RARE_EXAMPLES)
    assert not verdict.passed
    assert why in verdict.counterexample and re.search(r"\bx\[(\d+, )*1\]", verdict.counterexample)  # x[..., 1]


# 15 s each (CI's durations, 2026-11-27): line 7 (the batch axis, a rank-4 target) in make test-all, as line 3 (the
# rows, rank 3) fails the same way in make test, where fusion.egg:24 (rank 3 or 4) is checked too. Line 3 fails
# unshrunk (0.2 CPU s; shrinking its conv counterexample took 8): the shrinking is checked by line 7's case and by
# test_matmul_commutativity_is_caught_with_a_shrunk_counterexample.
@pytest.mark.parametrize(("line", "shrink"), [(3, False), pytest.param(7, True, marks=pytest.mark.slow)])
def test_a_conv_bias_fused_on_the_wrong_axis_fails(line: int, shrink: bool):
    """fusion.egg's conv + bias rule (b[K] reshaped to [K,1,1] or [1,K,1,1]) passes with the shipped rules; the
    same rule with the bias on the conv's rows or batch draws its reshape target too, and fails at its file:line."""
    # Not in wrong/: the CLI test checks that whole folder, and drawing convs is slow.
    wrong = next(r for r in load_rule_file(DATA / "wrong_conv" / "bias_axis.egg").rules if r.line == line)
    verdict = check_rule(wrong, EXAMPLES, shrink=shrink)
    assert not verdict.passed
    assert verdict.counterexample.startswith(f"{wrong.where}: b[") and "sh=" in verdict.counterexample


def test_a_birewrite_direction_that_gets_no_example_fails_as_untested(tmp_path: Path, monkeypatch):
    (tmp_path / "both.egg").write_text("(birewrite (Relu (Relu x)) (Relu x))\n")
    (rule,) = load_rule_file(tmp_path / "both.egg").rules
    drawn = rulecheck.cases

    def no_right_to_left(lhs, guards, *sizes):  # no input of the right-hand side can be drawn
        return st.nothing() if lhs == rule.rhs else drawn(lhs, guards)

    monkeypatch.setattr(rulecheck, "cases", no_right_to_left)
    verdict = check_rule(rule, 20)
    assert not verdict.passed and verdict.examples_run == 20
    assert verdict.counterexample == f"{rule.where}: right-to-left untested: no well-typed input satisfying the guards was found"


def test_check_rules_refuses_zero_examples_and_an_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["check-rules", "--examples", "0"]) == 2
    assert "--examples must be at least 1, got 0" in capsys.readouterr().err
    with pytest.warns(EmptyRulesWarning, match="no \\*.egg rule files"):
        assert main(["check-rules", str(tmp_path)]) == 1
    assert "no rules found" in capsys.readouterr().out
    (tmp_path / "blank.egg").write_text("; nothing yet\n")
    with pytest.warns(EmptyRulesWarning, match="blank.egg: no rules in this file"):
        assert main(["check-rules", str(tmp_path)]) == 1


def test_the_rules_link_at_the_top_of_the_repository_reaches_the_shipped_rules(capsys: pytest.CaptureFixture[str]):
    top = Path(__file__).parent.parent / "rules"
    assert sorted(p.name for p in top.glob("*.egg")) == sorted(p.name for p in BUILTIN_DIR.glob("*.egg"))


def test_a_failing_check_prints_no_hypothesis_hint(capsys: pytest.CaptureFixture[str]):
    assert main(["check-rules", str(DATA / "wrong" / "commute.egg"), "--examples", "20"]) == 1
    captured = capsys.readouterr()
    assert "@seed" not in captured.out + captured.err and "reproduce_failure" not in captured.out + captured.err


@pytest.mark.parametrize(("line", "expected"), [
    (3, "the left-hand side gives float32, the right-hand side "),
    (5, " bool, "),
])
def test_a_rule_wrong_only_at_some_dtypes_is_drawn_there_and_fails(line: int, expected: str):
    """Variables get the dtypes their kernels accept, mixed ones included; result dtypes and values are compared."""
    rule = next(r for r in load_rule_file(DATA / "wrong" / "dtypes.egg").rules if r.line == line)
    verdict = check_rule(rule, RARE_EXAMPLES)
    assert not verdict.passed
    assert verdict.counterexample.startswith(f"{rule.where}: ") and expected in verdict.counterexample


def test_half_precision_rounding_under_cancellation_is_not_a_wrong_rule():
    """CI drew this case for matmul distributing over add: in bfloat16 the sides differ by 5% of the output
    (b + c cancels), at float64 they agree. A rule wrong in its algebra still fails at half precision."""
    rule = next(r for r in SHIPPED if r.where.endswith("substitution.egg:21"))
    case = rulecheck.Case({"a": (2, 1), "b": (1, 1), "c": (1, 1)}, {}, 2185504,
                          {"a": "bfloat16", "b": "bfloat16", "c": "bfloat16"})
    assert rulecheck.disagreement(rule, case) is None
    (wrong,) = load_rule_file(DATA / "wrong" / "commute.egg").rules
    drawn = {v: (2, 2) for v in ("a", "b")}
    half = rulecheck.Case(drawn, {}, 1, dict.fromkeys(drawn, "bfloat16"))
    assert rulecheck.disagreement(wrong, half) is not None


def test_mixed_dtypes_are_drawn(monkeypatch):
    """Over one rule's examples, its two variables get several dtypes, and sometimes different ones."""
    seen = []
    disagreement = rulecheck.disagreement
    monkeypatch.setattr(rulecheck, "disagreement", lambda rule, case: seen.append(case.types) or disagreement(rule, case))
    rule = next(r for f in load_rules() for r in f.rules if r.lhs.head == "Relu" and "Add" in str(r.lhs))
    assert check_rule(rule, EXAMPLES).passed
    drawn = {d for types in seen for d in types.values()}
    assert {"float64", "float32", "int64"} <= drawn and any(len(set(t.values())) > 1 for t in seen), drawn


def test_a_wrong_two_output_rule_fails_naming_its_file_line_and_output():
    """Both outputs of a multi-output rule are checked on one drawn case; the counterexample names the
    output whose right-hand side is wrong (the first one found: the note on shrinking at the top; the CLI's,
    shrunk, is test_the_cli_names_a_wrong_two_output_rule's)."""
    (rule,) = load_rule_file(DATA / "wrong" / "merge_two.egg").rules
    verdict = check_rule(rule, EXAMPLES, shrink=False)
    assert not verdict.passed
    assert verdict.counterexample.startswith(f"{DATA / 'wrong' / 'merge_two.egg'}:2: ")
    assert "output b: values differ" in verdict.counterexample and "w1[" in verdict.counterexample


def test_a_right_two_output_rule_passes():
    (merge,) = [r for r in load_rule_file(TASO_DIR / "merge.egg").rules if r.line == 21]
    assert merge.form == "rule" and len(merge.outputs) == 2
    assert check_rule(merge, 30).passed


# Shrinking the two-output counterexample took 1-3 CPU s: make test-all. In make test the CLI fails a wrong rule
# naming its file:line (test_cli_exit_status_says_pass_fail_or_unloadable) and check_rule names the wrong output of
# this rule (test_a_wrong_two_output_rule_fails_naming_its_file_line_and_output).
@pytest.mark.slow
def test_the_cli_names_a_wrong_two_output_rule(capsys: pytest.CaptureFixture[str]):
    assert main(["check-rules", str(DATA / "wrong" / "merge_two.egg"), "--examples", "20"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "merge_two.egg:2: " in out.replace("\n", "")
