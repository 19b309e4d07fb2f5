"""Rule files: each `NAME.egg` is one ruleset, NAME, of rewrites over the logical layer.

A file holds `(rewrite LHS RHS [:when (GUARD ...)])` and `(birewrite ...)` forms, multi-output
`(rule (FACT ...) ((union OUT RHS) ...))` forms (several left-hand sides matched together, e.g. two
matmuls sharing an input, each unioned with its own right-hand side), and at most one `(iterations N)`:
the ruleset then runs in the first N saturation rounds only (Tensat's limit for multi-pattern rules).
Files are checked here first (known constructors, arity, variables), then by egglog in a scratch
e-graph, so a bad file is reported as file:line and never leaves half-loaded rules in the e-graph
being optimised.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tapestry.egraph.schema import FUNCTIONS, arities
from tapestry.egraph.sexp import Atom, SExp, SExpError, SList, parse

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "rules"
# TASO/Tensat algebra (ew, matmul, concat, conv): opt-in, for proofs and the substitution benchmark (docs/rules.md).
TASO_DIR = BUILTIN_DIR / "taso"
ARITH_OPS = {"+", "-", "*", "/", "%", "min", "max"}
GUARD_OPS = {"=", "!=", "<", ">", "<=", ">=", *ARITH_OPS}
FORMS = ("rewrite", "birewrite", "rule")


class RuleFileError(ValueError):
    """A rule file that cannot be loaded; the message starts with file:line."""


class EmptyRulesWarning(UserWarning):
    """A rule file with no rules, or a directory with no *.egg files: probably not what was meant."""


@dataclass(frozen=True)
class Output:
    """One left-hand side and what it is unioned with; `name` is its variable in a multi-output rule."""

    lhs: SList
    rhs: SExp
    name: str = ""


@dataclass(frozen=True)
class Rule:
    ruleset: str
    path: Path
    line: int
    form: str  # "rewrite", "birewrite" or "rule" (multi-output)
    outputs: tuple[Output, ...]
    guards: tuple[SList, ...]
    sizes: tuple[tuple[str, SList], ...] = ()  # a multi-output rule's integer variables: (n, (Dim w 1))

    @property
    def lhs(self) -> SList:
        """The left-hand side of a one-output rule (rewrite or birewrite)."""
        return self._single.lhs

    @property
    def rhs(self) -> SExp:
        return self._single.rhs

    @property
    def _single(self) -> Output:
        if len(self.outputs) != 1:
            raise ValueError(f"{self.where}: a rule with {len(self.outputs)} outputs has no single lhs/rhs")
        return self.outputs[0]

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def short(self) -> str:
        """file:line without the directory: the rule's egglog name, used in explanations and stats."""
        return f"{self.path.name}:{self.line}"

    @property
    def report_keys(self) -> tuple[str, ...]:
        """The names egglog's run report counts this rule's matches under (a birewrite is two rules)."""
        return (f"{self.short}=>", f"{self.short}<=") if self.form == "birewrite" else (self.short,)

    @property
    def builds(self) -> set[str]:
        """Constructors at the top of the right-hand sides: the nodes this rule makes."""
        return {o.rhs.head for o in self.outputs if isinstance(o.rhs, SList) and o.rhs.head}

    @property
    def egglog(self) -> str:
        tail = f':ruleset {self.ruleset} :name "{self.short}"'
        if self.form != "rule":
            when = f" :when ({' '.join(map(str, self.guards))})" if self.guards else ""
            return f"({self.form} {self.lhs} {self.rhs}{when} {tail})"
        facts = [f"(= {o.name} {o.lhs})" for o in self.outputs]
        facts += [f"(= {var} {term})" for var, term in self.sizes] + [str(g) for g in self.guards]
        actions = [f"(union {o.name} {o.rhs})" for o in self.outputs if o.rhs != Atom(o.name, o.rhs.line)]
        return f"(rule ({' '.join(facts)}) ({' '.join(actions)}) {tail})"

    def __str__(self) -> str:
        when = f" when {' '.join(map(str, self.guards))}" if self.guards else ""
        if self.form != "rule":
            return f"{self.lhs} => {self.rhs}{when}"
        sizes = "".join(f", {var} = {term}" for var, term in self.sizes)
        return (", ".join(f"{o.name} = {o.lhs}" for o in self.outputs) + sizes + " => "
                + ", ".join(f"{o.name}: {o.rhs}" for o in self.outputs) + when)


@dataclass(frozen=True)
class RuleFile:
    name: str
    path: Path
    rules: tuple[Rule, ...]
    iterations: int | None = None  # run in the first N saturation rounds only; None: every round


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


def _refuse_ruleset_clause(form: SList, ruleset: str, where: str) -> None:
    if any(str(i) in (":ruleset", ":name") for i in form.items):
        raise RuleFileError(f"{where}:{form.line}: do not name a ruleset; the file name {ruleset!r} is the ruleset "
                            "(and file:line names each rule)")


def _parse_rewrite(form: SList, ruleset: str, path: Path, table: dict[str, int]) -> Rule:
    where = str(path)
    items = form.items
    if len(items) not in (3, 5) or (len(items) == 5 and str(items[3]) != ":when"):
        _refuse_ruleset_clause(form, ruleset, where)
        raise RuleFileError(f"{where}:{form.line}: expected ({form.head} LHS RHS [:when (GUARD ...)]), found {form}")
    lhs, rhs = items[1], items[2]
    guards: tuple[SList, ...] = ()
    if len(items) == 5:
        if not isinstance(items[4], SList) or not all(isinstance(g, SList) for g in items[4].items):
            raise RuleFileError(f"{where}:{form.line}: :when takes a list of guards like ((= (Rank w) 2))")
        guards = tuple(items[4].items)  # type: ignore[arg-type]
    if not isinstance(lhs, SList) or (form.head == "birewrite" and not isinstance(rhs, SList)):
        raise RuleFileError(f"{where}:{form.line}: a rule's left-hand side must be a constructor term")
    _check_term(lhs, table, set(), where)
    _check_term(rhs, table, ARITH_OPS, where)
    for guard in guards:
        _check_term(guard, table, GUARD_OPS, where)
    bound = variables(lhs)
    needs = variables(rhs) | set().union(*(variables(g) for g in guards)) if guards else variables(rhs)
    if form.head == "birewrite":
        needs = needs | bound
        bound = bound & variables(rhs)
    _refuse_unbound(needs - bound, f"{where}:{form.line}", "the left-hand side")
    return Rule(ruleset, path, form.line, str(form.head), (Output(lhs, rhs),), guards)


def _refuse_unbound(unbound: set[str], where: str, binder: str) -> None:
    if unbound:
        raise RuleFileError(f"{where}: variable(s) {', '.join(sorted(unbound))} are not bound by {binder}")


_RULE_SHAPE = "(rule ((= OUT (Constructor ...)) ... [(= n (Dim t i))] [GUARD] ...) ((union OUT RHS) ...))"


def _parse_multi(form: SList, ruleset: str, path: Path, table: dict[str, int]) -> Rule:
    """A multi-output rule: facts bind outputs to patterns (`(= a (Matmul x w))`) or integer variables to
    sizes (`(= n (Dim w 1))`), or are guards; each action unions one output with its right-hand side."""
    where = f"{path}:{form.line}"
    _refuse_ruleset_clause(form, ruleset, str(path))
    if len(form.items) != 3 or not all(isinstance(i, SList) for i in form.items[1:]):
        raise RuleFileError(f"{where}: expected {_RULE_SHAPE}, found {form}")
    facts, actions = form.items[1].items, form.items[2].items  # type: ignore[union-attr]
    patterns: dict[str, SList] = {}
    sizes: list[tuple[str, SList]] = []
    guards: list[SList] = []
    for fact in facts:
        at = f"{path}:{fact.line}"
        if not isinstance(fact, SList):
            raise RuleFileError(f"{at}: a fact is a list like (= a (Matmul x w)), found {fact}")
        binds = fact.head == "=" and len(fact.items) == 3 and isinstance(fact.items[1], Atom) \
            and _is_var(fact.items[1]) and isinstance(fact.items[2], SList)
        target = fact.items[2] if binds else None
        if binds and target.head in FUNCTIONS:  # type: ignore[union-attr]
            _check_term(target, table, ARITH_OPS, str(path))  # type: ignore[arg-type]
            sizes.append((fact.items[1].text, target))  # type: ignore[union-attr,arg-type]
        elif binds and target.head in table:  # type: ignore[union-attr]
            name = fact.items[1].text  # type: ignore[union-attr]
            if name in patterns:
                raise RuleFileError(f"{at}: output {name} is bound twice")
            _check_term(target, table, set(), str(path))  # type: ignore[arg-type]
            patterns[name] = target  # type: ignore[assignment]
        else:
            _check_term(fact, table, GUARD_OPS, str(path))
            guards.append(fact)
    if not patterns:
        raise RuleFileError(f"{where}: a rule needs at least one pattern fact like (= a (Matmul x w))")
    for name, pattern in patterns.items():
        if variables(pattern) & set(patterns):
            raise RuleFileError(f"{path}:{pattern.line}: pattern of {name} uses another output "
                                f"({', '.join(sorted(variables(pattern) & set(patterns)))}); write its term instead")
    bound = set().union(*map(variables, patterns.values())) | set(patterns)
    for var, term in sizes:
        _refuse_unbound(variables(term) - bound, f"{path}:{term.line}", "a pattern")
        bound.add(var)
    for guard in guards:
        _refuse_unbound(variables(guard) - bound, f"{path}:{guard.line}", "a pattern or size")
    unions: dict[str, SExp] = {}
    for action in actions:
        at = f"{path}:{action.line}"
        if not (isinstance(action, SList) and action.head == "union" and len(action.items) == 3
                and isinstance(action.items[1], Atom) and action.items[1].text in patterns):
            raise RuleFileError(f"{at}: an action is (union OUT RHS) with OUT one of {', '.join(patterns)}, "
                                f"found {action}")
        name, rhs = action.items[1].text, action.items[2]
        if name in unions:
            raise RuleFileError(f"{at}: output {name} is unioned twice")
        _check_term(rhs, table, ARITH_OPS, str(path))
        _refuse_unbound(variables(rhs) - (bound - set(patterns)), at, "a pattern or size (outputs cannot appear "
                        "on a right-hand side)")
        unions[name] = rhs
    if not unions:
        raise RuleFileError(f"{where}: a rule needs at least one (union OUT RHS) action")
    outputs = tuple(Output(patterns[n], unions.get(n, Atom(n, form.line)), n) for n in patterns)
    return Rule(ruleset, path, form.line, "rule", outputs, tuple(guards), tuple(sizes))


def _parse_rule(form: SExp, ruleset: str, path: Path, table: dict[str, int]) -> Rule:
    if not isinstance(form, SList) or form.head not in FORMS:
        head = form.head if isinstance(form, SList) else str(form)
        raise RuleFileError(f"{path}:{form.line}: expected (rewrite LHS RHS), (birewrite LHS RHS), {_RULE_SHAPE} "
                            f"or (iterations N), found {head!r}")
    return (_parse_multi if form.head == "rule" else _parse_rewrite)(form, ruleset, path, table)


def _iterations(forms: list[SExp], path: Path) -> int | None:
    found = [f for f in forms if isinstance(f, SList) and f.head == "iterations"]
    if len(found) > 1:
        raise RuleFileError(f"{path}:{found[1].line}: (iterations N) given twice (first at line {found[0].line})")
    if not found:
        return None
    form = found[0]
    if len(form.items) != 2 or not str(form.items[1]).isdigit() or int(str(form.items[1])) < 1:
        raise RuleFileError(f"{path}:{form.line}: expected (iterations N) with N a positive integer, found {form}")
    return int(str(form.items[1]))


MAX_DEPTH = 100  # rule terms nest this deep at most: checking them recurses, and no real pattern comes close


def load_rule_file(path: str | Path) -> RuleFile:
    path = Path(path)
    name = path.stem
    if not name.isidentifier():
        raise RuleFileError(f"{path}: the file name must be an identifier (it names the ruleset), found {name!r}")
    try:
        forms = parse(path.read_text(encoding="utf-8"), MAX_DEPTH)
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        raise RuleFileError(f"{path}:{line}: not UTF-8 text (byte {err.object[err.start]:#04x})") from None
    except SExpError as err:
        raise RuleFileError(f"{path}:{err.line}: {err}") from None
    table = arities()
    iterations = _iterations(forms, path)
    rules = tuple(_parse_rule(f, name, path, table) for f in forms if not (isinstance(f, SList) and f.head == "iterations"))
    first: dict[tuple[str, ...], Rule] = {}
    for rule in rules:  # a repeated rule only wastes matches (a birewrite is two); say where
        for key in _directions(rule):
            if key in first:
                raise RuleFileError(f"{rule.where}: repeats the rule at line {first[key].line}")
            first[key] = rule
    if not rules:
        warnings.warn(f"{path}: no rules in this file", EmptyRulesWarning, stacklevel=2)
    return RuleFile(name, path, rules, iterations)


def _directions(rule: Rule) -> list[tuple[str, ...]]:
    """The one-way rules egglog makes of `rule`, as (lhs, rhs, guards) text."""
    guards = " ".join(map(str, rule.guards))
    if rule.form == "rule":
        return [(rule.egglog.split(" :ruleset ")[0],)]
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


def only_builtin(rule_files: Sequence[RuleFile]) -> bool:
    """Whether every file is one of the package's rules/*.egg: the rewrites `cost.floor` knows (it holds under
    those alone)."""
    shipped = {p.resolve() for p in builtin_rule_paths()}
    return all(Path(f.path).resolve() in shipped for f in rule_files)


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
