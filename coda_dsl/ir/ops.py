"""The op table: one OpDef per node op, the single place that defines it.

An OpDef says what kind of node the op makes (`kind`), how many inputs it takes, what it means
(for elementwise ops: a torch function on fp32 tensors, the reference semantics), how its width
follows from its inputs' (`width_rule`, see passes/widths.py) and how it folds when its inputs are
constants (`fold`). Passes dispatch on these attributes, not on op names. The C++ spelling of each
elementwise op lives in codegen/cpp.py (one table, keyed by op name; helpers in
csrc/coda_dsl/functional.h). Adding an elementwise op: one line here, one there, one cd. function.
Comparisons yield 1.0 / 0.0, so `where` tests `!= 0`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

KINDS = ("leaf", "elementwise", "structural", "reduction")


class FoldError(ValueError):
    """Constant inputs that make no constant (passes/simplify.py names the user's line)."""


@dataclass(frozen=True)
class OpDef:
    name: str
    arity: int  # inputs (reduce: 1, or 2 with take's index)
    kind: str = "elementwise"  # one of KINDS
    # the reference semantics on fp32 tensors (structural ops: on operands expanded to their widths)
    torch_fn: Callable[..., torch.Tensor] | None = None
    takes_attr: bool = False  # torch_fn also receives the node's attr (cast: the dtype)
    rounds: bool = False  # the value is its input rounded to the attr's dtype: what a store in it does too
    # width of the value relative to its inputs': "same" (elementwise), "half" (pair), "double"
    # (interleave); None: not a per-column value of the tile's math (leaves, reductions)
    width_rule: str | None = None
    folder: Callable[[object, list[float]], float] | None = None  # structural ops: constants -> constant
    # structural ops, per column pair q of the full-width tile: which (input, part) the value's even
    # and odd parts are (part 0: the pair's even column, 1: its odd one; a half-width value has one
    # part, kept in both); lowering fuses them into functors with this alone
    parts: Callable[[object], tuple[tuple[int, int], tuple[int, int]]] | None = None
    # the derivative: grad(d, attr, inputs, output, g) -> one adjoint per input (None: no gradient),
    # built with d's node constructors (passes/autodiff.py); torch's conventions at kinks and ties.
    # None: the op has no derivative yet (autodiff refuses programs that need one)
    grad: Callable | None = None
    # leaves: "fetched" (read per element by a visitor node of its own: the accumulator, loads, D) or
    # "uniform" (one value for every column, so any width: scalars, constants, a finished statistic)
    leaf_value: str | None = None

    def apply(self, attr, *args: torch.Tensor) -> torch.Tensor:
        """The reference semantics on fp32 tensors (elementwise and structural ops); on fp64 tensors the
        same math in fp64 (autodiff's checks)."""
        out = self.torch_fn(*args, attr) if self.takes_attr else self.torch_fn(*args)
        return out.to(torch.float64 if any(a.dtype == torch.float64 for a in args) else torch.float32)

    @property
    def fold(self) -> bool:
        """Can constant inputs be folded into one constant?"""
        return self.kind == "elementwise" or self.folder is not None

    def evaluate(self, attr, values: list[float]) -> float:
        """The op applied to constants: elementwise ops with the reference semantics (fp32 torch ops),
        so constant folding never changes a result."""
        if self.folder is not None:
            return self.folder(attr, values)
        return float(self.apply(attr, *(torch.tensor(v, dtype=torch.float32) for v in values)))


def _f(x: torch.Tensor) -> torch.Tensor:
    return x.float()


def _gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def _gelu_erf(x):
    """x Phi(x) in the kernels' order (functional.h: gelu_erf): F.gelu's vectorized CPU path gives NaN at inf
    and inf near fp32's largest values, where one value alone (and a folded constant) does not."""
    return 0.5 * x * (1.0 + torch.erf(x * 0.7071067811865476))


def elementwise(name: str, arity: int, fn: Callable, grad: Callable | None = None) -> OpDef:
    """An elementwise op: same width as its inputs, folded with its reference semantics; `grad` maps
    (d, inputs, output, g) to the inputs' adjoints (see OpDef.grad)."""
    return OpDef(name, arity, "elementwise", fn, width_rule="same",
                 grad=(lambda d, _attr, x, y, g: grad(d, x, y, g)) if grad else None)


def _no_grad(d, x, y, g):  # comparisons: piecewise constant
    return (None,) * len(x)


def _tie_split(d, win, tie, g):
    """torch's maximum/minimum: the winner takes g, a tie splits it in half, the loser gets exactly 0 (a
    select, as torch's masked_fill: g * 0 would make an infinite g NaN)."""
    return d.where(win, g, d.where(tie, d.mul(g, d.c(0.5)), d.c(0.0)))


def _gelu_grad(d, x, y, g):
    """d/dx x Phi(x) = Phi(x) + x phi(x), with Phi(x) = (1 + erf(x / sqrt 2)) / 2 as torch computes it (not
    gelu(x) / x, whose division and zero test cost more in a kernel than the erf they spare)."""
    (x,) = x
    cdf = d.mul(d.add(d.c(1.0), d.erf(d.mul(x, d.c(0.7071067811865476)))), d.c(0.5))
    pdf = d.mul(d.exp(d.mul(d.mul(x, x), d.c(-0.5))), d.c(0.3989422804014327))
    return (d.mul(g, d.add(cdf, d.mul(x, pdf))),)


def _gelu_tanh_grad(d, x, y, g):
    """0.5 (1 + t) + 0.5 x (1 - t^2) k0 (1 + 3 k1 x^2), t = tanh(k0 (x + k1 x^3)). With t = 2 s - 1, s = sigmoid(2
    k0 (x + k1 x^3)): s + s (1 - s) x b, b = 2 k0 + 6 k0 k1 x^2, 13 ops. The kernels' sigmoid is a few hardware
    instructions where an exact tanhf is ~25 (the epilogue's math shows in a cooperative tile). In fp32 within 2e-6
    of the exact value, closer than 0.5 (1 + t) where t nears -1; ordered so that it stays finite out to |x| ~
    1.8e19, where x^2 overflows (NaN beyond, as torch's)."""
    (x,) = x
    k0, k1 = 0.7978845608028654, 0.044715
    x2 = d.mul(x, x)
    s = d.sigmoid(d.mul(x, d.add(d.c(2 * k0), d.mul(d.c(2 * k0 * k1), x2))))
    b = d.add(d.c(2 * k0), d.mul(d.c(6 * k0 * k1), x2))
    return (d.mul(g, d.add(s, d.mul(d.mul(d.mul(s, d.sub(d.c(1.0), s)), x), b))),)


def _silu_grad(d, x, y, g):
    (x,) = x
    s = d.sigmoid(x)
    return (d.mul(g, d.mul(s, d.add(d.c(1.0), d.mul(x, d.sub(d.c(1.0), s))))),)


# The elementwise math of the DSL (what cd. functions and operators record).
OPS: dict[str, OpDef] = {
    o.name: o
    for o in [
        elementwise("add", 2, torch.add,
                    lambda d, x, y, g: (g, g)),
        elementwise("sub", 2, torch.sub,
                    lambda d, x, y, g: (g, d.neg(g))),
        elementwise("mul", 2, torch.mul,
                    lambda d, x, y, g: (d.mul(g, x[1]), d.mul(g, x[0]))),
        elementwise("div", 2, torch.div,
                    lambda d, x, y, g: (d.div(g, x[1]), d.neg(d.div(d.mul(g, y), x[1])))),
        elementwise("neg", 1, torch.neg,
                    lambda d, x, y, g: (d.neg(g),)),
        elementwise("maximum", 2, torch.maximum,
                    lambda d, x, y, g: (_tie_split(d, d.gt(*x), d.eq(*x), g), _tie_split(d, d.lt(*x), d.eq(*x), g))),
        elementwise("minimum", 2, torch.minimum,
                    lambda d, x, y, g: (_tie_split(d, d.lt(*x), d.eq(*x), g), _tie_split(d, d.gt(*x), d.eq(*x), g))),
        elementwise("lt", 2, lambda a, b: _f(a < b),
                    _no_grad),
        elementwise("le", 2, lambda a, b: _f(a <= b),
                    _no_grad),
        elementwise("gt", 2, lambda a, b: _f(a > b),
                    _no_grad),
        elementwise("ge", 2, lambda a, b: _f(a >= b),
                    _no_grad),
        elementwise("eq", 2, lambda a, b: _f(a == b),
                    _no_grad),
        elementwise("ne", 2, lambda a, b: _f(a != b),
                    _no_grad),
        elementwise("where", 3, lambda c, a, b: torch.where(c != 0, a, b),
                    lambda d, x, y, g: (None, d.where(x[0], g, d.c(0.0)), d.where(x[0], d.c(0.0), g))),
        elementwise("exp", 1, torch.exp,
                    lambda d, x, y, g: (d.mul(g, y),)),
        elementwise("log", 1, torch.log,
                    lambda d, x, y, g: (d.div(g, x[0]),)),
        elementwise("sqrt", 1, torch.sqrt,
                    lambda d, x, y, g: (d.div(d.mul(g, d.c(0.5)), y),)),
        elementwise("rsqrt", 1, torch.rsqrt,
                    lambda d, x, y, g: (d.mul(g, d.mul(d.c(-0.5), d.mul(y, d.mul(y, y)))),)),
        elementwise("tanh", 1, torch.tanh,
                    lambda d, x, y, g: (d.mul(g, d.sub(d.c(1.0), d.mul(y, y))),)),
        elementwise("sin", 1, torch.sin,
                    lambda d, x, y, g: (d.mul(g, d.cos(x[0])),)),
        elementwise("cos", 1, torch.cos,
                    lambda d, x, y, g: (d.neg(d.mul(g, d.sin(x[0]))),)),
        elementwise("sigmoid", 1, torch.sigmoid,
                    lambda d, x, y, g: (d.mul(g, d.mul(y, d.sub(d.c(1.0), y))),)),
        elementwise("abs", 1, torch.abs,
                    lambda d, x, y, g: (d.mul(g, d.sub(d.gt(x[0], d.c(0.0)), d.lt(x[0], d.c(0.0)))),)),
        elementwise("relu", 1, torch.relu,  # a select: an infinite g stays out of the inactive side
                    lambda d, x, y, g: (d.where(d.gt(x[0], d.c(0.0)), g, d.c(0.0)),)),
        elementwise("gelu", 1, _gelu_erf,
                    _gelu_grad),
        elementwise("gelu_tanh", 1, _gelu_tanh,
                    _gelu_tanh_grad),
        elementwise("silu", 1, torch.nn.functional.silu,
                    _silu_grad),
        elementwise("square", 1, torch.square,
                    lambda d, x, y, g: (d.mul(g, d.mul(d.c(2.0), x[0])),)),
        elementwise("erf", 1, torch.erf,  # 2/sqrt(pi) exp(-x^2)
                    lambda d, x, y, g: (d.mul(g, d.mul(d.c(1.1283791670955126), d.exp(d.neg(d.mul(x[0], x[0]))))),)),
        # rounding: zero gradient, as torch gives (steps)
        elementwise("round", 1, torch.round,  # to nearest, ties to even (rintf)
                    _no_grad),
        elementwise("floor", 1, torch.floor,
                    _no_grad),
        elementwise("ceil", 1, torch.ceil,
                    _no_grad),
    ]
}


def _interleave_constants(_attr, values: list[float]) -> float:
    a, b = values
    if repr(a) != repr(b):  # columns alternating between two numbers are no single constant
        raise FoldError(f"cd.interleave({a!r}, {b!r}) interleaves two different constants, which have no width "
                        "of their own")
    return a


# Every node op: the elementwise math, cast, the pairwise (structural) ops, reductions and leaves.
NODE_OPS: dict[str, OpDef] = {
    **OPS,
    "cast": OpDef("cast", 1, "elementwise", lambda x, dtype: x.to(DTYPES[dtype]), takes_attr=True,
                  rounds=True, width_rule="same", grad=lambda d, _dtype, x, y, g: (g,)),  # rounding: straight through
    # a constant has every column equal: either half of it is the constant itself
    "pair": OpDef("pair", 1, "structural", lambda x, which: x[..., which::2], takes_attr=True, width_rule="half",
                  folder=lambda _attr, values: values[0], parts=lambda which: ((0, which), (0, which)),
                  grad=lambda d, which, x, y, g: (d.interleave(g, d.c(0.0)) if which == 0 else
                                                  d.interleave(d.c(0.0), g),)),
    "interleave": OpDef("interleave", 2, "structural", lambda a, b: torch.stack([a, b], dim=-1).flatten(-2),
                        width_rule="double", folder=_interleave_constants, parts=lambda _attr: ((0, 0), (1, 0)),
                        grad=lambda d, _attr, x, y, g: (d.pair(g, 0), d.pair(g, 1))),
    "reduce": OpDef("reduce", 1, "reduction"),
    "finish": OpDef("finish", 1, "reduction"),
    # onehot: 1.0 at column index[m] of each row m, else 0.0 (attr: the index operand's name), N wide; what
    # cd.take's derivative scatters its gradient with
    **{leaf: OpDef(leaf, 0, "leaf", leaf_value="fetched") for leaf in ("acc", "load", "prior_d", "onehot")},
    **{leaf: OpDef(leaf, 0, "leaf", leaf_value="uniform") for leaf in ("scalar", "const", "const_param", "reduced")},
}


def op_def(name: str) -> OpDef | None:
    """The definition of node op `name`, or None for an unknown name."""
    return NODE_OPS.get(name)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[..., m, index[m]]; 0 where the index is outside [0, N) (every index when N = 0). A shared [M]
    index serves every batch of a batched x."""
    if x.shape[-1] == 0:
        return x.new_zeros(x.shape[:-1])
    index = index.to(x.device).expand(x.shape[:-1])
    inside = (index >= 0) & (index < x.shape[-1])
    got = x.gather(-1, torch.where(inside, index, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(inside, got, torch.zeros_like(got))


@dataclass(frozen=True)
class ReduceDef:
    """A reduction kind (the attr of a reduce node): its reference semantics and where it applies.
    Its C++ (register, shuffle, atomic and combine functions, identity) is in codegen/evt.py."""

    name: str
    torch_fn: Callable[..., torch.Tensor]  # (x, dims) -> the statistic; indexed: (x, index[m])
    axes: tuple = ("n", "m", None)  # the output axes it reduces over
    indexed: bool = False  # reads a per-row int64 column index (a cd.VecM operand): cd.take
    empty_defined: bool = True  # has a value over no elements (sum: 0); max/min: undefined, refused
    # the derivative: grad(d, inputs, y, dy) -> the adjoint of inputs[0] (the value reduced; take's inputs[1]
    # is its index), with y the statistic and dy its gradient (both broadcast back over the reduced axis);
    # None: none yet
    grad: Callable | None = None


REDUCTIONS: dict[str, ReduceDef] = {
    r.name: r
    for r in [
        ReduceDef("sum", lambda x, dims: x.sum(dim=dims), grad=lambda d, x, y, dy: dy),
        ReduceDef("max", lambda x, dims: x.amax(dim=dims), empty_defined=False),
        ReduceDef("min", lambda x, dims: x.amin(dim=dims), empty_defined=False),
        ReduceDef("amax", lambda x, dims: x.abs().amax(dim=dims), empty_defined=False),
        ReduceDef("logsumexp", lambda x, dims: torch.logsumexp(x, dim=dims), axes=("n",),
                  grad=lambda d, x, y, dy: d.mul(dy, d.exp(d.sub(x[0], y)))),  # dy times the softmax
        # x at column index[m] of each row m; dy goes back there alone (a select: an infinite dy stays there)
        ReduceDef("take", _take, axes=("n",), indexed=True,
                  grad=lambda d, x, y, dy: d.where(d.onehot(x[1]), dy, d.c(0.0))),
    ]
}


# dtype name -> torch dtype: the one table of storable dtypes (their C++ types: codegen/cpp.py, CPP_ELEMENT)
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TORCH_TO_DTYPE = {t: name for name, t in DTYPES.items()}
INDEX_DTYPE = "i64"  # cd.take's per-row column indices: read, never computed with or stored


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the reference semantics compute values of `dtype` in: fp32, or fp64 for fp64 (autodiff's
    checks, torch.autograd.gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# dtype_name's
DTYPE_SPELLINGS = "torch.bfloat16, torch.float16 or torch.float32, or a name: 'bf16', 'fp16', 'fp32', 'float32', ..."


def torch_dtype(dtype):
    """A dtype given by name as torch's: ours ('bf16') or torch's ('float32', 'torch.float64'); anything else
    (a torch dtype, a name of nothing) as it is."""
    if isinstance(dtype, str):
        return DTYPES[dtype] if dtype in DTYPES else getattr(torch, dtype.removeprefix("torch."), dtype)
    return dtype


def dtype_name(dtype) -> str:
    """Accept 'bf16' / torch.bfloat16 / cd.bfloat16 and return the canonical name."""
    dtype = torch_dtype(dtype)
    if dtype in TORCH_TO_DTYPE:
        return TORCH_TO_DTYPE[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}: use {DTYPE_SPELLINGS}")


def evaluate(op: str, attr, values: list[float]) -> float:
    """Op `op` applied to constants (see OpDef.evaluate); raises FoldError where no constant results."""
    return NODE_OPS[op].evaluate(attr, values)


def to_fp32(v: float) -> float:
    """v rounded to the nearest fp32 value (1e40 is inf in fp32)."""
    return float(torch.tensor(v, dtype=torch.float32).item())
