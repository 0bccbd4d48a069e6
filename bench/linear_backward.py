"""Training one linear layer with a fused epilogue (issue 15): forward + backward of y = f(x @ W^T, ...)
with cd.linear (the fused forward GEMM saves its accumulator; the derived backward epilogue, then the
two backward GEMMs), against the same PyTorch layer in eager and under torch.compile, and against the
floor: the three bare cuBLAS GEMMs (x @ W^T, dacc @ W, dacc^T @ x).

    python -m bench.linear_backward [--only bias_gelu,swiglu,residual_sumsq] [--shapes 8192x14336x4096]
                                    [--with-dy [--configs CFG,...]] [--iters 30] [--dry-run]

Each timed call is forward + backward (torch.autograd.grad of every output, with fixed random incoming
gradients, for x, W and the tensor operands). Ratios are time / the three GEMMs' time: lower is better.

--with-dy: also each step with the GEMM that produces D's incoming gradient, dY = G @ V^T (as the layer
above's backward does), against four bare GEMMs. There coda_dsl has the choice cd.linear lacks: the
derived backward epilogue (cd.backward_epilogue) runs in dY's GEMM, so dacc costs no pass of its own.
--configs: that variant again with the forward kernel and dY's GEMM on each of these tile configurations
("coda_dsl, dacc in dY's GEMM [CFG]"), in the same rounds as the default's (a rule's choice, measured).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.library import swiglu
from coda_dsl.passes.autodiff import GRAD

from .epilogues import bias_gelu, residual_sumsq
from .harness import (Row, config_texts, fmt, markdown, no_gpu, parser, positive, progress, results_only_on_stdout,
                      rotation, round_robin, save, shapes, subset)
from .harness import command as command_line

SHAPES = [(8192, 14336, 4096)]  # the target shape: Llama-3-8B's MLP width
FLOOR = "3 cuBLAS GEMMs (floor)"
FLOOR_DY = "4 cuBLAS GEMMs (floor, with dY's)"
IN_DY = "coda_dsl, dacc in dY's GEMM"


@dataclass(frozen=True)
class Case:
    epilogue: cd.Epilogue
    operands: Callable[[int, int], dict]  # (m, n) -> the operands that require grad
    torch_fn: Callable  # (acc, **operands) -> {output: tensor}, the same math in PyTorch


def _r(*shape, grad=True):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)


CASES = {
    "bias_gelu": Case(bias_gelu, lambda m, n: dict(bias=_r(n)),
                      lambda acc, bias: {"D": F.gelu(acc + bias, approximate="tanh")}),
    "swiglu": Case(swiglu, lambda m, n: {}, lambda acc: {"D": F.silu(acc[:, 0::2]) * acc[:, 1::2]}),
    "residual_sumsq": Case(residual_sumsq, lambda m, n: dict(residual=_r(m, n)),
                           lambda acc, residual: (lambda h: {"D": h, "sumsq": h.float().square().sum(-1)})(
                               acc + residual)),
}


def _layer(case: Case) -> Callable:
    """The PyTorch layer: cuBLAS GEMM, then the epilogue's math."""
    def layer(x, w, **operands):
        return case.torch_fn(x @ w.t(), **operands)
    return layer


def _step(forward: Callable) -> Callable:
    """forward + backward: the gradients of x, W and the tensor operands for fixed incoming gradients."""
    def step(x, w, operands, dys):
        outs = forward(x, w, **operands)
        names = [k for k in dys if k in outs]
        return torch.autograd.grad([outs[k] for k in names], [x, w, *operands.values()], [dys[k] for k in names])
    return step


def _inputs(case: Case, m: int, n: int, k: int, with_dy: bool = False) -> tuple:
    """x, W, the operands, the incoming gradients; with_dy: also G [M, K] and V [N_D, K] whose product is
    D's incoming gradient (the inputs of the GEMM that produces it)."""
    x, w = _r(m, k), (_r(n, k, grad=False) * k ** -0.5).requires_grad_()
    operands = case.operands(m, n)
    outs = _layer(case)(x, w, **operands)
    dys = {name: torch.randn_like(t) for name, t in outs.items()}
    if not with_dy:
        return x, w, operands, dys
    return x, w, operands, dys, _r(m, k, grad=False), _r(outs["D"].shape[1], k, grad=False) * k ** -0.5


def _gemms(x, w, operands, dys):
    acc = x @ w.t()
    return acc @ w, acc.t() @ x  # the backward GEMMs' shapes: dacc is [M, N] like acc


def _with_dy(step: Callable) -> Callable:
    """step, after dY's GEMM: D's incoming gradient is G @ V^T."""
    return lambda x, w, operands, dys, g, v: step(x, w, operands, {**dys, "D": g @ v.t()})


def _in_dy(case: Case, config: str | None = None) -> Callable:
    """Forward + backward with the derived backward epilogue in dY's GEMM: the forward kernel keeps what the
    derivative reads (the accumulator, or outputs it reads back); dY's GEMM then outputs dacc (its D) and
    the operands' gradients; then dacc @ W, dacc^T x. config: both fused kernels' (None: cd.gemm's pick)."""
    forward, backward = cd.forward_epilogue(case.epilogue), cd.backward_epilogue(case.epilogue)

    @torch.no_grad()  # as inside a layer's autograd.Function: cd.gemm is not recorded
    def step(x, w, operands, dys, g, v):
        outs = cd.gemm(x, w, forward, config=config, **operands)
        grads = cd.gemm(g, v, backward, config=config, **cd.saved_operands(backward, outs), **operands,
                        **{GRAD + o: dy for o, dy in dys.items() if o != "D"})
        dacc = grads["D"]
        return (dacc @ w, dacc.t() @ x, *(grads[k] for k in operands))
    return step


def measure(name: str, shape: tuple, iters: int, with_dy: bool = False, configs=()) -> list[Row]:
    case, (m, n, k) = CASES[name], shape
    gemm_inputs = (2 if with_dy else 1) * (m * k + n * k)  # x, W (and G, V)
    sets = rotation(lambda: _inputs(case, m, n, k, with_dy), 2 * (gemm_inputs + 2 * m * n))
    torch.compiler.reset()  # each case and shape compiled afresh, static (no dynamic-shape recompile)
    ours = _step(lambda x, w, **ops: cd.linear(x, w, case.epilogue, **ops))
    variants = {FLOOR: _gemms, "coda_dsl cd.linear": ours, "eager": _step(_layer(case)),
                "torch.compile": _step(torch.compile(_layer(case)))}
    floor = FLOOR
    if with_dy:
        variants = {FLOOR_DY: lambda x, w, operands, dys, g, v: (g @ v.t(), *_gemms(x, w, operands, dys)),
                    IN_DY: _in_dy(case), **{f"{IN_DY} [{c}]": _in_dy(case, c) for c in configs},
                    **{label: _with_dy(fn) for label, fn in variants.items() if label != FLOOR}}
        floor = FLOOR_DY
    ref = variants["eager"](*sets[0])
    for label, fn in variants.items():
        progress(f"linear_backward: {name} {fmt(shape)}: {label}")
        got = fn(*sets[0])  # builds / compiles outside the timing
        if label != floor:
            err = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(got, ref))
            if err > 3e-2:
                progress(f"  {label}: gradients differ from eager by {err:.1e}")
    times = round_robin(variants, sets, iters)
    flops = 3 * 2 * m * n * k + (2 * m * sets[0][5].shape[0] * k if with_dy else 0)
    bench = f"linear_backward/{name}" + (" +dY" if with_dy else "")
    return [Row(bench, fmt(shape), label, us, flops / us / 1e6, us / times[floor]) for label, us in times.items()]


def prebuild(todo: list[tuple[str, tuple]], with_dy: bool = False, configs=()) -> None:
    """cd.linear's forward kernels (the epilogue plus its saved accumulator), with the configs cd.gemm
    picks at each shape, and with_dy the backward epilogues in dY's GEMM (both also on each of
    `configs`), in one parallel ninja run instead of one by one at their first calls."""
    from coda_dsl.runtime import op as runtime
    from coda_dsl.runtime.tune import default
    ops = []
    for name, (m, n, k) in todo:
        case = CASES[name]
        x, w, operands, dys, *gv = _inputs(case, 64, 64, 64, with_dy)  # small: only dtypes and layouts matter
        operands = {key: v.detach() for key, v in operands.items()}
        forward = cd.forward_epilogue(case.epilogue)
        ops.append(cd.compile(forward, x.detach(), w.detach(), config=default(m, n, k)[0], **operands))
        if with_dy:
            g, v = gv
            backward = cd.backward_epilogue(case.epilogue)
            outs = cd.gemm(x.detach(), w.detach(), forward, backend="reference", **operands)
            n_d = dys["D"].shape[1] * n // 64  # the real problem's dY width
            grads = {GRAD + o: dy for o, dy in dys.items() if o != "D"}
            ops.append(cd.compile(backward, g, v, config=default(m, n_d, k)[0], **cd.saved_operands(backward, outs),
                                  **operands, **grads))
            for c in configs:
                ops += [cd.compile(forward, x.detach(), w.detach(), config=c, **operands),
                        cd.compile(backward, g, v, config=c, **cd.saved_operands(backward, outs), **operands, **grads)]
    runtime.prebuild(ops)


def main(argv=None) -> int:
    p = parser("python -m bench.linear_backward", __doc__)
    p.add_argument("--only", type=subset(list(CASES)), default=list(CASES), help="epilogues, comma-separated")
    p.add_argument("--shapes", type=shapes, default=SHAPES, help="MxNxK,... (default %(default)s)")
    p.add_argument("--iters", type=positive, default=30)
    p.add_argument("--with-dy", action="store_true",
                   help="also with dY's GEMM, where the derived backward epilogue can run (against 4 GEMMs)")
    p.add_argument("--configs", type=config_texts, default=[], metavar="CFG,...",
                   help="with --with-dy: also the fused kernels on each of these configurations")
    p.add_argument("--dry-run", action="store_true", help="print what would be measured, then exit")
    args = p.parse_args(argv)
    if args.configs and not args.with_dy:
        p.error("--configs times the fused kernels in dY's GEMM: give --with-dy too")
    todo = [(name, s) for name in args.only for s in args.shapes]
    if args.dry_run:
        print(markdown(["epilogue", "shape (M×N×K)", "variants"],
                       [[name, fmt(s), f"{FLOOR}, coda_dsl cd.linear, eager, torch.compile"
                         + (f"; {FLOOR_DY}, {IN_DY}" + "".join(f", {IN_DY} [{c}]" for c in args.configs)
                            + ", the same with dY's GEMM" if args.with_dy else "")]
                        for name, s in todo]))
        return 0
    if no_gpu():
        return 1
    rows = []
    with results_only_on_stdout():
        prebuild(todo, args.with_dy, args.configs)
        for name, s in todo:
            rows += measure(name, s, args.iters)
            if args.with_dy:
                rows += measure(name, s, args.iters, with_dy=True, configs=args.configs)
    print(markdown(["epilogue", "shape (M×N×K)", "variant", "fwd+bwd (µs)", "TFLOP/s", "× floor"],
                   [[r.bench.split("/")[1], r.shape, r.variant, f"{r.us:.0f}", f"{r.tflops:.0f}", f"{r.vs_gemm:.3f}"]
                    for r in rows], numeric=3))
    save(rows, "linear_backward", command_line("python -m bench.linear_backward", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
