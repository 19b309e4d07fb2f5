"""Imports flow one way: a module imports only modules of its own layer or of lower ones (docs/design.md, Layers).

Every import counts, a function-level one too: a lazy import still ties the layers into one circle."""
from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import networkx
import pytest

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


def _parsed(path: Path) -> ast.Module:
    return _parse(path.read_text(), str(path))


@functools.cache  # the layer check and the import graph read the same files
def _parse(text: str, filename: str) -> ast.Module:
    return ast.parse(text, filename)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported tapestry module) for every import in the file."""
    found = []
    for node in ast.walk(_parsed(path)):
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


def _names_used(tree: ast.Module) -> set[str]:
    """Names read anywhere in the module, quoted annotations included."""
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    for node in ast.walk(tree):
        for hint in (getattr(node, "annotation", None), getattr(node, "returns", None)):
            if isinstance(hint, ast.Constant) and isinstance(hint.value, str):
                used |= {n.id for n in ast.walk(ast.parse(hint.value, mode="eval")) if isinstance(n, ast.Name)}
    return used


def unused_imports(src: Path = SRC) -> list[str]:
    """Imported names a module never reads, where the line does not say `noqa: F401` (registration, re-export)
    and `__all__` does not list them."""
    problems = []
    for path in sorted(src.rglob("*.py")):
        tree, lines = _parsed(path), path.read_text().splitlines()
        exported = {e.value for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                    for e in node.value.elts}
        used = _names_used(tree) | exported
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "module", None) == "__future__":
                continue
            if any("noqa: F401" in line for line in lines[node.lineno - 1:node.end_lineno]):
                continue
            problems += [f"{path.relative_to(src.parent)}:{node.lineno}: {name}"
                         for name in (a.asname or a.name.split(".")[0] for a in node.names) if name not in used]
    return problems


def test_no_module_imports_a_name_it_does_not_use() -> None:
    assert unused_imports() == []


def test_the_unused_import_check_finds_one_and_passes_quoted_annotations(tmp_path) -> None:
    (tmp_path / "tapestry").mkdir()
    (tmp_path / "tapestry" / "m.py").write_text("import os\nimport sys  # noqa: F401\nfrom typing import Any\n"
                                                "from pathlib import Path\ndef f(x: 'Path') -> None: ...\n")
    assert unused_imports(tmp_path / "tapestry") == ["tapestry/m.py:1: os", "tapestry/m.py:3: Any"]


def _module_name(path: Path, src: Path) -> str:
    return ".".join((src.name, *path.relative_to(src).with_suffix("").parts)).removesuffix(".__init__")


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def _import_time_nodes(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """The statements a module runs as it loads: its top level, class bodies and decorators, and the branches of
    top-level if/try/with/for, but no function body and no `if TYPE_CHECKING:` block."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                yield from ast.walk(decorator)
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _import_time_nodes(node.orelse)
            continue
        yield node
        if isinstance(node, (ast.ClassDef, ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody"):
                yield from _import_time_nodes(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                yield from _import_time_nodes(handler.body)


def import_time_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the tapestry modules that loading it loads first (or finds half loaded).

    `from P import name` needs P whole, `from P import sub` (a submodule) needs sub; importing P.Q.m also runs the
    packages P and P.Q, unless the importer lies inside them (then they are already loading: a package runs before
    its modules, and a module reaching its own half-made package for a submodule is fine). A namespace package
    (no __init__.py) is a module that loads nothing."""
    paths = {_module_name(p, src): p for p in src.rglob("*.py") if p.name != "__main__.py"}
    graph: dict[str, set[str]] = {name: set() for name in {*paths, *(a for n in paths for a in _ancestors(n))}}
    for name, path in paths.items():
        for node in _import_time_nodes(_parsed(path).body):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == src.name:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == src.name]
            else:
                continue
            for target in targets:
                graph[name] |= {target} | (set(_ancestors(target)) - {name, *_ancestors(name)})
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph, from its first module by name round to it again, or [] where there is none."""
    try:
        edges = networkx.find_cycle(networkx.DiGraph([(a, b) for a, targets in graph.items() for b in targets]))
    except networkx.NetworkXNoCycle:
        return []
    cycle = [a for a, _ in edges]
    start = cycle.index(min(cycle))
    return cycle[start:] + cycle[:start + 1]


def test_no_cycle_of_imports_runs_as_modules_load() -> None:
    """With no cycle, no module ever meets another half loaded, whatever it is imported after: every module imports
    on its own (test_the_static_import_graph_is_what_modules_load checks that the graph misses no import)."""
    assert import_cycle(import_time_graph()) == []


def test_the_cycle_check_finds_a_module_needing_its_half_made_package_and_passes_lazy_imports(tmp_path) -> None:
    package = tmp_path / "tapestry" / "kit"
    package.mkdir(parents=True)
    (tmp_path / "tapestry" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from tapestry.kit.tool import hammer\nfrom tapestry.kit import base\n")
    (package / "base.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tapestry.kit\n"
                                     "def later():\n    from tapestry.kit import hammer\n")
    (package / "tool.py").write_text("from tapestry.kit.base import later\nhammer = later\n")
    assert import_cycle(import_time_graph(tmp_path / "tapestry")) == []
    # A class body runs as the module loads, and hammer is a name of the package's, not a module: a cycle.
    (package / "tool.py").write_text("from tapestry.kit import base\nclass Tool:\n    from tapestry.kit import hammer\n")
    cycle = import_cycle(import_time_graph(tmp_path / "tapestry"))
    assert cycle == ["tapestry.kit", "tapestry.kit.tool", "tapestry.kit"]


def test_the_static_import_graph_is_what_modules_load() -> None:
    """Every module imported in one process, in turn: what each newly loads lies within what the import graph says
    it loads, so that no import at load time (importlib, a call at top level) escapes the cycle check."""
    graph = import_time_graph()
    script = """
import importlib, json, sys
for name in sys.argv[1:]:
    before = set(sys.modules)
    try:
        importlib.import_module(name)
    except Exception as err:
        print(json.dumps([name, f"{type(err).__name__}: {err}"]))
    else:
        print(json.dumps([name, sorted(m for m in set(sys.modules) - before if m.split(".")[0] == "tapestry")]))
"""
    done = subprocess.run([sys.executable, "-c", script, *sorted(graph)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(SRC.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = dict(json.loads(line) for line in done.stdout.splitlines())
    assert sorted(loaded) == sorted(graph)
    failed = {name: error for name, error in loaded.items() if isinstance(error, str)}
    assert failed == {}
    unseen = {}
    for name, new in loaded.items():
        reach, todo = set(), [name, *_ancestors(name)]
        while todo:
            if (module := todo.pop()) not in reach:
                reach.add(module)
                todo += graph[module]
        if set(new) - reach:
            unseen[name] = sorted(set(new) - reach)
    assert unseen == {}, "modules loaded that the import graph does not know of"


@pytest.mark.slow  # test_no_cycle_of_imports_runs_as_modules_load with the graph check above proves this statically
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
