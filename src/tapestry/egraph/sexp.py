"""A small s-expression reader that remembers lines, so rule-file errors can say file:line."""
from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r'\s+|;[^\n]*|"(?:[^"\\]|\\.)*"|[()]|[^\s()";]+')


@dataclass(frozen=True)
class Atom:
    text: str
    line: int

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class SList:
    items: tuple[Atom | SList, ...]
    line: int

    @property
    def head(self) -> str | None:
        return self.items[0].text if self.items and isinstance(self.items[0], Atom) else None

    def __str__(self) -> str:
        return "(" + " ".join(map(str, self.items)) + ")"


SExp = Atom | SList


class SExpError(ValueError):
    def __init__(self, message: str, line: int) -> None:
        super().__init__(message)
        self.line = line


def parse(text: str, max_depth: int | None = None) -> list[SExp]:
    """Top-level forms of `text`; comments (; ...) are dropped. Nesting deeper than `max_depth` is an error at its
    line (the reader itself never recurses, but whatever walks the forms does)."""
    stack: list[list[SExp]] = [[]]
    opened: list[int] = []
    line, pos = 1, 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise SExpError(f"unreadable text {text[pos:pos + 10]!r}", line)
        token = match.group()
        if token == "(":
            if max_depth is not None and len(opened) >= max_depth:
                raise SExpError(f"nested deeper than {max_depth} levels (opened at line {opened[0]})", line)
            stack.append([])
            opened.append(line)
        elif token == ")":
            if len(stack) == 1:
                raise SExpError("unbalanced ')'", line)
            items = stack.pop()
            stack[-1].append(SList(tuple(items), opened.pop()))
        elif not token.isspace() and not token.startswith(";"):
            stack[-1].append(Atom(token, line))
        line += token.count("\n")
        pos = match.end()
    if len(stack) > 1:
        raise SExpError("unclosed '('", opened[-1])
    return stack[0]
