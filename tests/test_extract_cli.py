"""`tapestry extract`: the last stdout line is a JSON summary; bad input is one line on stderr, exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from extract_helpers import GYM
from tapestry import cli

SMALL = {
    "nodes": {
        "r": {"op": "f", "children": ["a", "a"], "eclass": "R", "cost": 1.0},
        "a": {"op": "x", "children": [], "eclass": "A", "cost": 2.0},
        "b": {"op": "g", "children": ["r"], "eclass": "A", "cost": 0.0},
    },
    "root_eclasses": ["R"],
    "class_data": {},
}


@pytest.fixture(autouse=True)
def only_the_extract_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other subcommands are built elsewhere in parallel; this suite depends on none of them."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("tapestry.extract.command",))


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("extractor", [None, "bottom-up", "greedy-dag", "ilp"])
def test_last_line_is_the_json_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str], extractor: str | None) -> None:
    path = tmp_path / "g.json"
    path.write_text(json.dumps(SMALL))
    args = ["extract", str(path)] + ([] if extractor is None else ["--extractor", extractor]) + ["--time-limit", "5"]
    code, out, _ = run(args, capsys)
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 0
    assert summary["extractor"] == (extractor or "ilp")
    assert summary["dag_cost"] == 3.0
    assert summary["acyclic"] is True
    assert summary["nodes_chosen"] == 2
    assert 0 <= summary["seconds"] <= 5 + 1  # within --time-limit, plus the reading and the summary


@pytest.mark.parametrize(
    ("content", "cause"),
    [(None, "cannot read"), ("{not json", "malformed JSON"), ('{"nodes": {}}', "root_eclasses")],
)
def test_bad_input_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, cause: str
) -> None:
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    code, out, err = run(["extract", str(path)], capsys)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert str(path) in err and cause in err


def test_a_root_without_finite_choice_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "inf.json"
    path.write_text(json.dumps({"nodes": {"r": {"eclass": "R", "cost": "inf"}}, "root_eclasses": ["R"]}))
    code, _, err = run(["extract", str(path)], capsys)
    assert code == 2
    assert "'R'" in err and "no finite choice" in err


@pytest.mark.skipif(not GYM.exists(), reason="extraction-gym data not present")
def test_works_on_a_real_gym_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["extract", str(GYM / "diospyros" / "simple_vec_add_root_7.json"), "--time-limit", "10"], capsys)
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and summary["acyclic"] and summary["valid"]


@pytest.mark.parametrize(("argv", "asked"), [([], 0.0), (["--stop-gap", "0.01"], 0.01)])
def test_the_ilp_proves_its_selection_unless_a_stop_gap_is_given(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        argv: list[str], asked: float) -> None:
    """The API's default stop gap grows past ilp.CONTRACT_FROM candidates; the command keeps proving by default."""
    import tapestry.extract.command as command
    path = tmp_path / "g.json"
    path.write_text(json.dumps(SMALL))
    seen = []
    extract = command.extract
    monkeypatch.setattr(command, "extract", lambda *args, **kwargs: seen.append(kwargs) or extract(*args, **kwargs))
    code, _, _ = run(["extract", str(path), *argv], capsys)
    assert code == 0 and seen == [{"stop_gap": asked}]


def test_a_stop_gap_outside_zero_to_one_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "g.json"
    path.write_text(json.dumps(SMALL))
    code, _, err = run(["extract", str(path), "--stop-gap", "1.5"], capsys)
    assert code == 2 and "--stop-gap must be a share in [0, 1), got 1.5" in err
