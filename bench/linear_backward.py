"""Training one linear layer with a fused epilogue (issue 15): forward + backward of y = f(x @ W^T, ...)
with cd.linear (the fused forward GEMM saves its accumulator; the derived backward epilogue, then the
two backward GEMMs), against the same PyTorch layer in eager and under torch.compile, and against the
floor: the three bare cuBLAS GEMMs (x @ W^T, dacc @ W, dacc^T @ x).

    python -m bench.linear_backward [--only bias_gelu,swiglu,residual_sumsq] [--shapes 8192x14336x4096]
                                    [--iters 30] [--dry-run]

Each timed call is forward + backward (torch.autograd.grad of every output, with fixed random incoming
gradients, for x, W and the tensor operands). Ratios are time / the three GEMMs' time: lower is better.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.library import swiglu

from .epilogues import bias_gelu, residual_sumsq
from .harness import (Row, fmt, markdown, no_gpu, parser, progress, results_only_on_stdout, rotation, round_robin,
                      save, shapes, subset)
from .harness import command as command_line

SHAPES = [(8192, 14336, 4096)]  # the target shape: Llama-3-8B's MLP width
FLOOR = "3 cuBLAS GEMMs (floor)"


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


def _inputs(case: Case, m: int, n: int, k: int) -> tuple:
    x, w = _r(m, k), (_r(n, k, grad=False) * k ** -0.5).requires_grad_()
    operands = case.operands(m, n)
    outs = _layer(case)(x, w, **operands)
    dys = {name: torch.randn_like(t) for name, t in outs.items()}
    return x, w, operands, dys


def _gemms(x, w, operands, dys):
    acc = x @ w.t()
    return acc @ w, acc.t() @ x  # the backward GEMMs' shapes: dacc is [M, N] like acc


def measure(name: str, shape: tuple, iters: int) -> list[Row]:
    case, (m, n, k) = CASES[name], shape
    sets = rotation(lambda: _inputs(case, m, n, k), 2 * (m * k + n * k + 2 * m * n))
    ours = _step(lambda x, w, **ops: cd.linear(x, w, case.epilogue, **ops))
    variants = {FLOOR: _gemms, "coda_dsl cd.linear": ours, "eager": _step(_layer(case)),
                "torch.compile": _step(torch.compile(_layer(case)))}
    ref = variants["eager"](*sets[0])
    for label, fn in variants.items():
        progress(f"linear_backward: {name} {fmt(shape)}: {label}")
        got = fn(*sets[0])  # builds / compiles outside the timing
        if label != FLOOR:
            err = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(got, ref))
            if err > 3e-2:
                progress(f"  {label}: gradients differ from eager by {err:.1e}")
    times = round_robin(variants, sets, iters)
    flops = 3 * 2 * m * n * k
    return [Row("linear_backward/" + name, fmt(shape), label, us, flops / us / 1e6, us / times[FLOOR])
            for label, us in times.items()]


def prebuild(todo: list[tuple[str, tuple]]) -> None:
    """cd.linear's forward kernels (the epilogue plus its saved accumulator), with the configs cd.gemm
    picks at each shape, in one parallel ninja run instead of one by one at their first calls."""
    from coda_dsl.runtime import op as runtime
    from coda_dsl.runtime.autograd import forward_epilogue
    from coda_dsl.runtime.tune import default
    ops = []
    for name, (m, n, k) in todo:
        case = CASES[name]
        x = _r(64, 64, grad=False)  # a small problem: only dtypes and layouts matter
        operands = {key: v.detach() for key, v in case.operands(64, 64).items()}
        ops.append(cd.compile(forward_epilogue(case.epilogue), x, x, config=default(m, n, k)[0], **operands))
    runtime.prebuild(ops)


def main(argv=None) -> int:
    p = parser("python -m bench.linear_backward", __doc__)
    p.add_argument("--only", type=subset(list(CASES)), default=list(CASES), help="epilogues, comma-separated")
    p.add_argument("--shapes", type=shapes, default=SHAPES, help="MxNxK,... (default %(default)s)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--dry-run", action="store_true", help="print what would be measured, then exit")
    args = p.parse_args(argv)
    todo = [(name, s) for name in args.only for s in args.shapes]
    if args.dry_run:
        print(markdown(["epilogue", "shape (M×N×K)", "variants"],
                       [[name, fmt(s), f"{FLOOR}, coda_dsl cd.linear, eager, torch.compile"] for name, s in todo]))
        return 0
    if no_gpu():
        return 1
    rows = []
    with results_only_on_stdout():
        prebuild(todo)
        for name, s in todo:
            rows += measure(name, s, args.iters)
    print(markdown(["epilogue", "shape (M×N×K)", "variant", "fwd+bwd (µs)", "TFLOP/s", "× 3 GEMMs"],
                   [[r.bench.split("/")[1], r.shape, r.variant, f"{r.us:.0f}", f"{r.tflops:.0f}", f"{r.vs_gemm:.3f}"]
                    for r in rows], numeric=3))
    save(rows, "linear_backward", command_line("python -m bench.linear_backward", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
