"""The egglog schema, generated from the kernel registry.

Two sorts. `T` is the logical layer: one constructor per kernel, kernel params as
trailing primitive args (ints as i64, int tuples as a comma string), plus
`(Input name)` and `(Id n)`, the handle Python uses to name an e-class. `D` is
the distributed layer: `(At t layout)` names "value t laid out as layout";
its members are `(Run<Kernel> args... partition)` and `(Place name layout)`
(reshards between layouts are made outside egglog, by `egraph.decode`). `(Result name)` names each program output's root class,
whose members are `(Deliver name d)`. `Rank`/`Dim`/`Dtype`/`Shape` (dims comma-joined) carry types for
rule guards.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

from tapestry.kernels import KERNELS, Kernel, ParamValue


def constructor_name(kernel_name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in kernel_name.split("_"))


def run_name(kernel_name: str) -> str:
    return "Run" + constructor_name(kernel_name)


@dataclass(frozen=True)
class Constructor:
    """A logical constructor: which kernel, how many tensor args, which params (and their egglog sorts)."""

    name: str
    kernel: Kernel
    params: tuple[str, ...]

    @property
    def arity(self) -> int:
        return len(self.kernel.inputs) + len(self.params)

    def param_sort(self, param: str) -> str:
        return param_sort(self.kernel.params[param])

    @property
    def signature_text(self) -> str:
        return " ".join(["T"] * len(self.kernel.inputs) + [self.param_sort(p) for p in self.params])


@cache
def constructors() -> Mapping[str, Constructor]:
    return {
        constructor_name(k.name): Constructor(constructor_name(k.name), k, tuple(sorted(k.params)))
        for k in KERNELS.values()
    }


@cache
def run_constructors() -> Mapping[str, Kernel]:
    return {run_name(k.name): k for k in KERNELS.values()}


def param_sort(default: ParamValue) -> str:
    """The egglog sort of a param, by the type of its default: ints and bools (0/1) are i64, floats f64,
    strings and int tuples (comma-joined) String."""
    if isinstance(default, float):
        return "f64"
    return "String" if isinstance(default, (tuple, str)) else "i64"


def encode_param(value: ParamValue) -> int | float | str:
    """A param as the egglog literal value of its sort."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, (bool, str, float)):
        return int(value) if isinstance(value, bool) else value
    return int(value)


def decode_param(default: ParamValue, literal: str) -> ParamValue:
    """A param from the text egglog serializes its literal as."""
    if isinstance(default, tuple):
        text = literal.strip('"')
        return tuple(int(p) for p in text.split(",")) if text else ()
    if isinstance(default, str):
        return json.loads(literal) if literal.startswith('"') else literal
    if isinstance(default, float):
        return float(literal)
    if isinstance(default, bool):
        return bool(int(literal))
    return int(literal)


BUILTIN_T = {"Input": ("String",), "Id": ("i64",)}
FUNCTIONS = {"Rank": ("T",), "Dim": ("T", "i64"), "Dtype": ("T",), "Shape": ("T",)}


def schema_text() -> str:
    """The whole schema as egglog text (also written to docs by `tapestry schema`)."""
    t_lines = [f"  ({name} {' '.join(sorts)})" for name, sorts in BUILTIN_T.items()]
    t_lines += [f"  ({c.name} {c.signature_text})" for c in constructors().values()]
    d_lines = [
        "  (At T String)",
        "  (Place String String)",
        "  (Result String)",
        "  (Deliver String D)",
        *(f"  ({name} {' '.join(['D'] * len(k.inputs))} String)" for name, k in run_constructors().items()),
    ]
    return "\n".join(
        [
            "; generated from the kernel registry by tapestry.egraph.schema: do not edit",
            "(datatype T",
            *t_lines,
            ")",
            "(function Rank (T) i64 :merge old)",
            "(function Dim (T i64) i64 :merge old)",
            "(function Dtype (T) String :merge old)",
            "(function Shape (T) String :merge old)",
            "(datatype D",
            *d_lines,
            ")",
        ]
    )


def arities() -> dict[str, int]:
    """Every name a rule may use, with its arity (for checking rule files before egglog sees them)."""
    table = {name: len(sorts) for name, sorts in BUILTIN_T.items()}
    table.update({c.name: c.arity for c in constructors().values()})
    table.update({name: len(sorts) for name, sorts in FUNCTIONS.items()})
    return table
