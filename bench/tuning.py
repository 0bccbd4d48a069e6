"""Tuning, and its reuse by a later process.

    python -m bench.tuning            # process 1: tune=True builds and times the candidates, records the winner
    python -m bench.tuning --reuse    # process 2: the same call finds the record: no build, no timing

Prints the chosen configuration, the time of the tuned kernel vs the default one and vs cuBLAS.
"""
from __future__ import annotations

import sys
import time

import torch

import coda_dsl as cd
from coda_dsl.runtime import tune as tuning

from .harness import no_gpu, parser, rotation, round_robin, shape


def main(argv=None) -> int:
    p = parser("python -m bench.tuning", __doc__)
    p.add_argument("--shape", type=shape, default=(8192, 8192, 8192), help="MxNxK")
    p.add_argument("--reuse", action="store_true", help="expect a recorded choice (second process)")
    args = p.parse_args(argv)
    if no_gpu():
        return 1
    m, n, k = args.shape
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    cd.gemm(a, w, tune=True)
    torch.cuda.synchronize()
    first_call = time.perf_counter() - t0
    chosen = tuning.recorded(a.device, cd.compile(cd.identity, a, w).plan.canonical, tuning.DEFAULT, (m, n, k, 1))
    print(f"first call with tune=True: {first_call:.2f} s (builds and timing included); chosen: "
          f"{chosen.text if chosen else None}; device: {tuning.device_key(a.device)}")
    if args.reuse and first_call > 5.0:
        print("ERROR: the second process should reuse the record without building or timing", file=sys.stderr)
        return 1
    sets = rotation(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                             torch.randn(n, k, device="cuda", dtype=torch.bfloat16)), 2 * (m * k + n * k + m * n))
    t = round_robin({"cuBLAS": lambda x, y: x @ y.t(), "tuned": lambda x, y: cd.gemm(x, y),
                     "default": lambda x, y: cd.gemm(x, y, config=tuning.DEFAULT)}, sets, iters=50)
    t_blas, t_tuned, t_default = t["cuBLAS"], t["tuned"], t["default"]
    print(f"| {m}x{n}x{k} | cuBLAS {t_blas:.1f} us | tuned {t_tuned:.1f} us ({t_tuned / t_blas:.3f}x) | "
          f"default {t_default:.1f} us ({t_default / t_blas:.3f}x) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
