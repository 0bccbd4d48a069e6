"""Build and load times of kernel specializations (issue 14): no GPU needed (nothing is launched).

    python -m bench.build_time [--kernels 10] [--jobs N] [--no-serial]

1. Cold builds of 3 representative epilogues (identity; bias + GELU; a residual with a per-row sum of
   squares, an atomic reduction): each alone (one after the other, each with its two nvcc passes at
   once, as a user's build), then all three in one parallel ninja run, each in an empty kernel cache.
2. Warm load: a fresh process imports coda_dsl, then torch (timed apart: it is not coda_dsl's, and
   import coda_dsl does not import it), and loads `--kernels` cached specializations (the 3
   above and variants of them, built first if missing: not timed), as a user's second run would:
   trace, lower, render, key, find in the cache, open the library (its GEMM's CUDA library loads at
   the first call, not timed here).
Prints a table; the cache is a temporary directory, removed at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time

from .harness import markdown, positive, progress

# (epilogue spec as module:name, signature options): the 3 representatives first, then variants
# (other configs and dtypes) that give the warm load its distinct cached kernels
REPRESENTATIVES = ["coda_dsl.dsl:identity", "coda_dsl.examples:bias_gelu", "coda_dsl.examples:residual_rms"]
VARIANTS = [("bf16", None), ("fp16", None), ("bf16", "128x128x64_c1x1_pingpong"), ("bf16", "128x128x64_c1x1_cooperative")]


def specs(n: int) -> list[tuple[str, str, str | None]]:
    """n (epilogue, A/B dtype, config) triples: the representatives in each variant in turn."""
    out = [(ep, dt, cfg) for dt, cfg in VARIANTS for ep in REPRESENTATIVES]
    if n > len(out):
        raise SystemExit(f"--kernels: at most {len(out)}")
    return out[:n]


def units(triples):
    """The build units of (epilogue, dtype, config) triples, rendered as `coda-dsl emit` would."""
    from coda_dsl import cli
    return [cli.specialization_from_options(cli.load_epilogue(ep), dt, config=cfg).unit for ep, dt, cfg in triples]


def _timed_build(us, jobs: int | None) -> float:
    from coda_dsl import build
    t = time.perf_counter()
    build.build_units(us, jobs=jobs, log=lambda *_: None)
    return time.perf_counter() - t


_LOAD = """
import sys, time
t0 = time.perf_counter()
import coda_dsl
from coda_dsl import build, cli
t1 = time.perf_counter()
import torch  # what the first kernel's load would import: timed apart (it is not coda_dsl's)
t2 = time.perf_counter()
for spec in sys.argv[1:]:
    ep, dt, cfg = spec.split(",")
    op = cli.specialization_from_options(cli.load_epilogue(ep), dt, config=cfg or None)
    build.library(op.unit, log=lambda *_: None)
t3 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2)
"""


def warm_load(triples, env) -> tuple[float, float, float]:
    """Seconds in a fresh process: (import coda_dsl, import torch, render + find + open the kernels)."""
    args = [f"{ep},{dt},{cfg or ''}" for ep, dt, cfg in triples]
    r = subprocess.run([sys.executable, "-c", _LOAD, *args], env=env, capture_output=True, text=True, check=True)
    t_import, t_torch, t_load = map(float, r.stdout.split()[-3:])
    return t_import, t_torch, t_load


@contextlib.contextmanager
def _restored_cache_env(saved: str | None):
    """CODA_DSL_CACHE as it was before the benchmark pointed it at its temporary caches."""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CODA_DSL_CACHE", None)
        else:
            os.environ["CODA_DSL_CACHE"] = saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.build_time", description=__doc__.split("\n")[0])
    p.add_argument("--kernels", type=positive, default=10, help="cached kernels the warm load opens (default 10)")
    p.add_argument("--jobs", type=positive, default=None, help="parallel nvcc jobs (default: coda_dsl's choice)")
    p.add_argument("--no-serial", action="store_true", help="skip the one-at-a-time cold builds")
    args = p.parse_args(argv)
    rows = []
    saved = os.environ.get("CODA_DSL_CACHE")
    with tempfile.TemporaryDirectory(prefix="coda_build_time_") as root, _restored_cache_env(saved):
        def fresh_cache(name: str) -> dict:
            os.environ["CODA_DSL_CACHE"] = os.path.join(root, name)
            return dict(os.environ)

        from coda_dsl import build
        triples = specs(args.kernels)
        reps = units(triples[:3])
        if not args.no_serial:
            for u, (ep, _, _) in zip(reps, triples):
                fresh_cache(f"serial-{u.key}")
                progress(f"cold build of {ep} alone ...")
                rows.append([f"cold build, alone: {ep.split(':')[1]}", f"{_timed_build([u], args.jobs):.1f}"])
        fresh_cache("parallel")
        progress("cold build of the 3 in one ninja run ...")
        rows.append([f"cold build, 3 in one ninja run (-j {args.jobs or 'auto'})",
                     f"{_timed_build(reps, args.jobs):.1f}"])
        rest = units(triples[3:])
        if rest:
            progress(f"building {len(rest)} more kernels for the warm load (not timed) ...")
            build.build_units(rest, jobs=args.jobs, log=lambda *_: None)
        t_import, t_torch, t_load = warm_load(triples, fresh_cache("parallel"))
        n = len(triples)
        rows += [["fresh process: import coda_dsl (torch comes lazily, with the first op)", f"{t_import:.2f}"],
                 ["fresh process: then import torch", f"{t_torch:.2f}"],
                 [f"fresh process: then load {n} cached kernels", f"{t_load:.2f}"],
                 [f"fresh process: import + load {n}, torch's import included", f"{t_import + t_torch + t_load:.2f}"]]
    print(markdown(["what", "seconds"], rows, numeric=1))
    print(f"\n{build.toolchain().nvcc_version} nvcc, {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
