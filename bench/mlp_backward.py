"""The Llama MLP backward's first GEMM (issue 12, item 4): dY = dOut @ W_down ([M, F]) with the SwiGLU
(and rstd) derivative in its epilogue, against the bare cuBLAS GEMM of that shape and torch.compile's
way (the GEMM, then one fused kernel over the saved gate and up outputs).

    python -m bench.mlp_backward [--shapes 8192x14336x4096] [--iters 30] [--configs default,cooperative]

Shapes are M x F x D (dY's M x N x K). Variants, all from the same dOut, W_down and saved activations:
- cuBLAS dY: torch.mm alone (the floor);
- torch.compile: torch.mm, then torch.compile of HF's SwiGLU backward over separate gate and up
  tensors ([M, F] each, as HF's layer saves them): d gate, d up;
- coda_dsl, per epilogue and config (default: the config cd.gemm picks):
  - `rms_swiglu_grad` (coda_dsl.nn's, what the layer runs): d gate, d up, Σ d(pre)·pre per row;
  - `grad_recompute_y`: the same and y again (a layer that does not keep y from the forward);
  - `grad_interleaved`: one interleaved [M, 2F] gradient (a double-width store) and the row sum.
Ratios are time / cuBLAS dY: lower is better. Each coda_dsl variant's d gate is checked against
eager PyTorch's (rel_err in the JSON; a warning on stderr above 3e-2).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.library import swiglu_grad
from coda_dsl.nn import rms_swiglu_grad
from coda_dsl.runtime.tune import DEFAULT, default

from .harness import Row, fmt, markdown, no_gpu, parser, progress, results_only_on_stdout, rotation, save, shapes, time_us
from .harness import command as command_line

SHAPES = [(8192, 14336, 4096)]  # Llama-3-8B: tokens x FFN x hidden
FLOOR, COMPILED = "cuBLAS dY", "torch.compile (mm + SwiGLU backward)"
BACKEND, DEVICE = "cutlass", "cuda"  # the CPU test runs the plumbing on the reference backend


@cd.epilogue
def grad_recompute_y(acc, pre: cd.Tensor, rstd: cd.VecM):
    g, u = cd.pairs(pre)
    dg, du, silu = swiglu_grad(acc, g, u)
    return {"dgate": rstd * dg, "dup": rstd * du, "y": silu * u, "dpre_pre": cd.sum(dg * g + du * u, axis="n")}


@cd.epilogue
def grad_interleaved(acc, pre: cd.Tensor, rstd: cd.VecM):
    g, u = cd.pairs(pre)
    dg, du, _ = swiglu_grad(acc, g, u)
    return {"D": cd.interleave(rstd * dg, rstd * du), "dpre_pre": cd.sum(dg * g + du * u, axis="n")}


EPILOGUES = [rms_swiglu_grad, grad_recompute_y, grad_interleaved]
CONFIGS = {"default": None, "cooperative": DEFAULT}  # None: what cd.gemm picks at the shape


def hf_swiglu_backward(dy, gate, up):
    """HF's act_fn(gate) * up, differentiated: (d gate, d up)."""
    g, u, d = gate.float(), up.float(), dy.float()
    sig = torch.sigmoid(g)
    return (d * u * sig * (1 + g * (1 - sig))).to(dy.dtype), (d * F.silu(g)).to(dy.dtype)


def _inputs(m: int, f: int, d: int) -> tuple:
    r = lambda *s: torch.randn(*s, device=DEVICE, dtype=torch.bfloat16)  # noqa: E731
    pre = r(m, 2 * f)
    return (r(m, d), r(d, f), pre, torch.rand(m, device=DEVICE) + 0.5,
            pre[:, 0::2].contiguous(), pre[:, 1::2].contiguous())


def _config(name: str, shape: tuple):
    m, f, d = shape
    return (CONFIGS[name] or default(m, f, d)[0]).text


def variants(configs: list[str], shape: tuple) -> dict:
    compiled = torch.compile(hf_swiglu_backward)
    out = {FLOOR: lambda dout, w, pre, rstd, gate, up: dout @ w,
           COMPILED: lambda dout, w, pre, rstd, gate, up: compiled(dout @ w, gate, up)}
    for ep in EPILOGUES:
        for c in configs:
            config = _config(c, shape)
            out[f"coda_dsl {ep.name} ({c})"] = (
                lambda dout, w, pre, rstd, gate, up, ep=ep, config=config:
                cd.gemm(dout, w.t(), ep, pre=pre, rstd=rstd, config=config, backend=BACKEND))
    return out


def prebuild(configs: list[str], todo: list[tuple]) -> None:
    """Every coda_dsl kernel of the run in one parallel ninja run."""
    from coda_dsl.runtime import op as runtime
    x, f32 = torch.empty(64, 64, dtype=torch.bfloat16, device=DEVICE), torch.empty(64, device=DEVICE)
    ops = {(ep.name, _config(c, s)): cd.compile(ep, x, x.t(), config=_config(c, s), pre=torch.cat((x, x), -1),
                                                rstd=f32)
           for ep in EPILOGUES for c in configs for s in todo}
    runtime.prebuild(list(ops.values()))


def _dgate(out) -> torch.Tensor:
    return out["D"][:, 0::2] if "D" in out else out["dgate"]


def measure(shape: tuple, configs: list[str], iters: int) -> list[Row]:
    m, f, d = shape
    sets = rotation(lambda: _inputs(m, f, d), 2 * (m * d + d * f + 4 * m * f))
    dout, w, _, rstd, gate, up = sets[0]
    want = hf_swiglu_backward(dout @ w, gate, up)[0].float() * rstd[:, None]
    times, errs = {}, {}
    for label, fn in variants(configs, shape).items():
        progress(f"mlp_backward {fmt(shape)}: {label}")
        got = fn(*sets[0])  # builds / compiles outside the timing
        if label.startswith("coda_dsl"):
            errs[label] = ((_dgate(got).float() - want).norm() / want.norm()).item()
            if errs[label] > 3e-2:
                progress(f"  {label}: d gate differs from eager PyTorch's by {errs[label]:.1e}")
        times[label] = time_us(fn, sets, iters=iters, warmup=3)
    flops = 2 * m * f * d
    return [Row("mlp_backward", fmt(shape), label, us, flops / us / 1e6, us / times[FLOOR],
                {"vs_compile": us / times[COMPILED], **({"rel_err": errs[label]} if label in errs else {})})
            for label, us in times.items()]


def main(argv=None) -> int:
    p = parser("python -m bench.mlp_backward", __doc__)
    p.add_argument("--shapes", type=shapes, default=SHAPES, help="MxFxD,... (default %(default)s)")
    p.add_argument("--configs", default="default", help=f"comma-separated, of {list(CONFIGS)}")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    configs = args.configs.split(",")
    if unknown := set(configs) - set(CONFIGS):
        p.error(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    if no_gpu():
        return 1
    rows = []
    with results_only_on_stdout():
        prebuild(configs, args.shapes)
        for s in args.shapes:
            rows += measure(s, configs, args.iters)
    print(markdown(["shape (M×F×D)", "variant", "time (µs)", "TFLOP/s", "× cuBLAS dY", "× torch.compile"],
                   [[r.shape, r.variant, f"{r.us:.0f}", f"{r.tflops:.0f}", f"{r.vs_gemm:.3f}",
                     f"{r.extra['vs_compile']:.3f}"] for r in rows], numeric=4))
    save(rows, "mlp_backward", command_line("python -m bench.mlp_backward", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
