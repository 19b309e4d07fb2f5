"""Apply known-wrong mutations to a copy of the project, one at a time, and show which test catches each.

    .venv/bin/python tests/mutants.py              # every mutant, against the tests that catch them
    .venv/bin/python tests/mutants.py --all        # against the whole of `make test` (minutes per mutant)
    .venv/bin/python tests/mutants.py halo-short   # one mutant
    .venv/bin/python tests/mutants.py --tests tests/test_end_to_end.py   # do the property tests alone catch them?

Each mutant is a bug an audit planted by hand and the property tests once missed. The working tree is never
touched: a copy of a commit (HEAD) lives in a temporary folder and comes first on PYTHONPATH (ranks inherit it). Exit 1 when a
mutant survives.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The tests that catch these mutants, in the order they usually fail; --all runs the whole suite instead.
CATCHING = ("tests/test_plan.py", "tests/test_sharding.py", "tests/test_lower.py", "tests/test_runtime.py",
            "tests/test_end_to_end.py")


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # under ROOT
    edits: tuple[tuple[str, str], ...]  # (exact text, replacement), each found exactly once
    why: str


MUTANTS = (
    Mutant(
        "halo-short", "src/tapestry/sharding/partition.py",
        (("    return Layout(tuple(_clipped(sig.projections[arg], b, sig.input_shapes[arg]) for b in part.blocks))",
          "    clipped = (_clipped(sig.projections[arg], b, sig.input_shapes[arg]) for b in part.blocks)\n"
          "    return Layout(tuple(None if c is None else ZRange(c.start, tuple(\n"
          "        e - 1 if n > 1 and e < size and e - s > 1 else e\n"
          "        for s, e, n, size in zip(c.start, c.end, sig.projections[arg].shape, sig.input_shapes[arg])))\n"
          "        for c in clipped))"),),
        "plan generation gives each device a halo one row short of what its window reads",
    ),
    Mutant(
        "reshard-skips-predecessor", "src/tapestry/sharding/comm.py",
        (("        for step in range(1, n):", "        for step in range(1, n - 1):"),
         ("        if missing:\n            raise CommError", "        if False:\n            raise CommError")),
        "a reshard fetches from every device but its ring predecessor, and says nothing of the cells left out",
    ),
    Mutant(
        "last-partial-unsent", "src/tapestry/sharding/comm.py",
        (("            for j in range(n):", "            for j in range(n - 1):"),),
        "the last device's partial sums are never sent",
    ),
    Mutant(
        "all-gather-skips-own", "src/tapestry/lower/program.py",
        (('            take = ((Piece(rank, own),) if own is not None else ()) + _pieces(moves, rank, "dst")',
          '            take = _pieces(moves, rank, "dst")'),),
        "an all-gather leaves out the rank's own piece of its destination block",
    ),
)


def copy_project(into: Path, commit: str) -> None:
    """The files of `commit` (not the working tree: others may be half-way through an edit there)."""
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def apply(mutant: Mutant, root: Path) -> None:
    path = root / mutant.path
    text = path.read_text()
    for old, new in mutant.edits:
        if text.count(old) != 1:
            raise SystemExit(f"{mutant.name}: {mutant.path} no longer holds this text once; update the mutant:\n{old}")
        text = text.replace(old, new)
    path.write_text(text)


def run_tests(root: Path, tests: tuple[str, ...]) -> tuple[bool, str]:
    """(caught, the first failing test or the summary)."""
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], cwd=root,
                          env=env, capture_output=True, text=True)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.MULTILINE)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-300:]
    return done.returncode != 0, failed[0] if failed else summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", choices=[[], *(m.name for m in MUTANTS)], metavar="MUTANT")
    parser.add_argument("--all", action="store_true", help="run the whole suite, as `make test` does")
    parser.add_argument("--commit", default="HEAD", help="the commit to mutate (default HEAD)")
    parser.add_argument("--tests", nargs="+", default=CATCHING, metavar="PATH", help="the tests to run instead")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    tests = ("-n", "2") if args.all else tuple(args.tests)
    survived = []
    for mutant in chosen:
        with tempfile.TemporaryDirectory(prefix=f"tapestry-mutant-{mutant.name}-") as scratch:
            copy_project(Path(scratch), args.commit)
            apply(mutant, Path(scratch))
            caught, where = run_tests(Path(scratch), tests)
        print(f"{mutant.name:28} {'caught by' if caught else 'SURVIVED:'} {where}    ({mutant.why})", flush=True)
        if not caught:
            survived.append(mutant.name)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
