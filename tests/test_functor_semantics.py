"""The plans' functors mean what the reference backend means, checked without a compiler: a
functor is data (passes/plan.py: steps of ir/ops.py ops over inputs, pair slots, scalars and
constants), run here with each op's torch semantics on CPU tensors, and the plan's elementwise nodes
are compared with cd.gemm(..., backend="reference"). This catches swapped operands or pair slots in
lowering and wrong broadcasts, which otherwise only the GPU suite could see (and some of which it
would not: see the cases below). The C++ spelling of each op (codegen/cpp.py) is checked against its
torch function separately, by reading the table's small C++ subset as Python."""
from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.codegen.cpp import OP_CPP
from coda_dsl.ir.ops import NODE_OPS, OPS, REDUCTIONS
from coda_dsl.library import rope_positions, rope_tables, swiglu_keep_preactivation
from coda_dsl.passes.plan import (AccFetch, AuxLoad, AuxStore, ColBroadcast, Compute, LogSumExp, PairLoad,
                                  PairStore, Reduce, RowBroadcast)
from epilogues import pairs_with_full_width_operands, statistics_of_a_half

pytestmark = pytest.mark.usefixtures("seed")  # fresh random data every run

# What the C++ helpers and intrinsics of the op table stand for, as torch functions on fp32 tensors.
_ENV = dict(
    expf=torch.exp, logf=torch.log, sqrtf=torch.sqrt, rsqrtf=torch.rsqrt, tanhf=torch.tanh, fast_sin=torch.sin,
    fast_cos=torch.cos, fabsf=torch.abs, maximum=torch.maximum, minimum=torch.minimum, sigmoid=torch.sigmoid,
    relu=torch.relu, silu=F.silu, gelu_erf=F.gelu, gelu_tanh=lambda x: F.gelu(x, approximate="tanh"), erff=torch.erf,
    rintf=torch.round, floorf=torch.floor, ceilf=torch.ceil,  # C's rintf: the default mode, ties to even
    as_float=lambda b: torch.as_tensor(b).float(), where=lambda c, a, b: torch.where(torch.as_tensor(c), a, b),
)
_REWRITES = [
    (r"coda::", ""),
    (r"\((\w+) != 0\.f \? (\w+) : (\w+)\)", r"where(\1 != 0, \2, \3)"),
    (r"\bfloat\(", "as_float("),
]


def as_python(cpp: str) -> str:
    for pattern, repl in _REWRITES:
        cpp = re.sub(pattern, repl, cpp)
    return cpp


def run_functor(functor, inputs: list[torch.Tensor], scalars: list[float]) -> torch.Tensor:
    """The functor applied to full [M, N] fp32 inputs (a pair functor: to every column pair), each
    step with its op's reference semantics (ir/ops.py)."""
    temps: list[torch.Tensor] = []

    def value(r):
        if r.kind == "input":  # slot 0 / 1: the even / odd column of each pair
            return inputs[r.index] if r.slot is None else inputs[r.index][..., r.slot::2]
        if r.kind == "temp":
            return temps[r.index]
        return torch.tensor(r.index if r.kind == "const" else scalars[r.index], dtype=torch.float32)

    for step in functor.steps:
        temps.append(NODE_OPS[step.op].apply(step.attr, *map(value, step.args)))
    shape = inputs[0].shape
    if not functor.pairwise:
        return torch.broadcast_to(value(functor.result), shape)
    out = torch.empty(shape)
    out[..., 0::2] = value(functor.result)
    out[..., 1::2] = value(functor.result_odd)
    return out


def run_plan(plan, acc: torch.Tensor, operands: dict, scalars: dict[str, float]) -> dict[str, torch.Tensor]:
    """The plan's elementwise nodes on CPU: every value as a full [M, N] fp32 tensor."""
    m, n = acc.shape
    names = [o[0] for o in plan.outputs]
    p = [scalars[s] for s in plan.scalars]  # the Scalars struct, by position
    values, outs = [], {}
    for node in plan.nodes:
        kids = [values[c] for c in node.children]
        if isinstance(node, (RowBroadcast, ColBroadcast, AuxLoad, PairLoad)):
            name = plan.inputs[node.input_index]
            x = operands[name].float()
            if isinstance(node, PairLoad) or name in plan.widened:
                x = x.repeat_interleave(2, dim=-1)  # one value per pair, seen in both of its slots
            v = x.expand(m, n) if isinstance(node, RowBroadcast) else x[:, None].expand(m, n) \
                if isinstance(node, ColBroadcast) else x
        elif isinstance(node, AccFetch):
            v = acc
        elif isinstance(node, Compute):
            v = run_functor(node.functor, kids, p)
        elif isinstance(node, (AuxStore, PairStore)):
            v = kids[0]
            outs[names[node.output_index]] = v[..., 0::2] if isinstance(node, PairStore) else v
        elif type(node) in (Reduce, LogSumExp):  # a tap: the statistic of its full [M, N] input, then .then's
            v = kids[0]
            s = REDUCTIONS["logsumexp" if isinstance(node, LogSumExp) else node.kind].torch_fn(
                v, {"n": -1, "m": -2, None: (-2, -1)}[node.axis])
            outs[names[node.output_index]] = run_functor(node.finish, [s], p) if node.finish else s
        else:
            raise NotImplementedError(f"{type(node).__name__}: not an elementwise node")
        values.append(v)
    if plan.d_dtype:
        outs["D"] = values[-1]  # a half-width D is a PairStore among the outputs
    return outs


def check(make_plan, ep, operands=None, scalars=None, m=6, n=8, k=16, **signature):
    """The plan, run on CPU, against the reference backend on the same operands."""
    operands, scalars = operands or {}, scalars or {}
    a, b = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    ref = cd.gemm(a, b, ep, backend="reference", **operands, **scalars)
    got = run_plan(make_plan(ep, **signature), a.float() @ b.float().t(), operands, scalars)
    assert set(got) == set(ref)
    for name, r in ref.items():
        g = got[name].to(r.dtype).float()
        assert torch.allclose(g, r.float(), rtol=1e-2, atol=1e-2), f"{ep.name}.{name}: {(g - r.float()).abs().max()}"


def test_op_table_cpp_means_the_torch_function():
    grid = [torch.tensor(v) for v in (-1.5, 0.0, 0.3, 1.0, 2.0)]  # equal operands included (le, ge, eq)
    for op in OPS.values():
        names = [f"a{i}" for i in range(op.arity)]
        expr = as_python(OP_CPP[op.name].format(*names))
        for args in itertools.product(grid, repeat=op.arity):
            got = torch.as_tensor(eval(expr, {**_ENV, **dict(zip(names, args))})).float()  # noqa: S307
            assert torch.allclose(got, op.torch_fn(*args).float(), equal_nan=True), (op.name, args, expr)


def test_every_elementwise_op_has_one_cpp_spelling():
    assert set(OP_CPP) == {name for name, op in NODE_OPS.items() if op.kind == "elementwise"}


@cd.epilogue
def every_kind_of_op(acc, r: cd.Tensor, t: cd.Scalar):
    x = acc * 0.5
    return {"D": cd.where(x > t, x - r, r - x) + (x <= t) * 2.0 + (x == r) * 4.0,
            "q": cd.cast(cd.gelu(x, approximate="tanh") - cd.minimum(x, r) / (r * r + 1.0), cd.float32)}


@cd.epilogue
def pair_halves_mixed_with_a_row_value(acc, rs: cd.VecM):
    even, odd = cd.pairs(acc)
    return {"D": cd.interleave(even + rs, odd * rs), "same": cd.interleave(even, even)}


def test_elementwise_ops(make_plan):
    check(make_plan, every_kind_of_op, dict(r=torch.randn(6, 8).bfloat16()), dict(t=0.3),
          output_dtypes={"q": "fp32"})


def test_pairs_with_full_width_operands(make_plan):
    check(make_plan, pairs_with_full_width_operands, dict(bias=torch.randn(8).bfloat16(), rs=torch.randn(6)),
          dict(s=0.7), operand_dtypes={"rs": "fp32"}, output_dtypes={"h": "fp32"})


def test_pair_halves_mixed_with_a_row_value(make_plan):
    check(make_plan, pair_halves_mixed_with_a_row_value, dict(rs=torch.randn(6).bfloat16()))


@pytest.mark.parametrize("ep, operands", [
    (rope_tables, dict(cos=torch.randn(6, 4).bfloat16(), sin=torch.randn(6, 4).bfloat16())),
    (rope_positions, dict(pos=torch.arange(6.0), inv_freq=torch.rand(4))),
    (swiglu_keep_preactivation, {}),
], ids=lambda x: getattr(x, "name", ""))
def test_library_pairwise_epilogues(make_plan, ep, operands):
    dtypes = {name: "fp32" for name, t in operands.items() if t.dtype == torch.float32}
    check(make_plan, ep, operands, operand_dtypes=dtypes)


@cd.epilogue
def statistics(acc, r: cd.Tensor):
    h = acc + r
    return {"D": h, "sumsq": cd.sum(h * h, axis="n").then(lambda s: cd.rsqrt(s + 1.0)), "cmax": cd.max(h, axis="m"),
            "tamax": cd.amax(h, axis=None), "lse": cd.logsumexp(h, axis="n")}


@pytest.mark.parametrize("ep", [statistics, statistics_of_a_half], ids=lambda e: e.name)
def test_statistics(make_plan, ep):
    check(make_plan, ep, dict(r=torch.randn(6, 8).bfloat16()) if ep is statistics else {})
