"""Tracing: a plain Python function runs once on stand-in values; operator overloading records the IR.

Everything a user can get wrong while writing an epilogue raises EpilogueError naming their
function and line, with the fix.
"""
from __future__ import annotations

import builtins
import dis
import inspect
import itertools
import linecache
import numbers
import os
import re
import sys
from typing import Any, Callable

from ..errors import EpilogueError
from ..ir import graph as ir
from ..ir.ops import DTYPE_SPELLINGS, REDUCTIONS, dtype_name, op_def

_DSL_DIR = os.path.dirname(os.path.abspath(__file__))  # frames in here are the tracer, not the user


def _user_frame():
    """The innermost stack frame outside the DSL package and outside numpy and torch, whose functions call
    a traced value's methods (np.clip(x) calls x.clip): the user's line, or None."""
    f = sys._getframe(1)
    while f is not None and (os.path.abspath(f.f_code.co_filename).startswith(_DSL_DIR + os.sep)
                             or f.f_globals.get("__name__", "").partition(".")[0] in ("numpy", "torch")):
        f = f.f_back
    return f


def user_location() -> str:
    """'file.py:line' of the user's line."""
    f = _user_frame()
    if f is None:
        return "<unknown>"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


# math/numpy/torch functions whose cd. counterpart has another name
_CD_NAMES = {"fabs": "abs", "absolute": "abs", "fmax": "maximum", "fmin": "minimum", "clamp_min": "maximum",
             "clamp_max": "minimum", "clip": "clamp", "float32": "cast", "float16": "cast", "bfloat16": "cast"}


def _cd_fix(name: str) -> str:
    """The fix for a math/numpy/torch function or method `name` on a traced value: its cd. function (with
    its required arguments), where coda_dsl has one."""
    from . import ops
    name = _CD_NAMES.get(name, name)
    if name in ops.__all__:  # each is cd.<name> too
        fn = getattr(ops, name)
        required = [p.name for p in inspect.signature(fn).parameters.values() if p.default is p.empty]
        return f"use cd.{name}({', '.join(required)})"
    return "use the cd. functions and operators (listed in help(coda_dsl))"


def foreign_function(qualname: str) -> EpilogueError:
    """The error for math.exp(x), np.exp(x), torch.exp(x) and the like on a traced value: they compute
    once on numbers while tracing, and cannot record anything."""
    return fail(f"{qualname}() cannot take a traced value: only coda_dsl's functions record epilogue math",
                _cd_fix(qualname.rpartition(".")[2]))


def _foreign(obj) -> str | None:
    """'math.exp' for a function of math, numpy or torch (np.exp: 'np.exp'), else None."""
    module = (getattr(obj, "__module__", None) or "").partition(".")[0]
    if module in ("math", "numpy", "torch") and hasattr(obj, "__name__"):
        return f"{'np' if module == 'numpy' else module}.{obj.__name__}"
    return None


def _called_function() -> str | None:
    """'math.exp' (or 'np.where', 'torch.tensor') when the user's line is calling that function of math,
    numpy or torch: the call in progress (Python >= 3.11, _callee), else the line's first math.X(...); None
    otherwise."""
    f = _user_frame()
    if f is None:
        return None
    if sys.version_info >= (3, 11) and (name := _callee(f)):
        return name
    m = re.search(r"\bmath\.(\w+)\s*\(", linecache.getline(f.f_code.co_filename, f.f_lineno))
    return f"math.{m.group(1)}" if m else None


def _callee(f) -> str | None:
    """The math/numpy/torch function the frame's current call calls, from its bytecode (source or not: stdin,
    exec): the names loaded first within the call's own span, through module attributes (`math.exp` of
    math.exp(cd.relu(x)), `torch.nn.functional.gelu`), not an earlier call of the line."""
    first, last, col, end = next(itertools.islice(f.f_code.co_positions(), f.f_lasti // 2, None), (None,) * 4)
    if col is None or first != last:  # (a call over several lines: the line's text decides)
        return None
    span = [i for i in dis.get_instructions(f.f_code)
            if i.offset <= f.f_lasti and i.positions.lineno == first and i.positions.col_offset is not None
            and col <= i.positions.col_offset and i.positions.end_col_offset <= end]
    if not span or span[0].opname not in _NAME_LOADS:
        return None
    name = span[0].argval
    obj = f.f_locals.get(name, f.f_globals.get(name, getattr(builtins, name, None)))
    for i in span[1:]:
        if i.opname not in ("LOAD_ATTR", "LOAD_METHOD") or not inspect.ismodule(obj):
            break
        obj = getattr(obj, i.argval, None)
    return _foreign(obj)


_NAME_LOADS = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF")


class _Tracer:
    """The trace in progress: which function, and where each node was written."""

    current: "_Tracer | None" = None

    def __init__(self, fn_name: str):
        self.fn_name = fn_name
        self.locations: dict[int, str] = {}

    def record(self, node: ir.Node) -> None:
        self.locations.setdefault(id(node), user_location())


def fail(message: str, fix: str = "") -> EpilogueError:
    t = _Tracer.current
    where = f"in epilogue '{t.fn_name}' at {user_location()}: " if t else f"at {user_location()}: "
    return EpilogueError(where + message + (f"\n  fix: {fix}" if fix else ""))


def _refused(symbol: str, fix: str) -> Callable:
    """A Python operator an epilogue cannot express: tracing it is an EpilogueError with `fix`."""
    def refuse(self, *args):
        raise fail(f"{symbol} of a traced value is not supported", fix)
    return refuse


class Value:
    """A traced [M, N] (or reduced) value. Supports the arithmetic of ir/ops.py."""

    __slots__ = ("node",)
    __array_priority__ = 1000  # so torch/numpy scalars on the left defer to us

    def __init__(self, node: ir.Node):
        self.node = node
        if _Tracer.current is not None:
            _Tracer.current.record(node)

    # arithmetic -------------------------------------------------------------
    def __add__(self, o): return apply("add", self, o)
    def __radd__(self, o): return apply("add", o, self)
    def __sub__(self, o): return apply("sub", self, o)
    def __rsub__(self, o): return apply("sub", o, self)
    def __mul__(self, o): return apply("mul", self, o)
    def __rmul__(self, o): return apply("mul", o, self)
    def __truediv__(self, o): return apply("div", self, o)
    def __rtruediv__(self, o): return apply("div", o, self)
    def __neg__(self): return apply("neg", self)
    def __pos__(self): return self
    def __abs__(self): return apply("abs", self)
    def __lt__(self, o): return apply("lt", self, o)
    def __le__(self, o): return apply("le", self, o)
    def __gt__(self, o): return apply("gt", self, o)
    def __ge__(self, o): return apply("ge", self, o)
    def __eq__(self, o): return apply("eq", self, o)  # type: ignore[override]
    def __ne__(self, o): return apply("ne", self, o)  # type: ignore[override]

    def __pow__(self, p, modulo=None):
        if modulo is not None:
            raise fail("pow(x, p, m) is not supported (a modulus)", "x ** p, with p an integer up to 8 in magnitude")
        if isinstance(p, Value):
            raise fail("x ** p takes a Python number p (it picks multiplications, sqrt or rsqrt while tracing), "
                       "not a traced value, cd.Scalar or cd.Const", "for x > 0: cd.exp(p * cd.log(x))")
        if not isinstance(p, numbers.Real):  # a 0-d numpy/torch number (anything else: lift explains)
            p = lift(p).attr
        if p == 0.5:
            return apply("sqrt", self)
        if p == -0.5:
            return apply("rsqrt", self)
        if p == 0:  # as torch.pow: 1, NaN included
            return Value(ir.const(1.0))
        if -8 <= p <= 8 and p == int(p):  # x**3 = x*x*x, as torch.pow (inf, nan and huge p fail the bounds)
            n, y, x = int(abs(p)), None, self
            while n:  # by squaring: x**8 is three multiplications
                if n & 1:
                    y = x if y is None else y * x
                n >>= 1
                if n:
                    x = apply("square", x)
            return y if p > 0 else 1.0 / y  # (half the rounding error of (1/x)**n; 0 where x**n overflows)
        shown = repr(p) if len(repr(p)) <= 24 else repr(p)[:20] + "..."
        raise fail(f"x ** {shown} is not supported (integers up to 8 in magnitude, 0.5 and -0.5 are)",
                   "for x > 0: cd.exp(p * cd.log(x)); for any x and an odd integer p: cd.where(x < 0, -1.0, 1.0) * "
                   "cd.exp(p * cd.log(cd.abs(x)))")

    def __rpow__(self, base):
        raise fail(f"{base!r} ** x is not supported", "use cd.exp(x * math.log(base)) (math.log of the number)")

    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __divmod__ = _refused(
        "//, % or divmod", "write it with cd.where and the ops coda_dsl has (see help(coda_dsl))")
    __matmul__ = __rmatmul__ = _refused(
        "@", "an epilogue is elementwise over the GEMM's output: the GEMM itself is cd.gemm(A, B)")
    __getitem__ = _refused(
        "indexing", "a traced value is one element of [M, N]: g, u = cd.pairs(x) takes adjacent column pairs, "
        "cd.VecN / cd.VecM operands give per-column / per-row values")
    def __round__(self, ndigits=None):
        if ndigits is not None:
            raise fail(f"round(x, {ndigits!r}) is not supported", "scale, cd.round, scale back")
        return apply("round", self)

    def __floor__(self):
        return apply("floor", self)

    def __ceil__(self):
        return apply("ceil", self)

    def __trunc__(self):
        return apply("where", self < 0.0, apply("ceil", self), apply("floor", self))
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __invert__ = _refused(
        "&, |, ^ or ~", "combine conditions with cd.where(c1, c2, False) / cd.where(c1, True, c2)")
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = _refused(
        "<< or >>", "values are fp32: scale by a power of two, x * 2.0 ** k")

    __hash__ = object.__hash__

    # what a traced value cannot do ----------------------------------------
    def __bool__(self):
        raise fail(
            "a traced value has no truth value: Python `if`, `and`, `or`, `not` and bool() run once while "
            "tracing, not per element",
            "use cd.where(cond, a, b) for per-element choices (and cd.maximum/cd.minimum for clamps)",
        )

    def _number(self, what: str):
        called = _called_function()  # math.exp(x) lands here: math converts its argument to a float
        if called:
            raise foreign_function(called)
        raise fail(f"{what}: its value exists only on the GPU", "keep it as a traced value")

    def __float__(self):
        self._number("float() of a traced value")

    def __complex__(self):
        self._number("complex() of a traced value")

    def __format__(self, spec):  # f"{x:.2f}": a Python string made once while tracing
        raise fail("a traced value cannot be formatted (f-string, format()): it has no value while tracing",
                   "format the operands or the results outside the epilogue")

    def __int__(self):
        self._number("int() of a traced value")

    def __index__(self):  # range(x), a list indexed by x, ...
        self._number("a traced value used as an integer (an index or a size)")

    def __iter__(self):
        raise fail("a traced value is not iterable",
                   "write the math per element; g, u = cd.pairs(x) splits adjacent column pairs")

    def __contains__(self, _):  # `v in x` would otherwise iterate
        self.__iter__()

    def __len__(self):  # torch.tensor(x), np.asarray(x), ... probe it
        called = _called_function()
        if called:
            raise foreign_function(called)
        raise fail("a traced value has no length: it stands for one element of the tile", "write the math per element")

    def __array__(self, *args, **kwargs):  # np.where(x > 0, x, 0), np.float32(x), ...
        raise foreign_function(_called_function() or "numpy")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """torch.exp(x) on a traced value: a clear error. Tensor operators (tensor * x) return
        NotImplemented, so that Python calls our reflected operator (a 0-d tensor is a number)."""
        name = getattr(func, "__name__", str(func))
        if name.startswith("__"):
            return NotImplemented
        module = getattr(func, "__module__", None) or ""  # F.gelu: torch._C._nn, F.silu: torch.nn.functional
        raise foreign_function(f"{'torch.nn.functional' if 'nn' in module else 'torch'}.{name}")

    # numpy ufuncs that are Python's operators (numpy scalar * x): (our method, its reflection)
    _UFUNC_METHODS = {"add": ("__add__", "__radd__"), "subtract": ("__sub__", "__rsub__"),
                      "multiply": ("__mul__", "__rmul__"), "divide": ("__truediv__", "__rtruediv__"),
                      "less": ("__lt__", "__gt__"), "less_equal": ("__le__", "__ge__"),
                      "greater": ("__gt__", "__lt__"), "greater_equal": ("__ge__", "__le__"),
                      "equal": ("__eq__", "__eq__"), "not_equal": ("__ne__", "__ne__")}

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """numpy scalar * x records a multiply, as 2.0 * x does; np.exp(x) is a clear error."""
        methods = self._UFUNC_METHODS.get(ufunc.__name__)
        if methods and method == "__call__" and not kwargs and len(inputs) == 2:
            a, b = inputs
            return getattr(a, methods[0])(b) if isinstance(a, Value) else getattr(b, methods[1])(a)
        raise foreign_function(f"np.{ufunc.__name__}")

    def __getattr__(self, name):
        if name.startswith("__"):  # protocol probes (numpy, torch, copy) must see a plain AttributeError
            raise AttributeError(name)
        raise fail(f"traced values have no attribute or method '{name}'", _cd_fix(name))

    def __repr__(self) -> str:
        return f"<traced {self.node.op}>"


class Reduction(Value):
    """The result of cd.sum/max/min/amax: an output, never an input of the same tile's math."""

    __slots__ = ()

    def _misuse(self, *_):
        raise fail(
            "a reduction's result cannot be used in the same epilogue's elementwise math: a statistic over n "
            "(or m) is complete only after every tile of the row (column) has finished, which is after this "
            "tile's epilogue has run",
            "a function of the statistic alone finishes it: cd.sum(x).then(cd.log) (log-sum-exp: cd.logsumexp); "
            "else return the reduction as an output and apply it in the NEXT GEMM's epilogue (e.g. as a cd.VecM "
            "operand: the reparameterization of the CODA paper)",
        )

    def then(self, fn: Callable) -> "Reduction":
        """A finishing expression on the complete statistic, run after the GEMM in one small kernel:
        cd.sum(h * h, axis="n").then(lambda s: cd.rsqrt(s * inv_n + eps)). It may use scalars and
        constants, not [M, N] values or other reductions."""
        if self.node.op == "finish":
            raise fail(".then() was already applied to this reduction", "compose both steps in one function")
        if not callable(fn):
            raise fail(f".then() takes a function of the statistic, not {fn!r}",
                       "e.g. .then(lambda s: cd.rsqrt(s * inv_n + eps))")
        try:
            inspect.signature(fn).bind(None)
        except TypeError as e:
            raise fail(f".then() calls its function with the statistic alone: {e}",
                       "pass a function of one argument, e.g. .then(lambda s: cd.rsqrt(s * inv_n + eps))") from None
        except ValueError:  # a builtin without a signature: let the call say
            pass
        node = lift(fn(Value(ir.reduced())))
        bad = [n.op for n in ir.topo_order([node]) if _per_element(n.op)]
        if bad:
            what = {"acc": "the accumulator", "load": "an operand", "prior_d": "D's prior value",
                    "reduce": "a reduction", "pair": "cd.pairs"}.get(bad[0], f"cd.{bad[0]}")
            raise fail(f"a finishing expression sees only the statistic, scalars and constants, but it uses {what}",
                       "move that math into the epilogue body (before the reduction) or the next GEMM")
        return Reduction(ir.finish(self.node, node))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _misuse
    __truediv__ = __rtruediv__ = __neg__ = __abs__ = __pow__ = _misuse
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _misuse  # type: ignore[assignment]
    __hash__ = object.__hash__


def _per_element(op: str) -> bool:
    """A node a finishing expression cannot hold: a tile's values (fetched, paired) or another reduction."""
    d = op_def(op)
    return op == "reduce" or d.kind == "structural" or d.leaf_value == "fetched"


def lift(x: Any) -> ir.Node:
    """A Value's node, or a const node for a Python number; anything else is a user error."""
    if isinstance(x, Reduction):
        x._misuse()
    if isinstance(x, Value):
        return x.node
    if isinstance(x, bool):
        return ir.const(1.0 if x else 0.0)
    if isinstance(x, (int, float)):
        return ir.const(_number(x))
    if type(x).__module__.startswith("torch") or type(x).__module__.startswith("numpy"):
        if getattr(x, "ndim", 1) == 0 or getattr(x, "shape", None) == ():
            if getattr(x, "requires_grad", False):  # a parameter baked in as a constant would never learn
                raise fail("a 0-d tensor that requires grad is captured from outside the epilogue: it would "
                           "become a constant (its value now), with no gradient and blind to later updates",
                           "declare it an operand (x: cd.Scalar) and pass the tensor (cd.linear learns it); "
                           "for a constant, capture float(x) or x.detach()")
            return ir.const(_number(x))
        raise fail(
            f"a {type(x).__name__} captured from outside the epilogue cannot be used in traced math",
            "declare it as an operand (x: cd.Tensor / cd.VecN / cd.VecM / cd.Scalar) and pass it to cd.gemm",
        )
    raise fail(f"cannot use a value of type {type(x).__name__} in an epilogue", "use traced values or numbers")


def _number(x) -> float:
    """A real number (a Python or 0-d numpy/torch one) as a float: complex values and integers beyond a
    float's range are refused, not truncated or raised as Python's own errors."""
    if "complex" in str(getattr(x, "dtype", "")):
        raise fail(f"{x!r} is complex: epilogue math is real (fp32)", "use its real part, x.real")
    try:
        return float(x)
    except OverflowError:
        raise fail("an integer beyond a float's range (fp32 holds up to ~3.4e38)",
                   "use float('inf') if that is meant") from None


def apply(op: str, *args: Any) -> Value:
    return Value(ir.compute(op, *(lift(a) for a in args)))


# ---------------------------------------------------------------------------------------------
# Tracing a function
# ---------------------------------------------------------------------------------------------
def trace(fn: Callable, params: tuple[ir.Param, ...], name: str, defined_at: str) -> ir.Program:
    tracer = _Tracer(name)
    prev, _Tracer.current = _Tracer.current, tracer
    try:
        args = [Value(ir.acc())]
        for p in params:
            if p.kind in ir.LOAD_KINDS:
                args.append(Value(ir.load(p.kind, p.name)))
            elif p.kind == "scalar":
                args.append(Value(ir.scalar(p.name)))
            else:
                args.append(Value(ir.const_param(p.name)))
        result = fn(*args)
        outputs = _outputs(result, name, defined_at)
    finally:
        _Tracer.current = prev
    program = ir.Program(name, params, outputs, defined_at, tracer.locations)
    declared = {(p.kind, p.name) for p in params}
    for node in ir.walk(program):  # a value kept from another epilogue's trace names that epilogue's operands
        if (used := ir.operand_of(node)) and used not in declared:
            raise EpilogueError(f"epilogue '{name}' ({defined_at}) uses operand '{used[1]}', which is not one of its "
                                "parameters: a value traced in another epilogue was kept and used here"
                                f"\n  fix: declare '{used[1]}' as a parameter of '{name}' and use that")
    return program


def _outputs(result: Any, name: str, defined_at: str) -> tuple[ir.Output, ...]:
    if isinstance(result, Value):
        result = {"D": result}
    if not isinstance(result, dict) or not result:
        raise EpilogueError(
            f"epilogue '{name}' ({defined_at}) must return a traced value (stored as D) or a non-empty dict "
            f"{{'D': ..., 'other': ...}}, got {type(result).__name__}\n  fix: "
            + ("name each output: return {'D': first, 'aux': second}" if isinstance(result, (tuple, list))
               else "return acc, or a value computed from it")
        )
    outs = []
    for key, v in result.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise EpilogueError(f"epilogue '{name}' ({defined_at}): output name {key!r} must be a Python identifier"
                                "\n  fix: a name such as 'D', 'aux' or 'row_sum' (the key of its result, and of out=)")
        if not isinstance(v, Value):
            raise EpilogueError(
                f"epilogue '{name}' ({defined_at}): output '{key}' is a {type(v).__name__}, not a traced value; "
                "an output must depend on the operands (a constant of the tile's shape: cd.where(acc == acc, c, "
                "c), which NaN and inf in acc do not reach)\n  fix: compute it from acc or an operand, or fold the "
                "constant into a later step"
            )
        node = v.node
        outs.append(ir.Output(key, node, node.attr if node.op == "cast" else None))  # reductions: fp32
    return tuple(outs)


def cast(x: Any, dtype) -> Value:
    try:
        name = dtype_name(dtype)
    except ValueError:
        raise fail(f"cd.cast to {dtype!r}: not a dtype an epilogue computes or stores",
                   f"cast to {DTYPE_SPELLINGS}") from None
    return Value(ir.cast(lift(x), name))


def index_operand(index: Any, api: str) -> ir.Node:
    """The load of the cd.VecM operand `index` that `api` (cd.take, cd.onehot) reads as column indices."""
    idx = lift(index)
    if idx.op != "load" or idx.attr[0] != "vec_m":
        raise fail(f"{api} needs a cd.VecM operand of int64 column indices (one per row)",
                   "declare it `target: cd.VecM` and pass a torch.int64 tensor of shape [M]")
    return idx


def reduce(kind: str, x: Any, axis, index: Any = None) -> Reduction:
    if isinstance(axis, Value):  # cd.max(a, b): the elementwise maximum was meant
        elementwise = {"max": "cd.maximum(a, b)", "min": "cd.minimum(a, b)", "sum": "a + b"}.get(
            kind, "cd.maximum, cd.minimum or the operators")
        raise fail(f"cd.{kind}(x, axis) reduces x over an output axis; its second argument is the axis "
                   '("n", "m" or None), not a traced value',
                   f"pass the axis as a Python string (a cd.Const is a number); for the elementwise "
                   f"result of two values use {elementwise}")
    if axis not in ir.REDUCE_AXES:
        elementwise = {"max": "; cd.maximum(x, y) for the larger of two values",
                       "min": "; cd.minimum(x, y) for the smaller of two values"}.get(kind, "")
        raise fail(f"axis={axis!r} is not an output axis", 'use axis="n" (per row, result [M]), '
                   'axis="m" (per column, result [N]) or axis=None (whole tensor)' + elementwise)
    definition = REDUCTIONS[kind]
    if axis not in definition.axes:
        raise fail(f"cd.{kind} works over axis='n' (per row), not {axis!r}")
    idx = index_operand(index, f"cd.{kind}") if definition.indexed else None
    node = lift(x)
    if any(n.op == "reduced" for n in ir.topo_order([node])):
        raise fail(f"cd.{kind} inside .then(): a finishing expression maps each finished statistic (one number per "
                   "row, column or the whole tensor) to another, and cannot reduce again",
                   "return the statistic as an output and reduce it in a later step")
    return Reduction(ir.reduce(kind, axis, node, idx))


def signature_params(fn: Callable, reserved: set[str]) -> tuple[str, tuple[ir.Param, ...]]:
    """Read operand kinds from the annotations; returns ("file.py:line" of the def, params after acc)."""
    from . import types  # the annotation classes

    code = fn.__code__
    defined_at = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"
    sig = inspect.signature(fn)
    try:
        ann = inspect.get_annotations(fn, eval_str=True)
    except Exception:
        ann = dict(getattr(fn, "__annotations__", {}))
    names = list(sig.parameters)
    if not names:
        raise EpilogueError(f"epilogue '{fn.__name__}' ({defined_at}) needs at least the accumulator parameter"
                            f"\n  fix: def {fn.__name__}(acc, ...)")
    first = names[0]
    if kind := types.kind_of(ann.get(first, inspect.Parameter.empty)):  # an operand kind where acc goes
        annotation = types.annotation_of(kind)
        raise EpilogueError(f"epilogue '{fn.__name__}' ({defined_at}): the first parameter, '{first}', is the "
                            f"accumulator A @ B^T, but it is annotated as an operand ({annotation})\n  fix: put the "
                            f"accumulator first, unannotated (or cd.Acc): def {fn.__name__}(acc, "
                            f"{first if first != 'acc' else 'x'}: {annotation}, ...)")
    params = []
    for pname in names[1:]:
        p = sig.parameters[pname]
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise EpilogueError(f"epilogue '{fn.__name__}' ({defined_at}): *args/**kwargs are not supported "
                                f"('{pname}'): each operand is a named, annotated parameter\n  fix: list the operands, "
                                f"e.g. def {fn.__name__}(acc, bias: cd.VecN, scale: cd.Scalar)")
        if p.kind == p.KEYWORD_ONLY:
            raise EpilogueError(f"epilogue '{fn.__name__}' ({defined_at}): keyword-only parameter '{pname}' "
                                f"is not supported\n  fix: list it before the '*', as an ordinary parameter")
        if p.default is not p.empty:
            raise EpilogueError(f"epilogue '{fn.__name__}' ({defined_at}): parameter '{pname}' has a default "
                                f"value, which a call would not use (every operand is passed to cd.gemm)\n  fix: "
                                f"remove the default, or make it a constant in the body")
        kind = types.kind_of(ann.get(pname, inspect.Parameter.empty))
        if kind is None:
            got = ann.get(pname, None)
            raise EpilogueError(
                f"epilogue '{fn.__name__}' ({defined_at}): parameter '{pname}' "
                + ("has no annotation" if got is None else f"has annotation {got!r}, which is not an operand kind")
                + f"\n  fix: annotate it, e.g. `{pname}: cd.Tensor` ([M, N]), cd.VecN (one value per column n), "
                "cd.VecM (one per row m), cd.Scalar (runtime number) or cd.Const (compile-time number)"
            )
        if pname in reserved:
            raise EpilogueError(f"epilogue '{fn.__name__}' ({defined_at}): parameter name '{pname}' is reserved by "
                                f"cd.gemm ({', '.join(sorted(reserved))})\n  fix: rename it")
        if pname == "acc":  # the IR, explain and derived backwards (their output acc) name the accumulator so
            raise EpilogueError(f"epilogue '{fn.__name__}' ({defined_at}): an operand named 'acc' would read as the "
                                f"accumulator (the first parameter, '{first}', is it)\n  fix: rename the operand")
        params.append(ir.Param(pname, kind))
    return defined_at, tuple(params)
