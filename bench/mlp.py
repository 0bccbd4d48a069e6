"""The Llama MLP's two fused GEMMs (issues 12 and 16), each against the bare cuBLAS GEMM of its shape and
torch.compile's way of doing the same work:

    python -m bench.mlp [--steps gate_up,dY] [--shapes 8192x14336x4096] [--iters 30] [--configs default,...]
                        [--sustained MS]

Shapes are M x F x D (tokens x FFN x hidden). Steps, every variant on the same operands:
- gate_up (forward): coda_dsl.nn's `rms_swiglu_fwd`, H @ W_gate_up^T ([M, 2F], rows interleaved) with rstd
  and SwiGLU in the epilogue, writing y [M, F] and the [M, 2F] accumulator the backward reads. Floor:
  the bare cuBLAS GEMM H @ W_gate_up^T. torch.compile: HF's way, the gate and up GEMMs (cuBLAS), then
  torch.compile of SwiGLU over them (HF's layer keeps gate and up for its backward).
- dY (backward): dY = dOut @ W_down ([M, F]) with the SwiGLU and rstd derivative in its epilogue:
  - `rms_swiglu_grad` (coda_dsl.nn's, what the layer runs: derived from rms_swiglu by passes/autodiff.py,
    reading the saved accumulator): d gate, d up, d rstd;
  - `rms_swiglu_grad + y`: the same and y again (coda_dsl.nn's rms_swiglu_grad_and_y: LlamaMLP.keep_y False);
  - `rms_swiglu_grad_by_hand`: the same written by hand, reading the saved pre-activation rstd * acc
    (what the layer ran before the derived one).
  Floor: the bare cuBLAS dY. torch.compile: torch.mm, then torch.compile of HF's SwiGLU backward over
  separate gate and up tensors.
- wgrad (backward, not in the default --steps): W_gate's gradient dgate^T @ (h * gamma2), [F, D], as
  `gain_wgrad`: dgate passed transposed as A, h as B, gamma2 on the columns in the epilogue, so the
  layer need not keep h * gamma2 for its backward (what coda_dsl.nn does). Floor: cuBLAS on a kept
  h * gamma2 (what the layer did before). torch.compile: (dgate^T @ h) * gamma2.
Each step also runs coda_dsl's kernel with the identity epilogue at each config: the bare GEMM through
the same mainloop, so a fused kernel's time splits into the mainloop's gap to cuBLAS and its epilogue's.
--configs: `default` (the config cd.gemm picks at the shape), runtime/tune.py's named ones, or any config
text (e.g. 128x128x64_c1x2_pingpong_e64x32_s4: see passes/plan.Config.parse). Timing: round-robin over the
variants (harness.round_robin), or with --sustained MS each variant alone after MS ms of its own calls, with
the SM clock and board power read meanwhile (harness.sustained): a kernel that draws more power per
FLOP runs at lower clocks when it runs for long, which round-robin averages away. Ratios are
time / the step's floor: lower is better. Each fused variant's results (y; d gate, d up, d rstd, and y where
it recomputes it) are checked against PyTorch's in fp32 (the largest relative error in the JSON as
rel_err; a warning on stderr above 3e-2); the identity rows are not.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.library import gain_wgrad
from coda_dsl.nn import rms_swiglu_fwd, rms_swiglu_grad, rms_swiglu_grad_and_y
from coda_dsl.passes.plan import Config
from coda_dsl.runtime.tune import DEFAULT, PINGPONG, PINGPONG_192, default

from .harness import (Row, Timing, add_timing, fmt, markdown, no_gpu, parser, positive, progress,
                      results_only_on_stdout, rotation, save, shapes, timed)
from .harness import command as command_line

SHAPES = [(8192, 14336, 4096)]  # Llama-3-8B: tokens x FFN x hidden
BACKEND, DEVICE = "cutlass", "cuda"  # the CPU test runs the plumbing on the reference backend
CONFIGS = {"default": None, "cooperative": DEFAULT, "pingpong": PINGPONG, "pingpong192": PINGPONG_192}


def swiglu_grad(dy, g, u):
    """(d g, d u, silu(g)) of y = silu(g) * u for an incoming dy, written out by hand."""
    sig = cd.sigmoid(g)
    silu = g * sig
    return dy * u * sig * (1.0 + g * (1.0 - sig)), dy * silu, silu


@cd.epilogue
def rms_swiglu_grad_by_hand(acc, pre: cd.Tensor, rstd: cd.VecM):
    """rms_swiglu_grad written by hand: d gate, d up, and per row sum_n d(pre) * pre = d rstd * rstd."""
    g, u = cd.pairs(pre)
    dg, du, _ = swiglu_grad(acc, g, u)
    return {"dgate": rstd * dg, "dup": rstd * du, "dpre_pre": cd.sum(dg * g + du * u, axis="n")}


def hf_swiglu(gate, up):
    """HF's act_fn(gate) * up."""
    return F.silu(gate) * up


def hf_swiglu_backward(dy, gate, up):
    """HF's act_fn(gate) * up, differentiated: (d gate, d up)."""
    g, u, d = gate.float(), up.float(), dy.float()
    sig = torch.sigmoid(g)
    return (d * u * sig * (1 + g * (1 - sig))).to(dy.dtype), (d * F.silu(g)).to(dy.dtype)


@dataclass
class Step:
    """One fused GEMM of the MLP: its operands, the bare GEMM, torch.compile's way, coda_dsl's call of an
    epilogue, and the step's results in PyTorch (by name) and in a coda_dsl variant's outputs. Each callable
    takes the operands as one dict."""
    floor_name: str
    compiled_name: str
    epilogues: dict  # label -> epilogue
    inputs: Callable[[int, int, int], dict]  # (M, F, D) -> named operands
    floor: Callable[[dict], torch.Tensor]
    compiled: Callable[[Callable], Callable]  # torch.compile -> the call
    coda: Callable  # (epilogue, config, operands) -> outputs
    want: Callable[[dict], dict]  # operands -> {result name: fp32 PyTorch value}
    results: Callable[[dict, dict], dict]  # (a coda_dsl variant's outputs, operands) -> {result name: value}
    flops: Callable[[int, int, int], int]
    mnk: Callable[[int, int, int], tuple[int, int, int]]  # (M, F, D) -> the coda_dsl GEMM's M, N, K


def _r(*s) -> torch.Tensor:
    return torch.randn(*s, device=DEVICE, dtype=torch.bfloat16)


def _gate_up_inputs(m: int, f: int, d: int) -> dict:
    """H, the interleaved weight (coda_dsl's), the same two weights apart (HF's), rstd."""
    wg, wu = _r(f, d), _r(f, d)
    return {"h": _r(m, d), "w": torch.stack((wg, wu), 1).flatten(0, 1), "wg": wg, "wu": wu,
            "rstd": torch.rand(m, device=DEVICE) + 0.5}


def _dy_inputs(m: int, f: int, d: int) -> dict:
    """dOut, W_down, the forward's interleaved accumulator and pre-activation rstd * acc (what the derived
    and the hand-written epilogue read), the latter's halves apart (HF's gate and up), rstd."""
    acc, rstd = _r(m, 2 * f), torch.rand(m, device=DEVICE) + 0.5
    pre = (rstd[:, None] * acc).to(acc.dtype)
    return {"dout": _r(m, d), "w": _r(d, f), "saved_acc": acc, "pre": pre, "gate": pre[:, 0::2].contiguous(),
            "up": pre[:, 1::2].contiguous(), "rstd": rstd}


def _wgrad_inputs(m: int, f: int, d: int) -> dict:
    """d gate (what the dY GEMM gives), h and gamma2, and h * gamma2 (what the layer keeps today)."""
    h, gamma = _r(m, d), torch.rand(d, device=DEVICE, dtype=torch.bfloat16) + 0.5
    return {"dgate": _r(m, f), "h": h, "gamma": gamma, "hg": h * gamma}


def _dy_want(o: dict) -> dict:
    """d gate, d up (of the accumulators: rstd * d pre), d rstd (sum_n d pre * acc) and y, in fp32."""
    g, u, rstd = o["gate"].float(), o["up"].float(), o["rstd"][:, None]
    dg, du = hf_swiglu_backward(o["dout"].float() @ o["w"].float(), g, u)
    return {"d gate": dg * rstd, "d up": du * rstd, "d rstd": ((dg * g + du * u) / rstd).sum(-1),
            "y": hf_swiglu(g, u)}


def _dy_results(out: dict, o: dict) -> dict:
    if "D_even" in out:  # the derived epilogues
        y = {"y": out["recomputed_D"]} if "recomputed_D" in out else {}
        return {"d gate": out["D_even"], "d up": out["D_odd"], "d rstd": out["rstd"], **y}
    return {"d gate": out["dgate"], "d up": out["dup"], "d rstd": out["dpre_pre"] / o["rstd"]}


STEPS = {
    "gate_up": Step(
        "cuBLAS gate/up GEMM", "torch.compile (gate, up GEMMs + SwiGLU)",
        {"rms_swiglu_fwd": rms_swiglu_fwd, "identity": cd.identity},
        _gate_up_inputs,
        floor=lambda o: o["h"] @ o["w"].t(),
        compiled=lambda compile: (lambda o, fn=compile(hf_swiglu): fn(o["h"] @ o["wg"].t(), o["h"] @ o["wu"].t())),
        coda=lambda ep, config, o: cd.gemm(o["h"], o["w"], ep, config=config, backend=BACKEND,
                                           **{p.name: o[p.name] for p in ep.params}),
        want=lambda o: {"y": hf_swiglu(*(o["rstd"][:, None] * (o["h"].float() @ o["w"].float().t()))
                                       .unflatten(-1, (-1, 2)).unbind(-1))},
        results=lambda out, o: {"y": out["D"]},
        flops=lambda m, f, d: 2 * m * 2 * f * d,
        mnk=lambda m, f, d: (m, 2 * f, d)),
    "dY": Step(
        "cuBLAS dY", "torch.compile (mm + SwiGLU backward)",
        {"rms_swiglu_grad": rms_swiglu_grad, "rms_swiglu_grad + y": rms_swiglu_grad_and_y,
         "rms_swiglu_grad_by_hand": rms_swiglu_grad_by_hand, "identity": cd.identity},
        _dy_inputs,
        floor=lambda o: o["dout"] @ o["w"],
        compiled=lambda compile: (lambda o, fn=compile(hf_swiglu_backward): fn(o["dout"] @ o["w"], o["gate"], o["up"])),
        coda=lambda ep, config, o: cd.gemm(o["dout"], o["w"].t(), ep, config=config, backend=BACKEND,
                                           **{p.name: o[p.name] for p in ep.params}),
        want=_dy_want,
        results=_dy_results,
        flops=lambda m, f, d: 2 * m * f * d,
        mnk=lambda m, f, d: (m, f, d)),
    "wgrad": Step(
        "cuBLAS dW_gate = dgate^T @ (h * gamma)", "torch.compile ((dgate^T @ h) * gamma)",
        {"gain_wgrad": gain_wgrad, "identity": cd.identity},
        _wgrad_inputs,
        floor=lambda o: o["dgate"].t() @ o["hg"],
        compiled=lambda compile: (lambda o, fn=compile(lambda g, h, gamma: (g.t() @ h) * gamma):
                                  fn(o["dgate"], o["h"], o["gamma"])),
        coda=lambda ep, config, o: cd.gemm(o["dgate"].t(), (o["h"] if ep is gain_wgrad else o["hg"]).t(), ep,
                                           config=config, backend=BACKEND,
                                           **{p.name: o[p.name] for p in ep.params}),
        want=lambda o: {"dW": (o["dgate"].float().t() @ o["h"].float()) * o["gamma"].float()},
        results=lambda out, o: {"dW": out["D"]},
        flops=lambda m, f, d: 2 * m * f * d,
        mnk=lambda m, f, d: (f, d, m)),
}


def _config(name: str, shape: tuple, step: str):
    """The config text a --configs entry means at this shape and step."""
    m, f, d = shape
    if name not in CONFIGS:
        return Config.parse(name).text
    return (CONFIGS[name] or default(*STEPS[step].mnk(m, f, d))[0]).text


def variants(step: str, configs: list[str], shape: tuple) -> dict[str, tuple[Callable[[dict], object], bool]]:
    """label -> (the call, whether its first output is the step's result, checked against eager PyTorch)."""
    s = STEPS[step]
    out = {s.floor_name: (s.floor, False), s.compiled_name: (s.compiled(torch.compile), False)}
    for name, ep in s.epilogues.items():
        for c in configs:
            out[f"coda_dsl {name} ({c})"] = (lambda o, ep=ep, config=_config(c, shape, step): s.coda(ep, config, o),
                                             ep is not cd.identity)
    return out


def prebuild(steps: list[str], configs: list[str], todo: list[tuple]) -> None:
    """Every coda_dsl kernel of the run in one parallel ninja run (small operands: only layouts matter)."""
    from coda_dsl.runtime import op as runtime
    x, f32 = torch.empty(64, 64, dtype=torch.bfloat16, device=DEVICE), torch.empty(64, device=DEVICE)
    wide = torch.cat((x, x), -1)
    small = {"gate_up": ((x, x), dict(rstd=f32)), "dY": ((x, x.t()), dict(saved_acc=wide, pre=wide, rstd=f32)),
             "wgrad": ((x.t(), x.t()), dict(gamma=x[0]))}  # A passed transposed: dgate^T
    ops = {(step, name, cfg): cd.compile(ep, *small[step][0], config=cfg,
                                      **{p.name: small[step][1][p.name] for p in ep.params})
           for step in steps for name, ep in STEPS[step].epilogues.items() for c in configs for s in todo
           for cfg in [_config(c, s, step)]}
    runtime.prebuild(list(ops.values()))


def measure(step: str, shape: tuple, configs: list[str], iters: int, timing: Timing = Timing()) -> list[Row]:
    s, (m, f, d) = STEPS[step], shape
    one = s.inputs(m, f, d)
    made = iter([one])  # rotation's first set: this one, already made
    sets = rotation(lambda: next(made, None) or s.inputs(m, f, d), sum(t.nbytes for t in one.values()))
    want = s.want(one)
    torch.compiler.reset()  # each shape and step compiled afresh, static (no dynamic-shape recompile)
    errs, calls = {}, variants(step, configs, shape)
    for label, (fn, check) in calls.items():
        progress(f"mlp {step} {fmt(shape)}: {label}")
        got = fn(one)  # builds / compiles outside the timing
        if check:
            rels = {name: ((v.float() - want[name]).norm() / want[name].norm()).item()
                    for name, v in s.results(got, one).items()}
            worst = max(rels, key=rels.get)
            errs[label] = rels[worst]
            if errs[label] > 3e-2:
                progress(f"  {label}: {worst} differs from PyTorch's by {errs[label]:.1e}")
    fns, args = {label: fn for label, (fn, _) in calls.items()}, [(o,) for o in sets]
    times, steady = timed(fns, args, iters, timing)
    floor, compiled = times[s.floor_name], times[s.compiled_name]
    return [Row(f"mlp {step}", fmt(shape), label, us, s.flops(m, f, d) / us / 1e6, us / floor,
                {"vs_compile": us / compiled, **({"rel_err": errs[label]} if label in errs else {}),
                 **steady.get(label, {})})
            for label, us in times.items()]


def _num(v) -> str:
    return "–" if v is None else f"{v:.0f}"


def main(argv=None) -> int:
    p = parser("python -m bench.mlp", __doc__)
    p.add_argument("--steps", default="gate_up,dY", help=f"comma-separated, of {list(STEPS)}")
    p.add_argument("--shapes", type=shapes, default=SHAPES, help="MxFxD,... (default %(default)s)")
    p.add_argument("--configs", default="default",
                   help=f"comma-separated: {list(CONFIGS)} or config texts like 128x128x64_c1x2_pingpong")
    p.add_argument("--iters", type=positive, default=30)
    add_timing(p)
    args = p.parse_args(argv)
    steps, configs = args.steps.split(","), args.configs.split(",")
    if unknown := set(steps) - set(STEPS):
        p.error(f"--steps: unknown {sorted(unknown)}; choose from {list(STEPS)}")
    for c in (c for c in configs if c not in CONFIGS):
        try:
            Config.parse(c)
        except ValueError as e:
            p.error(f"--configs: {c!r} is none of {list(CONFIGS)} and not a config text: {e}")
    if no_gpu():
        return 1
    rows = []
    with results_only_on_stdout():
        prebuild(steps, configs, args.shapes)
        for step in steps:
            for s in args.shapes:
                rows += measure(step, s, configs, args.iters, Timing.of(args))
    power = ["MHz", "W"] if args.sustained else []
    print(markdown(["step", "shape (M×F×D)", "variant", "time (µs)", "TFLOP/s", "× floor", "× torch.compile", *power],
                   [[r.bench.split()[1], r.shape, r.variant, f"{r.us:.0f}", f"{r.tflops:.0f}", f"{r.vs_gemm:.3f}",
                     f"{r.extra['vs_compile']:.3f}", *(_num(r.extra.get(k)) for k in ("mhz", "watts")[:len(power)])]
                    for r in rows], numeric=4 + len(power)))
    save(rows, "mlp", command_line("python -m bench.mlp", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
