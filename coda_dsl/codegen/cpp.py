"""Functors in C++: the one table spelling each elementwise op (ir/ops.py defines the ops), and the
rendering of a plan's functors (passes/plan.py: steps over references) into statements.

Each table entry is a str.format template over fp32 operand expressions {0}, {1}, ...; `cast` also
gets {dtype}, the CUTLASS element type it rounds through. Helpers live in csrc/coda_dsl/functional.h.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir.ops import to_fp32
from ..passes.plan import Functor, Ref

OP_CPP: dict[str, str] = {
    "add": "({0} + {1})",
    "sub": "({0} - {1})",
    "mul": "({0} * {1})",
    "div": "({0} / {1})",
    "neg": "(-{0})",
    "maximum": "coda::maximum({0}, {1})",
    "minimum": "coda::minimum({0}, {1})",
    "lt": "float({0} < {1})",
    "le": "float({0} <= {1})",
    "gt": "float({0} > {1})",
    "ge": "float({0} >= {1})",
    "eq": "float({0} == {1})",
    "ne": "float({0} != {1})",
    "where": "({0} != 0.f ? {1} : {2})",
    "exp": "expf({0})",
    "log": "logf({0})",
    "sqrt": "sqrtf({0})",
    "rsqrt": "rsqrtf({0})",
    "tanh": "tanhf({0})",
    "sin": "coda::fast_sin({0})",
    "cos": "coda::fast_cos({0})",
    "sigmoid": "coda::sigmoid({0})",
    "abs": "fabsf({0})",
    "relu": "coda::relu({0})",
    "gelu": "coda::gelu_erf({0})",
    "gelu_tanh": "coda::gelu_tanh({0})",
    "silu": "coda::silu({0})",
    "square": "({0} * {0})",
    "erf": "erff({0})",
    "round": "rintf({0})",  # the default rounding mode: to nearest, ties to even, as torch.round
    "floor": "floorf({0})",
    "ceil": "ceilf({0})",
    "cast": "coda::round_to<{dtype}>({0})",
}


def op_expr(op: str, attr, args: list[str]) -> str:
    """The C++ expression of elementwise op `op` (attr: cast's dtype name) over operand expressions."""
    return OP_CPP[op].format(*args, dtype=cpp_element(attr) if attr is not None else "")


# a storable dtype's name (ir/ops.py DTYPES) -> its CUTLASS element type
CPP_ELEMENT = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t", "fp32": "float"}


def cpp_element(dtype: str) -> str:
    return CPP_ELEMENT[dtype]


def cpp_float(v: float) -> str:
    """A C++ float literal that round-trips exactly (inf/nan included)."""
    v = to_fp32(v)  # round first: 1e40 is inf in fp32
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    return f"{v!r}f"


def ref(r: Ref) -> str:
    """A functor value in C++: inputs x<k> (pairwise: the slot's column, in fp32), temporaries t<i>,
    constants as literals, scalars by position in the Scalars struct p."""
    if r.kind == "input":
        return f"x{r.index}" if r.slot is None else f"float(x{r.index}[2 * q{' + 1' if r.slot else ''}])"
    if r.kind == "temp":
        return f"t{r.index}"
    if r.kind == "const":
        return cpp_float(r.index)
    return f"p.s{r.index}"  # by position: the key must not depend on names, nor C++ on them


@dataclass(frozen=True)
class CppFunctor:
    """A functor as the template renders it."""

    name: str
    arity: int
    text: str
    pairwise: bool
    body: list[str]  # statements, each defining a float t<i>
    result: str  # the expression returned (pairwise: for the even slot)
    result_odd: str  # pairwise: the expression for the odd slot


def functor(f: Functor) -> CppFunctor:
    body = [f"float t{i} = {op_expr(s.op, s.attr, [ref(a) for a in s.args])};" for i, s in enumerate(f.steps)]
    odd = ref(f.result_odd) if f.pairwise and f.result_odd is not None else ""
    return CppFunctor(f.name, f.arity, f.text, f.pairwise, body, ref(f.result), odd)

