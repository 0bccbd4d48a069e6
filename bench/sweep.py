"""Kernel configurations against the bare cuBLAS GEMM, one table per epilogue: the data behind the
default configuration (runtime/tune.py:default).

    python -m bench.sweep [--only identity,...] [--configs KEY,...] [--shapes MxNxK,...] [--iters 30]
                          [--sustained MS | --graph]

Besides bench.epilogues' cases, `--only ce_logits`: the cross-entropy's logits GEMM over one chunk of
4096 rows at V = 128256 (linear_cross_entropy's default there), its statistics epilogue storing the fp16
logits (of order 1, as a model's: w scaled by d^-1/2); with `identity` on the same configurations and
`--shapes 4096x128256x4096`, what the epilogue costs on each. `--only bias_gelu_keep_acc,bias_gelu_backward`:
cd.linear's forward kernel for bias_gelu (D and the accumulator) and its derived backward in the GEMM that
produces D's gradient (cd.backward_epilogue: dacc and the bias's column sums).

Every (epilogue, configuration) kernel is built in one parallel ninja run; then, per shape, the
cuBLAS GEMM and every configuration are timed round-robin (CUDA events, median of rounds, inputs
rotated past L2), or with --graph from CUDA graph replays (the GPU's time without the host's), or
with --sustained MS each alone after MS ms of its own calls (harness.sustained), as training runs
them: under the 700 W cap a tile that draws more power per FLOP clocks lower, which short
round-robin bursts do not show (runtime/tune.py:default). Also prints the name of the kernel
cuBLAS runs at each shape (its tile, cluster and schedule are in the name). JSON under $OUT or
bench/results/ (sweep.json).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.library import cross_entropy as ce
from coda_dsl.passes.plan import Config
from coda_dsl.runtime import op as runtime

from . import epilogues
from .epilogues import CASES, Case, _inputs, bias_gelu
from .harness import (Row, Timing, add_timing, config_texts, fmt, markdown, no_gpu, parser, positive, progress,
                      rel_err, results_only_on_stdout, rotation, save, shapes, subset, timed)
from .harness import command as command_line

LLAMA = ((8192, 4096, 4096), (8192, 6144, 4096), (8192, 14336, 4096), (8192, 4096, 14336),  # 8B: o, qkv, up, down
         (8192, 28672, 8192), (8192, 8192, 28672))  # 70B: up, down
SHAPES = {"swiglu": ((8192, 28672, 4096), (8192, 57344, 8192)), "rope": ((8192, 6144, 4096), (8192, 12288, 4096)),
          "ce_logits": ((4096, 128256, 4096),)}  # M = a chunk's rows, N = Llama-3's vocabulary, K = d


def _targets(m: int, n: int) -> torch.Tensor:
    return torch.randint(0, n, (m,), device="cuda")


def _gelu_backward_eager(a, w, bias, saved_acc):
    """dY = a @ w^T times gelu_tanh'(saved_acc + bias): the gradient of bias_gelu's accumulator."""
    h = (saved_acc.float() + bias.float()).requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(F.gelu(h, approximate="tanh"), h, (a @ w.t()).float())[0]


SWEPT = {**CASES, "ce_logits": Case("ce_logits", ce._forward_epilogue(False, None, ce.stored_logits(torch.bfloat16)),
                                    lambda m, n: {"target": _targets(m, n)}, lambda a, w, target: a @ w.t(),
                                    scaled_w=True),
         # cd.linear's forward kernel (bias_gelu keeping its accumulator), and bias_gelu's derived backward in the
         # GEMM that produces its incoming gradient (the accumulator's and the bias's gradients): issue 15's kernels
         "bias_gelu_keep_acc": Case("bias_gelu_keep_acc", cd.forward_epilogue(bias_gelu),
                                    lambda m, n: {"bias": epilogues._r(n)},
                                    lambda a, w, bias: F.gelu(a @ w.t() + bias, approximate="tanh")),
         "bias_gelu_backward": Case("bias_gelu_backward", cd.backward_epilogue(bias_gelu),
                                    lambda m, n: {"bias": epilogues._r(n), "saved_acc": epilogues._r(m, n)},
                                    _gelu_backward_eager)}
CONFIGS = ("128x256x64_c2x1_cooperative_s1", "128x256x64_c2x1_cooperative", "128x256x64_c2x1_cooperative_rm_s4",
           "128x256x64_c2x1_cooperative_streamk", "256x128x64_c2x1_cooperative",
           "128x256x64_c2x1_cooperative_e128x64", "128x192x64_c2x1_pingpong", "128x128x64_c2x1_pingpong")


def cublas_kernel(m: int, n: int, k: int) -> str:
    """The name of the GPU kernel that `a @ w.t()` runs at this shape."""
    a, w = _inputs(CASES["identity"], m, n, k)[:2]
    a @ w.t()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        a @ w.t()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
             and "memset" not in e.name.lower()]  # cuBLAS may clear a workspace first
    return names[0] if names else "?"


def built_kernels(cases, configs: list[Config]) -> tuple[dict, list[str]]:
    """Every (epilogue, configuration) kernel, built in one parallel ninja run: {(name, config text): op}
    for those that built, and a line for each that did not."""
    a, w = (torch.randn(256, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ops = {(c.name, cfg.text): cd.compile(c.epilogue, a, w, config=cfg, **c.operands(256, 256))
           for c in cases for cfg in configs}
    try:
        runtime.prebuild(list(ops.values()))
    except Exception as e:  # noqa: BLE001  measure what built
        progress(f"builds: {type(e).__name__}: {str(e)[:2000]}")
    built = {key: op for key, op in ops.items() if op.built}
    return built, [f"{name} {config}: did not build" for name, config in ops if (name, config) not in built]


def main(argv=None) -> int:
    p = parser("python -m bench.sweep", __doc__)
    p.add_argument("--only", type=subset(tuple(SWEPT)), default=list(CASES),
                   help="epilogues (default: bench.epilogues' cases)")
    p.add_argument("--configs", type=config_texts, default=list(CONFIGS), help="configuration keys, comma-separated")
    p.add_argument("--shapes", type=shapes, help="MxNxK,... (default: Llama-3 8B/70B projections at 8192 tokens)")
    p.add_argument("--iters", type=positive, default=30, help="timed calls per variant, over all rounds")
    add_timing(p, graph=True)
    args = p.parse_args(argv)
    configs = [Config.parse(c) for c in args.configs]
    if no_gpu():
        return 1
    command = command_line("python -m bench.sweep", argv)
    cases = [SWEPT[n] for n in args.only]
    with results_only_on_stdout():
        ops, failed = built_kernels(cases, configs)
    shapes_of = {c.name: args.shapes or SHAPES.get(c.name, LLAMA) for c in cases}
    rows, tables = [], []
    for c in cases:
        header, lines = None, []
        for shape in shapes_of[c.name]:
            m, n, k = shape
            sets = rotation(lambda: _inputs(c, m, n, k), 2 * (m * k + n * k + m * n))
            a, w, o = sets[0]
            ref = c.eager(a, w, **o)
            ref = ref[0] if isinstance(ref, tuple) else ref
            variants = {"cuBLAS": lambda a, w, o: a @ w.t()}
            for cfg in configs:
                op = ops.get((c.name, cfg.text))
                if op is None:
                    continue
                try:
                    err = rel_err(op(a, w, **o)["D"], ref)
                except Exception as e:  # noqa: BLE001
                    failed.append(f"{c.name} {cfg.text} {fmt(shape)}: {type(e).__name__}: {e}")
                    continue
                if not err < 2e-2:
                    failed.append(f"{c.name} {cfg.text} {fmt(shape)}: rel. error {err:.3g}")
                    continue
                variants[cfg.text] = (lambda op: lambda a, w, o: op(a, w, **o))(op)
            t, clocks = timed(variants, sets, args.iters, Timing.of(args))
            rows += [Row(c.name, fmt(shape), v, t[v], 2 * m * n * k / t[v] / 1e6, t[v] / t["cuBLAS"],
                         clocks.get(v, {})) for v in t]
            header = header or [cfg.text for cfg in configs]
            lines.append([fmt(shape), f"{t['cuBLAS']:.0f}", *(f"{t[k] / t['cuBLAS']:.3f}" if k in t else "–"
                                                               for k in header)])
            progress(f"{c.name} {fmt(shape)}: " + ", ".join(f"{v} {x:.1f}" for v, x in t.items()))
        tables.append(f"### {c.name}\n\n" + markdown(["shape", "cuBLAS µs", *header], lines, numeric=1 + len(header)))
    print("Time / the bare cuBLAS GEMM of the same shape (lower is better):\n")
    print("\n\n".join(tables))
    print("\ncuBLAS kernels:\n")
    swept = dict.fromkeys(s for c in cases for s in shapes_of[c.name])  # each shape once, in order
    print(markdown(["shape", "kernel"], [[fmt(s), cublas_kernel(*s)] for s in swept]))
    for f in failed:
        print(f"- FAILED {f}")
    progress(f"results: {save(rows, 'sweep', command, failed=failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
