"""Fused GEMM + epilogue vs the bare cuBLAS GEMM (the floor), eager PyTorch, torch.compile and,
where one exists, cuBLASLt's fused epilogue. Same shapes, same run, random data.

    python -m bench.epilogues [--shapes 4096x4096x4096,...] [--only bias_gelu,...] [--autotune]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.library import rope_frequencies, rope_positions, swiglu
from coda_dsl.runtime import op as runtime

from .harness import Row, rotation, save, table, time_us

ROUNDS = 5
SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 4096), (8192, 14336, 4096)]  # M, N, K


@cd.epilogue
def bias_gelu(acc, bias: cd.VecN):
    return cd.gelu(acc + bias, approximate="tanh")


@cd.epilogue
def residual_add(acc, residual: cd.Tensor):
    return acc + residual


@cd.epilogue
def residual_sumsq(acc, residual: cd.Tensor):
    """The RMSNorm producer: the new residual stream and its per-row sum of squares, in one kernel."""
    h = acc + residual
    return {"D": h, "sumsq": cd.sum(h * h, axis="n")}


def _residual_sumsq_eager(a, w, residual):
    h = torch.addmm(residual, a, w.t())
    return h, h.float().pow(2).sum(-1)


@dataclass
class Case:
    name: str
    epilogue: cd.Epilogue
    operands: Callable[[int, int], dict]  # (M, N) -> operand tensors
    eager: Callable  # (a, w, **operands) -> output(s): the unfused PyTorch formulation
    cublaslt: Callable | None = None  # a cuBLASLt fused epilogue doing the same, if one exists


def _r(*s):
    return torch.randn(*s, device="cuda", dtype=torch.bfloat16)


def _swiglu_eager(a, w):  # w interleaves gate and up rows
    h = a @ w.t()
    return F.silu(h[:, 0::2]) * h[:, 1::2]


def _rope_eager(a, w, pos, inv_freq):
    h = (a @ w.t()).float()
    angle = pos[:, None] * inv_freq[None, :]
    x0, x1 = h[:, 0::2], h[:, 1::2]
    c, s = torch.cos(angle), torch.sin(angle)
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2).to(a.dtype)


CASES = {
    "identity": Case("identity", cd.identity, lambda m, n: {}, lambda a, w: a @ w.t()),
    "bias_gelu": Case("bias_gelu", bias_gelu, lambda m, n: {"bias": _r(n)},
                      lambda a, w, bias: F.gelu(F.linear(a, w, bias), approximate="tanh"),
                      lambda a, w, bias: torch._addmm_activation(bias, a, w.t(), use_gelu=True)),
    "residual_add": Case("residual_add", residual_add, lambda m, n: {"residual": _r(m, n)},
                         lambda a, w, residual: torch.addmm(residual, a, w.t())),
    "residual_sumsq": Case("residual_sumsq", residual_sumsq, lambda m, n: {"residual": _r(m, n)},
                           _residual_sumsq_eager),
    # pairwise: N = 2F (gate and up interleaved) or the QKV width
    "swiglu": Case("swiglu", swiglu, lambda m, n: {}, _swiglu_eager),
    "rope": Case("rope", rope_positions,
                 lambda m, n: {"pos": torch.arange(m, device="cuda", dtype=torch.float32),
                               "inv_freq": rope_frequencies(n, 128).cuda()}, _rope_eager),
}


def run(cases: list[Case], shapes, autotune: bool, iters: int, tune: bool = False) -> list[Row]:
    mode = "max-autotune-no-cudagraphs" if autotune else None
    ops = {}  # build every kernel first, in parallel
    for c in cases:
        a, w = _r(256, 256), _r(256, 256)
        ops[c.name] = cd.compile(c.epilogue, a, w, **c.operands(256, 256))
    runtime.prebuild(list(ops.values()))
    rows = []
    for m, n, k in shapes:
        shape = f"{m}×{n}×{k}"
        flops = 2 * m * n * k
        per_set = 2 * (m * k + n * k + m * n)
        for c in cases:
            sets = rotation(lambda: (_r(m, k), _r(n, k), c.operands(m, n)), per_set)
            op = ops[c.name]
            variants = {"cuBLAS GEMM (floor)": lambda a, w, o: a @ w.t(),
                        "coda_dsl fused": lambda a, w, o: op(a, w, **o),
                        "eager": lambda a, w, o: c.eager(a, w, **o),
                        "torch.compile" + (" (max-autotune)" if autotune else ""):
                            _compiled(c.eager, mode)}
            if c.cublaslt:
                variants["cuBLASLt fused"] = lambda a, w, o: c.cublaslt(a, w, **o)
            check = sets[0]
            if tune:  # pick this shape's configuration (recorded: later runs skip the builds and timing)
                cd.gemm(check[0], check[1], c.epilogue, tune=True, **check[2])
                op = _TunedOp(c.epilogue)
            ref = c.eager(check[0], check[1], **check[2])
            ref = ref[0] if isinstance(ref, tuple) else ref
            got = op(check[0], check[1], **check[2])["D"]
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            # Round-robin over the variants, several rounds: clock and thermal drift during the run
            # then hits every variant alike instead of whichever was measured last.
            samples: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(ROUNDS):
                for name, fn in variants.items():
                    samples[name].append(time_us(fn, sets, max(1, iters // ROUNDS)))
            times = {name: statistics.median(v) for name, v in samples.items()}
            floor = times["cuBLAS GEMM (floor)"]
            for name, t in times.items():
                rows.append(Row(c.name, shape, name, t, flops / t / 1e6, t / floor,
                                {"rel_err_vs_eager": err} if name.startswith("coda") else {}))
            print(table(rows[-len(variants):]), file=sys.stderr, flush=True)
    return rows


class _TunedOp:
    """cd.gemm with the configuration tuned for the call's shape bucket."""

    def __init__(self, epilogue):
        self.epilogue = epilogue

    def __call__(self, a, w, **operands):
        return cd.gemm(a, w, self.epilogue, **operands)


def _compiled(eager: Callable, mode):
    f = torch.compile(eager, mode=mode, dynamic=False)
    return lambda a, w, o: f(a, w, **o)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.epilogues", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES), help="MxNxK,...")
    p.add_argument("--only", default=",".join(CASES), help=f"subset of {list(CASES)}")
    p.add_argument("--autotune", action="store_true", help="torch.compile with max-autotune-no-cudagraphs")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tune", action="store_true", help="coda_dsl with configurations tuned per shape")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU (the fused kernels need sm_90)", file=sys.stderr)
        return 1
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = run([CASES[c] for c in args.only.split(",")], shapes, args.autotune, args.iters, args.tune)
    print(table(rows))
    print(f"results: {save(rows, 'epilogues', ' '.join(['python -m bench.epilogues', *(argv or sys.argv[1:])]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
