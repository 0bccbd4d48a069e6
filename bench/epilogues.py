"""Fused GEMM + epilogue vs the bare cuBLAS GEMM (the floor), eager PyTorch, torch.compile and,
where one exists, cuBLASLt's fused epilogue. Same shapes, same run, random data.

    python -m bench.epilogues [--only bias_gelu,...] [--shapes 4096x4096x4096,...] [--autotune]
                              [--sustained MS | --graph] [--dry-run]

Each case has its own shapes (--shapes replaces them all): the generic epilogues run the cubes
2048-8192 and Llama-3-8B's and -70B's projections at M = 8192 tokens; swiglu, geglu and rope the
projections they belong to. Shapes are MxNxK: A [M, K], W [N, K]. Timing: round-robin over the
variants, or with --sustained MS each alone after MS ms of its own calls, as training runs them (the
SM clock and board power then go into the JSON), or with --graph from CUDA graph replays of each
variant's calls (the GPU's time without the host's: at 2048³ round-robin measures the host too).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.library import geglu, rope_frequencies, rope_positions, swiglu
from coda_dsl.runtime import op as runtime
from coda_dsl.runtime import tune as tuning

from .harness import (FLOOR, Row, Timing, add_timing, background, compile_label, compile_mode, config_text, fmt,
                      markdown, no_gpu, out_dir, parser, positive, progress, rel_err, results_only_on_stdout,
                      rotation, save, shapes, subset, table, timed)
from .harness import command as command_line

CUBES = tuple((s, s, s) for s in (2048, 4096, 8192))  # M, N, K
LLAMA3_8B = ((8192, 4096, 4096), (8192, 6144, 4096), (8192, 14336, 4096), (8192, 4096, 14336))  # o, qkv, up, down
LLAMA3_70B = ((8192, 28672, 8192), (8192, 8192, 28672))  # FFN up, FFN down
GENERIC = CUBES + LLAMA3_8B + LLAMA3_70B
GATED = ((8192, 2 * 14336, 4096), (8192, 2 * 28672, 8192))  # gate and up interleaved


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
    shapes: tuple = GENERIC  # default (M, N, K) list
    scaled_w: bool = False  # w scaled by K^-1/2, the GEMM's values of order 1 (logits: what the epilogue meets)


def _r(*s):
    return torch.randn(*s, device="cuda", dtype=torch.bfloat16)


def _swiglu_eager(a, w):  # w interleaves gate and up rows
    h = a @ w.t()
    return F.silu(h[:, 0::2]) * h[:, 1::2]


def _geglu_eager(a, w):
    h = a @ w.t()
    return F.gelu(h[:, 0::2], approximate="tanh") * h[:, 1::2]


def _rope_eager(a, w, pos, inv_freq):
    h = (a @ w.t()).float()
    angle = pos[:, None] * inv_freq[None, :]
    x0, x1 = h[:, 0::2], h[:, 1::2]
    c, s = torch.cos(angle), torch.sin(angle)
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2).to(a.dtype)


V_COLS = {6144: 8 * 128, 3 * 4096: 4096}  # V's columns in the rope case's QKV widths; others (--shapes) rotate all

CASES = {
    "identity": Case("identity", cd.identity, lambda m, n: {}, lambda a, w: a @ w.t()),
    "bias_gelu": Case("bias_gelu", bias_gelu, lambda m, n: {"bias": _r(n)},
                      lambda a, w, bias: F.gelu(F.linear(a, w, bias), approximate="tanh"),
                      lambda a, w, bias: torch._addmm_activation(bias, a, w.t(), use_gelu=True)),
    "residual_add": Case("residual_add", residual_add, lambda m, n: {"residual": _r(m, n)},
                         lambda a, w, residual: torch.addmm(residual, a, w.t())),
    "residual_sumsq": Case("residual_sumsq", residual_sumsq, lambda m, n: {"residual": _r(m, n)},
                           _residual_sumsq_eager),
    # pairwise: the FFN up projections of Llama-3-8B and -70B with gate and up interleaved (N = 2 x
    # 14336, 2 x 28672), and fused QKV projections of head dim 128 whose V passes through: Llama-3-8B's
    # (32 Q, 8 K and 8 V heads) and a multi-head one (32 each)
    "swiglu": Case("swiglu", swiglu, lambda m, n: {}, _swiglu_eager, shapes=GATED),
    "geglu": Case("geglu", geglu, lambda m, n: {}, _geglu_eager, shapes=GATED),
    "rope": Case("rope", rope_positions,
                 lambda m, n: {"pos": torch.arange(m, device="cuda", dtype=torch.float32),
                               "inv_freq": rope_frequencies(n, 128, rotate_cols=n - V_COLS.get(n, 0)).cuda()},
                 _rope_eager,
                 shapes=((8192, 6144, 4096), (8192, 3 * 4096, 4096))),
}


def plan(cases: list[Case], shapes=None) -> list[tuple[Case, tuple]]:
    """(case, shape) pairs in measuring order: --shapes if given, else each case's own."""
    return [(c, s) for c in cases for s in (shapes or c.shapes)]


def _variants(c: Case, op, compiled, label: str) -> dict[str, Callable]:
    """What is timed for a case, by variant name (with op and compiled None: only the names count)."""
    v = {FLOOR: lambda a, w, o: a @ w.t(),
         "coda_dsl fused": lambda a, w, o: op(a, w, **o),
         "eager": lambda a, w, o: c.eager(a, w, **o),
         label: lambda a, w, o: compiled(a, w, **o)}
    if c.cublaslt:
        v["cuBLASLt fused"] = lambda a, w, o: c.cublaslt(a, w, **o)
    return v


def plan_rows(cases: list[Case], shapes=None, autotune=False, dynamic=False) -> list[list[str]]:
    label = compile_label(autotune, dynamic)
    return [[c.name, fmt(s), ", ".join(_variants(c, None, None, label))] for c, s in plan(cases, shapes)]


def kernels(todo: list[tuple[Case, tuple]], config: str | None = None) -> dict:
    """Each (case, shape)'s kernel in `config`, else the configuration cd.gemm picks for that shape untuned,
    rendered but not built (runtime.prebuild builds them all in one ninja run)."""
    a, w = _r(256, 256), _r(256, 256)
    return {(c.name, s): cd.compile(c.epilogue, a, w, config=config or tuning.default(*s)[0], **c.operands(256, 256))
            for c, s in todo}


def _inputs(c: Case, m: int, n: int, k: int) -> tuple:
    w = _r(n, k)
    return _r(m, k), w.mul_(k ** -0.5) if c.scaled_w else w, c.operands(m, n)


# torch.compile recompiles once per static shape, up to a limit: (config module, setting name).
# torch.compiler.config is its public home; older torch has only the private dynamo setting.
RECOMPILE_LIMIT = ((torch.compiler.config, "recompile_limit")
                   if hasattr(getattr(torch.compiler, "config", None), "recompile_limit")
                   else (torch._dynamo.config, "cache_size_limit"))


def _compile_all(todo, autotune: bool, dynamic: bool, failed: list[str]) -> dict:
    """torch.compile of each case's eager code, compiled for each shape now (first call): the compile
    time stays out of the timings and is reported instead. Static shapes compile once per shape."""
    mode = compile_mode(autotune)
    setattr(*RECOMPILE_LIMIT, max(getattr(*RECOMPILE_LIMIT), len(todo)))
    fns, done = {}, {}
    for c, (m, n, k) in todo:
        if c.name not in fns:
            fns[c.name] = torch.compile(c.eager, mode=mode, dynamic=dynamic)
        f = fns[c.name]
        a, w, o = _inputs(c, m, n, k)
        t0 = time.perf_counter()
        try:
            f(a, w, **o)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (keep the other cases: the GPU time is short)
            failed.append(f"{c.name} {fmt((m, n, k))}: torch.compile: {type(e).__name__}: {e}")
            continue
        done[c.name, (m, n, k)] = (f, time.perf_counter() - t0)
        progress(f"torch.compile {c.name} {fmt((m, n, k))}: {done[c.name, (m, n, k)][1]:.1f} s")
    return done


def run(cases: list[Case], shapes=None, autotune=False, iters=50, tune=False, dynamic=False, also_build=(),
        checkpoint: Callable | None = None, config: str | None = None,
        timing: Timing = Timing()) -> tuple[list[Row], list[str]]:
    """Measure every (case, shape); returns the rows and one line per failure. also_build: more
    kernels (another benchmark's) for the same parallel build. checkpoint(rows, failed) after each
    shape, so that a run stopped by a time limit still leaves its numbers. config: one configuration
    for every kernel instead of each shape's default. timing: harness.timed's way (round-robin by default)."""
    todo = plan(cases, shapes)
    ops = kernels(todo, config)
    # nvcc (one core per kernel, in subprocesses) builds while torch.compile works in this thread
    built = background(runtime.prebuild, [*ops.values(), *also_build])
    failed: list[str] = []
    compiled = _compile_all(todo, autotune, dynamic, failed)
    try:
        built.result()
    except Exception as e:  # noqa: BLE001  measure what built; a failed kernel would be rebuilt (and fail) per call
        failed.append(f"kernel builds: {type(e).__name__}: {e}")
        for (name, s), op in ops.items():
            if not op.built:
                failed.append(f"{name} {fmt(s)}: not measured, its kernel did not build")
                todo = [t for t in todo if (t[0].name, t[1]) != (name, s)]
    rows = []
    for c, s in todo:
        try:
            new = _measure(c, s, ops[c.name, s], *compiled.get((c.name, s), (None, None)),
                           compile_label(autotune, dynamic), iters, tune, timing)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{c.name} {fmt(s)}: {type(e).__name__}: {e}")
            continue
        progress(table(new))
        rows += new
        if checkpoint:
            checkpoint(rows, failed)
    return rows, failed


def _measure(c: Case, shape, op, compiled, compile_s: float | None, label: str, iters: int, tune: bool,
             timing: Timing = Timing()) -> list[Row]:
    m, n, k = shape
    sets = rotation(lambda: _inputs(c, m, n, k), 2 * (m * k + n * k + m * n))
    a, w, o = sets[0]
    if tune:  # pick this shape's configuration (recorded: later runs skip the builds and timing)
        cd.gemm(a, w, c.epilogue, tune=True, **o)
        op = lambda a, w, **operands: cd.gemm(a, w, c.epilogue, **operands)  # noqa: E731  the tuned config
    variants = _variants(c, op, compiled, label)
    if compiled is None:  # its compile failed (reported): time the others
        del variants[label]
    # every variant that computes the epilogue, against eager's outputs, before anything is timed
    ref = c.eager(a, w, **o)  # eager's tuple: the epilogue's outputs in order
    errs = {name: rel_err(_outputs(fn(a, w, o), ref), ref) for name, fn in variants.items()
            if name not in (FLOOR, "eager")}
    if wrong := {name: e for name, e in errs.items() if not e <= MAX_REL_ERR}:
        raise ValueError(f"outputs differ from eager's beyond {MAX_REL_ERR} (relative): {wrong}; nothing timed")
    times, clocks = timed(variants, sets, iters, timing)
    extra = {name: {**({"rel_err_vs_eager": errs[name]} if name in errs else {}), **clocks.get(name, {})}
             for name in times}
    extra.setdefault(label, {})["compile_s"] = round(compile_s or 0, 2)
    return [Row(c.name, fmt(shape), name, t, 2 * m * n * k / t / 1e6, t / times[FLOOR], extra.get(name, {}))
            for name, t in times.items()]


MAX_REL_ERR = 3e-2  # bf16 outputs: ~1e-3 expected; beyond this a variant computes something else


def _outputs(result, ref):
    """A variant's result in eager's form: coda_dsl's dict as the tuple of its first outputs, or D."""
    if isinstance(result, dict):
        return tuple(result.values())[: len(ref)] if isinstance(ref, tuple) else result["D"]
    return result


def summary(rows: list[Row]) -> str:
    """One line per case and shape: the floor's time and each variant's time relative to it."""
    variants = [v for v in dict.fromkeys(r.variant for r in rows) if v != FLOOR]
    groups: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        groups.setdefault((r.bench, r.shape), {})[r.variant] = r
    lines = [[b, s, f"{g[FLOOR].us:.0f}", *(f"{g[v].vs_gemm:.3f}" if v in g else "–" for v in variants)]
             for (b, s), g in groups.items()]
    return markdown(["epilogue", "shape (M×N×K)", "cuBLAS GEMM µs", *(f"{v} ×" for v in variants)], lines,
                    numeric=1 + len(variants))


def checkpoint(command: str) -> Callable:
    """Saves the rows so far (complete: false), for run()."""
    return lambda rows, failed: save(rows, "epilogues", command, failed=failed, complete=False)


def report(rows: list[Row], failed: list[str], command: str) -> None:
    """Tables on stdout; JSON and the chart under $OUT or bench/results/ (paths on stderr)."""
    if rows:
        print("Time relative to the bare cuBLAS GEMM of the same shape (lower is better):\n")
        print(summary(rows) + "\n\n" + table(rows) + "\n")
    for f in failed:
        print(f"- FAILED {f}")
    progress(f"results: {save(rows, 'epilogues', command, failed=failed, complete=True)}")
    from .chart import chart  # matplotlib loads only here, and may be missing
    png = chart(rows, out_dir() / "epilogues.png")
    if png:
        progress(f"chart: {png}")


def add_args(p: argparse.ArgumentParser, only=tuple(CASES)) -> None:
    p.add_argument("--only", type=subset(only), default=list(only), help=f"subset of {','.join(only)}")
    p.add_argument("--shapes", type=shapes, help="MxNxK,... for every case (default: each case's own)")
    p.add_argument("--iters", type=positive, default=50, help="timed calls per variant, over all rounds")
    p.add_argument("--autotune", action="store_true", help="torch.compile with max-autotune-no-cudagraphs (slow)")
    p.add_argument("--compile-dynamic", action="store_true",
                   help="torch.compile once per case with dynamic shapes instead of once per shape (faster)")
    chosen = p.add_mutually_exclusive_group()
    chosen.add_argument("--tune", action="store_true", help="coda_dsl with configurations tuned per shape")
    chosen.add_argument("--config", type=config_text, metavar="CFG",
                   help="coda_dsl in this configuration (e.g. 128x128x64_c2x1_pingpong) at every shape, instead "
                        "of each shape's default: a mainloop's cost apart from its epilogue's")
    add_timing(p, graph=True)
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")


def main(argv=None) -> int:
    p = parser("python -m bench.epilogues", __doc__)
    add_args(p)
    args = p.parse_args(argv)
    cases = [CASES[n] for n in args.only]
    if args.dry_run:
        print(markdown(["case", "shape (M×N×K)", "variants"],
                       plan_rows(cases, args.shapes, args.autotune, args.compile_dynamic)))
        return 0
    if no_gpu():
        return 1
    command = command_line("python -m bench.epilogues", argv)
    with results_only_on_stdout():
        rows, failed = run(cases, args.shapes, args.autotune, args.iters, args.tune, args.compile_dynamic,
                           checkpoint=checkpoint(command), config=args.config, timing=Timing.of(args))
    report(rows, failed, command)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
