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
    # width of the value relative to its inputs': "same" (elementwise), "half" (pair), "double"
    # (interleave); None: not a per-column value of the tile's math (leaves, reductions)
    width_rule: str | None = None
    folder: Callable[[object, list[float]], float] | None = None  # structural ops: constants -> constant
    # structural ops, per column pair q of the full-width tile: which (input, part) the value's even
    # and odd parts are (part 0: the pair's even column, 1: its odd one; a half-width value has one
    # part, kept in both); lowering fuses them into functors with this alone
    parts: Callable[[object], tuple[tuple[int, int], tuple[int, int]]] | None = None

    def apply(self, attr, *args: torch.Tensor) -> torch.Tensor:
        """The reference semantics on fp32 tensors (elementwise and structural ops)."""
        return (self.torch_fn(*args, attr) if self.takes_attr else self.torch_fn(*args)).float()

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
    return torch.nn.functional.gelu(x)


def elementwise(name: str, arity: int, fn: Callable) -> OpDef:
    """An elementwise op: same width as its inputs, folded with its reference semantics."""
    return OpDef(name, arity, "elementwise", fn, width_rule="same")


# The elementwise math of the DSL (what cd. functions and operators record).
OPS: dict[str, OpDef] = {
    o.name: o
    for o in [
        elementwise("add", 2, torch.add),
        elementwise("sub", 2, torch.sub),
        elementwise("mul", 2, torch.mul),
        elementwise("div", 2, torch.div),
        elementwise("neg", 1, torch.neg),
        elementwise("maximum", 2, torch.maximum),
        elementwise("minimum", 2, torch.minimum),
        elementwise("lt", 2, lambda a, b: _f(a < b)),
        elementwise("le", 2, lambda a, b: _f(a <= b)),
        elementwise("gt", 2, lambda a, b: _f(a > b)),
        elementwise("ge", 2, lambda a, b: _f(a >= b)),
        elementwise("eq", 2, lambda a, b: _f(a == b)),
        elementwise("ne", 2, lambda a, b: _f(a != b)),
        elementwise("where", 3, lambda c, a, b: torch.where(c != 0, a, b)),
        elementwise("exp", 1, torch.exp),
        elementwise("log", 1, torch.log),
        elementwise("sqrt", 1, torch.sqrt),
        elementwise("rsqrt", 1, torch.rsqrt),
        elementwise("tanh", 1, torch.tanh),
        elementwise("sin", 1, torch.sin),
        elementwise("cos", 1, torch.cos),
        elementwise("sigmoid", 1, torch.sigmoid),
        elementwise("abs", 1, torch.abs),
        elementwise("relu", 1, torch.relu),
        elementwise("gelu", 1, _gelu_erf),
        elementwise("gelu_tanh", 1, _gelu_tanh),
        elementwise("silu", 1, torch.nn.functional.silu),
        elementwise("square", 1, torch.square),
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
    "cast": OpDef("cast", 1, "elementwise", lambda x, dtype: x.to(DTYPES[dtype][0]), takes_attr=True,
                  width_rule="same"),
    # a constant has every column equal: either half of it is the constant itself
    "pair": OpDef("pair", 1, "structural", lambda x, which: x[..., which::2], takes_attr=True, width_rule="half",
                  folder=lambda _attr, values: values[0], parts=lambda which: ((0, which), (0, which))),
    "interleave": OpDef("interleave", 2, "structural", lambda a, b: torch.stack([a, b], dim=-1).flatten(-2),
                        width_rule="double", folder=_interleave_constants, parts=lambda _attr: ((0, 0), (1, 0))),
    "reduce": OpDef("reduce", 1, "reduction"),
    "finish": OpDef("finish", 1, "reduction"),
    **{leaf: OpDef(leaf, 0, "leaf") for leaf in ("acc", "load", "source", "scalar", "const", "const_param",
                                                   "reduced")},
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


REDUCTIONS: dict[str, ReduceDef] = {
    r.name: r
    for r in [
        ReduceDef("sum", lambda x, dims: x.sum(dim=dims)),
        ReduceDef("max", lambda x, dims: x.amax(dim=dims), empty_defined=False),
        ReduceDef("min", lambda x, dims: x.amin(dim=dims), empty_defined=False),
        ReduceDef("amax", lambda x, dims: x.abs().amax(dim=dims), empty_defined=False),
        ReduceDef("logsumexp", lambda x, dims: torch.logsumexp(x, dim=dims), axes=("n",)),
        ReduceDef("take", _take, axes=("n",), indexed=True),  # x at column index[m] of each row m
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
    """Op `op` applied to constants (see OpDef.evaluate); raises FoldError where no constant results."""
    return NODE_OPS[op].evaluate(attr, values)


def to_fp32(v: float) -> float:
    """v rounded to the nearest fp32 value (1e40 is inf in fp32)."""
    return float(torch.tensor(v, dtype=torch.float32).item())
