"""Imports flow one way: a module imports only modules of its own layer or of lower ones (docs/design.md, Layers).

Every import counts, a function-level one too: a lazy import still ties the layers into one circle."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "tapestry"

# Lowest first. A name is a top-level module or package of tapestry; every `command.py` (a CLI subcommand) is in
# the CLI layer, whatever package holds it.
LAYERS: tuple[frozenset[str], ...] = tuple(map(frozenset, (
    {"zspace", "dtypes", "components", "clock", "collector"},
    {"kernels"},
    {"graph", "sharding"},
    {"evaluator"},
    {"plan", "verify"},
    {"lower"},
    {"cost"},
    {"extract", "egraph"},
    {"importer", "training", "models"},
    {"optimizer", "prove", "testing"},
    {"pipeline"},
    {"runtime"},
    {"spmd"},
    {"cli", "demo", "program", "command", "optimize_command", "__init__", "__main__"},
)))
LEVEL = {name: k for k, names in enumerate(LAYERS) for name in names}


def _layer(path: Path, src: Path) -> str:
    relative = path.relative_to(src)
    return "command" if path.name == "command.py" else relative.parts[0].removesuffix(".py")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported tapestry module) for every import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names] if node.module == "tapestry" \
                else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.startswith("tapestry.")]
    return found


def layering_violations(src: Path = SRC) -> list[str]:
    problems = []
    for path in sorted(src.rglob("*.py")):
        layer = _layer(path, src)
        if layer not in LEVEL:
            problems.append(f"{path.relative_to(src.parent)}: module {layer!r} has no layer in tests/test_layers.py")
            continue
        for line, name in _imports(path):
            target = name.split(".")[1]
            if target in LEVEL and LEVEL[target] > LEVEL[layer]:
                problems.append(f"{path.relative_to(src.parent)}:{line}: {layer} (layer {LEVEL[layer]}) imports "
                                f"{name} (layer {LEVEL[target]})")
    return problems


def test_no_module_imports_a_higher_layer() -> None:
    assert layering_violations() == []


def test_the_check_finds_an_import_of_a_higher_layer(tmp_path) -> None:
    (tmp_path / "tapestry" / "plan").mkdir(parents=True)
    (tmp_path / "tapestry" / "plan" / "plan.py").write_text("def run():\n    from tapestry.runtime import run_plan\n")
    assert layering_violations(tmp_path / "tapestry") == [
        "tapestry/plan/plan.py:2: plan (layer 4) imports tapestry.runtime (layer 11)"]


def test_every_module_imports_on_its_own():
    """No import cycle hides behind the order the package happens to load in (tapestry.training.capture, imported
    first, once found tapestry.importer half made). One process; tapestry's modules forgotten before each."""
    modules = sorted(".".join(("tapestry", *p.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
                     for p in SRC.rglob("*.py") if p.name != "__main__.py")
    script = """
import importlib, sys
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "tapestry" or m.startswith("tapestry.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as err:
        print(f"{name}: {type(err).__name__}: {err}")
"""
    done = subprocess.run([sys.executable, "-c", script, *modules], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(SRC.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", done.stdout
