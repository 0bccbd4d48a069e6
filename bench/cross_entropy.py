"""LM head + cross-entropy (issues 5, 13): the mean loss of x @ W^T against int64 targets (a few rows
ignore_index=-100), forward, and forward+backward (the gradients of x and W), at Llama-3-8B's
vocabulary (M = 8192 and 16384 tokens) and at V = 32000 and 256000. Per variant: median time and
the peak memory the call adds, relative to eager PyTorch.

    python -m bench.cross_entropy [--shape 8192x4096x128256,...] [--iters 10] [--autotune]
                                  [--chunk-rows 2048,4096] [--configs CFG,...] [--profile N] [--dry-run]

Variants: eager (bf16 logits cast to fp32, then F.cross_entropy), torch.compile of the same, and
cd.linear_cross_entropy (by design no fp32 logits), with its default chunk rows and, per --chunk-rows,
with others ("coda_dsl (chunk R)"), and per --configs with other tile configurations ("coda_dsl (CFG)",
a cd.Config's text). --profile N: then one forward+backward of torch.compile and of each coda_dsl
variant under torch.profiler, its N costliest GPU kernels (stderr). Warnings a variant raises (e.g. coda_dsl
running on its reference backend) are printed under the table and kept in the JSON.
"""
from __future__ import annotations

import functools
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.library import cross_entropy as ce
from coda_dsl.runtime import op as runtime

from .harness import (background, compile_label, compile_mode, config_texts, fmt, markdown, no_gpu,
                      non_negative, parser, peak_mib, positive, profile_kernels, progress, rel_err,
                      results_only_on_stdout, round_robin, save, shapes)
from .harness import command as command_line

SHAPE = (8192, 4096, 128256)  # M tokens, d model width, V vocabulary (Llama-3-8B)
SHAPES = [SHAPE, (16384, 4096, 128256), (8192, 4096, 32000), (8192, 4096, 256000)]  # issue 13
STEPS = ("forward", "forward+backward")
IGNORED_ROWS = 8  # targets set to ignore_index, like padding
WARMUP = 3  # calls of 10-100 ms each: a few suffice


def eager_loss(x, w, t):
    return F.cross_entropy((x @ w.t()).float(), t, ignore_index=-100)


@dataclass
class CERow:
    shape: str  # M×d×V
    step: str  # forward or forward+backward
    variant: str
    ms: float
    tflops: float
    peak_mib: float  # peak memory allocated during the call beyond what was allocated before it
    speedup: float  # eager's time / this time
    memory: float  # this peak / eager's peak
    extra: dict = field(default_factory=dict)
    bench: str = "cross_entropy"


def variants(autotune: bool, chunk_rows=(), configs=()) -> dict[str, Callable]:
    """label -> loss function (x, w, target) -> loss."""
    return {"eager": eager_loss,
            compile_label(autotune): torch.compile(eager_loss, mode=compile_mode(autotune), dynamic=False),
            "coda_dsl": cd.linear_cross_entropy,
            **{f"coda_dsl (chunk {r})": functools.partial(cd.linear_cross_entropy, chunk_rows=r) for r in chunk_rows},
            **{f"coda_dsl ({c})": functools.partial(cd.linear_cross_entropy, config=c) for c in configs}}


def plan_rows(shapes=SHAPES, autotune=False, chunk_rows=(), configs=()) -> list[list[str]]:
    return [["cross_entropy", f"{fmt(s)} (M×d×V)",
             f"{' and '.join(STEPS)}: {', '.join(variants(autotune, chunk_rows, configs))}"] for s in shapes]


def kernels(configs=(None,)) -> list:
    """The kernels cd.linear_cross_entropy launches with its default options and each of `configs`
    (the same for every shape), rendered for the same parallel build as the other benchmarks' kernels:
    the statistics-only forward (no grad) and the forward that also stores the logits chunk (with
    gradients). Best effort: one left out here is built (or falls back to the reference backend, with
    a warning) at its first call."""
    x = torch.empty(128, 128, device="cuda", dtype=torch.bfloat16)
    target = torch.zeros(128, device="cuda", dtype=torch.int64)
    logits = torch.empty(128, 128, device="cuda", dtype=ce.logits_buffer_dtype(x.dtype))
    ops = []
    for config in configs:
        config = config or ce.default_config(x.device)
        make = {"forward": lambda: cd.compile(ce._forward_epilogue(False, None), x, x, target=target, config=config),
                "forward with logits": lambda: cd.compile(ce._forward_epilogue(False, None, ce.stored_logits(x.dtype)),
                                                          x, x, target=target, out={"D": logits}, config=config)}
        for name, compile_op in make.items():
            try:
                ops.append(compile_op())
            except Exception as e:  # noqa: BLE001
                progress(f"cross_entropy: {name} kernel ({config}) not prebuilt "
                         f"({type(e).__name__}: {str(e).splitlines()[0]})")
    return ops


def _inputs(m: int, d: int, v: int) -> tuple:
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16).mul_(d ** -0.5)  # logits of order 1
    t = torch.randint(0, v, (m,), device="cuda")
    t[:: max(1, m // IGNORED_ROWS)] = -100
    return x, w, t


def _step(loss, step: str):
    if step == "forward":
        return loss
    # autograd.grad returns the gradients instead of accumulating into .grad across calls
    return lambda x, w, t: torch.autograd.grad(loss(x, w, t), (x, w))


def run(shapes=SHAPES, iters: int = 10, autotune: bool = False, chunk_rows=(), configs=(),
        profile: int = 0) -> tuple[list[CERow], list[str]]:
    """Every shape, step and variant; returns the rows and one line per failure."""
    # nothing to do if `python -m bench` built them
    built = background(runtime.prebuild, kernels((None, *configs)))
    rows, failed = [], []
    for shape in shapes:
        torch.compiler.reset()  # each shape compiled afresh, static: no recompile limit reached, no fallback
        r, f = _run_shape(shape, built, iters, autotune, chunk_rows, configs, profile)
        rows, failed = rows + r, failed + [f"{fmt(shape)} {line}" for line in f]
        torch.cuda.empty_cache()  # the next shape's eager logits need the room
    return rows, failed


def _run_shape(shape, built, iters: int, autotune: bool, chunk_rows=(), configs=(),
               profile: int = 0) -> tuple[list[CERow], list[str]]:
    m, d, v = shape
    x, w, t = _inputs(m, d, v)
    inputs = {"forward": (x, w, t), "forward+backward": (x.detach().requires_grad_(), w.detach().requires_grad_(), t)}
    losses = variants(autotune, chunk_rows, configs)
    refs, checked, failed = {}, {}, []
    # first calls variant by variant, eager first (the reference), so that torch.compile compiles while
    # nvcc builds; then each step's variants timed round-robin (harness.round_robin: same clocks for all)
    for name, loss in losses.items():
        if name == "coda_dsl":
            try:
                built.result()
            except Exception as e:  # noqa: BLE001  its kernels would be rebuilt (and fail) at every call
                failed.append(f"coda_dsl kernels: {type(e).__name__}: {e}")
                break
        for step in STEPS:
            fn, args = _step(loss, step), inputs[step]
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    t0 = time.perf_counter()
                    out = fn(*args)
                    torch.cuda.synchronize()
                    first_s = time.perf_counter() - t0
                notes = list(dict.fromkeys(f"{c.category.__name__}: {c.message}" for c in caught))
                extra = {"first_call_s": round(first_s, 2), "warnings": notes}
                if name.startswith("coda_dsl"):
                    extra["chunk_rows"] = getattr(loss, "keywords", {}).get("chunk_rows") or \
                        ce.default_chunk_rows(m, v, x.device, x.dtype)
                if name == "eager":
                    refs[step] = out
                elif step in refs:
                    extra["rel_err_vs_eager"] = rel_err(out, refs[step])
                del out
                peak = peak_mib(fn, *args)
            except Exception as e:  # noqa: BLE001  keep the other variants' numbers
                failed.append(f"{name} {step}: {type(e).__name__}: {e}")
                continue
            progress(f"cross_entropy {step} {name}: peak +{peak:.0f} MiB, first call {first_s:.1f} s"
                     + "".join(f"\n  warning: {n}" for n in notes))
            checked[step, name] = (fn, peak, extra)
    raw = []
    for step in STEPS:
        fns = {name: fn for (st, name), (fn, _, _) in checked.items() if st == step}
        times = round_robin(fns, [inputs[step]], iters, WARMUP)
        for name, us in times.items():
            progress(f"cross_entropy {step} {name}: {us / 1e3:.2f} ms")
            raw.append((step, name, us, *checked[step, name][1:]))
    for name, loss in list(losses.items())[1:] if profile else ():
        fn, args = _step(loss, "forward+backward"), inputs["forward+backward"]
        progress(f"cross_entropy {fmt(shape)} forward+backward, {name}, under torch.profiler:\n"
                 + profile_kernels(lambda: fn(*args), profile))
    return _rows(shape, raw), failed


def _rows(shape, raw) -> list[CERow]:
    """Rows in table order (by step, then variant), with the ratios to eager of the same step."""
    eager = {step: (us, peak) for step, name, us, peak, _ in raw if name == "eager"}
    flops = {"forward": 2 * shape[0] * shape[1] * shape[2], "forward+backward": 6 * shape[0] * shape[1] * shape[2]}
    rows = []
    for step, name, us, peak, extra in sorted(raw, key=lambda r: STEPS.index(r[0])):  # stable: variants stay in order
        e_us, e_peak = eager.get(step, (float("nan"), float("nan")))
        rows.append(CERow(fmt(shape), step, name, us / 1e3, flops[step] / us / 1e6, peak, e_us / us,
                          peak / e_peak if e_peak else float("nan"), extra))
    return rows


def table(rows: list[CERow]) -> str:
    return markdown(["shape (M×d×V)", "step", "variant", "time (ms)", "TFLOP/s", "speedup vs eager",
                     "peak extra memory (MiB)", "memory vs eager"],
                    [[r.shape, r.step, r.variant, f"{r.ms:.2f}", f"{r.tflops:.0f}", f"{r.speedup:.2f}×",
                      f"{r.peak_mib:.0f}", f"{r.memory:.2f}×"] for r in rows], numeric=5)


def report(rows: list[CERow], failed: list[str], command: str) -> None:
    if rows:
        print("LM head + cross-entropy: time and peak extra memory relative to eager PyTorch "
              "(speedup: higher is better; memory: lower is better):\n")
        print(table(rows) + "\n")
    for r in rows:
        for n in r.extra.get("warnings", []):
            print(f"- {r.variant}, {r.step}: {n}")
    for f in failed:
        print(f"- FAILED {f}")
    progress(f"results: {save(rows, 'cross_entropy', command, failed=failed)}")


def main(argv=None) -> int:
    p = parser("python -m bench.cross_entropy", __doc__)
    p.add_argument("--shape", type=shapes, default=SHAPES, help="MxDxV,...: tokens, model width, vocabulary")
    p.add_argument("--iters", type=positive, default=10, help="timed calls per variant and step")
    p.add_argument("--autotune", action="store_true", help="torch.compile with max-autotune-no-cudagraphs (slow)")
    p.add_argument("--chunk-rows", type=lambda t: [positive(r) for r in t.split(",")], default=[],
                   help="also measure cd.linear_cross_entropy with these chunk_rows (comma-separated)")
    p.add_argument("--configs", type=config_texts, default=[],
                   help="also measure cd.linear_cross_entropy with these tile configurations (comma-separated "
                        "cd.Config texts, e.g. 128x128x64_c1x1_pingpong)")
    p.add_argument("--profile", type=non_negative, default=0, metavar="N",
                   help="after the timing, the N costliest GPU kernels of one forward+backward per variant (stderr)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    args = p.parse_args(argv)
    if args.dry_run:
        print(markdown(["bench", "shape", "variants"],
                       plan_rows(args.shape, args.autotune, args.chunk_rows, args.configs)))
        return 0
    if no_gpu():
        return 1
    with results_only_on_stdout():
        rows, failed = run(args.shape, args.iters, args.autotune, args.chunk_rows, args.configs, args.profile)
    report(rows, failed, command_line("python -m bench.cross_entropy", argv))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
