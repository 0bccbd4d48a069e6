"""How the IR's elementwise ops are spelled in C++: the one table of it (ir/ops.py defines the ops).

Each entry is a str.format template over fp32 operand expressions {0}, {1}, ...; `cast` also gets
{dtype}, the CUTLASS element type it rounds through. Helpers live in csrc/coda_dsl/functional.h.
"""
from __future__ import annotations

from ..ir.ops import DTYPES

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
    "cast": "coda::round_to<{dtype}>({0})",
}


def op_expr(op: str, attr, args: list[str]) -> str:
    """The C++ expression of elementwise op `op` (attr: cast's dtype name) over operand expressions."""
    return OP_CPP[op].format(*args, dtype=DTYPES[attr][1] if attr is not None else "")
