"""Linear algebra: linear, addmm and matmul, and einsum lowered to matmuls with transposes and reshapes."""
from __future__ import annotations

import math
from typing import Any

from tapestry.graph import Value
from tapestry.importer.aten.elementwise import binary
from tapestry.importer.translate import Builder, Unsupported, converts


def _weight_t(b: Builder, w: Any) -> Value:
    """torch's weight is [out, in]; Tapestry's linear reads [in, out]."""
    return b.op("transpose", b.tensor(w), perm=(1, 0))


@converts("aten.linear.default")
def _linear(b: Builder, x: Any, w: Any, bias: Any = None) -> Value:
    value = b.tensor(x)
    if value.ndim < 2:
        raise Unsupported("a 1-D input")
    if bias is None:
        return b.op("matmul", value, _weight_t(b, w))
    return b.op("linear", value, _weight_t(b, w), b.tensor(bias))


@converts("aten.addmm.default")
def _addmm(b: Builder, bias: Any, m1: Any, m2: Any, beta: Any = 1, alpha: Any = 1) -> Value:
    bias_v = b.tensor(bias)
    if beta == 1 and alpha == 1 and bias_v.ndim == 1:
        return b.op("linear", b.tensor(m1), b.tensor(m2), bias_v)
    product = binary(b, "mul", b.op("matmul", b.tensor(m1), b.tensor(m2)), alpha) if alpha != 1 else \
        b.op("matmul", b.tensor(m1), b.tensor(m2))
    return binary(b, "add", product, bias_v if beta == 1 else binary(b, "mul", bias_v, beta))


@converts("aten.baddbmm.default")
def _baddbmm(b: Builder, bias: Any, b1: Any, b2: Any, beta: Any = 1, alpha: Any = 1) -> Value:
    """beta·bias + alpha·(b1 @ b2), the bias broadcast (BLOOM's ALiBi scores); beta 0 ignores the bias, as torch."""
    product = b.op("matmul", b.tensor(b1), b.tensor(b2))
    product = binary(b, "mul", product, alpha) if alpha != 1 else product
    if beta == 0:
        return product
    return binary(b, "add", product, bias if beta == 1 else binary(b, "mul", bias, beta))


@converts("aten.mm.default", "aten.bmm.default", "aten.matmul.default")
def _matmul(b: Builder, x: Any, y: Any) -> Value:
    a, c = b.tensor(x), b.tensor(y)
    if a.ndim < 2 or c.ndim < 2:
        raise Unsupported("a 1-D operand")
    if c.ndim > 2 and a.shape[:-2] != c.shape[:-2]:
        batch = b.shape[:-2]
        a = a if a.shape[:-2] == batch else b.op("expand", a, shape=(*batch, *a.shape[-2:]))
        c = c if c.shape[:-2] == batch else b.op("expand", c, shape=(*batch, *c.shape[-2:]))
    return b.op("matmul", a, c)


def _einsum_labels(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """Each operand's labels and the output's, with `...` spelled as fresh upper-case labels (torch's implicit
    output: the ellipsis, then the labels seen once, in alphabetical order)."""
    spec = equation.replace(" ", "")
    lhs, arrow, rhs = spec.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise Unsupported(f"{len(terms)} terms for {len(ranks)} operands")
    fresh = max((rank - len(t.replace("...", "")) for t, rank in zip(terms, ranks) if "..." in t), default=0)
    ellipsis = "".join(chr(ord("Z") - i) for i in reversed(range(fresh)))
    if any(c.isupper() for c in spec):
        raise Unsupported("upper-case labels")
    labels = []
    for term, rank in zip(terms, ranks):
        own = rank - len(term.replace("...", ""))
        labels.append(term.replace("...", ellipsis[fresh - own :]) if "..." in term else term)
        if len(labels[-1]) != rank:
            raise Unsupported(f"term {term!r} does not fit a {rank}-D operand")
    if arrow:
        output = rhs.replace("...", ellipsis)
    else:
        seen = "".join(labels)
        output = ellipsis + "".join(sorted(c for c in set(seen) if seen.count(c) == 1 and c.islower()))
    for term in (*labels, output):
        if len(set(term)) != len(term):
            raise Unsupported(f"a label repeated within {term!r} (a diagonal)")
    return labels, output


def _arranged(b: Builder, value: Value, labels: str, order: str) -> Value:
    """`value` (dims named by `labels`) transposed to `order`."""
    perm = tuple(labels.index(c) for c in order)
    return value if perm == tuple(range(len(perm))) else b.op("transpose", value, perm=perm)


def _reshaped(b: Builder, value: Value, shape: tuple[int, ...]) -> Value:
    return value if value.shape == shape else b.op("reshape", value, shape=shape)


def _summed(b: Builder, value: Value, labels: str, keep: set[str]) -> tuple[Value, str]:
    """Labels not in `keep` summed away (they appear in no other operand and not in the output)."""
    for axis in reversed(range(len(labels))):
        if labels[axis] not in keep:
            value = b.op("sum", value, axis=axis, keepdim=False)
    return value, "".join(c for c in labels if c in keep)


def _contract(b: Builder, a: Value, la: str, c: Value, lc: str, keep: set[str]) -> tuple[Value, str]:
    """a·c over their shared labels not in `keep`, as one matmul: a to [batch, m, k], c to [batch, k, n] (no
    batch: a keeps its m dims as matmul's leading dims and c is 2-D, so a linear-style einsum shards like one)."""
    a, la = _summed(b, a, la, keep | set(lc))
    c, lc = _summed(b, c, lc, keep | set(la))
    size = {**dict(zip(la, a.shape)), **dict(zip(lc, c.shape))}
    if any(dict(zip(la, a.shape))[x] != dict(zip(lc, c.shape))[x] for x in set(la) & set(lc)):
        raise Unsupported("a label of different sizes in two operands (broadcasting)")
    batch = [x for x in la if x in lc and x in keep]
    inner = [x for x in la if x in lc and x not in keep]
    m, n = [x for x in la if x not in lc], [x for x in lc if x not in la]
    k = math.prod(size[x] for x in inner)
    if batch:
        shape_a = (*(size[x] for x in batch), math.prod(size[x] for x in m), k)
        shape_c = (*(size[x] for x in batch), k, math.prod(size[x] for x in n))
    else:
        shape_a = (*(size[x] for x in m), k) if m else (1, k)
        shape_c = (k, math.prod(size[x] for x in n))
    left = _reshaped(b, _arranged(b, a, la, "".join(batch + m + inner)), shape_a)
    right = _reshaped(b, _arranged(b, c, lc, "".join(batch + inner + n)), shape_c)
    labels = "".join(batch + m + n)
    return _reshaped(b, b.op("matmul", left, right), tuple(size[x] for x in labels)), labels


@converts("aten.einsum.default")
def _einsum(b: Builder, equation: str, operands: list[Any], path: Any = None) -> Value:
    """Pairwise, left to right (torch's order without opt_einsum): each pair one matmul with transposes and
    reshapes around it, so einsum attention and einsum linears shard as matmuls do."""
    values = [b.tensor(t) for t in operands]
    labels, output = _einsum_labels(equation, [v.ndim for v in values])
    value, have = _summed(b, values[0], labels[0], set(output).union(*labels[1:]))
    for i in range(1, len(values)):
        later = set(output).union(*labels[i + 1 :])
        value, have = _contract(b, value, have, values[i], labels[i], later)
    if set(have) != set(output):
        raise Unsupported(f"output labels {output!r} not among the operands' {have!r}")
    return _arranged(b, value, have, output)
