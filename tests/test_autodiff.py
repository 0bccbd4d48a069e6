"""Derived backward epilogues (passes/autodiff.py) against torch.autograd through the reference
semantics, in fp64: every op's rule, every operand kind, reductions as outputs, column pairs, and
random programs; and by torch.autograd.gradcheck against finite differences. The derived program is
evaluated by the same reference backend as any epilogue."""
from __future__ import annotations

import random
from fractions import Fraction

import pytest
import torch

import coda_dsl as cd
from coda_dsl.errors import UnsupportedError
from coda_dsl.ir import graph as ir
from coda_dsl.ir.ops import OPS, REDUCTIONS
from coda_dsl.passes import specialize
from coda_dsl.passes.autodiff import ACC, GRAD, SAVED, derive
from coda_dsl.runtime.autograd import derived_backward
from coda_dsl.runtime.reference import evaluate_on
from epilogues import rel_err

pytestmark = pytest.mark.usefixtures("seed")  # fresh random data every run
M, N = 6, 8
KINDS = {"tensor": (M, N), "vec_n": (N,), "vec_m": (M,)}


def _inputs(program, half=False):
    """fp64 leaves: acc, and one tensor per operand (0-d for scalars); int64 column indices for cd.take's,
    some outside [0, N)."""
    widths = {"tensor": (M, N // 2) if half else (M, N), "vec_n": (N // 2,) if half else (N,), "vec_m": (M,)}
    indices = ir.index_operands(ir.walk(program))
    values = {p.name: torch.randint(-1, N + 1, (M,)) if p.name in indices else
              torch.randn(widths[p.kind] if p.kind in widths else (), dtype=torch.float64)
              for p in program.params if p.kind != "const"}
    return torch.randn(M, N, dtype=torch.float64), values


def _statistics(program, back, acc, values, ys) -> dict:
    """saved_<name> for the backward: the output itself, or for a .then output the statistic before .then."""
    before = ir.Program(program.name, program.params, tuple(
        ir.Output(k, ir.reduction_of(program.output(k).node), None) for k in back.unfinished))
    raw = evaluate_on(before, acc, values, {}) if back.unfinished else {}
    return {SAVED + k: (raw[k] if k in raw else ys[k]).detach() for k in back.saved}


def _check(program, half=False, acc=None, values=None, consts=None, no_grad=()):
    """The derived gradients equal torch.autograd's of sum_i <y_i, dy_i> through the forward program
    (operands in `no_grad` get no gradient output)."""
    program = specialize(program, consts or {})
    acc0, values0 = _inputs(program, half)
    acc = (acc0 if acc is None else acc).requires_grad_()
    values = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in (values or values0).items()}
    ys = evaluate_on(program, acc, values, {})
    dys = {k: torch.randn_like(y) for k, y in ys.items()}
    loss = sum((y * dys[k]).sum() for k, y in ys.items())
    graded = [k for k, v in values.items() if v.requires_grad]  # (indices have no gradient)
    leaves = [acc, *(values[k] for k in graded)]
    expected = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
    back = derive(program)
    operands = {**{k: v.detach() for k, v in values.items()}, **{GRAD + k: dys[k] for k in back.grads},
                **_statistics(program, back, acc.detach(), {k: v.detach() for k, v in values.items()}, ys)}
    got = evaluate_on(back.program, acc.detach(), operands, {})
    for name, want in zip(["acc", *graded], expected):
        if name in no_grad:
            assert name not in got, f"{name}: a gradient output"
            continue
        if want is None or not want.abs().sum():
            assert name not in got or not got[name].abs().sum(), f"{name}: gradient where there is none"
            continue
        # equal_nan: a random program may overflow (exp of exp) where both then give NaN, at the same places
        torch.testing.assert_close(got[name].expand_as(want), want, rtol=1e-9, atol=1e-11, equal_nan=True,
                                   msg=f"d{name}")
    return back


@pytest.mark.parametrize("op", [o for o in OPS.values() if o.arity <= 2], ids=lambda o: o.name)
def test_every_op_with_every_operand_kind(op):
    """acc and a tensor, a per-column vector, a per-row vector and a scalar, through each op."""
    guard = {"log": lambda x: ir.compute("add", ir.compute("abs", x), ir.const(1.5)),
             "sqrt": lambda x: ir.compute("add", ir.compute("abs", x), ir.const(1.5)),
             "rsqrt": lambda x: ir.compute("add", ir.compute("abs", x), ir.const(1.5))}.get(op.name, lambda x: x)
    for kind, leaf in (("tensor", ir.load("tensor", "t")), ("vec_n", ir.load("vec_n", "b")),
                       ("vec_m", ir.load("vec_m", "r")), ("scalar", ir.scalar("s"))):
        h = ir.compute("add", ir.compute("mul", ir.acc(), ir.const(0.7)), leaf)
        args = (guard(h),) if op.arity == 1 else (guard(h), ir.compute("sub", leaf, ir.acc()))
        if op.name == "div":
            args = (args[0], ir.compute("add", ir.compute("abs", args[1]), ir.const(1.0)))
        y = ir.compute(op.name, *args)
        name = {"tensor": "t", "vec_n": "b", "vec_m": "r", "scalar": "s"}[kind]
        _check(ir.Program(op.name, (ir.Param(name, kind),), (ir.Output("D", y, None),)))


def _gradcheck(program, values=None, consts=None, frozen=()):
    """torch.autograd.gradcheck, in fp64, of the forward program as a torch function whose backward is
    its derived program: the derived gradients against finite differences (not against torch.autograd
    of the same reference ops, as _check). `frozen` operands are held constant."""
    program = specialize(program, consts or {})
    back = derive(program)
    acc, values0 = _inputs(program)
    values = values or values0
    names = [k for k in values if k not in frozen and values[k].is_floating_point()]
    fixed = {k: v for k, v in values.items() if k not in names}

    class Forward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, acc, *tensors):
            vals = {**fixed, **dict(zip(names, tensors))}
            ys = evaluate_on(program, acc, vals, {})
            ctx.save_for_backward(acc, *tensors)
            ctx.ys = ys
            return tuple(ys[o] for o in [o.name for o in program.outputs])

        @staticmethod
        def backward(ctx, *dys):
            acc, *tensors = ctx.saved_tensors
            vals = {**fixed, **dict(zip(names, tensors))}
            operands = {**vals, **_statistics(program, back, acc, vals, ctx.ys),
                        **{GRAD + o: dy for o, dy in zip([o.name for o in program.outputs], dys) if o in back.grads}}
            got = evaluate_on(back.program, acc, operands, {})
            leaves = [acc, *tensors]
            return tuple(got[k].expand_as(t).clone() if k in got else torch.zeros_like(t)
                         for k, t in zip(["acc", *names], leaves))

    leaves = [acc.requires_grad_(), *(values[k].requires_grad_() for k in names)]
    assert torch.autograd.gradcheck(Forward.apply, leaves, eps=1e-6, atol=1e-5, rtol=1e-4)


def _gradcheck_linear(program, values=None, frozen=()):
    """torch.autograd.gradcheck, in fp64 on the reference backend, of cd.linear with the program as its
    epilogue: the public path (forward with the saved accumulator and statistics, the derived backward,
    dacc @ W and dacc^T x) against finite differences in x, W and every operand, cd.Scalars as 0-d
    tensors; `frozen` operands are held constant."""
    ep = cd.Epilogue.of_program(program)
    x, w = torch.randn(M, 3, dtype=torch.float64), torch.randn(N, 3, dtype=torch.float64)
    values = values or _inputs(program)[1]
    names = [k for k in values if k not in frozen and values[k].is_floating_point()]
    fixed = {k: v for k, v in values.items() if k not in names}

    def f(x, w, *tensors):
        outs = cd.linear(x, w, ep, backend="reference", **fixed, **dict(zip(names, tensors)))
        return tuple(outs.values())

    leaves = [x.requires_grad_(), w.requires_grad_(), *(values[k].requires_grad_() for k in names)]
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-5, rtol=1e-4)


def _positive(x):
    return ir.compute("add", ir.compute("square", x), ir.const(1.5))


@pytest.mark.parametrize("op", OPS.values(), ids=lambda o: o.name)
def test_every_op_passes_gradcheck(seed, op):
    """Each op's derivative rule, with an operand of each kind, against finite differences in fp64: the derived
    program alone, and through cd.linear on the reference backend. Steps and kinks get inputs far from where
    they jump or bend, on one side for two operand kinds and on the other for the other two: random data
    within eps of one fails now and then (CI saw round fail), and there finite differences disagree with any
    subgradient."""
    c = ir.const
    for side, (kind, leaf, name) in zip((1.0, -1.0, 1.0, -1.0), (
            ("tensor", ir.load("tensor", "t"), "t"), ("vec_n", ir.load("vec_n", "b"), "b"),
            ("vec_m", ir.load("vec_m", "r"), "r"), ("scalar", ir.scalar("s"), "s"))):
        def far(x, by=0.25):  # by +- 0.01 on this side of 0
            return ir.compute("add", ir.compute("mul", x, c(1e-3)), c(by * side))
        guard = {"log": _positive, "sqrt": _positive, "rsqrt": _positive,
                 **dict.fromkeys(("round", "floor", "ceil", "abs", "relu"), far)}.get(op.name, lambda x: x)
        h = ir.compute("add", ir.compute("mul", ir.acc(), c(0.7)), leaf)
        y = ir.compute("sub", leaf, ir.acc())
        if op.name in ("maximum", "minimum", "lt", "le", "gt", "ge", "eq", "ne"):  # jump or bend where x == y:
            y = ir.compute("add", h, far(y, 0.5))  # y stays 0.5 +- 0.01 above h or below it
        args = (guard(h),) if op.arity == 1 else (guard(h), y)
        if op.name == "div":
            args = (args[0], _positive(args[1]))
        if op.name == "where":  # a condition that is 1 on one side, 0 on the other
            args = (ir.compute("gt", far(h), c(0.0)), h, y)
        program = ir.Program(op.name, (ir.Param(name, kind),), (ir.Output("D", ir.compute(op.name, *args), None),))
        _gradcheck(program)
        _gradcheck_linear(program)


def test_library_and_statistics_pass_gradcheck():
    """Column pairs (SwiGLU, RoPE), reductions as outputs and finished statistics against finite differences."""
    from coda_dsl.library import rope_positions, swiglu

    @cd.epilogue
    def stats(acc, residual: cd.Tensor, bias: cd.VecN, alpha: cd.Scalar, idx: cd.VecM):
        h = cd.gelu(acc * alpha + bias) + residual
        return {"D": h, "rstd": cd.sum(h * h, axis="n").then(lambda s: cd.rsqrt(s * 0.125 + 1e-3)),
                "lse": cd.logsumexp(h, axis="n"), "cols": cd.sum(h, axis="m"), "all": cd.sum(h, axis=None),
                "picked": cd.take(h, idx).then(lambda t: t * t)}

    rope_values = {"pos": torch.arange(M, dtype=torch.float64) * 3.0, "inv_freq": torch.rand(N // 2, dtype=torch.float64)}
    for check in (_gradcheck, _gradcheck_linear):
        check(swiglu.program)
        check(rope_positions.program, values=dict(rope_values), frozen=("pos", "inv_freq"))
        check(stats.program)


def test_row_and_scalar_operands_in_pairwise_math_pass_gradcheck():
    """A cd.VecM or cd.Scalar has no width: read where values are N/2 or 2N wide (or at several widths), its
    gradient sums its adjoints over the columns it met there (found by a fuzzer: 2x too large, or crashes)."""
    @cd.epilogue
    def row_stat_of_a_half(acc, r: cd.VecM):
        g, u = cd.pairs(acc)
        return {"D": g * u, "st": cd.sum(r + g, axis="n")}

    @cd.epilogue
    def total_of_a_half(acc, r: cd.VecM):  # silu, not relu: finite differences across a kink fail now and then
        return {"D": cd.silu(acc), "st": cd.sum(r + cd.pairs(acc)[0], axis=None)}

    @cd.epilogue
    def shared_at_three_widths(acc, r: cd.VecM, s: cd.Scalar):
        t = cd.tanh(r) * s
        return {"D": t + acc, "h": cd.pairs(acc)[1] * t, "st": cd.sum(cd.interleave(acc, acc) * t, axis="n")}
    @cd.epilogue
    def statistics_of_interleaved_halves(acc):  # a row's dy is uniform: its pair halves are dy itself
        g, u = cd.pairs(acc)
        return {"st": cd.sum(cd.interleave(g * u, g * u), axis="n"), "tot": cd.sum(cd.interleave(g, u), axis=None)}
    r = torch.randn(M, dtype=torch.float64)
    for ep in (row_stat_of_a_half, total_of_a_half, shared_at_three_widths, statistics_of_interleaved_halves):
        values = {"r": r.clone()} if ep is not shared_at_three_widths else {"r": r.clone(), "s": torch.tensor(0.7)}
        values = {} if ep is statistics_of_interleaved_halves else values
        _gradcheck_linear(ep.program, values={k: v.double() for k, v in values.items()})

    @cd.epilogue
    def column_sums_of_a_half(acc):  # a statistic's dy is a vector: the width check leaves it alone
        g, u = cd.pairs(acc)
        return {"D": g * u, "cols": cd.sum(g * u, axis="m"), "tot": cd.sum(g, axis="m").then(cd.tanh)}
    _gradcheck_linear(column_sums_of_a_half.program, values={})

    @cd.epilogue
    def even_columns_plus(acc, t: cd.Tensor):  # linear in acc: only dy's declared width fixes dacc's
        return {"D": cd.pairs(acc)[0] + 1.0, "E": cd.pairs(acc)[1] * t}
    back = derive(even_columns_plus.program)
    assert {p.name: p.width for p in back.program.params if p.name.startswith("grad_")} == {
        "grad_D": Fraction(1, 2), "grad_E": Fraction(1, 2)}
    _gradcheck_linear(even_columns_plus.program, values={"t": torch.randn(M, N // 2, dtype=torch.float64)})


def test_where_and_comparisons_pass_gradients_only_through_the_chosen_value():
    @cd.epilogue
    def f(acc, t: cd.Tensor):
        return cd.where(acc > t, acc * t, cd.relu(-acc)) + (acc < 0.0)
    back = _check(f.program)
    assert back.uses_acc


def test_an_infinite_gradient_stays_out_of_the_side_not_taken():
    """relu, maximum and minimum select, as torch does: sqrt(relu(acc))'s infinite gradient where acc <= 0
    is 0 there, not inf * 0 = NaN spread over all of grad_x and grad_W."""
    @cd.epilogue
    def f(acc, t: cd.Tensor):
        return cd.sqrt(cd.relu(acc)) + cd.log(cd.maximum(acc, 0.0)) * 0.0 + cd.sqrt(-cd.minimum(acc, t))

    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    t = torch.zeros(6, 7, dtype=torch.float64)
    y = cd.linear(x, w, f, t=t, backend="reference")["D"]
    keep = torch.isfinite(y)  # log(0) * 0 is NaN where acc <= 0, in torch too: leave those out of the loss
    y[keep].sum().backward()
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    z = x2 @ w2.t()
    ref = torch.sqrt(torch.relu(z)) + torch.log(torch.maximum(z, torch.zeros(()))) * 0.0 + torch.sqrt(-torch.minimum(z, t))
    ref[keep].sum().backward()
    for got, want in ((x.grad, x2.grad), (w.grad, w2.grad)):
        assert not got.isnan().any() and torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_reductions_as_outputs_and_operand_gradients_as_reductions():
    @cd.epilogue
    def f(acc, bias: cd.VecN, scale: cd.VecM, alpha: cd.Scalar, c: cd.Const):
        h = cd.gelu((acc + bias) * scale) * alpha + c
        return {"D": h, "rows": cd.sum(h * h, axis="n"), "cols": cd.sum(h, axis="m"), "all": cd.sum(h, axis=None),
                "lse": cd.logsumexp(h, axis="n")}
    back = _check(f.program, consts={"c": 0.25})
    assert back.saved == ("lse",) and {o.name for o in back.program.outputs} == {"acc", "bias", "scale", "alpha"}
    kinds = {o.name: (o.node.op, o.node.attr) for o in back.program.outputs}
    assert kinds["bias"] == ("reduce", ("sum", "m")) and kinds["scale"] == ("reduce", ("sum", "n"))
    assert kinds["alpha"] == ("reduce", ("sum", None)) and kinds["acc"][0] != "reduce"


def test_swiglu_and_rope_derived():
    """Column pairs: SwiGLU's and RoPE's derived gradients equal torch.autograd's."""
    from coda_dsl.library import rope_positions, swiglu
    _check(swiglu.program)
    _check(rope_positions.program, values={"pos": torch.arange(M, dtype=torch.float64) * 3.0,
                                           "inv_freq": torch.rand(N // 2, dtype=torch.float64)})


def test_casts_pass_gradients_straight_through():
    @cd.epilogue
    def f(acc):
        return {"D": cd.cast(acc * 2.0, cd.bfloat16), "h": cd.cast(cd.exp(acc), cd.float32)}
    program = specialize(f.program, {})
    acc, _ = _inputs(program)
    back = derive(program)
    dys = {GRAD + "D": torch.randn(M, N, dtype=torch.float64), GRAD + "h": torch.randn(M, N, dtype=torch.float64)}
    got = evaluate_on(back.program, acc, dys, {})["acc"]
    torch.testing.assert_close(got, 2 * dys[GRAD + "D"] + acc.exp() * dys[GRAD + "h"])


def test_finished_statistics_pass_back_through_then():
    """y = f(s) for a statistic s (.then): dy * f'(s) goes back through s's rule, with s saved (the forward
    outputs it, before f); scalars that only f reads get no gradient output, constant-only f none at all."""
    @cd.epilogue
    def f(acc, residual: cd.Tensor, inv_n: cd.Scalar, eps: cd.Scalar, alpha: cd.Scalar):
        h = acc * alpha + residual
        return {"D": h, "rstd": cd.sum(h * h, axis="n").then(lambda s: cd.rsqrt(s * inv_n + eps)),
                "lse2": cd.logsumexp(h, axis="n").then(lambda s: s * s),
                "cols": cd.sum(h, axis="m").then(lambda s: cd.exp(s * 0.1)),
                "flat": cd.sum(h, axis=None).then(lambda s: 3.0)}
    program = specialize(f.program, {})
    acc, values = _inputs(program)
    values.update(inv_n=torch.tensor(1.0 / N, dtype=torch.float64), eps=torch.tensor(1e-3, dtype=torch.float64))
    back = _check(f.program, acc=acc, values=values, no_grad=("inv_n", "eps"))
    assert back.saved == back.unfinished == ("rstd", "lse2", "cols")
    assert "alpha" in {o.name for o in back.program.outputs}  # read by the body, not by a finishing step


def test_the_forward_kernel_outputs_statistics_before_then(make_plan):
    """cd.linear's forward kernel for a .then output: the statistic and its finished value, two reductions of
    one value (lowered for the cutlass backend)."""
    from coda_dsl.passes.plan import Reduce

    @cd.epilogue
    def residual_rms(acc, residual: cd.Tensor, inv_n: cd.Scalar, eps: cd.Scalar):
        h = acc + residual
        return {"D": h, "rstd": cd.sum(h * h, axis="n").then(lambda s: cd.rsqrt(s * inv_n + eps))}
    forward = cd.forward_epilogue(residual_rms)
    # the derivative reads h = acc + residual back from D: no accumulator kept
    assert forward.output_names == ("D", "rstd", SAVED + "rstd")
    reduces = [n for n in make_plan(forward).nodes if isinstance(n, Reduce)]
    assert len(reduces) == 2 and reduces[0].children == reduces[1].children
    assert sorted(r.finish is None for r in reduces) == [False, True]

    # fused into the GEMM that produces D's gradient (dOut = src @ w_next^T), the statistic an operand
    m, n, eps = 7, 8, 1e-3
    src, w_next, res, drstd = torch.randn(m, 3), torch.randn(n, 3), torch.randn(m, n), torch.randn(m)
    acc = torch.randn(m, n, requires_grad=True)
    h = acc + res
    s = (h * h).sum(-1)
    ((h * (src @ w_next.t())).sum() + (torch.rsqrt(s / n + eps) * drstd).sum()).backward()
    got = cd.gemm(src, w_next, cd.backward_epilogue(residual_rms), backend="reference", saved_D=h.detach(),
                  residual=res, grad_rstd=drstd, saved_rstd=s.detach(), inv_n=1 / n, eps=eps)
    assert rel_err(got["D"], acc.grad) < 1e-6


def test_a_gradient_that_is_dacc_is_stored_once(make_plan):
    """y = acc + residual: the residual's gradient is dacc itself. The fused backward stores it once (one [M, N]
    store fewer) and returns it as D's tensor, on every path: a call, a batched one, a CompiledOp's plan,
    torch.compile; out= for it, and accumulate=True (D would hold a sum), are refused with the fix."""
    @cd.epilogue
    def residual_sumsq(acc, residual: cd.Tensor):
        h = acc + residual
        return {"D": h, "sumsq": cd.sum(h * h, axis="n")}

    bw = cd.backward_epilogue(residual_sumsq)
    assert bw.output_names == ("D",) and bw.program.aliases == (("residual", "D"),)
    assert "out residual = out D (the same tensor)" in ir.format_program(bw.program)
    plan = make_plan(bw)
    assert plan.d_dtype is not None and plan.outputs == []  # D alone is stored

    m, n = 6, 8
    x, w, r = torch.randn(m, 5, dtype=torch.float64), torch.randn(n, 5, dtype=torch.float64), torch.randn(m, n)
    g, v, dsum = torch.randn(m, 4), torch.randn(n, 4), torch.randn(m)
    xr, wr, rr = (t.clone().requires_grad_() for t in (x, w, r.double()))
    h = xr @ wr.t() + rr
    ((h * (g.double() @ v.double().t())).sum() + ((h * h).sum(-1) * dsum.double()).sum()).backward()
    saved = cd.saved_operands(bw, cd.gemm(x.float(), w.float(), cd.forward_epilogue(residual_sumsq),
                                          backend="reference", residual=r))
    args = dict(backend="reference", residual=r, grad_sumsq=dsum, **saved)
    got = cd.gemm(g, v, bw, **args)
    assert got["residual"] is got["D"] and rel_err(got["residual"], rr.grad) < 1e-5
    batched = cd.gemm(torch.stack([g, g]), v, bw, **{**args, "grad_sumsq": torch.stack([dsum, dsum])})
    assert batched["residual"] is batched["D"] and torch.equal(batched["D"][1], got["D"])
    compiled = torch.compile(lambda g: cd.gemm(g, v, bw, **args), fullgraph=True, backend="aot_eager")(g)
    assert set(compiled) == {"D", "residual"} and torch.equal(compiled["residual"], got["D"])
    with pytest.raises(cd.OperandError, match="out has 'residual', which is output 'D'.*\n  fix: pass out=\\{'D'"):
        cd.gemm(g, v, bw, out={"residual": torch.empty(m, n)}, **args)
    with pytest.raises(UnsupportedError, match="output 'residual' is D's value.*accumulate=True"):
        cd.gemm(g, v, bw, out={"D": torch.zeros(m, n)}, accumulate=True, **args)


@pytest.mark.parametrize("make, what", [
    (lambda acc: {"m": cd.max(acc, axis="n")}, "cd.max"),
    (lambda acc: {"s": cd.amax(acc * acc, axis="n").then(lambda s: cd.rsqrt(s + 1.0))}, "cd.amax"),
])
def test_statistics_without_a_rule_are_refused(make, what):
    with pytest.raises(UnsupportedError, match=what):
        derive(specialize(cd.epilogue(make, name="f").program, {}))


def test_take_sends_its_gradient_to_the_taken_column():
    """cd.take's derivative is the one-hot of its index: a cross-entropy written as lse - take gets the gradient
    of F.cross_entropy (a row whose index is outside [0, N), as ignore_index, none), and the derived backward
    run as the epilogue of the GEMM that recomputes the logits gives softmax - one-hot, also per batch."""
    @cd.epilogue
    def ce(acc, target: cd.VecM):
        return {"lse": cd.logsumexp(acc), "zt": cd.take(acc, target)}
    x, w = torch.randn(M, 5, dtype=torch.float64), torch.randn(N, 5, dtype=torch.float64)
    t = torch.randint(0, N, (M,))
    t[1], t[2] = -100, N
    keep = (t >= 0) & (t < N)
    x1, w1, x2, w2 = (v.clone().requires_grad_() for v in (x, w, x, w))
    out = cd.linear(x1, w1, ce, backend="reference", target=t)
    ((out["lse"] - out["zt"]) * keep).sum().backward()
    torch.nn.functional.cross_entropy(x2 @ w2.t(), torch.where(keep, t, -100), reduction="sum").backward()
    for got, want in ((x1.grad, x2.grad), (w1.grad, w2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    bw = derived_backward(ce)
    assert "onehot(target)" in ir.format_program(bw.program)
    a, b = torch.randn(3, M, 5, dtype=torch.float64), torch.randn(3, N, 5, dtype=torch.float64)
    tb = torch.randint(-1, N + 1, (3, M))
    z = a @ b.transpose(-1, -2)
    g_lse, g_zt = torch.randn(3, M, dtype=torch.float64), torch.randn(3, M, dtype=torch.float64)
    lse = torch.logsumexp(z, -1)
    got = cd.gemm(a, b, bw, backend="reference", target=tb, grad_lse=g_lse, saved_lse=lse, grad_zt=g_zt)["acc"]
    onehot = torch.nn.functional.one_hot(tb.clamp(0, N - 1), N) * ((tb >= 0) & (tb < N))[..., None]
    torch.testing.assert_close(got, g_lse[..., None] * torch.softmax(z, -1) + g_zt[..., None] * onehot)

    g_zt[0, 0] = float("inf")  # an infinite gradient stays at its column (a select)
    got = cd.gemm(a, b, bw, backend="reference", target=tb, grad_lse=g_lse * 0, saved_lse=lse, grad_zt=g_zt)["acc"]
    assert got[0, 0].isinf().sum() == (0 <= tb[0, 0] < N) and not got[0, 0].isnan().any()


def test_onehot_is_a_constant_of_the_derivation():
    """cd.onehot(index) written in a forward: no gradient through it, a scalar's multiplying it gets the sum of
    dy at the index's columns (as torch.autograd's), and the one-hot rows are the reference's arange(N) == index."""
    @cd.epilogue
    def shift(acc, target: cd.VecM, h: cd.Scalar):
        return cd.exp(acc) - h * cd.onehot(target)
    back = _check(shift.program)
    assert {o.name for o in back.program.outputs} == {"acc", "h"}  # none for the index
    t = torch.tensor([0, 3, -100, N, N - 1, 2])
    got = evaluate_on(shift.program, torch.zeros(M, N, dtype=torch.float64), {"target": t, "h": torch.tensor(2.0)},
                      {})["D"]
    want = 1.0 - 2.0 * ((torch.arange(N) == t[:, None]) & (t[:, None] >= 0))
    torch.testing.assert_close(got, want.double())


def test_take_of_a_value_not_n_wide_has_no_derivative_yet():
    @cd.epilogue
    def half_take(acc, idx: cd.VecM):
        g, u = cd.pairs(acc)
        return {"D": g * u, "p": cd.take(g * u, idx)}
    with pytest.raises(UnsupportedError, match="'p' is a cd.take of a value not N wide, which has no derivative"):
        derive(half_take.program)
    x = torch.randn(4, 3, requires_grad=True)
    idx = torch.zeros(4, dtype=torch.long)
    cd.linear(x, torch.randn(8, 3), half_take, backend="reference", idx=idx)["D"].sum().backward()
    assert x.grad is not None  # computed, and D trains


def test_take_in_a_fused_backward(make_plan):
    """cd.backward_epilogue of a forward with a take beside D: its gradient arrives as grad_<take> where D is N
    wide (the one-hot is over D's columns); where D is not (cd.pairs), the take is left out, as before it had a
    derivative. A derived backward whose index is also read in math is refused on the cutlass backend, as its
    forward is."""
    @cd.epilogue
    def gelu_take(acc, idx: cd.VecM):
        return {"D": cd.gelu(acc), "zt": cd.take(acc, idx)}
    bw = cd.backward_epilogue(gelu_take)
    assert [p.name for p in bw.params] == ["idx", "saved_acc", "grad_zt"]
    acc = torch.randn(M, N, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(-1, N + 1, (M,))
    g, g_zt = torch.randn(M, N, dtype=torch.float64), torch.randn(M, dtype=torch.float64)
    ys = evaluate_on(gelu_take.program, acc, {"idx": idx}, {})
    ((ys["D"] * g).sum() + (ys["zt"] * g_zt).sum()).backward()
    got = evaluate_on(bw.program, g, {"idx": idx, "saved_acc": acc.detach(), "grad_zt": g_zt}, {})["D"]
    torch.testing.assert_close(got, acc.grad)

    @cd.epilogue
    def swiglu_take(acc, idx: cd.VecM):
        g, u = cd.pairs(acc)
        return {"D": cd.silu(g) * u, "zt": cd.take(acc, idx)}
    assert "grad_zt" not in [p.name for p in cd.backward_epilogue(swiglu_take).params]

    @cd.epilogue
    def index_in_math(acc, idx: cd.VecM):
        return {"D": acc * idx, "zt": cd.take(acc, idx)}
    with pytest.raises(UnsupportedError, match="'idx' holds int64 column indices (.|\n)*reference backend"):
        make_plan(derived_backward(index_in_math), operand_dtypes={"idx": "i64"})


def test_operand_names_that_clash_are_refused():
    @cd.epilogue
    def f(acc, grad_D: cd.Tensor):
        return acc * grad_D
    with pytest.raises(cd.OperandError, match="clashes(.|\n)*fix: rename it"):
        derive(f.program)


_UNARY = ["neg", "exp", "tanh", "sin", "cos", "sigmoid", "abs", "relu", "gelu", "gelu_tanh", "silu", "square", "erf"]
_BINARY = ["add", "sub", "mul", "maximum", "minimum"]
_OF_POSITIVE = ["log", "sqrt", "rsqrt"]  # on x^2 + 1


def _random_program(rng: random.Random, i: int) -> ir.Program:
    leaves = [ir.acc(), ir.load("tensor", "t"), ir.load("vec_n", "b"), ir.load("vec_m", "r"), ir.scalar("s"),
              ir.const(rng.uniform(-2, 2))]
    pool = [ir.acc(), ir.acc()]
    for _ in range(rng.randint(2, 8)):
        r = rng.random()
        if r < 0.35:
            x = ir.compute(rng.choice(_UNARY), rng.choice(pool))
        elif r < 0.7:
            x = ir.compute(rng.choice(_BINARY), rng.choice(pool), rng.choice(pool + leaves))
        elif r < 0.78:
            x = ir.compute("div", rng.choice(pool), ir.compute("add", ir.compute("abs", rng.choice(pool + leaves)),
                                                               ir.const(1.0)))
        elif r < 0.88:
            x = ir.compute("where", ir.compute("gt", rng.choice(pool), rng.choice(leaves)), rng.choice(pool),
                           rng.choice(pool + leaves))
        else:  # (casts are left out: torch rounds the gradient at a cast, the derived backward does not)
            x = ir.compute(rng.choice(_OF_POSITIVE), ir.compute("add", ir.compute("square", rng.choice(pool)),
                                                                 ir.const(1.0)))
        pool.append(x)
    outputs = [ir.Output("D", pool[-1], None)]
    params = (ir.Param("t", "tensor"), ir.Param("b", "vec_n"), ir.Param("r", "vec_m"), ir.Param("s", "scalar"))
    if rng.random() < 0.5:
        kind = rng.choice(["sum", "logsumexp", "take"])
        axes = REDUCTIONS[kind].axes  # a log-sum-exp and a take are per row
        if kind == "take":  # (int64 indices, some outside [0, N): _inputs)
            params += (ir.Param("idx", "vec_m"),)
            stat = ir.reduce(kind, "n", rng.choice(pool[2:]), ir.load("vec_m", "idx"))
        else:
            stat = ir.reduce(kind, rng.choice(axes), rng.choice(pool[2:]))
        if rng.random() < 0.5:  # a finishing step over the statistic
            s = ir.reduced()
            stat = ir.finish(stat, rng.choice([ir.compute("tanh", s), ir.compute("exp", ir.compute("mul", s, ir.const(0.1))),
                                               ir.compute("add", ir.compute("mul", s, s), s)]))
        outputs.append(ir.Output("rows", stat, None))
    return ir.Program(f"random{i}", params, tuple(outputs))


def test_random_programs(seed):
    """200 random differentiable epilogues (sums, log-sum-exps and takes, some finished by .then): derived
    gradients equal torch.autograd's (fp64)."""
    rng = random.Random(seed)
    for i in range(200):
        _check(_random_program(rng, i))


# ---- cd.linear: the autograd-aware call ---------------------------------------------------------------

def _reference_grads(ep, x, w, operands, dys, consts=None):
    """torch.autograd through the reference semantics in fp32: what cd.linear's gradients must equal."""
    from coda_dsl.runtime.reference import accumulator
    program = specialize(ep.program, consts or {})
    leaves = [x, w, *[v for v in operands.values() if isinstance(v, torch.Tensor)]]
    ys = evaluate_on(program, accumulator(x, w), operands, {})
    loss = sum((ys[k] * dys[k]).sum() for k in dys)
    return torch.autograd.grad(loss, leaves, allow_unused=True)


@pytest.mark.parametrize("reduction_output", [None, "lse", "rstd"])
def test_linear_matches_autograd_of_the_reference(reduction_output):
    @cd.epilogue
    def f(acc, bias: cd.VecN, scale: cd.VecM, res: cd.Tensor, alpha: cd.Scalar):
        h = cd.gelu(acc * scale + bias, approximate="tanh") * alpha + res
        if reduction_output == "rstd":  # a finished statistic: the forward also outputs the sum before .then
            return {"D": h, "rstd": cd.sum(h * h, axis="n").then(lambda s: cd.rsqrt(s * alpha + 1e-3))}
        return {"D": h, "lse": cd.logsumexp(h, axis="n")} if reduction_output else h
    m, n, k = 37, 24, 16
    x, w = torch.randn(m, k, requires_grad=True), torch.randn(n, k, requires_grad=True)
    ops = dict(bias=torch.randn(n, requires_grad=True), scale=(torch.rand(m) + 0.5).requires_grad_(),
               res=torch.randn(m, n, requires_grad=True))
    out = cd.linear(x, w, f, backend="reference", alpha=0.7, **ops)
    dys = {name: torch.randn_like(t) for name, t in out.items()}
    torch.autograd.backward(list(out.values()), list(dys.values()))
    want = _reference_grads(f, x, w, {**ops, "alpha": 0.7}, dys)
    for name, t, g in zip(["x", "w", *ops], [x, w, *ops.values()], want):
        assert rel_err(t.grad, g) < 1e-5, f"d{name}"  # fp32, two summation orders: norm-wise


def test_linear_leaves_out_outputs_the_loss_does_not_use():
    """An output with no incoming gradient adds nothing, not 0 * f'(x): sqrt's derivative is NaN where
    acc < 0, and D's gradient must stay finite and right."""
    @cd.epilogue
    def f(acc):
        return {"D": acc * 2.0, "root": cd.sqrt(acc)}
    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(5, 4)
    cd.linear(x, w, f, backend="reference")["D"].sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * w.sum(0).expand(6, 4))


def test_leaving_out_an_output_never_breaks_the_backward():
    """With D unused, h's derivative alone does not tie dy's width to the accumulator's: its declared width does."""
    @cd.epilogue
    def f(acc):
        g, u = cd.pairs(acc)
        return {"D": g * u, "h": g * 2.0}
    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(8, 4)
    cd.linear(x, w, f, backend="reference")["h"].sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * w[0::2].sum(0).expand(6, 4))


def test_learnt_scalars_are_0d_tensors_of_any_float_dtype():
    @cd.epilogue
    def f(acc, s: cd.Scalar):
        return acc * s
    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(5, 4)
    s = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)  # beside fp32 x
    cd.linear(x, w, f, backend="reference", s=s)["D"].sum().backward()
    assert s.grad.dtype == torch.float64 and torch.allclose(s.grad.float(), (x @ w.t()).sum().detach())
    with pytest.raises(cd.OperandError, match="scalar 's' was given as a tensor"):
        cd.linear(x, w, f, backend="reference", s=torch.tensor([0.5], requires_grad=True))
    for bad in (torch.tensor(True), torch.tensor(1j)):  # was used as 1.0 / an internal error
        with pytest.raises(cd.OperandError, match=f"cd.Scalar 's' given as a 0-d tensor of dtype {bad.dtype}"):
            cd.linear(x, w, f, backend="reference", s=bad)
    torch.testing.assert_close(cd.linear(x, w, f, backend="reference", s=torch.tensor(2))["D"], 2 * x @ w.t())


def test_a_scalar_read_by_then_is_not_learnt_silently():
    """Its gradient through .then is not derived, so none is: a 0-d tensor that wants one is refused,
    a number (or a tensor without requires_grad) runs."""
    @cd.epilogue
    def f(acc, s: cd.Scalar):
        return {"D": acc * s, "st": cd.sum(acc, axis="n").then(lambda q: q * s)}
    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(5, 4)
    with pytest.raises(UnsupportedError, match="cd.Scalar 's' inside .then"):
        cd.linear(x, w, f, backend="reference", s=torch.tensor(0.7, requires_grad=True))
    out = cd.linear(x, w, f, backend="reference", s=torch.tensor(0.7))
    out["D"].sum().backward()
    torch.testing.assert_close(x.grad, 0.7 * w.sum(0).expand(6, 4))


def test_outputs_read_back_instead_of_recomputed():
    """A forward value that is also an output (a residual stream h = acc + r) is read back from that output:
    the forward keeps no accumulator and the backward reads neither it nor r. Gradients as torch's, with every
    output used or one unused (the backward then reads what the forward kept); an in-place change of the
    saved output is caught, as torch's own ops catch it. Where reading back would move more, nothing is."""

    @cd.epilogue
    def residual_sumsq(acc, residual: cd.Tensor):
        h = acc + residual
        return {"D": h, "sumsq": cd.sum(h * h, axis="n")}
    back = derive(specialize(residual_sumsq.program, {}))
    assert back.reused == back.saved == ("D",) and not back.uses_acc
    assert {n.attr[1] for n in ir.walk(back.program) if n.op == "load"} == {"grad_D", "grad_sumsq", "saved_D"}
    assert cd.forward_epilogue(residual_sumsq).output_names == ("D", "sumsq")
    fused = cd.backward_epilogue(residual_sumsq)
    assert [p.name for p in fused.params] == ["residual", "grad_sumsq", "saved_D"]
    forward_outs = {"D": torch.ones(2, 3), "sumsq": torch.ones(2)}
    assert cd.saved_operands(fused, forward_outs) == {"saved_D": forward_outs["D"]}
    with pytest.raises(cd.OperandError, match="reads saved_D.*lack"):
        cd.saved_operands(fused, {"sumsq": torch.ones(2)})
    # dacc is also the residual's gradient: cd.linear's backward makes it once (share=True)
    values = {"residual": torch.randn(5, 4), "grad_D": torch.randn(5, 4), "grad_sumsq": torch.randn(5),
              "saved_D": torch.randn(5, 4)}
    dtypes = {"acc": "bf16", "residual": "bf16"}
    got = evaluate_on(back.program, torch.zeros(5, 4), values, dtypes, share=True)
    assert got["acc"] is got["residual"]
    assert evaluate_on(back.program, torch.zeros(5, 4), values, dtypes)["acc"] is not got["residual"]

    x, w, r = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((5, 3), (4, 3), (5, 4)))
    run = lambda x, w, r: cd.linear(x, w, residual_sumsq, residual=r, backend="reference")  # noqa: E731
    assert torch.autograd.gradcheck(lambda *t: tuple(run(*t).values()), (x, w, r))
    for use in ("D", "sumsq"):
        got = torch.autograd.grad(run(x, w, r)[use].sum(), (x, w, r))
        h = x @ w.t() + r
        want = torch.autograd.grad((h if use == "D" else (h * h).sum(-1)).sum(), (x, w, r))
        for g, t in zip(got, want):
            torch.testing.assert_close(g, t)
    out = run(x, w, r)
    out["D"].add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out["sumsq"].sum().backward()

    @cd.epilogue
    def gelu_with_residual(acc, residual: cd.Tensor):  # the derivative reads acc + r, D is gelu of it
        return cd.gelu(acc + residual)
    assert derive(specialize(gelu_with_residual.program, {})).reused == ()

    # recompute: what it computes again reads the outputs read back too (no saved_acc the forward lacks)
    @cd.epilogue
    def residual_and_gelu(acc, r: cd.Tensor):
        h = acc + r
        return {"D": h, "y": cd.gelu(h)}
    assert cd.forward_epilogue(residual_and_gelu).output_names == ("D", "y")
    bw = cd.backward_epilogue(residual_and_gelu, recompute="y")
    assert [p.name for p in bw.params] == ["r", "grad_y", "saved_D"]
    acc, r, dy = torch.randn(5, 6), torch.randn(5, 6), torch.randn(5, 6)
    got = cd.gemm(dy, torch.eye(6), bw, backend="reference", r=r, saved_D=acc + r, grad_y=torch.randn(5, 6))
    torch.testing.assert_close(got["recomputed_y"], torch.nn.functional.gelu(acc + r))
    with pytest.raises(UnsupportedError, match="recompute names 'D'.*reads back"):
        cd.backward_epilogue(residual_and_gelu, recompute="D")


def test_activation_outputs_are_not_read_back():
    """tanh's rule reads its output y: 1 - y^2 from a y rounded to bf16 is 0 wherever tanh rounds to 1 (|x| >= 3),
    so an activation's output is not read back (the accumulator is, in A's dtype, and the fp32 math rounds
    nothing more); an output that is the accumulator itself is, whatever its place among the outputs."""
    for make in (lambda acc: cd.tanh(acc), lambda acc: {"D": cd.tanh(acc), "pre": acc},
                 lambda acc: {"pre": acc, "D": cd.sigmoid(acc)}):
        back = derive(specialize(cd.epilogue(make, name="act").program, {}))
        assert back.reused in ((), ("pre",)) and "D" not in back.reused
    x = torch.tensor([[3.5], [2.5], [5.0], [-4.0]], dtype=torch.bfloat16, requires_grad=True)
    y = cd.linear(x, torch.ones(1, 1, dtype=torch.bfloat16), cd.epilogue(lambda acc: cd.tanh(acc), name="t"),
                  backend="reference")["D"]
    y.float().sum().backward()
    want = 1 - torch.tanh(x.detach().double()) ** 2
    assert ((x.grad.double() - want).abs() / want).max() < 2e-2


def test_linear_keeps_outputs_named_like_its_saved_values_apart():
    """An output named 'acc' is the user's own when the derivative does not read the accumulator, or when it
    is the accumulator (read back as saved_acc); where the derivative reads the accumulator and 'acc' is
    something else (or an output is named saved_<statistic>), the clash is refused with the fix."""
    @cd.epilogue
    def linear_acc(acc):
        return {"D": acc * 2.0, "acc": acc}

    @cd.epilogue
    def gelu_acc(acc):
        return {"D": cd.gelu(acc), "acc": acc * 2.0}

    @cd.epilogue
    def gelu_and_acc(acc):
        return {"D": cd.gelu(acc), "acc": acc}

    @cd.epilogue
    def saved(acc):
        return {"s": cd.sum(acc * acc, axis="n").then(cd.rsqrt), "saved_s": cd.sum(acc, axis="n")}
    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(5, 4)
    out = cd.linear(x, w, linear_acc, backend="reference")
    torch.testing.assert_close(out["acc"], x.detach() @ w.t())
    (out["D"].sum() + out["acc"].sum()).backward()
    torch.testing.assert_close(x.grad, 3.0 * w.sum(0).expand(6, 4))
    for ep, name in ((gelu_acc, "acc"), (saved, "saved_s")):
        with pytest.raises(cd.OperandError, match=f"output named '{name}'.*rename"):
            cd.linear(x, w, ep, backend="reference")
    x.grad = None
    out = cd.linear(x, w, gelu_and_acc, backend="reference")
    (out["D"].sum() + out["acc"].sum()).backward()
    xd = x.detach().requires_grad_()
    (torch.nn.functional.gelu(xd @ w.t()).sum() + (xd @ w.t()).sum()).backward()
    torch.testing.assert_close(x.grad, xd.grad)
    bw = cd.backward_epilogue(gelu_and_acc)  # one saved_acc: the accumulator, which the forward outputs as acc
    assert [p.name for p in bw.params] == ["saved_acc", "grad_acc"]

    @cd.epilogue
    def named_like_read_back(acc, r: cd.Tensor):  # D is read back as the backward epilogue's operand saved_D
        h = acc + r
        return {"D": h, "sumsq": cd.sum(h * h, axis="n"), "saved_D": acc * 3.0}
    with pytest.raises(cd.OperandError, match="output named 'saved_D'.*reads output 'D' back as(.|\n)*rename"):
        cd.backward_epilogue(named_like_read_back)  # saved_operands would take the user's saved_D for it

    @cd.epilogue
    def named_like_a_statistic_read(acc):  # lse's derivative reads lse, as saved_lse
        return {"D": acc * 2.0, "lse": cd.logsumexp(acc, axis="n"), "saved_lse": acc * 3.0}
    with pytest.raises(cd.OperandError, match="output named 'saved_lse'.*reads output 'lse' back as"):
        cd.backward_epilogue(named_like_a_statistic_read)
    xd, rd = x.detach().double().requires_grad_(), torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, r: tuple(cd.linear(x, w.double(), named_like_read_back, r=r,
                                                                 backend="reference").values()), (xd, rd))


def test_gemm_has_no_derivative_on_any_backend():
    """cd.gemm's reference backend computes with torch ops, but its gradient is not offered: the kernel and
    torch.compile's custom op have none, so training code written on the CPU would lose it on the GPU."""
    @cd.epilogue
    def f(acc, bias: cd.VecN):
        return cd.gelu(acc + bias)
    x, w, b = torch.randn(6, 4, requires_grad=True), torch.randn(8, 4), torch.randn(8)
    y = cd.gemm(x, w, f, backend="reference", bias=b)["D"]
    with pytest.raises(UnsupportedError, match="cd.gemm has no derivative.*\n.*cd.linear"):
        y.sum().backward()
    with pytest.raises(cd.OperandError, match="out= with inputs that require grad"):
        cd.gemm(x, w, f, backend="reference", bias=b, out={"D": torch.empty(6, 8)})
    with torch.no_grad():
        assert not cd.gemm(x, w, f, backend="reference", bias=b)["D"].requires_grad
    torch.testing.assert_close(y, cd.linear(x, w, f, backend="reference", bias=b)["D"])


def test_linear_swiglu_trains_only_what_requires_grad():
    from coda_dsl.library import swiglu
    x, w = torch.randn(20, 16), torch.randn(32, 16, requires_grad=True)
    y = cd.linear(x, w, swiglu, backend="reference")["D"]
    assert y.shape == (20, 16)
    y.square().sum().backward()
    assert x.grad is None and w.grad is not None
    w2 = w.detach().clone().requires_grad_()
    h = x @ w2.t()
    (torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]).square().sum().backward()
    assert rel_err(w.grad, w2.grad) < 1e-5


def test_linear_refuses_what_it_cannot_differentiate():
    @cd.epilogue
    def f(acc):
        return {"D": acc, "m": cd.max(acc, axis="n")}
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8)
    out = cd.linear(x, w, f, backend="reference")  # a statistic with no derivative is computed ...
    out["D"].sum().backward()  # ... and trains what does not depend on it (an fp8 scale's amax, say)
    torch.testing.assert_close(x.grad, w.sum(0).expand(4, 8))
    with pytest.raises(UnsupportedError, match="depends on output 'm', a cd.max"):
        cd.linear(x, w, f, backend="reference")["m"].sum().backward()

    @cd.epilogue
    def picked(acc, idx: cd.VecM):  # cd.take's int64 indices: an operand with no gradient (fp32 x: not fp64's path)
        return {"D": acc * 2.0, "picked": cd.take(acc, idx, axis="n")}
    x.grad = None
    cd.linear(x, w, picked, backend="reference", idx=torch.randint(0, 8, (4,)))["D"].sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * w.sum(0).expand(4, 8))
    # compiled: at once (AOTAutograd gives an unused output zeros, not None), with the fix (Dynamo's wrapper)
    with pytest.raises(Exception, match="output 'm', a statistic with no derivative yet(.|\n)*fix: compute it"):
        torch.compile(lambda x: cd.linear(x, w, f, backend="reference")["D"], fullgraph=True, backend="aot_eager")(x)
    with torch.no_grad():  # no gradient wanted: the plain fused GEMM, nothing derived
        assert cd.linear(x, w, f, backend="reference")["m"].shape == (4,)
    with pytest.raises(cd.OperandError, match="2-D"):
        cd.linear(torch.randn(2, 4, 8), torch.randn(8, 8), backend="reference")
    with pytest.raises(cd.OperandError, match="B must be a 2-D weight"):  # not cd.gemm's advice for batched B
        cd.linear(x, torch.randn(1, 8, 8), backend="reference")
    with pytest.raises(cd.OperandError, match="B must be a 2-D weight"):  # both batched: flattening A cannot help
        cd.linear(torch.randn(2, 4, 8), torch.randn(2, 8, 8), backend="reference")
    for option in ({"out": {"D": torch.empty(4, 8)}}, {"accumulate": True}):
        with pytest.raises(cd.OperandError, match="autograd cannot record"):
            cd.linear(x, torch.randn(8, 8), backend="reference", **option)
    y = cd.linear(x, torch.randn(8, 8), backend="reference", deterministic=True, tune=False)["D"]
    assert y.requires_grad  # cd.gemm's options reach the forward kernel; autograd still records


@pytest.mark.parametrize("uses", [("D",), ("D", "rstd")])
def test_linear_under_torch_compile_and_checkpointing(uses):
    """torch.compile(fullgraph=True) traces cd.linear with no graph break, also as the epilogue's first use
    (its derivation is run, not traced), and activation checkpointing recomputes it: both give the eager
    gradients, with every output in the loss or one left unused."""
    from torch.utils.checkpoint import checkpoint

    @cd.epilogue
    def bias_gelu_rstd(acc, bias: cd.VecN):
        h = cd.gelu(acc + bias, approximate="tanh")
        return {"D": h, "rstd": cd.sum(h * h, axis="n").then(lambda s: cd.rsqrt(s + 1.0))}

    def loss(x, w, b):
        outs = cd.linear(x, w, bias_gelu_rstd, backend="reference", bias=b)
        return sum(outs[name].square().sum() for name in uses)

    leaves = (torch.randn(16, 32, requires_grad=True), torch.randn(24, 32, requires_grad=True),
              torch.randn(24, requires_grad=True))
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    first = torch.autograd.grad(compiled(*leaves), leaves)  # before any eager call
    want = torch.autograd.grad(loss(*leaves), leaves)
    for got in (first, torch.autograd.grad(checkpoint(loss, *leaves, use_reentrant=False), leaves)):
        for g, w in zip(got, want):
            assert rel_err(g, w) < 1e-6


@pytest.mark.parametrize("dynamic", [None, True])
def test_linear_with_a_const_under_torch_compile(dynamic):
    """A cd.Const given as a float input of the compiled function (traced symbolically under dynamic shapes,
    or once its value changes): specialized to its value (it shapes the derived backward), so each value gets
    its own graph and the eager gradients."""
    @cd.epilogue
    def leaky(acc, slope: cd.Const):
        return cd.where(acc > 0, acc, acc * slope)

    def loss(x, w, slope):
        return cd.linear(x, w, leaky, backend="reference", slope=slope)["D"].square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for slope in (0.1, 0.3):
        x, w = torch.randn(9, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
        got = torch.autograd.grad(compiled(x, w, slope), (x, w))
        for g, e in zip(got, torch.autograd.grad(loss(x, w, slope), (x, w))):
            assert rel_err(g, e) < 1e-6


def test_second_order_gradients_raise():
    """The backward reads the saved accumulator, which has no graph to x or W: a gradient of the gradient
    would silently miss those paths, so it raises instead, also in a gradient penalty whose first-order
    part alone would go through (torch's once_differentiable gave w a gradient without the penalty's)."""
    @cd.epilogue
    def gelu(acc):
        return cd.gelu(acc)

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    y = cd.linear(x, w, gelu, backend="reference")["D"]
    gx, = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(cd.UnsupportedError, match="cd.linear has no second derivative"):
        torch.autograd.grad(gx.square().sum(), w)
    with pytest.raises(cd.UnsupportedError, match="cd.linear has no second derivative"):
        (y.sum() + gx.square().sum()).backward()
    # a head's parameter that reaches cd.linear's backward only through the incoming gradient (an input-
    # gradient penalty): its second derivative came back None, as if unused
    p = torch.randn(4, 6, requires_grad=True)
    gx, = torch.autograd.grad((cd.linear(x, w, gelu, backend="reference")["D"].tanh() * p).sum(), x, create_graph=True)
    with pytest.raises(cd.UnsupportedError, match="cd.linear has no second derivative"):
        torch.autograd.grad(gx.square().sum(), p, allow_unused=True)


def test_operands_of_other_widths_whose_gradient_comes_from_a_row_statistic():
    """An [M, N/2] cd.Tensor or [N/2] cd.VecN next to cd.pairs(acc) (also N/4 and 4N: nested pairs and
    interleaves), whose gradient comes only through a row sum: the gradient is the same in every column (no
    width of its own); it comes back in the operand's shape (it was N wide, which autograd refused; at N/4
    and 4N an internal error)."""
    @cd.epilogue
    def tensor_half(acc, r: cd.Tensor):
        g, u = cd.pairs(acc)
        return {"rs": cd.sum(g * u + r, axis="n")}

    @cd.epilogue
    def vec_half(acc, b: cd.VecN):
        g, u = cd.pairs(acc)
        return {"rs": cd.sum(g * u + b, axis="n")}

    @cd.epilogue
    def vec_quarter(acc, b: cd.VecN):
        g, u = cd.pairs(cd.pairs(acc)[0])
        return {"rs": cd.sum(g * u + b, axis="n")}

    @cd.epilogue
    def tensor_quadruple(acc, r: cd.Tensor):
        return {"rs": cd.sum(cd.interleave(cd.interleave(acc, acc), cd.interleave(acc, acc)) + r, axis="n")}

    f64 = dict(dtype=torch.float64)
    x, w = torch.randn(4, 3, **f64, requires_grad=True), torch.randn(8, 3, **f64, requires_grad=True)
    for ep, operand, ref in (
            (tensor_half, torch.randn(4, 4, **f64), lambda a, t: a[:, 0::2] * a[:, 1::2] + t),
            (vec_half, torch.randn(4, **f64), lambda a, t: a[:, 0::2] * a[:, 1::2] + t),
            (vec_quarter, torch.randn(2, **f64), lambda a, t: a[:, 0::4] * a[:, 2::4] + t),
            (tensor_quadruple, torch.randn(4, 32, **f64), lambda a, t: a.repeat_interleave(4, -1) + t)):
        name = ep.params[0].name
        operand.requires_grad_()
        got = cd.linear(x, w, ep, backend="reference", **{name: operand})["rs"]
        want = ref(x @ w.t(), operand).sum(-1)
        dy = torch.randn(4, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(got, (x, w, operand), dy), torch.autograd.grad(want, (x, w, operand), dy)):
            assert a.shape == b.shape and rel_err(a, b) < 1e-12


def test_const_given_as_a_tensor_is_refused_as_cd_gemm_refuses_it():
    @cd.epilogue
    def scaled(acc, c: cd.Const):
        return acc * c

    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(6, 3)
    with pytest.raises(cd.OperandError, match=r"'c' \(const\) must be a number"):
        cd.linear(x, w, scaled, backend="reference", c=torch.ones(2))


def test_two_epilogues_derived_while_one_graph_is_traced():
    """torch.compile(fullgraph=True) of two cd.linear calls whose epilogues were never derived: Dynamo calls
    the derivation for each while tracing (the second one's lookup was a KeyError: Dynamo read the cache
    dict from its own copy)."""
    @cd.epilogue
    def to_fp32(acc):
        return cd.cast(acc, torch.float32)

    @cd.epilogue
    def relu_now(acc):
        return cd.maximum(acc, 0.0)

    def f(a, w):
        return cd.linear(cd.linear(a, w, to_fp32, backend="reference")["D"], w, relu_now, backend="reference")["D"]

    a, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(a, w)
    want = torch.relu((a @ w.t()) @ w.t())
    assert rel_err(got, want) < 1e-5
    ga = torch.autograd.grad(got.sum(), a)[0]
    assert rel_err(ga, torch.autograd.grad(want.sum(), a)[0]) < 1e-5


def test_new_epilogues_elsewhere_do_not_recompile_a_compiled_step():
    """A compiled training step with cd.linear recompiles when its inputs change, not when the process
    makes new IR nodes elsewhere (a new epilogue, a new cd.Const value): tracing the derived backward
    once guarded on the DSL's node-interning table, so every new node anywhere recompiled the step, and
    after 8 recompiles torch.compile runs it eagerly, silently."""
    @cd.epilogue
    def leaky(acc, slope: cd.Const):
        return cd.where(acc > 0, acc, acc * slope)

    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    def step(x, w):
        return cd.linear(x, w, leaky, slope=0.1, backend="reference")["D"].square().mean()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    x, w = torch.randn(16, 8, requires_grad=True), torch.randn(12, 8, requires_grad=True)
    compiled(x, w).backward()
    first = len(compiles)
    for slope in (0.2, 0.3, 0.4):  # new nodes: another Const value's specialization and its derivative
        cd.linear(x, w, leaky, slope=slope, backend="reference")["D"].sum().backward()
        cd.epilogue(lambda acc: acc * slope, name="fresh")  # noqa: B023
    compiled(x, w).backward()
    assert len(compiles) == first


def test_outputs_that_do_not_depend_on_the_accumulator_give_zero_gradients():
    """cd.round(acc) + b: dacc is 0 everywhere; x and W get zeros, as torch gives them (None would make
    optimizers skip the parameter and DDP call it unused)."""
    @cd.epilogue
    def rounded(acc, b: cd.VecN):
        return cd.round(acc) + b

    x, w, b = (torch.randn(*s, requires_grad=True) for s in ((4, 3), (8, 3), (8,)))
    cd.linear(x, w, rounded, backend="reference", b=b)["D"].sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))
    assert torch.equal(b.grad, torch.full_like(b, 4.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("pairwise", [False, True], ids=["operand", "columns of it"])
def test_gradients_never_share_memory_with_the_incoming_gradient(dtype, pairwise):
    """acc + r: r's gradient is dy itself; acc + interleave(r, s): r's is dy's even columns (at M = 1 a
    contiguous view). Handed to autograd as (a view of) dy, it became r.grad, and the next backward added into
    it in place: the caller's dy changed and r.grad, W.grad came out wrong. (bf16 and fp16 gradients are
    rounded from fp32 math: new tensors.)"""
    @cd.epilogue
    def res(acc, r: cd.Tensor):
        return acc + r

    @cd.epilogue
    def res_pairs(acc, r: cd.Tensor, s: cd.Tensor):
        return acc + cd.interleave(r, s)

    torch.manual_seed(0)
    m, n = (1, 2) if pairwise else (5, 3)
    x, w = torch.randn(m, 4, dtype=dtype), torch.randn(n, 4, dtype=dtype, requires_grad=True)
    ops = {"r": torch.randn(m, n // 2, dtype=dtype), "s": torch.randn(m, n // 2, dtype=dtype)} if pairwise else \
        {"r": torch.randn(m, n, dtype=dtype)}
    ops = {k: v.requires_grad_() for k, v in ops.items()}
    g = torch.randn(m, n, dtype=dtype)
    g0 = g.clone()
    for _ in range(3):  # one incoming gradient, three accumulated backwards
        cd.linear(x, w, res_pairs if pairwise else res, backend="reference", **ops)["D"].backward(g)
    assert torch.equal(g, g0)
    for t in ops.values():
        assert t.grad.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
    want = g0[:, 0::2] if pairwise else g0
    assert torch.allclose(ops["r"].grad, 3 * want) and torch.allclose(w.grad, 3 * g0.t() @ x)


def test_fp16_keeps_its_accumulator_in_fp32():
    """fp16 ends at 65504, this accumulator at 102400: kept for sin's derivative in fp16 it was inf (NaN
    gradients); cd.linear keeps it in fp32."""

    @cd.epilogue
    def scaled_sin(acc):
        return cd.sin(acc * 1e-5)

    def loss(x, w):
        return cd.linear(x, w, scaled_sin, backend="reference")["D"].float().sum()

    xd, wd = torch.full((2, 64), 40.0, dtype=torch.float64), torch.full((3, 64), 40.0, dtype=torch.float64)
    xd.requires_grad_(), wd.requires_grad_()
    torch.sin((xd @ wd.t()) * 1e-5).sum().backward()
    for run in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):  # the kernel's output dtype
        x, w = (t.detach().half().requires_grad_() for t in (xd, wd))           # is the traced one's too
        run(x, w).backward()
        assert rel_err(x.grad, xd.grad) < 1e-2 and rel_err(w.grad, wd.grad) < 1e-2
    outputs = lambda ep: {o.name: o.dtype for o in ep.program.outputs}  # noqa: E731  what a prebuild builds
    assert outputs(cd.forward_epilogue(scaled_sin, dtype=torch.float16))["acc"] == "fp32"
    assert outputs(cd.forward_epilogue(scaled_sin))["acc"] is None  # A's dtype: bf16 has fp32's range
    for name in ("fp16", "float16", "torch.float16"):  # names, as cd.cast takes them
        assert outputs(cd.forward_epilogue(scaled_sin, dtype=name))["acc"] == "fp32"
    for bad in ("int8", "fp8", torch.int32):
        with pytest.raises(cd.OperandError, match=f"dtype is A's, a torch floating dtype or its name, not {bad!r}"):
            cd.forward_epilogue(scaled_sin, bad)


def test_fused_backward_step_equals_the_eager_one():
    """On CUDA the derived program runs through torch.compile (runtime/torch_compile.py); here compiled on the CPU,
    with the operand kinds, a statistic output and column pairs (widths under symbolic shapes)."""
    from coda_dsl.library import swiglu
    from coda_dsl.passes.autodiff import GRAD
    from coda_dsl.runtime.autograd import _derive

    @cd.epilogue
    def f(acc, bias: cd.VecN, scale: cd.VecM, alpha: cd.Scalar):
        h = cd.gelu(acc * scale + bias, approximate="tanh") * alpha
        return {"D": h, "lse": cd.logsumexp(h, axis="n")}
    m, n = 37, 24
    for ep, ops, dys in ((f, dict(bias=torch.randn(n), scale=torch.rand(m) + 0.5, alpha=0.7),
                          {"D": torch.randn(m, n), "lse": torch.randn(m)}),
                         (swiglu, {}, {"D": torch.randn(m, n // 2)})):
        derived = _derive(ep, {})
        acc = torch.randn(m, n).bfloat16()
        operands = {**ops, **{GRAD + k: v for k, v in dys.items()}}
        if derived.back.saved:  # the statistic the derivative reads: the forward's own
            fwd = cd.gemm(acc.float(), torch.eye(n), ep, backend="reference", **ops)
            operands.update({"saved_" + k: fwd[k] for k in derived.back.saved})
        dtypes = {"acc": "bf16", **{k: "fp32" for k, v in ops.items() if isinstance(v, torch.Tensor)}}
        eager = derived.backward(acc, operands, dtypes)  # CPU tensors: not compiled
        for t in (acc, *(v for v in operands.values() if isinstance(v, torch.Tensor))):
            torch._dynamo.mark_dynamic(t, 0)  # symbolic sizes, as after torch_compile.on_cuda's one recompile
            if t.dim() == 2:
                torch._dynamo.mark_dynamic(t, 1)
        fused = torch.compile(derived.backward.eager)(acc, operands, dtypes)
        assert eager.keys() == fused.keys() and eager["acc"].dtype == torch.bfloat16
        for k in eager:
            assert rel_err(fused[k], eager[k]) < 2e-3, k  # the same math, fused: bf16 rounding apart


def test_backward_epilogue_fuses_into_the_producer_gemm():
    """cd.backward_epilogue: the derived backward on the GEMM that produces the incoming gradient (acc = dY),
    the forward's accumulator as `saved_acc`. SwiGLU's (the library's swiglu_backward) lowers to
    the double-width nodes; bias + GELU's also gives the bias gradient (a sum over m)."""
    from coda_dsl.library import swiglu
    from coda_dsl.passes import lower, specialize
    from coda_dsl.passes.plan import Pack, Signature, Unpack, WideLoad, WideStore
    m, f, d = 29, 20, 24
    w_next, dout = torch.randn(d, f), torch.randn(m, d)
    pre = (3 * torch.randn(m, 2 * f)).requires_grad_()
    bw = cd.backward_epilogue(swiglu)
    got = cd.gemm(dout, w_next.t(), bw, saved_acc=pre.detach(), backend="reference")["D"]
    y = torch.nn.functional.silu(pre[:, 0::2]) * pre[:, 1::2]
    (y @ w_next.t()).backward(dout)
    assert rel_err(got, pre.grad) < 1e-5
    plan = lower(specialize(bw.program, {}), Signature("bf16", "nk", (("saved_acc", "bf16"),), (("D", "bf16"),)))
    kinds = [type(n) for n in plan.nodes]
    assert [kinds.count(k) for k in (WideLoad, Unpack, Pack, WideStore)] == [1, 2, 1, 1]
    assert not any(f.pairwise for f in plan.functors)

    @cd.epilogue
    def bias_gelu(acc, bias: cd.VecN):
        return cd.gelu(acc + bias, approximate="tanh")
    n = 16
    acc, bias = torch.randn(m, n, requires_grad=True), torch.randn(n, requires_grad=True)
    w_next = torch.randn(d, n)
    torch.nn.functional.gelu(acc + bias, approximate="tanh").matmul(w_next.t()).backward(dout)
    got = cd.gemm(dout, w_next.t(), cd.backward_epilogue(bias_gelu), saved_acc=acc.detach(), bias=bias.detach(),
                  backend="reference")
    assert rel_err(got["D"], acc.grad) < 1e-5 and rel_err(got["bias"], bias.grad) < 1e-5
    with pytest.raises(cd.OperandError, match=r"no output 'nope' with a gradient\n  fix: output= one of \['D'\]"):
        cd.backward_epilogue(bias_gelu, output="nope")

    @cd.epilogue
    def row_lse(acc):
        return cd.logsumexp(acc)
    with pytest.raises(UnsupportedError, match="is a reduction.*nothing to fuse"):
        cd.backward_epilogue(row_lse)

    @cd.epilogue
    def gated_by_a_row_value(acc, r: cd.VecM):  # a computed uniform factor narrows like a leaf one
        g, u = cd.pairs(acc)
        return cd.silu(g) * u * cd.tanh(r)
    from coda_dsl import cli
    assert cli.specialization_from_options(cd.backward_epilogue(gated_by_a_row_value), "bf16").cu_text
    assert cd.forward_epilogue(bias_gelu).output_names == ("D", "acc")  # what cd.linear's forward kernel runs


def test_outputs_without_a_gradient():
    """no_grad: an output kept for the backward (SwiGLU's pre-activation) gets no grad_<name> operand; the
    derived backward is then SwiGLU's. Unknown names are refused."""
    from coda_dsl.library import swiglu, swiglu_keep_preactivation
    keep = cd.backward_epilogue(swiglu_keep_preactivation)  # reads the accumulator back from pre
    assert {p.name for p in keep.params} == {"saved_pre", "grad_pre"}
    bw = cd.backward_epilogue(swiglu_keep_preactivation, no_grad=("pre",))
    assert [p.name for p in bw.params] == ["saved_pre"] and bw.output_names == ("D",)
    dy, acc = torch.randn(9, 6), torch.randn(9, 12)
    want = cd.gemm(dy, torch.eye(6), cd.backward_epilogue(swiglu), saved_acc=acc, backend="reference")["D"]
    got = cd.gemm(dy, torch.eye(6), bw, saved_pre=acc, backend="reference")["D"]
    assert torch.equal(got, want)
    assert cd.backward_epilogue(swiglu_keep_preactivation, no_grad="pre").output_names == ("D",)  # one name
    with pytest.raises(cd.OperandError, match=r"no_grad names \['y'\], which are not outputs(.|\n)*fix: name"):
        cd.backward_epilogue(swiglu_keep_preactivation, no_grad=("y",))
    with pytest.raises(UnsupportedError, match="recompute names 'pre', which is not a computed"):
        cd.backward_epilogue(swiglu_keep_preactivation, no_grad="pre", recompute="pre")  # saved_acc itself

    @cd.epilogue
    def gated_by(acc, D_even: cd.VecN):  # its gradient would be an output named D_even too
        g, u = cd.pairs(acc)
        return cd.silu(g) * u * D_even
    with pytest.raises(cd.OperandError, match=r"two outputs named \['D_even'\](.|\n)*fix: rename"):
        cd.backward_epilogue(gated_by, split=True)


def test_backward_epilogue_narrows_a_pairwise_forward_with_a_row_operand():
    """rms_swiglu (rstd per row, then SwiGLU of the interleaved pairs), derived and fused: the 2N-wide
    intermediates are taken apart (pairs onto saved_acc, math inside the interleave, rstd's row sum over
    both halves), so it lowers to the kernels' nodes; split=True gives the two halves' gradients apart.
    Values against torch.autograd."""
    from coda_dsl.passes import lower, specialize
    from coda_dsl.passes.plan import Pack, Reduce, Signature, Unpack, WideLoad, WideStore

    @cd.epilogue
    def rms_swiglu(acc, rstd: cd.VecM):
        g, u = cd.pairs(rstd * acc)
        return cd.silu(g) * u
    m, f, d = 13, 10, 6
    dout, w_down = torch.randn(m, d), torch.randn(d, f)
    acc, rstd = torch.randn(m, 2 * f, requires_grad=True), (torch.rand(m) + 0.5).requires_grad_()
    pre = rstd[:, None] * acc
    (torch.nn.functional.silu(pre[:, 0::2]) * pre[:, 1::2]).matmul(w_down.t()).backward(dout)
    for split, outs in ((False, ("D", "rstd")), (True, ("D_even", "D_odd", "rstd"))):
        bw = cd.backward_epilogue(rms_swiglu, split=split)
        assert bw.output_names == outs
        got = cd.gemm(dout, w_down.t(), bw, saved_acc=acc.detach(), rstd=rstd.detach(), backend="reference")
        dacc = torch.stack((got["D_even"], got["D_odd"]), -1).flatten(-2) if split else got["D"]
        assert rel_err(dacc, acc.grad) < 1e-5 and rel_err(got["rstd"], rstd.grad) < 1e-5
        # a row operand's gradient is a reduction: fp32 like every reduction output, on every backend and
        # in torch.compile's fake outputs (runtime/torch_op.py reads the program's dtype)
        assert bw.program.output("rstd").dtype == "fp32"
        sig = Signature("bf16", "nk", (("rstd", "fp32"), ("saved_acc", "bf16")),
                        tuple((o, "fp32" if o == "rstd" else "bf16") for o in outs))
        kinds = [type(n) for n in lower(specialize(bw.program, {}), sig).nodes]
        assert [kinds.count(k) for k in (WideLoad, Unpack, Reduce)] == [1, 2, 1]
        assert [kinds.count(k) for k in (Pack, WideStore)] == ([0, 0] if split else [1, 1])

    # recompute: y again, from the saved accumulator, for a forward that does not keep it
    bw = cd.backward_epilogue(rms_swiglu, split=True, recompute=("D",))
    assert bw.output_names == ("D_even", "D_odd", "rstd", "recomputed_D")
    got = cd.gemm(dout, w_down.t(), bw, saved_acc=acc.detach(), rstd=rstd.detach(), backend="reference")
    y = torch.nn.functional.silu(pre[:, 0::2]) * pre[:, 1::2]
    assert rel_err(got["recomputed_D"], y) < 1e-6 and rel_err(got["rstd"], rstd.grad) < 1e-5
    sig = Signature("bf16", "nk", (("rstd", "fp32"), ("saved_acc", "bf16")),
                    tuple((o, "fp32" if o == "rstd" else "bf16") for o in bw.output_names))
    kinds = [type(n).__name__ for n in lower(specialize(bw.program, {}), sig).nodes]
    assert kinds.count("AuxStore") == 3 and kinds.count("WideLoad") == 1

    @cd.epilogue
    def with_statistic(acc):
        g, u = cd.pairs(acc)
        y = cd.silu(g) * u
        return {"D": y, "ss": cd.sum(y * y, axis="n")}
    for name, error in (("ss", UnsupportedError), ("nope", cd.OperandError)):  # a statistic; a typo
        with pytest.raises(error, match=f"recompute names '{name}'(.|\n)*fix: recompute one of \\['D'\\]"):
            cd.backward_epilogue(with_statistic, recompute=(name,), no_grad=("ss",))

    @cd.epilogue
    def scaled_relu(acc, s: cd.VecM):
        return cd.relu(acc * s)
    with pytest.raises(UnsupportedError, match="split=True needs a pairwise forward"):
        cd.backward_epilogue(scaled_relu, split=True)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_derivatives_in_fp32_match_torch_at_every_magnitude(approximate):
    """The GELU rules are factored for fewer ops (tanh's through a sigmoid, erf's cdf as torch's, with no
    division); in fp32 they stay within 2e-6 of torch's fp64 derivative from tiny to huge |x| (no inf * 0
    where x^3 overflows but the derivative is still finite), relatively no further than torch's own fp32 form."""
    x = torch.cat([torch.tensor([0.0, 1e-30, -1e-30]), torch.logspace(-6, 18.5, 60), -torch.logspace(-6, 18.5, 60),
                   torch.linspace(-12.0, 12.0, 2001)])
    program = cd.epilogue(lambda acc: cd.gelu(acc, approximate=approximate), name="gelu").program
    back = derive(specialize(program, {}))
    assert not {"tanh", "div", "where"} & {n.op for n in ir.walk(back.program)}  # the kernels' costly ops
    got = evaluate_on(back.program, x[None], {GRAD + "D": torch.ones(1, len(x))}, {})[ACC][0]

    def torch_grad(v):
        v = v.clone().requires_grad_()
        torch.nn.functional.gelu(v, approximate=approximate).sum().backward()
        return v.grad
    want, torch_fp32 = torch_grad(x.double()), torch_grad(x).double()
    assert torch.isfinite(got).all()
    err = (got.double() - want).abs()
    assert err.max() < 3e-6  # the derivative is at most ~1.13
    big = want.abs() > 1e-3  # (near the zero at x ~ -0.75 any fp32 form loses its relative precision)
    rel = lambda e: (e / want.abs())[big].max()  # noqa: E731
    assert rel(err) < 5e-5 and rel(err) <= 1.5 * rel((torch_fp32 - want).abs())


def test_backward_epilogue_explains_a_constant_named_like_its_options():
    """A cd.Const named like an option of cd.backward_epilogue could never get its value (the keyword binds to
    the option): refused with the fix, not 'pass split=<number>'. A plain function is explained too."""
    @cd.epilogue
    def scaled(acc, split: cd.Const):
        return cd.gelu(acc * split)
    with pytest.raises(cd.OperandError, match="cd.Const named 'split'.*\n.*rename the constant"):
        cd.backward_epilogue(scaled, split=2.0)
    with pytest.raises(cd.EpilogueError, match="decorated with @cd.epilogue"):
        cd.backward_epilogue(lambda acc: acc)


def test_derivation_entry_points_check_what_they_are_given():
    """cd.forward_epilogue, derived_backward, cd.backward_epilogue and cd.saved_operands explain a plain function,
    a misspelt option or unknown constant (not swallowed), and a constant that is no number, as cd.gemm does."""
    from coda_dsl.runtime.autograd import derived_backward

    @cd.epilogue
    def scaled(acc, b: cd.VecN, c: cd.Const):
        return {"D": cd.gelu(acc * c + b), "pre": acc}
    for fn in (cd.forward_epilogue, derived_backward, cd.backward_epilogue):
        with pytest.raises(cd.EpilogueError, match="decorated with @cd.epilogue"):
            fn(lambda acc: acc)
        with pytest.raises(cd.OperandError, match=r"unexpected keyword\(s\) \['zz'\](.|\n)*parameters are \['c'\]"):
            fn(scaled, c=2.0, zz=1)
        for bad in ("2.0", None, [1]):
            with pytest.raises(cd.OperandError, match="'c' \\(const\\) must be a number"):
                fn(scaled, c=bad)
    with pytest.raises(cd.OperandError, match=r"\['nograd'\](.|\n)*options are \['output', 'split', 'no_grad'"):
        cd.backward_epilogue(scaled, c=2.0, nograd="pre")
    with pytest.raises(cd.EpilogueError, match="saved_operands: .*decorated with @cd.epilogue"):
        cd.saved_operands(lambda acc: acc, {})
    with pytest.raises(cd.OperandError, match="dict of outputs"):
        cd.saved_operands(cd.backward_epilogue(scaled, c=2.0), [torch.ones(2)])


def test_saved_operands_take_a_finished_statistic_before_its_then():
    """A statistic under .then is read by the backward before .then: saved_operands takes it from the forward
    kernel's saved_<name> output, never the finished <name> of a plain call's outputs (which gave a dacc 3.7x
    off, silently). Only a derived backward names where its saved operands come from."""
    @cd.epilogue
    def residual_rms(acc, residual: cd.Tensor):
        h = acc + residual
        return {"D": h, "rstd": cd.sum(h * h, axis="n").then(lambda s: cd.rsqrt(s * 0.125 + 1e-5))}

    bw = cd.backward_epilogue(residual_rms)
    assert bw.saved_from == {"saved_acc": "acc", "saved_rstd": "saved_rstd", "saved_D": "D"}
    x, w, r = torch.randn(5, 3), torch.randn(8, 3), torch.randn(5, 8)
    outs = cd.gemm(x, w, cd.forward_epilogue(residual_rms, dtype=torch.float32), backend="reference", residual=r)
    saved = cd.saved_operands(bw, outs)
    assert saved["saved_rstd"] is outs["saved_rstd"] and saved["saved_D"] is outs["D"]
    with pytest.raises(cd.OperandError, match=r"reads saved_rstd, the output 'saved_rstd'.*lack \(\['D', 'rstd'\]\)"):
        cd.saved_operands(bw, cd.gemm(x, w, residual_rms, backend="reference", residual=r))
    with pytest.raises(cd.OperandError, match="'residual_rms' is not a derived backward"):
        cd.saved_operands(residual_rms, outs)
    assert set(cd.saved_operands(derived_backward(residual_rms), outs)) == {"saved_rstd", "saved_D"}


def test_backward_epilogue_leaves_out_statistics_with_no_derivative():
    """An fp8 scale's amax beside the activation: cd.backward_epilogue leaves it out (no grad_amax operand), as
    cd.linear and derived_backward do, and its gradients are torch's."""
    @cd.epilogue
    def gelu_amax(acc, b: cd.VecN):
        y = cd.gelu(acc + b)
        return {"D": y, "amax": cd.amax(y, axis=None)}
    bw = cd.backward_epilogue(gelu_amax)
    assert [p.name for p in bw.params] == ["b", "saved_acc"] and bw.output_names == ("D", "b")
    assert [p.name for p in cd.backward_epilogue(gelu_amax, no_grad="amax").params] == ["b", "saved_acc"]
    x, w, b = torch.randn(6, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64), torch.randn(5)
    g, v = torch.randn(6, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    acc = x @ w.t()
    got = cd.gemm(g, v, bw, b=b.double(), saved_acc=acc, backend="reference")
    a = acc.clone().requires_grad_()
    bd = b.double().requires_grad_()
    torch.autograd.backward(torch.nn.functional.gelu(a + bd), g @ v.t())
    torch.testing.assert_close(got["D"], a.grad)
    torch.testing.assert_close(got["b"], bd.grad)


def test_fused_backward_of_a_pairwise_forward_keeps_full_width_operands():
    """A pairwise forward's backward fused into the GEMM of its N/2-wide output's gradient: a residual as wide
    as the forward's accumulator keeps that width there, twice dY's, whether the derivative reads it or not
    (it was declared dY-wide, and the caller's tensor refused). Gradients as torch's; the kernel's C++ renders."""
    @cd.epilogue
    def gated_and_residual(acc, r: cd.Tensor):
        g, u = cd.pairs(acc)
        return {"D": cd.silu(g) * u, "h": acc + r}
    m, n, k = 7, 12, 5
    bw = cd.backward_epilogue(gated_and_residual)
    assert {p.name: p.width for p in bw.params}["r"] == 2
    acc, r = (torch.randn(m, n, dtype=torch.float64, requires_grad=True) for _ in range(2))
    src, w_next, dh = torch.randn(m, k, dtype=torch.float64), torch.randn(n // 2, k, dtype=torch.float64), \
        torch.randn(m, n, dtype=torch.float64)
    y = torch.nn.functional.silu(acc[:, 0::2]) * acc[:, 1::2]
    ((y * (src @ w_next.t())).sum() + ((acc + r) * dh).sum()).backward()
    got = cd.gemm(src, w_next, bw, backend="reference", r=r.detach(), grad_h=dh, saved_acc=acc.detach())
    torch.testing.assert_close(got["D"], acc.grad)
    torch.testing.assert_close(got["r"], r.grad)
    from coda_dsl import cli
    assert cli.specialization_from_options(bw, "bf16").cu_text


@cd.epilogue
def _half_read_by_a_row_sum(acc, t: cd.Tensor, s: cd.VecM):
    g, u = cd.pairs(acc)
    return {"D": g * u + cd.floor(t), "r": cd.sum(t * s, axis="n")}


@cd.epilogue
def _wide_read_by_a_row_sum(acc, t: cd.Tensor, s: cd.VecM):
    return {"D": cd.interleave(acc, acc) * t, "r": cd.sum(t * t * s, axis="n")}


@pytest.mark.parametrize("ep, t_cols", [(_half_read_by_a_row_sum, lambda n: n // 2),
                                        (_wide_read_by_a_row_sum, lambda n: 2 * n)], ids=["half", "wide"])
@pytest.mark.parametrize("n", [2, 4])
def test_an_operand_the_backward_reads_only_through_a_row_statistic_keeps_its_width(ep, t_cols, n):
    """There the backward reads t only as dy_r * t (floor has no derivative; or D's gradient is not asked for),
    which ties no width: t keeps the forward's (N/2, 2N), not N (was: a gradient off by a factor of 2, or a
    shape error inside the reference backend)."""
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(n, 2, dtype=torch.float64)
    t = torch.randn(3, t_cols(n), dtype=torch.float64, requires_grad=True)
    s = torch.randn(3, dtype=torch.float64, requires_grad=True)
    out = cd.linear(x, w, ep, backend="reference", t=t, s=s)
    out["r"].sum().backward()
    r = t * t if ep is _wide_read_by_a_row_sum else t
    torch.testing.assert_close(s.grad, r.sum(1))
    torch.testing.assert_close(t.grad, (2 * t if ep is _wide_read_by_a_row_sum else torch.ones_like(t)) * s[:, None])
