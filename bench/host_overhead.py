"""Warm-path host overhead of a call: cache hit, checks, output allocation, argument packing, launch.

    python -m bench.host_overhead                  # on an sm_90 GPU
    python -m bench.host_overhead --python-only    # anywhere: the Python part, kernel launch stubbed

Tiny shapes keep the GPU idle, so the host is the bottleneck: CPU time per call = wall time of N
back-to-back calls / N. Compares cd.gemm, a kept CompiledOp and a bare torch.matmul of the same size.
--python-only runs on CPU tensors with the kernel replaced by a no-op: what is left is coda_dsl's
own Python (checks, caches, output allocation), without the torch op dispatch and the launch.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import coda_dsl as cd
from coda_dsl.runtime import op as runtime

from .harness import no_gpu


@cd.epilogue
def bias_relu(acc, bias: cd.VecN, alpha: cd.Scalar):
    return cd.relu(alpha * acc + bias)


def per_call_us(fn, n: int = 2000) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(50):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e6


def _stub_kernels() -> None:
    """Kernels that do nothing, and the cutlass call path allowed on CPU tensors."""
    runtime.CompiledOp.load = lambda self: setattr(self, "_op", lambda *args: None) or self
    runtime.checks.require_hopper = lambda where, device: None
    runtime._choose_config = lambda spec, call, tune, key: runtime.Config()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--python-only", action="store_true", help="CPU tensors, kernel launch stubbed out")
    args = p.parse_args(argv)
    if args.python_only:
        _stub_kernels()
        device, backend, n = "cpu", "cutlass", 20000
    elif no_gpu():
        return 1
    else:
        device, backend, n = "cuda", "auto", 2000
    a = torch.randn(128, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(128, 64, device=device, dtype=torch.bfloat16)
    bias = torch.randn(128, device=device, dtype=torch.bfloat16)
    op = cd.compile(bias_relu, a, w, bias=bias, alpha=1.0)
    rows = {} if args.python_only else {"torch.matmul (reference point)": per_call_us(lambda: a @ w.t(), n)}
    rows["cd.gemm(A, B, epilogue, ...)"] = per_call_us(
        lambda: cd.gemm(a, w, bias_relu, backend=backend, bias=bias, alpha=0.5), n)
    rows["CompiledOp(A, B, ...)"] = per_call_us(lambda: op(a, w, bias=bias, alpha=0.5), n)
    what = "Python µs per call (launch stubbed)" if args.python_only else "host µs per call"
    print(f"| call | {what} |\n|---|---:|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
