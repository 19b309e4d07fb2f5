"""Rule files: each `NAME.egg` is one ruleset, NAME, of rewrites over the logical layer.

A file holds `(rewrite LHS RHS [:when (GUARD ...)])` and `(birewrite ...)` forms.
Files are checked here first (known constructors, arity, variables), then by
egglog in a scratch e-graph, so a bad file is reported as file:line and never
leaves half-loaded rules in the e-graph being optimised.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tapestry.egraph.schema import arities
from tapestry.egraph.sexp import Atom, SExp, SExpError, SList, parse

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "rules"
GUARD_OPS = {"=", "!=", "<", ">", "<=", ">=", "+", "-", "*", "/", "%", "min", "max"}
FORMS = ("rewrite", "birewrite")


class RuleFileError(ValueError):
    """A rule file that cannot be loaded; the message starts with file:line."""


class EmptyRulesWarning(UserWarning):
    """A rule file with no rules, or a directory with no *.egg files: probably not what was meant."""


@dataclass(frozen=True)
class Rule:
    ruleset: str
    path: Path
    line: int
    form: str
    lhs: SExp
    rhs: SExp
    guards: tuple[SList, ...]

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def short(self) -> str:
        """file:line without the directory, for explanations."""
        return f"{self.path.name}:{self.line}"

    @property
    def egglog(self) -> str:
        when = f" :when ({' '.join(map(str, self.guards))})" if self.guards else ""
        return f"({self.form} {self.lhs} {self.rhs}{when} :ruleset {self.ruleset})"

    def __str__(self) -> str:
        return f"{self.lhs} => {self.rhs}" + (f" when {' '.join(map(str, self.guards))}" if self.guards else "")


@dataclass(frozen=True)
class RuleFile:
    name: str
    path: Path
    rules: tuple[Rule, ...]


def _is_var(atom: Atom) -> bool:
    return atom.text[:1].isalpha() or atom.text[:1] == "_"


def variables(expr: SExp) -> set[str]:
    if isinstance(expr, Atom):
        return {expr.text} if _is_var(expr) else set()
    return set().union(*(variables(e) for e in expr.items[1:])) if expr.items else set()


def _check_term(expr: SExp, table: dict[str, int], allow: set[str], where: str) -> None:
    if isinstance(expr, Atom):
        return
    head = expr.head
    if head is None:
        raise RuleFileError(f"{where}:{expr.line}: expected (Constructor args...), found {expr}")
    if head not in table and head not in allow:
        raise RuleFileError(f"{where}:{expr.line}: unknown constructor {head!r}; known: {', '.join(sorted(table))}")
    if head in table and len(expr.items) - 1 != table[head]:
        raise RuleFileError(
            f"{where}:{expr.line}: {head} takes {table[head]} argument(s), found {len(expr.items) - 1} in {expr}"
        )
    for item in expr.items[1:]:
        _check_term(item, table, allow, where)


def _parse_rule(form: SExp, ruleset: str, path: Path, table: dict[str, int]) -> Rule:
    where = str(path)
    if not isinstance(form, SList) or form.head not in FORMS:
        head = form.head if isinstance(form, SList) else str(form)
        raise RuleFileError(f"{where}:{form.line}: expected (rewrite LHS RHS) or (birewrite LHS RHS), found {head!r}")
    items = form.items
    if len(items) not in (3, 5) or (len(items) == 5 and str(items[3]) != ":when"):
        if any(str(i) == ":ruleset" for i in items):
            raise RuleFileError(f"{where}:{form.line}: do not name a ruleset; the file name {ruleset!r} is the ruleset")
        raise RuleFileError(f"{where}:{form.line}: expected ({form.head} LHS RHS [:when (GUARD ...)]), found {form}")
    lhs, rhs = items[1], items[2]
    guards: tuple[SList, ...] = ()
    if len(items) == 5:
        if not isinstance(items[4], SList) or not all(isinstance(g, SList) for g in items[4].items):
            raise RuleFileError(f"{where}:{form.line}: :when takes a list of guards like ((= (Rank w) 2))")
        guards = tuple(items[4].items)  # type: ignore[arg-type]
    if not isinstance(lhs, SList) or (form.head == "birewrite" and not isinstance(rhs, SList)):
        raise RuleFileError(f"{where}:{form.line}: a rule's left-hand side must be a constructor term")
    for side in (lhs, rhs):
        _check_term(side, table, set(), where)
    for guard in guards:
        _check_term(guard, table, GUARD_OPS, where)
    bound = variables(lhs)
    needs = variables(rhs) | set().union(*(variables(g) for g in guards)) if guards else variables(rhs)
    if form.head == "birewrite":
        needs = needs | bound
        bound = bound & variables(rhs)
    unbound = sorted(needs - bound)
    if unbound:
        raise RuleFileError(f"{where}:{form.line}: variable(s) {', '.join(unbound)} are not bound by the left-hand side")
    return Rule(ruleset, path, form.line, str(form.head), lhs, rhs, guards)


def load_rule_file(path: str | Path) -> RuleFile:
    path = Path(path)
    name = path.stem
    if not name.isidentifier():
        raise RuleFileError(f"{path}: the file name must be an identifier (it names the ruleset), found {name!r}")
    try:
        forms = parse(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        raise RuleFileError(f"{path}:{line}: not UTF-8 text (byte {err.object[err.start]:#04x})") from None
    except SExpError as err:
        raise RuleFileError(f"{path}:{err.line}: {err}") from None
    table = arities()
    rules = tuple(_parse_rule(f, name, path, table) for f in forms)
    first: dict[tuple[str, ...], Rule] = {}
    for rule in rules:  # egglog panics on a repeated rule (a birewrite is two); say where instead
        for key in _directions(rule):
            if key in first:
                raise RuleFileError(f"{rule.where}: repeats the rule at line {first[key].line}")
            first[key] = rule
    if not rules:
        warnings.warn(f"{path}: no rules in this file", EmptyRulesWarning, stacklevel=2)
    return RuleFile(name, path, rules)


def _directions(rule: Rule) -> list[tuple[str, ...]]:
    """The one-way rules egglog makes of `rule`, as (lhs, rhs, guards) text."""
    guards = " ".join(map(str, rule.guards))
    forward = (str(rule.lhs), str(rule.rhs), guards)
    return [forward] if rule.form == "rewrite" else [forward, (str(rule.rhs), str(rule.lhs), guards)]


def rule_paths(sources: Iterable[str | Path]) -> list[Path]:
    """Files named directly, and the *.egg files of directories, in a stable order."""
    paths: list[Path] = []
    for source in sources:
        source = Path(source)
        if source.is_dir():
            found = sorted(source.glob("*.egg"))
            if not found:
                warnings.warn(f"{source}: no *.egg rule files in this directory", EmptyRulesWarning, stacklevel=2)
            paths.extend(found)
        elif source.is_file():
            paths.append(source)
        else:
            raise RuleFileError(f"{source}: no such rule file or directory")
    return paths


def builtin_rule_paths() -> list[Path]:
    return rule_paths([BUILTIN_DIR])


def load_rules(sources: Sequence[str | Path] | None = None) -> list[RuleFile]:
    """Load and fully check rule files (default: the package's rules/); atomic: all or nothing."""
    files = [load_rule_file(p) for p in (rule_paths(sources) if sources is not None else builtin_rule_paths())]
    seen: dict[str, Path] = {}
    for f in files:
        if f.name in seen:
            raise RuleFileError(f"{f.path}: ruleset {f.name!r} is already defined by {seen[f.name]}")
        seen[f.name] = f.path
    _check_with_egglog(files)
    return files


def _check_with_egglog(files: Sequence[RuleFile]) -> None:
    """Send every rule to a scratch e-graph, so egglog's own errors surface as file:line."""
    from tapestry.egraph.session import EgglogError, Session  # the session loads rules: import late

    scratch = Session(())
    for f in files:
        scratch.text(f"(ruleset {f.name})")
        for rule in f.rules:
            try:
                scratch.text(rule.egglog)
            except EgglogError as err:
                raise RuleFileError(f"{rule.where}: egglog rejected the rule: {err}") from None


def rules_program(files: Sequence[RuleFile]) -> str:
    lines = []
    for f in files:
        lines.append(f"(ruleset {f.name})")
        lines.extend(r.egglog for r in f.rules)
    return "\n".join(lines)
