"""Tracing: every op reachable from the DSL, operand kinds, hash-consing, and every user error
(EpilogueError naming the epilogue, the user's own file:line, and a fix)."""
import functools
import inspect
import math
from math import exp
import os
import pydoc
import re
import sys

import numpy as np
import pytest
import torch

import coda_dsl as cd
from coda_dsl import EpilogueError
from coda_dsl.ir import graph as ir
from coda_dsl.ir.ops import OPS

HERE = os.path.basename(__file__)


def loc(fn, marker="# <-"):
    """'test_dsl.py:<line>' of the line of `fn` carrying `marker` (or of its def when marker is None)."""
    lines, first = inspect.getsourcelines(fn)
    if marker is None:
        return f"{HERE}:{fn.__code__.co_firstlineno}"
    hits = [first + i for i, text in enumerate(lines) if marker in text]
    assert len(hits) == 1, f"marker {marker!r} must be on exactly one line of {fn.__name__}"
    return f"{HERE}:{hits[0]}"


def D(ep):
    return ep.program.output("D").node


X, Y, Z = ir.load("tensor", "x"), ir.load("vec_n", "y"), ir.load("vec_m", "z")
ACC = ir.acc()

# op name -> (DSL spelling over traced x (Tensor), y (VecN), z (VecM), expected inputs)
SPELLINGS = {
    "add": (lambda x, y, z: x + y, (X, Y)),
    "sub": (lambda x, y, z: x - y, (X, Y)),
    "mul": (lambda x, y, z: x * y, (X, Y)),
    "div": (lambda x, y, z: x / y, (X, Y)),
    "neg": (lambda x, y, z: -x, (X,)),
    "maximum": (lambda x, y, z: cd.maximum(x, y), (X, Y)),
    "minimum": (lambda x, y, z: cd.minimum(x, y), (X, Y)),
    "lt": (lambda x, y, z: x < y, (X, Y)),
    "le": (lambda x, y, z: x <= y, (X, Y)),
    "gt": (lambda x, y, z: x > y, (X, Y)),
    "ge": (lambda x, y, z: x >= y, (X, Y)),
    "eq": (lambda x, y, z: x == y, (X, Y)),
    "ne": (lambda x, y, z: x != y, (X, Y)),
    "where": (lambda x, y, z: cd.where(x, y, z), (X, Y, Z)),
    "exp": (lambda x, y, z: cd.exp(x), (X,)),
    "log": (lambda x, y, z: cd.log(x), (X,)),
    "sqrt": (lambda x, y, z: cd.sqrt(x), (X,)),
    "rsqrt": (lambda x, y, z: cd.rsqrt(x), (X,)),
    "tanh": (lambda x, y, z: cd.tanh(x), (X,)),
    "sin": (lambda x, y, z: cd.sin(x), (X,)),
    "cos": (lambda x, y, z: cd.cos(x), (X,)),
    "sigmoid": (lambda x, y, z: cd.sigmoid(x), (X,)),
    "abs": (lambda x, y, z: cd.abs(x), (X,)),
    "relu": (lambda x, y, z: cd.relu(x), (X,)),
    "gelu": (lambda x, y, z: cd.gelu(x), (X,)),
    "gelu_tanh": (lambda x, y, z: cd.gelu(x, approximate="tanh"), (X,)),
    "silu": (lambda x, y, z: cd.silu(x), (X,)),
    "square": (lambda x, y, z: x ** 2, (X,)),
    "erf": (lambda x, y, z: cd.erf(x), (X,)),
    "round": (lambda x, y, z: cd.round(x), (X,)),
    "floor": (lambda x, y, z: cd.floor(x), (X,)),
    "ceil": (lambda x, y, z: cd.ceil(x), (X,)),
}


def _trace_with(spell):
    def fn(acc, x: cd.Tensor, y: cd.VecN, z: cd.VecM):
        return spell(x, y, z)
    return cd.epilogue(fn)


def test_every_op_has_a_dsl_spelling():
    assert set(SPELLINGS) == set(OPS), "an op of ir/ops.py is not reachable from the DSL (or was removed)"


@pytest.mark.parametrize("op", sorted(SPELLINGS))
def test_op_traces_to_its_node(op):
    spell, inputs = SPELLINGS[op]
    node = D(_trace_with(spell))
    assert node.op == op
    assert node.inputs == inputs
    assert len(inputs) == OPS[op].arity


@pytest.mark.parametrize("spell, op, inputs", [
    (lambda x: abs(x), "abs", (X,)),  # builtin abs()
    (lambda x: x ** 0.5, "sqrt", (X,)),
    (lambda x: x ** -0.5, "rsqrt", (X,)),
    (lambda x: x ** 2.0, "square", (X,)),
    (lambda x: +x, "load", ()),
    (lambda x: round(x), "round", (X,)),
    (lambda x: math.floor(x), "floor", (X,)),
    (lambda x: math.ceil(x), "ceil", (X,)),
])
def test_operator_aliases(spell, op, inputs):
    node = D(_trace_with(lambda x, y, z: spell(x)))
    assert node.op == op and node.inputs == inputs


@pytest.mark.parametrize("dtype, name", [(cd.bfloat16, "bf16"), (torch.float16, "fp16"), (cd.float32, "fp32"),
                                         ("bf16", "bf16"), ("float32", "fp32"), ("torch.bfloat16", "bf16")])
def test_cast(dtype, name):
    ep = _trace_with(lambda x, y, z: cd.cast(x, dtype))
    node = D(ep)
    assert (node.op, node.attr, node.inputs) == ("cast", name, (X,))
    assert ep.program.output("D").dtype == name  # an output that is a cast is stored in that dtype


@pytest.mark.parametrize("spell, op, args", [
    (lambda x: 2 + x, "add", (2.0, X)),
    (lambda x: 2 - x, "sub", (2.0, X)),
    (lambda x: 3 * x, "mul", (3.0, X)),
    (lambda x: 1 / x, "div", (1.0, X)),
    (lambda x: x - 0.5, "sub", (X, 0.5)),
    (lambda x: x / 4, "div", (X, 4.0)),
    (lambda x: 1 < x, "gt", (X, 1.0)),  # Python reflects 1 < x into x > 1
    (lambda x: 1 >= x, "le", (X, 1.0)),
    (lambda x: True * x, "mul", (1.0, X)),
    (lambda x: torch.tensor(2.5) * x, "mul", (2.5, X)),  # a 0-d tensor is a number (torch defers to us)
    (lambda x: np.float32(2.5) * x, "mul", (2.5, X)),  # so is a numpy scalar (numpy defers to us)
    (lambda x: np.float64(0.5) < x, "gt", (X, 0.5)),
    (lambda x: np.float32(2.0) - x, "sub", (2.0, X)),
    (lambda x: cd.where(x > 0, x, float("-inf")), "where", None),
])
def test_python_numbers_on_either_side(spell, op, args):
    node = D(_trace_with(lambda x, y, z: spell(x)))
    assert node.op == op
    if args is None:
        assert node.inputs[2] is ir.const(float("-inf"))
        return
    expected = tuple(a if isinstance(a, ir.Node) else ir.const(a) for a in args)
    assert node.inputs == expected


def test_operand_kinds_become_leaves():
    @cd.epilogue
    def kinds(acc, t: cd.Tensor, n: cd.VecN, m: cd.VecM, s: cd.Scalar, c: cd.Const):
        return acc + t + n + m + s + c

    assert [(p.name, p.kind) for p in kinds.params] == [
        ("t", "tensor"), ("n", "vec_n"), ("m", "vec_m"), ("s", "scalar"), ("c", "const")]
    leaves = {n for n in ir.walk(kinds.program) if n.is_leaf}
    assert leaves == {ir.acc(), ir.load("tensor", "t"), ir.load("vec_n", "n"), ir.load("vec_m", "m"),
                      ir.scalar("s"), ir.const_param("c")}
    assert kinds.output_names == ("D",)


def test_acc_annotation_is_optional():
    @cd.epilogue
    def annotated(acc: cd.Acc, b: cd.VecN):
        return acc + b

    assert D(annotated) is ir.compute("add", ACC, ir.load("vec_n", "b"))


def test_hash_consing_same_subexpression_is_one_node():
    @cd.epilogue
    def twice(acc, b: cd.VecN, s: cd.VecM):
        return {"D": cd.gelu(acc * s + b), "other": cd.exp(acc * s + b)}  # acc * s + b written twice

    d, other = D(twice), twice.program.output("other").node
    assert d.inputs[0] is other.inputs[0]
    ops = [n.op for n in ir.walk(twice.program)]
    assert ops.count("add") == 1 and ops.count("mul") == 1
    # constants are consed by value, and -0.0 stays apart from 0.0
    assert ir.const(2) is ir.const(2.0)
    assert ir.const(-0.0) is not ir.const(0.0)


def test_outputs_and_dtypes():
    @cd.epilogue
    def multi(acc, b: cd.VecN):
        h = acc + b
        return {"D": h, "h16": cd.cast(h, cd.float16), "s": cd.sum(h, axis="n"), "mx": cd.amax(h, axis=None)}

    assert multi.output_names == ("D", "h16", "s", "mx")
    dt = {o.name: o.dtype for o in multi.program.outputs}
    assert dt == {"D": None, "h16": "fp16", "s": "fp32", "mx": "fp32"}
    s = multi.program.output("s").node
    assert (s.op, s.attr) == ("reduce", ("sum", "n"))
    assert multi.program.output("mx").node.attr == ("amax", None)


def test_bare_value_return_is_d():
    ep = cd.epilogue(lambda acc: acc * 2)
    assert ep.output_names == ("D",)
    assert D(ep) is ir.compute("mul", ACC, ir.const(2.0))


def test_string_annotations_resolve():
    src = ("from __future__ import annotations\n"
           "import coda_dsl as cd\n"
           "def strs(acc, b: cd.VecN, m: 'cd.VecM', s: cd.Scalar, c: cd.Const, t: cd.Tensor):\n"
           "    return acc * s + b + m + c + t\n")
    ns: dict = {}
    exec(compile(src, "user_epilogue.py", "exec"), ns)
    ep = cd.epilogue(ns["strs"])
    assert [(p.name, p.kind) for p in ep.params] == [
        ("b", "vec_n"), ("m", "vec_m"), ("s", "scalar"), ("c", "const"), ("t", "tensor")]
    # unresolvable at definition (cd is not a global there): the spelled class name still resolves
    ns2: dict = {}
    src2 = src.replace("import coda_dsl as cd\n", "").replace("'cd.VecM'", "cd.VecM")
    exec(compile(src2, "user_epilogue2.py", "exec"), ns2)
    assert [p.kind for p in cd.epilogue(ns2["strs"]).params] == ["vec_n", "vec_m", "scalar", "const", "tensor"]


def test_epilogue_is_not_called_directly():
    @cd.epilogue
    def direct(acc, b: cd.VecN):
        return acc + b
    with pytest.raises(TypeError, match=r"cd\.gemm\(A, B, direct, b=\.\.\.\)"):
        direct(1, 2)


def test_named_epilogue():
    ep = cd.epilogue(lambda acc: acc, name="my_name")
    assert ep.name == "my_name" and "my_name" in repr(ep)


@cd.epilogue_factory
def _scaled_by(c: float):
    return cd.epilogue(lambda acc: acc * c, name="scaled")


def test_epilogues_copy_and_pickle_by_reference():
    """An epilogue is immutable: copies of a model holding one share it (EMA copies, torch.save of a module);
    pickled by its importable name, or by the factory call that made it, as functions are."""
    import copy
    import pickle
    from coda_dsl.examples import bias_gelu
    model = torch.nn.Linear(2, 2)
    model.ep, model.made = bias_gelu, _scaled_by(3.0)
    for ep in (bias_gelu, cd.identity, model.made):
        assert copy.copy(ep) is ep and copy.deepcopy(ep) is ep and pickle.loads(pickle.dumps(ep)) is ep
    again = pickle.loads(pickle.dumps(copy.deepcopy(model)))
    assert again.ep is bias_gelu and again.made is _scaled_by(3.0)
    node = bias_gelu.program.outputs[0].node
    assert copy.deepcopy(node) is node and pickle.loads(pickle.dumps(node)) is node  # interned
    local = cd.epilogue(lambda acc: acc, name="local")
    with pytest.raises(TypeError, match="cannot be pickled.*\n  fix: define it at the top level"):
        pickle.dumps(local)


# ---------------------------------------------------------------------------------------------
# Errors inside the function body: message names the epilogue and the user's line, with a fix
# ---------------------------------------------------------------------------------------------
CAPTURED = torch.randn(8)


def e_if(acc):
    if acc > 0:  # <-
        return acc
    return -acc


def e_bool(acc):
    return bool(acc)  # <-


def e_and(acc, b: cd.VecN):
    return acc and b  # <-


def e_not(acc):
    return acc * 0 + (not acc)  # <-


def e_float(acc):
    return acc * float(acc)  # <-


def e_int(acc):
    return acc * int(acc)  # <-


def e_attr(acc):
    return acc.foo()  # <-


def e_method(acc):
    return acc.exp()  # <-


def e_captured_right(acc):
    return acc + CAPTURED  # <-


def e_captured_left(acc):
    return CAPTURED * acc  # <-


def e_captured_in_fn(acc):
    return cd.maximum(acc, CAPTURED)  # <-


LEARNT = torch.nn.Parameter(torch.tensor(2.0))


def e_captured_parameter(acc):
    return acc * LEARNT  # <-


def e_format(acc):
    return acc * float(f"{acc:.2f}")  # <-


def e_complex(acc):
    return acc * complex(acc).real  # <-


def e_reduction_in_math(acc):
    s = cd.sum(acc, axis="n")
    return acc / s  # <-


def e_reduction_in_fn(acc):
    return cd.exp(cd.max(acc, axis="m"))  # <-


def e_reduction_of_reduction(acc):
    return {"D": acc, "s": cd.sum(cd.sum(acc, axis="n"), axis=None)}  # <-


def e_reduction_compare(acc):
    return cd.where(acc > cd.amax(acc, axis="n") * 0.5, acc, 0.0)  # <-


def e_bad_axis(acc):
    return {"D": acc, "s": cd.sum(acc, axis="k")}  # <-


def e_axis_int(acc):
    return {"D": acc, "s": cd.min(acc, axis=1)}  # <-


def e_gelu(acc):
    return cd.gelu(acc, approximate="bad")  # <-


def e_cast_int(acc):
    return cd.cast(acc, torch.int8)  # <-


def e_cast_str(acc):
    return cd.cast(acc, "fp8")  # <-


def e_pow(acc):
    return acc ** 1.5  # <-


def e_iter(acc):
    g, u = acc  # <-
    return g * u


def e_string(acc):
    return acc + "1"  # <-


def e_contains(acc):
    return cd.where(1.0 in acc, acc, 0.0)  # <-


def e_gelu_traced_form(acc, form: cd.Const):
    return cd.gelu(acc, approximate=form)  # <-


def e_axis_const(acc, axis: cd.Const):
    return {"D": acc, "s": cd.sum(acc, axis=axis)}  # <-


def e_then_interleave(acc):
    return {"D": acc, "s": cd.sum(acc, axis="n").then(lambda s: cd.interleave(s, 1.0))}  # <-


def e_then_pairs(acc):
    return {"D": acc, "s": cd.sum(acc, axis="n").then(lambda s: cd.pairs(s)[0])}  # <-


def e_then_two_arguments(acc):
    return {"D": acc, "s": cd.sum(acc, axis="n").then(lambda s, t: s)}  # <-


def e_math_exp(acc):
    return math.exp(acc)  # <-


def e_torch_exp(acc):
    return torch.exp(acc)  # <-


def e_np_exp(acc):
    return np.exp(acc)  # <-


def e_functional_gelu(acc):
    return torch.nn.functional.gelu(acc)  # <-


def e_torch_where(acc):
    return torch.where(acc > 0, acc, 0.0)  # <-


def e_np_negative(acc):
    return np.negative(acc)  # <-


def e_two_math_calls(acc):
    return math.sqrt(2.0) * math.tanh(acc)  # <-


def e_imported_from_math(acc):
    return exp(acc)  # <-


def e_np_where(acc):
    return np.where(acc > 0, acc, 0.0)  # <-


def e_np_float32(acc):
    return np.float32(acc)  # <-


def e_torch_tensor(acc):
    return torch.tensor(acc)  # <-


def e_np_clip(acc):
    return np.clip(acc, 0.0, 1.0)  # <- (numpy calls acc.clip: the user's line, not numpy's)


def e_onehot_of_values(acc, r: cd.Tensor):
    return acc * cd.onehot(r)  # <-


def e_max_of_two(acc, r: cd.Tensor):
    return cd.max(acc, r)  # <-


BODY_ERRORS = [
    (e_onehot_of_values, ["cd.onehot needs a cd.VecM operand of int64", "fix: declare it `target: cd.VecM`"]),
    (e_math_exp, ["math.exp() cannot take a traced value", "fix: use cd.exp(x)"]),
    (e_torch_exp, ["torch.exp() cannot take a traced value", "fix: use cd.exp(x)"]),
    (e_np_exp, ["np.exp() cannot take a traced value", "fix: use cd.exp(x)"]),
    (e_functional_gelu, ["torch.nn.functional.gelu()", "fix: use cd.gelu(x)"]),
    (e_torch_where, ["torch.where()", "fix: use cd.where(cond, a, b)"]),
    (e_np_negative, ["np.negative()", "fix: use the cd. functions and operators (listed in help(coda_dsl))"]),
    (e_two_math_calls, ["math.tanh() cannot take a traced value", "fix: use cd.tanh(x)"]),  # the call, not the line's first
    (e_imported_from_math, ["math.exp() cannot take a traced value", "fix: use cd.exp(x)"]),
    (e_np_where, ["np.where() cannot take a traced value", "fix: use cd.where(cond, a, b)"]),
    (e_np_float32, ["np.float32() cannot take a traced value", "fix: use cd.cast(x, dtype)"]),
    (e_torch_tensor, ["torch.tensor() cannot take a traced value"]),
    (e_np_clip, ["attribute or method 'clip'", "fix: use cd.clamp(x)"]),
    (e_max_of_two, ["cd.max(x, axis) reduces", "not a traced value", "cd.maximum(a, b)"]),
    (e_if, ["no truth value", "cd.where"]),
    (e_bool, ["no truth value", "cd.where"]),
    (e_and, ["no truth value", "cd.where"]),
    (e_not, ["no truth value", "cd.where"]),
    (e_float, ["float()", "keep it as a traced value"]),
    (e_int, ["int() of a traced value", "keep it as a traced value"]),
    (e_attr, ["attribute or method 'foo'", "fix: use the cd. functions and operators"]),  # no cd.foo to name
    (e_method, ["attribute or method 'exp'", "cd.exp(x)"]),
    (e_captured_right, ["captured from outside", "cd.Tensor"]),
    (e_captured_left, ["captured from outside", "cd.Tensor"]),
    (e_captured_in_fn, ["captured from outside", "cd.Tensor"]),
    (e_captured_parameter, ["0-d tensor that requires grad", "no gradient", "cd.Scalar", "x.detach()"]),
    (e_format, ["cannot be formatted", "outside the epilogue"]),
    (e_complex, ["complex() of a traced value"]),
    (e_reduction_in_math, ["reduction", "tile", "NEXT GEMM", "cd.VecM", ".then(cd.log)"]),
    (e_reduction_in_fn, ["reduction", "tile", "NEXT GEMM"]),
    (e_reduction_of_reduction, ["reduction", "tile", "NEXT GEMM"]),
    (e_reduction_compare, ["reduction", "tile", "NEXT GEMM"]),
    (e_bad_axis, ["axis='k'", 'axis="n"', 'axis="m"', "axis=None"]),
    (e_axis_int, ["axis=1", 'axis="n"']),
    (e_gelu, ["approximate='bad'", '"none"', '"tanh"']),
    (e_cast_int, ["int8", "torch.bfloat16", "torch.float16", "torch.float32"]),
    (e_cast_str, ["fp8", "torch.bfloat16"]),
    (e_pow, ["** 1.5", "integers up to 8", "cd.exp(p * cd.log(x))"]),
    (e_iter, ["not iterable", "per element"]),
    (e_string, ["str"]),
    (e_contains, ["not iterable"]),
    (e_gelu_traced_form, ["is not a GELU form", '"tanh"']),
    (e_axis_const, ["not a traced value", "a Python string"]),
    # a finishing expression maps the statistic alone: a pair or an interleave of it has no columns
    (e_then_interleave, ["finishing expression", "cd.interleave"]),
    (e_then_pairs, ["finishing expression", "cd.pairs"]),
    (e_then_two_arguments, [".then() calls its function with the statistic alone", "one argument"]),
]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="instructions carry their line from Python 3.11 on")
def test_foreign_function_named_without_source():
    """Code with no source file (python - < file, exec): the error still names the math function, read from
    the bytecode of the line's call; a plain float() is not mistaken for an earlier line's np.sqrt."""
    env = {"cd": cd, "math": math, "np": np}
    for src, needle in (("@cd.epilogue\ndef f(acc): return cd.relu(math.exp(acc * 2))", "math.exp() cannot take"),
                        ("from math import tanh\n@cd.epilogue\ndef f(acc):\n  return tanh(acc)", "math.tanh() cannot"),
                        ("@cd.epilogue\ndef f(acc):\n  c = np.sqrt(2.0)\n  return float(acc) * c", "float() of a traced")):
        with pytest.raises(EpilogueError, match=re.escape(needle)):
            exec(compile(src, "<stdin>", "exec"), env)


def test_help_coda_dsl_lists_every_dsl_function():
    """Errors say "see help(coda_dsl)": that help lists every cd. function, and __all__ exports them."""
    functions = [n for n, f in vars(cd.dsl.ops).items()
                 if inspect.isfunction(f) and f.__module__ == cd.dsl.ops.__name__ and not n.startswith("_")]
    assert len(functions) > 20
    text = pydoc.render_doc(cd, renderer=pydoc.plaintext)
    for name in functions + ["epilogue", "gemm", "Tensor", "VecN", "VecM", "Scalar", "Const", "cast"]:
        assert name in cd.__all__, name
        assert f"cd.{name}" in cd.__doc__ and f"cd.{name}" in text, name
    assert all(getattr(cd, name) is not None for name in cd.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cd.nope


def assert_epilogue_error(fn, needles, where):
    """Tracing fn fails with a message naming the function, the line `where`, a fix, and every needle."""
    with pytest.raises(EpilogueError) as info:
        cd.epilogue(fn)
    msg = str(info.value)
    assert "\n  fix: " in msg, msg  # README: every EpilogueError suggests one
    assert f"'{fn.__name__}'" in msg, msg
    assert where in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize("fn, needles", BODY_ERRORS, ids=[f.__name__ for f, _ in BODY_ERRORS])
def test_body_error_names_function_line_and_fix(fn, needles):
    assert_epilogue_error(fn, needles, loc(fn))  # the user's own line, not a coda_dsl frame


def test_reduction_misuse_message_explains_the_rule():
    with pytest.raises(EpilogueError) as info:
        cd.epilogue(e_reduction_in_math)
    msg = str(info.value)
    assert "complete only after every tile" in msg and "fix:" in msg
    assert "return the reduction as an output" in msg


def test_error_line_inside_a_helper_is_the_helpers_line():
    def helper(v):
        return v.nope  # <-

    def uses_helper(acc):
        return helper(acc) + 1

    with pytest.raises(EpilogueError) as info:
        cd.epilogue(uses_helper)
    assert "'uses_helper'" in str(info.value) and loc(helper) in str(info.value)


def test_epilogue_error_is_a_type_error():
    """EpilogueError is also a TypeError (the Python category of these mistakes) and a CodaError."""
    with pytest.raises(TypeError):
        cd.epilogue(e_bool)
    with pytest.raises(cd.CodaError):
        cd.epilogue(e_bool)


def test_tracer_state_is_restored_after_an_error():
    with pytest.raises(EpilogueError):
        cd.epilogue(e_bool)
    # the next epilogue traces cleanly and names itself, not the failed one
    with pytest.raises(EpilogueError) as info:
        cd.epilogue(e_float)
    assert "'e_float'" in str(info.value) and "'e_bool'" not in str(info.value)
    assert D(cd.epilogue(lambda acc: acc + 1)).op == "add"


# ---------------------------------------------------------------------------------------------
# Errors in the signature and the return value: name the epilogue and its def line
# ---------------------------------------------------------------------------------------------
def s_missing(acc, bias):
    return acc + bias


def s_wrong(acc, bias: torch.Tensor):
    return acc + bias


def s_wrong_str(acc, bias: "cd.Bias"):  # noqa: F821
    return acc + bias


def s_acc_kind(acc, other: cd.Acc):
    return acc + other


def s_reserved(acc, out: cd.Tensor):
    return acc + out


def s_reserved_backend(acc, backend: cd.Scalar):
    return acc * backend


def s_varargs(acc, *rest: cd.Tensor):
    return acc


def s_no_params():
    return 1


def r_number(acc):
    return 1.0


def r_list(acc):
    return [acc]


def r_empty(acc):
    return {}


def r_nonvalue(acc):
    return {"D": acc, "c": 2.0}


def r_space_name(acc):
    return {"D": acc, "my out": acc}


def r_int_name(acc):
    return {"D": acc, 1: acc}


SIG_ERRORS = [
    (s_missing, ["parameter 'bias' has no annotation", "bias: cd.Tensor", "cd.VecN"]),
    (s_wrong, ["parameter 'bias'", "not an operand kind", "fix:", "cd.VecM"]),
    (s_wrong_str, ["parameter 'bias'", "not an operand kind", "fix:"]),
    (s_acc_kind, ["parameter 'other'", "not an operand kind"]),
    (s_reserved, ["'out' is reserved", "rename it"]),
    (s_reserved_backend, ["'backend' is reserved", "rename it"]),
    (s_varargs, ["*args", "'rest'"]),
    (s_no_params, ["accumulator", "(acc, ...)"]),
    (r_number, ["must return a traced value", "{'D': ...", "got float"]),
    (r_list, ["must return a traced value", "got list", "{'D': first, 'aux': second}"]),
    (r_empty, ["non-empty dict"]),
    (r_nonvalue, ["output 'c'", "not a traced value", "cd.where(acc == acc, c, c)"]),
    (r_space_name, ["'my out'", "Python identifier"]),
    (r_int_name, ["1", "Python identifier"]),
]


@pytest.mark.parametrize("fn, needles", SIG_ERRORS, ids=[f.__name__ for f, _ in SIG_ERRORS])
def test_signature_and_return_errors(fn, needles):
    assert_epilogue_error(fn, needles, loc(fn, marker=None))


def test_operand_named_like_a_gemm_argument_is_rejected_or_usable():
    def named_a(acc, A: cd.Tensor):
        return acc + A

    try:
        ep = cd.epilogue(named_a)
    except EpilogueError as e:  # rejected at definition, like 'out': fine
        assert "'A'" in str(e)
        return
    x, w, r = torch.randn(4, 8), torch.randn(6, 8), torch.randn(4, 6)
    out = cd.gemm(x, w, ep, A=r, backend="reference")["D"]  # or usable
    torch.testing.assert_close(out, x @ w.T + r)


@pytest.mark.parametrize("body, message", [
    (lambda acc: acc // 2, "//, % or divmod"), (lambda acc: acc % 2, "//, % or divmod"),
    (lambda acc: round(acc, 2), "round\\(x, 2\\)"), (lambda acc: 2 ** acc, "2 \\*\\* x is not supported"),
    (lambda acc: acc @ acc, "@ of a traced value"), (lambda acc: acc[0], "indexing of a traced value"),
    (lambda acc: (acc > 0) & (acc < 1), "&, \\|, \\^ or ~"),
    (lambda acc: cd.sum(acc, axis="n").then(3), "then\\(\\) takes a function"),
    (lambda acc: acc << 1, "<< or >>"), (lambda acc: 1 >> acc, "<< or >>"),
    (lambda acc: pow(acc, 2, 3), "pow\\(x, p, m\\) is not supported"),
], ids=["floordiv", "mod", "round", "rpow", "matmul", "getitem", "and", "then", "lshift", "rrshift", "pow_mod"])
def test_python_operators_without_a_meaning_say_so(body, message):
    """Operators an epilogue cannot express are refused while tracing, with the line and a fix, not a raw
    TypeError from Python."""
    with pytest.raises(cd.EpilogueError, match=message):
        cd.epilogue(body, name="bad")


def test_first_parameter_annotated_as_an_operand_is_refused():
    """The first parameter is the accumulator: an operand kind there (the accumulator forgotten) is explained,
    not traced as acc with the operand then 'unexpected'."""
    def add_residual(residual: cd.Tensor):
        return residual
    with pytest.raises(cd.EpilogueError, match="first parameter, 'residual', is the accumulator(.|\n)*fix: put the "
                       "accumulator first"):
        cd.epilogue(add_residual)

    def named_acc(acc: cd.Tensor):  # the fix must not suggest def named_acc(acc, acc: ...)
        return acc
    with pytest.raises(cd.EpilogueError, match=re.escape("def named_acc(acc, x: cd.Tensor, ...)")):
        cd.epilogue(named_acc)
    assert cd.epilogue(lambda acc: acc).params == () and cd.epilogue(_annotated_acc).params == ()


def _annotated_acc(acc: cd.Acc):
    return acc


def test_powers_rounding_and_clamp_mean_what_torch_means():
    """x ** n by multiplications (as torch.pow for integer n), Python's round/floor/ceil/trunc, cd.erf and
    cd.clamp, values and gradients, on the reference backend against torch."""
    x, w = torch.randn(6, 5), torch.randn(8, 5)
    acc = x @ w.t() * 3.0
    acc[0, :4] = torch.tensor([0.5, 1.5, -2.5, 3.0])  # ties to even, and a value at a clamp bound
    cases = [(lambda a: a ** 3, lambda a: a ** 3), (lambda a: a ** 8, lambda a: a ** 8),
             (lambda a: a ** -1, lambda a: a ** -1), (lambda a: a ** -3, lambda a: a ** -3),
             (lambda a: a ** 1, lambda a: a), (lambda a: round(a), torch.round), (lambda a: math.floor(a), torch.floor),
             (lambda a: math.ceil(a), torch.ceil), (lambda a: math.trunc(a), torch.trunc), (cd.erf, torch.erf),
             (lambda a: cd.clamp(a, -1.0, 3.0), lambda a: torch.clamp(a, -1.0, 3.0)),
             (lambda a: cd.clamp(a, max=0.5), lambda a: torch.clamp(a, max=0.5))]
    for spell, want in cases:
        got = cd.gemm(acc, torch.eye(8), cd.epilogue(lambda a: spell(a), name="f"), backend="reference")["D"]  # noqa: B023
        torch.testing.assert_close(got, want(acc), rtol=1e-5, atol=1e-5)
    # the gradient, with values below, at and above both bounds (W = I: acc is x itself)
    xs = torch.tensor([[-2.0, -1.0, 0.5, 3.0, 4.0, 1.0]], dtype=torch.float64, requires_grad=True)
    clamped = cd.epilogue(lambda a: cd.clamp(a, -1.0, 3.0), name="clamped")
    cd.linear(xs, torch.eye(6, dtype=torch.float64), clamped, backend="reference")["D"].sum().backward()
    xt = xs.detach().clone().requires_grad_()
    torch.clamp(xt, -1.0, 3.0).sum().backward()
    torch.testing.assert_close(xs.grad, xt.grad)  # none at the bounds, as torch's
    swapped = cd.gemm(acc, torch.eye(8), cd.epilogue(lambda a: cd.clamp(a, 3.0, 1.0), name="f"), backend="reference")
    torch.testing.assert_close(swapped["D"], torch.clamp(acc, 3.0, 1.0))  # min > max: max everywhere
    for p in (0, np.int64(2)):
        got = cd.gemm(acc, torch.eye(8), cd.epilogue(lambda a: a ** p, name="f"), backend="reference")["D"]  # noqa: B023
        torch.testing.assert_close(got, acc ** int(p))
    nan = float("nan")  # a NaN bound, a number or a cd.Scalar's value: NaN everywhere, as torch.clamp
    for bounds in ((nan, None), (None, nan), (-1.0, nan)):
        got = cd.gemm(acc, torch.eye(8), cd.epilogue(lambda a: cd.clamp(a, *bounds), name="f"), backend="reference")  # noqa: B023
        torch.testing.assert_close(got["D"], torch.clamp(acc, *bounds), equal_nan=True)

    @cd.epilogue
    def clamped_by(acc, lo: cd.Scalar, hi: cd.Scalar):
        return cd.clamp(acc, lo, hi)
    for lo, hi in ((nan, 3.0), (-1.0, nan), (-1.0, 3.0)):
        got = cd.gemm(acc, torch.eye(8), clamped_by, lo=lo, hi=hi, backend="reference")["D"]
        torch.testing.assert_close(got, torch.clamp(acc, lo, hi), equal_nan=True)
    with pytest.raises(cd.EpilogueError, match="needs min, max or both"):
        cd.epilogue(lambda a: cd.clamp(a), name="bad")


def test_parameters_an_epilogue_cannot_take():
    def pow_by_scalar(acc, s: cd.Scalar):
        return acc ** s

    def keyword_only(acc, *, s: cd.Scalar):
        return acc * s

    def with_default(acc, s: cd.Scalar = 1.0):
        return acc * s

    for fn, message in ((pow_by_scalar, "takes a Python number p"), (keyword_only, "keyword-only parameter 's'"),
                        (with_default, "parameter 's' has a default value")):
        with pytest.raises(cd.EpilogueError, match=message):
            cd.epilogue(fn)
    for not_a_function in (3, functools.partial(with_default, s=2.0), abs):  # a partial: no code to trace and name
        with pytest.raises(cd.EpilogueError, match="cd.epilogue decorates a function"):
            cd.epilogue(not_a_function)


@pytest.mark.parametrize("math_of_acc, words", [
    (lambda acc: acc ** float("inf"), "x ** inf is not supported"),  # was OverflowError from int(p)
    (lambda acc: acc ** float("nan"), "x ** nan is not supported"),  # was ValueError
    (lambda acc: acc + 10 ** 400, "an integer beyond a float's range"),  # was OverflowError
    (lambda acc: acc + 10 ** 5000, "an integer beyond a float's range"),  # (str() of it raises past 4300 digits)
    (lambda acc: acc ** 10 ** 400, "x ** 10000000000000000000... is not supported"),
    (lambda acc: acc * torch.tensor(1 + 2j), "is complex: epilogue math is real"),  # was RuntimeError
    (lambda acc: acc * np.complex64(2 + 3j), "is complex: epilogue math is real"),  # was the real part, silently
])
def test_numbers_a_float_cannot_hold_are_epilogue_errors(math_of_acc, words):
    with pytest.raises(cd.EpilogueError, match=re.escape(words)):
        cd.epilogue(math_of_acc)


def test_a_0d_tensor_exponent_is_a_number():
    """acc ** torch.tensor(2.0) is acc ** 2.0 (0-d tensors are numbers in traced math; 0.5 already was)."""
    assert cd.epilogue(lambda acc: acc ** torch.tensor(2.0)).program.outputs[0].node.op == "square"


def test_every_dsl_function_is_a_cd_name():
    """coda_dsl exports dsl.ops lazily under a list of its own: the two must name the same functions (the
    fixes that errors suggest, "use cd.<name>(...)", are taken from dsl.ops.__all__)."""
    from coda_dsl.dsl import ops
    assert sorted(ops.__all__) == sorted(cd._LAZY["dsl.ops"])
    assert all(getattr(cd, name) is getattr(ops, name) for name in ops.__all__)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="instructions carry their columns from Python 3.11 on")
def test_the_bytecode_names_the_call_in_progress_not_an_earlier_one():
    """Without source, the callee is read from the current call's span: float(acc) after np.float32(2.0) on the
    same line is float()'s error, not np.float32's."""
    env = {"cd": cd, "math": math, "np": np}
    for src, needle in (("@cd.epilogue\ndef f(acc): return acc * float(np.float32(2.0)) + float(acc)", "float() of a"),
                        ("@cd.epilogue\ndef f(acc):\n  y = math.sqrt(2.0); return float(acc)", "float() of a"),
                        ("@cd.epilogue\ndef f(acc): return math.exp(cd.relu(acc))", "math.exp() cannot take")):
        with pytest.raises(EpilogueError, match=re.escape(needle)):
            exec(compile(src, "<stdin>", "exec"), dict(env))


def test_an_epilogue_uid_names_its_program():
    """A graph names its epilogue by uid: a count (unique in the process) and a digest of the program, so that a
    graph made in another process (torch.export) cannot run another epilogue of the same name and count."""
    a = cd.epilogue(lambda acc: acc * 2.0, name="same")
    b = cd.epilogue(lambda acc: acc * 3.0, name="same")
    assert a.uid.split(".")[1] != b.uid.split(".")[1] and cd.Epilogue.by_uid(a.uid) is a
    elsewhere = b.uid.split(".")[0] + "." + a.uid.split(".")[1]  # b's count with a's program: made nowhere here
    with pytest.raises(cd.UnsupportedError, match="which this process has not made"):
        cd.Epilogue.by_uid(elsewhere)
    # programs that differ only inside a finishing expression (an op's attribute there: cast's dtype)
    def finished_in(dt):
        return cd.epilogue(lambda acc: {"s": cd.sum(acc, axis="n").then(lambda s: cd.cast(s, dt) * 2.0)}, name="same")
    kept = [finished_in(cd.bfloat16), finished_in(cd.float16)]
    assert kept[0].uid.split(".")[1] != kept[1].uid.split(".")[1]


def test_an_operand_named_acc_is_refused():
    def f(x, acc: cd.Tensor):
        return x + acc
    with pytest.raises(EpilogueError, match="an operand named 'acc' would read as the accumulator .*'x', is it"):
        cd.epilogue(f)


def test_a_value_kept_from_another_trace_is_refused():
    """A traced value saved while tracing one epilogue and used in another names operands the second lacks:
    refused when the second is traced, not a KeyError at its first call."""
    kept = {}

    @cd.epilogue
    def first(acc, t: cd.VecM, s: cd.Scalar):
        kept.update(t=t, s=s, hot=cd.onehot(t))
        return acc

    for what, name in (("t", "t"), ("s", "s"), ("hot", "t")):
        with pytest.raises(EpilogueError, match=f"uses operand '{name}', which is not one of its parameters"):
            cd.epilogue(lambda acc: acc * kept[what], name="second")  # noqa: B023  (traced at once)

    @cd.epilogue
    def same_names(acc, t: cd.VecM, s: cd.Scalar):  # operands of the same names and kinds: what was meant
        return acc * kept["t"] + kept["s"]
    assert {p.name for p in same_names.params} == {"t", "s"}
