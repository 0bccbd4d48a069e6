"""The functions an epilogue calls: cd.exp(x), cd.where(c, a, b), cd.sum(x, axis="n"), ..."""
from __future__ import annotations

import math

from ..ir import graph as ir
from .trace import Reduction, Value, apply, cast, fail, index_operand, lift, reduce

__all__ = ["pairs", "interleave", "where", "maximum", "minimum", "clamp", "exp", "log", "sqrt", "rsqrt", "tanh", "sin",
           "cos", "sigmoid", "abs", "relu", "gelu", "silu", "erf", "round", "floor", "ceil", "cast", "sum", "max", "min",
           "amax", "logsumexp", "take", "onehot"]


def pairs(x) -> tuple[Value, Value]:
    """The even and odd columns (2j, 2j+1) of x, each half as wide. A Hopper thread holds both
    columns of a pair in its own registers, so pairwise math stays in the epilogue (SwiGLU, RoPE)."""
    node = lift(x)
    return Value(ir.pair(node, 0)), Value(ir.pair(node, 1))


def interleave(a, b) -> Value:
    """The inverse of cd.pairs: columns a0 b0 a1 b1 ..., twice as wide as a and b."""
    a, b = lift(a), lift(b)
    if a.op == b.op == "const" and repr(a.attr) != repr(b.attr):  # refused here, where the file and line are known
        raise fail(f"cd.interleave({a.attr!r}, {b.attr!r}) interleaves two different numbers, which have no width "
                   "of their own", "interleave traced values (e.g. of cd.pairs(acc)), or make one of them traced")
    return Value(ir.interleave(a, b))


def where(cond, a, b) -> Value:
    """Per element: a where cond is true (non-zero), else b."""
    return apply("where", cond, a, b)


def maximum(a, b) -> Value:
    return apply("maximum", a, b)


def minimum(a, b) -> Value:
    return apply("minimum", a, b)


def clamp(x, min=None, max=None) -> Value:  # noqa: A002  (torch.clamp's names)
    """x limited to [min, max] like torch.clamp (bounds: numbers or traced values; either may be None; a NaN
    x or bound gives NaN). The gradient passes to x where min < x < max, none at a number bound, as torch's;
    where x equals a traced bound it goes to the bound (torch's clamp splits it, half to each). x equal to a
    bound gives the bound (what carries no gradient): -0.0 at min=0.0 gives 0.0, where torch keeps -0.0."""
    if min is None and max is None:
        raise fail("cd.clamp(x) needs min, max or both", "e.g. cd.clamp(x, -448.0, 448.0)")
    y = Value(lift(x))
    if min is not None:  # min first, then max: min > max gives max everywhere, as torch.clamp
        y = _nan_bound(y, min, where(y <= min, min, y))
    if max is not None:
        y = _nan_bound(y, max, where(y >= max, max, y))
    return y


def _nan_bound(y: Value, bound, clamped: Value) -> Value:
    """clamped, but NaN where the bound is NaN (torch.clamp's result; `y <= nan` is false)."""
    if isinstance(bound, Value):  # traced: NaN perhaps only at run time
        return where(bound == bound, clamped, bound)
    return y * 0.0 + bound if math.isnan(bound) else clamped


def exp(x) -> Value: return apply("exp", x)
def log(x) -> Value: return apply("log", x)
def sqrt(x) -> Value: return apply("sqrt", x)
def rsqrt(x) -> Value: return apply("rsqrt", x)
def tanh(x) -> Value: return apply("tanh", x)
def sin(x) -> Value: return apply("sin", x)
def cos(x) -> Value: return apply("cos", x)
def sigmoid(x) -> Value: return apply("sigmoid", x)
def abs(x) -> Value: return apply("abs", x)  # noqa: A001  (cd.abs mirrors torch.abs)
def relu(x) -> Value: return apply("relu", x)
def silu(x) -> Value: return apply("silu", x)
def erf(x) -> Value: return apply("erf", x)
def round(x) -> Value: return apply("round", x)  # noqa: A001  to nearest, ties to even, as torch.round
def floor(x) -> Value: return apply("floor", x)
def ceil(x) -> Value: return apply("ceil", x)


def gelu(x, approximate: str = "none") -> Value:
    """GELU like torch.nn.functional.gelu: approximate="none" (erf form) or "tanh"."""
    if not isinstance(approximate, str) or approximate not in ("none", "tanh"):  # a traced value would compare
        raise fail(f"gelu(approximate={approximate!r}) is not a GELU form", 'use approximate="none" or "tanh"')
    return apply("gelu" if approximate == "none" else "gelu_tanh", x)


def sum(x, axis="n") -> Reduction:  # noqa: A001
    """Sum over an output axis: "n" -> [M] per row, "m" -> [N] per column, None -> a scalar. fp32."""
    return reduce("sum", x, axis)


def max(x, axis="n") -> Reduction:  # noqa: A001
    return reduce("max", x, axis)


def min(x, axis="n") -> Reduction:  # noqa: A001
    return reduce("min", x, axis)


def logsumexp(x, axis="n") -> Reduction:
    """log sum_n exp(x) per row, computed online (a running reference point and sum of exponentials), fp32."""
    return reduce("logsumexp", x, axis)


def take(x, index, axis="n") -> Reduction:
    """x at column index[m] of each row m (cross-entropy's target logit); index: a cd.VecM of int64.
    Rows whose index is outside [0, N) (e.g. ignore_index = -100) get 0."""
    return reduce("take", x, axis, index)


def onehot(index) -> Value:
    """1.0 at column index[m] of each row m, else 0.0 (N wide; index: a cd.VecM of int64, as cd.take's). An
    index outside [0, N) (e.g. ignore_index = -100) matches no column. The derivative of cd.take is this mask."""
    return Value(ir.onehot(index_operand(index, "cd.onehot")))


def amax(x, axis="n") -> Reduction:
    """max |x| over an axis (fp8 scaling statistics)."""
    return reduce("amax", x, axis)
