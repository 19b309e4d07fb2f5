"""The command line's table of commands: `--help` stays light, and the table agrees with the command modules."""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pytest
from blocking import OPTIONAL_ABSENT

from tapestry import cli

HEAVY = ("torch", "numpy", "egglog", "islpy", "ortools", "graphviz", "sympy", "hypothesis")


def test_help_imports_no_heavy_package() -> None:
    """`tapestry --help` took 4 s because every command module pulled in torch and egglog."""
    code = (f"import sys\nfrom tapestry import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            f"print('LOADED', [m for m in {HEAVY!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "check-rules" in done.stdout and "LOADED []" in done.stdout, done.stdout


def test_the_table_lists_every_command_of_its_modules_with_their_help() -> None:
    for module in cli.COMMAND_MODULES:
        scratch = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(scratch)
        registered = {action.dest: action.help for action in scratch._choices_actions}
        listed = {name: command.help for name, command in cli.COMMANDS.items() if command.module == module}
        assert registered == listed, module


LOAD_EACH = '''
import importlib, json
failed = []
for module in MODULES:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError:
        failed.append(module)
print(json.dumps(failed))
'''


def test_commands_that_need_an_optional_package_are_the_ones_that_cannot_load_without_it() -> None:
    """On a node without the optimiser's packages, `--help` must leave out exactly the commands that cannot load."""
    code = f"{OPTIONAL_ABSENT}\nMODULES = {list(cli.COMMAND_MODULES)!r}\n{LOAD_EACH}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    failed = set(json.loads(done.stdout.splitlines()[-1]))
    declared = {command.module for command in cli.COMMANDS.values() if command.needs}
    assert failed == declared


def test_a_command_whose_package_is_missing_says_so(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "_installed", lambda package: package != "egglog")
    with pytest.raises(SystemExit) as exited:
        cli.main(["optimize", "g.json"])
    assert exited.value.code == 2
    assert "optimize needs the package egglog, which is not installed here" in capsys.readouterr().err
