"""The elementwise op table: one entry per op, the single place that defines it.

Each op says how many inputs it takes, what it means (a torch function on fp32 tensors: the
reference semantics) and how it is spelled in the generated C++ (a format string over fp32
operands; helpers live in csrc/coda_dsl/functional.h). Adding an elementwise op touches only this file.
Comparisons yield 1.0 / 0.0, so `where` tests `!= 0`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class OpDef:
    name: str
    arity: int
    torch_fn: Callable[..., torch.Tensor]
    cpp: str  # str.format template over the operand expressions {0}, {1}, ...


def _f(x: torch.Tensor) -> torch.Tensor:
    return x.float()


def _gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def _gelu_erf(x):
    return torch.nn.functional.gelu(x)


OPS: dict[str, OpDef] = {
    o.name: o
    for o in [
        OpDef("add", 2, torch.add, "({0} + {1})"),
        OpDef("sub", 2, torch.sub, "({0} - {1})"),
        OpDef("mul", 2, torch.mul, "({0} * {1})"),
        OpDef("div", 2, torch.div, "({0} / {1})"),
        OpDef("neg", 1, torch.neg, "(-{0})"),
        OpDef("maximum", 2, torch.maximum, "coda::maximum({0}, {1})"),
        OpDef("minimum", 2, torch.minimum, "coda::minimum({0}, {1})"),
        OpDef("lt", 2, lambda a, b: _f(a < b), "float({0} < {1})"),
        OpDef("le", 2, lambda a, b: _f(a <= b), "float({0} <= {1})"),
        OpDef("gt", 2, lambda a, b: _f(a > b), "float({0} > {1})"),
        OpDef("ge", 2, lambda a, b: _f(a >= b), "float({0} >= {1})"),
        OpDef("eq", 2, lambda a, b: _f(a == b), "float({0} == {1})"),
        OpDef("ne", 2, lambda a, b: _f(a != b), "float({0} != {1})"),
        OpDef("where", 3, lambda c, a, b: torch.where(c != 0, a, b), "({0} != 0.f ? {1} : {2})"),
        OpDef("exp", 1, torch.exp, "expf({0})"),
        OpDef("log", 1, torch.log, "logf({0})"),
        OpDef("sqrt", 1, torch.sqrt, "sqrtf({0})"),
        OpDef("rsqrt", 1, torch.rsqrt, "rsqrtf({0})"),
        OpDef("tanh", 1, torch.tanh, "tanhf({0})"),
        OpDef("sin", 1, torch.sin, "coda::fast_sin({0})"),
        OpDef("cos", 1, torch.cos, "coda::fast_cos({0})"),
        OpDef("sigmoid", 1, torch.sigmoid, "coda::sigmoid({0})"),
        OpDef("abs", 1, torch.abs, "fabsf({0})"),
        OpDef("relu", 1, torch.relu, "coda::relu({0})"),
        OpDef("gelu", 1, _gelu_erf, "coda::gelu_erf({0})"),
        OpDef("gelu_tanh", 1, _gelu_tanh, "coda::gelu_tanh({0})"),
        OpDef("silu", 1, torch.nn.functional.silu, "coda::silu({0})"),
        OpDef("square", 1, torch.square, "({0} * {0})"),
    ]
}

# dtype name -> (torch dtype, CUTLASS element type). The one table of storable dtypes.
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "bf16": (torch.bfloat16, "cutlass::bfloat16_t"),
    "fp16": (torch.float16, "cutlass::half_t"),
    "fp32": (torch.float32, "float"),
}
TORCH_TO_DTYPE = {t: name for name, (t, _) in DTYPES.items()}
INDEX_DTYPE = "i64"  # cd.take's per-row column indices: read, never computed with or stored


def dtype_name(dtype) -> str:
    """Accept 'bf16' / torch.bfloat16 / cd.bfloat16 and return the canonical name."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    if dtype in TORCH_TO_DTYPE:
        return TORCH_TO_DTYPE[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}: use one of torch.bfloat16, torch.float16, torch.float32")


def evaluate(op: str, attr, values: list[float]) -> float:
    """An op (or cast(attr)) applied to constants with the reference semantics (fp32 torch ops), so
    constant folding never changes a result."""
    args = [torch.tensor(v, dtype=torch.float32) for v in values]
    if op == "cast":
        return float(args[0].to(DTYPES[attr][0]).float())
    return float(OPS[op].torch_fn(*args).float())


def to_fp32(v: float) -> float:
    """v rounded to the nearest fp32 value (1e40 is inf in fp32)."""
    return float(torch.tensor(v, dtype=torch.float32).item())
