"""Warm-path host overhead of a call: cache hit, checks, output allocation, argument packing, launch.

    python -m bench.host_overhead

Tiny shapes keep the GPU idle, so the host is the bottleneck: CPU time per call = wall time of N
back-to-back calls / N. Compares cd.gemm, a kept CompiledOp and a bare torch.matmul of the same size.
"""
from __future__ import annotations

import sys
import time

import torch

import coda_dsl as cd

from .harness import no_gpu


@cd.epilogue
def bias_relu(acc, bias: cd.VecN, alpha: cd.Scalar):
    return cd.relu(alpha * acc + bias)


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main() -> int:
    if no_gpu():
        return 1
    a = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    op = cd.compile(bias_relu, a, w, bias=bias, alpha=1.0)
    rows = {
        "torch.matmul (reference point)": per_call_us(lambda: a @ w.t()),
        "cd.gemm(A, B, epilogue, ...)": per_call_us(lambda: cd.gemm(a, w, bias_relu, bias=bias, alpha=0.5)),
        "CompiledOp(A, B, ...)": per_call_us(lambda: op(a, w, bias=bias, alpha=0.5)),
    }
    print("| call | host µs per call |\n|---|---:|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
