"""One Llama decoder layer (issue 16), forward and forward+backward, bf16: coda_dsl.nn.LlamaDecoderLayer
against Hugging Face's LlamaDecoderLayer (eager and torch.compile, the same weights) and the floor
that fusion can reach, in one process, round-robin, CUDA events, median.

    python -m bench.llama_layer [--config 8b] [--tokens 8192,16384] [--seq 2048] [--iters 20] [--json PATH]
                                [--profile N [--timeline]] [--without-y] [--sustained MS]

Variants (tokens = batch x seq; batch = tokens / seq):
- coda_dsl: LlamaDecoderLayer.from_hf(hf_layer, backend="cutlass"), with mlp.tie_gate_up() (the gate and
  up weights stored interleaved, as one process or DDP may train them; not with FSDP2); with --without-y
  also the same with mlp.keep_y = False ("coda_dsl, y recomputed": less memory held for the backward);
- HF eager: transformers' LlamaDecoderLayer, attention through SDPA (attention_mask None, so causal
  flash), cos/sin built once outside the timed region by LlamaRotaryEmbedding, as HF's model does;
- HF torch.compile: the same layer under torch.compile (default mode, dynamic=False), compiled and
  warmed up before timing;
- floor: the layer's GEMMs as bare cuBLAS (torch.mm on random bf16 operands of the same shapes and
  layouts: forward x @ W^T for QKV, O, gate/up, down; backward dY @ W and dY^T @ x for each) plus SDPA
  forward (and backward), each part timed alone and summed.
--profile N: after the timing, one fwd+bwd of each variant under torch.profiler, its N costliest GPU
kernels (total time, calls) on stderr: where each variant's time goes. --timeline: also every kernel of a
fwd+bwd launched right behind another one (the host ahead, the clocks under load, as inside a model), in
launch order (start, duration), to compare the variants step by step.
The round-robin never waits for the GPU, so the host runs ahead and the GPU stays loaded, as in
training. (Timing each call behind an idle GPU spin instead made every variant, even a lone cuBLAS
GEMM, 11-14 % faster on the H200: clock headroom after idling, not a property of the code.)
--sustained MS: each variant (and floor part) alone instead, after MS ms of its own calls, with the SM
clock and board power NVML read meanwhile: the steady state of a GPU that runs only that variant, as
training runs one layer's kernels for hours, where a kernel mix that draws more power runs at lower
clocks (the round-robin averages the clocks over all variants). Host ms: the host's time to launch one
fwd+bwd, with the GPU kept busy meanwhile so that no launch waits.
"fwd" runs under torch.no_grad (inference forward); "fwd+bwd" is torch.autograd.grad of the output
with respect to the input and every parameter (no accumulation into .grad). Peak MiB: for one
fwd+bwd, max_memory_allocated minus what was allocated before the call (parameters, inputs): the
activations, the workspaces and the gradients. Held for bwd: what a forward with autograd on leaves
allocated (its output and the tensors saved for the backward): a layer's share of a model's activations.
The coda_dsl layer's kernels are built first, in one parallel run (LlamaDecoderLayer.prebuild: minutes
when the cache is cold; progress on stderr).
"""
from __future__ import annotations

import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .harness import (Timing, add_timing, markdown, no_gpu, non_negative, parser, peak_mib, positive,
                      profile_kernels, progress, rel_err, results_only_on_stdout, save, timed)
from .harness import command as command_line

CONFIGS = {
    "8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=14336),  # Llama-3-8B
    "1b": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               intermediate_size=8192),  # Llama-3.2-1B
    "tiny": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=352),  # the CPU tests
}
TOKENS = [8192, 16384]
FLOOR = "floor (cuBLAS GEMMs + SDPA)"
CODA, EAGER, COMPILED = "coda_dsl", "HF eager", "HF torch.compile"
CODA_WITHOUT_Y = "coda_dsl, y recomputed"  # --without-y: mlp.keep_y = False
VARIANTS = (CODA, EAGER, COMPILED)
WARMUP = 3  # calls of milliseconds each, after the first (building / compiling) call


def llama_config(name: str):
    from transformers import LlamaConfig
    return LlamaConfig(**CONFIGS[name], rope_theta=500000.0, rms_norm_eps=1e-5, attn_implementation="sdpa")


# ---------------------------------------------------------------- the floor

def projections(config) -> list[tuple[str, int, int]]:
    """(name, N, K) of the layer's four forward GEMMs x[T, K] @ W[N, K]^T (QKV and gate/up fused, as the
    coda_dsl layer runs them)."""
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    nq, nkv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return [("qkv", nq + 2 * nkv, d), ("o", d, nq), ("gate_up", 2 * f, d), ("down", d, f)]


def floor_gemms(config, tokens: int) -> list[tuple[str, int, int, int]]:
    """(part, M, N, K) of every GEMM of one fwd+bwd: per projection the forward x @ W^T [T, N], the
    input gradient dY @ W [T, K] and the weight gradient dY^T @ x [N, K]."""
    out = []
    for name, n, k in projections(config):
        out += [(f"{name} fwd", tokens, n, k), (f"{name} dgrad", tokens, k, n), (f"{name} wgrad", n, k, tokens)]
    return out


def floor_parts(config, batch: int, seq: int, device) -> dict[str, Callable]:
    """part name -> a call of that part alone, on operands made here (outside the timed region); each part
    its own, so that one part does not find the one before's operands in L2 (a layer's do not)."""
    dt, t = torch.bfloat16, batch * seq
    r = lambda *s: torch.randn(*s, device=device, dtype=dt)  # noqa: E731
    parts = {}
    for name, n, k in projections(config):
        parts[f"{name} fwd"] = lambda x=r(t, k), w=r(n, k): torch.mm(x, w.t())
        parts[f"{name} dgrad"] = lambda g=r(t, n), w=r(n, k): torch.mm(g, w)
        parts[f"{name} wgrad"] = lambda g=r(t, n), x=r(t, k): torch.mm(g.t(), x)
    hd, h, kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q, k, v = (r(batch, n, seq, hd).requires_grad_() for n in (h, kv, kv))

    def attention():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd ** -0.5, enable_gqa=h != kv)

    with torch.enable_grad():
        o = attention()  # the graph the backward part reruns (retain_graph)
    go = torch.randn_like(o)

    def attention_fwd():
        with torch.no_grad():
            return attention()

    parts["attention fwd"] = attention_fwd
    parts["attention bwd"] = lambda: torch.autograd.grad(o, (q, k, v), go, retain_graph=True)
    return parts


def is_forward(part: str) -> bool:
    return part.endswith("fwd")


# ---------------------------------------------------------------- timing (the CPU tests replace these)

def host_ms(fn: Callable, iters: int) -> float:
    """Median host time of one fn() in ms, each behind a GPU spin of SPIN_MS so that no launch waits."""
    spin, times = spin_cycles(SPIN_MS), []
    for _ in range(iters):
        torch.cuda._sleep(spin)
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
        torch.cuda.synchronize()
    if max(times) > 0.8 * SPIN_MS:
        progress(f"warning: a call's host time reached {max(times):.1f} ms, near the {SPIN_MS} ms spin")
    return statistics.median(times)


SPIN_MS = 25.0  # GPU spin behind which host_ms launches: well above any variant's host time per call


def spin_cycles(ms: float) -> int:
    """torch.cuda._sleep's cycle count that keeps the GPU busy about `ms` (measured, clocks vary)."""
    start, end, probe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), 10**7
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def saved_mib(train_fwd: Callable) -> float:
    """What one training forward leaves allocated for its backward (its output and the tensors autograd
    saved): a layer's share of a model's activation memory."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = train_fwd()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    del out
    return held / 2**20


def cuda_mallocs(device) -> int | None:
    """How many memory segments torch's caching allocator has taken from cudaMalloc so far (None off CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("segment.all.allocated", 0)


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- the variants

class Calls(NamedTuple):
    fwd: Callable  # the forward under no_grad (inference)
    fwd_bwd: Callable  # the forward, then autograd.grad of the input and every parameter
    train_fwd: Callable  # the forward with autograd on: its output holds what the backward will read


def layer_calls(layer, x, dy, **kwargs) -> Calls:
    xg = x.detach().requires_grad_()
    params = [p for p in layer.parameters() if p.requires_grad]

    def fwd():
        with torch.no_grad():
            return layer(x, **kwargs)

    def fwd_bwd():
        return torch.autograd.grad(layer(xg, **kwargs), [xg, *params], dy)

    return Calls(fwd, fwd_bwd, lambda: layer(xg, **kwargs))


def variant_calls(config, batch: int, seq: int, device, backend: str, compile_fn=None, without_y: bool = False) \
        -> dict:
    """name -> its Calls on the same weights and input; compile_fn: torch.compile (a test passes another);
    without_y: also coda_dsl's layer with mlp.keep_y = False."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer as HFLayer
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from coda_dsl import nn as cdnn
    torch.manual_seed(0)
    hf = HFLayer(config, 0).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():  # HF's init leaves the norms at 1; random gammas exercise the norms
        for p in hf.parameters():
            p.normal_(0, config.hidden_size ** -0.5) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    ours = {}
    for name, keep_y in ((CODA, True), (CODA_WITHOUT_Y, False))[:1 + without_y]:
        ours[name] = layer = cdnn.LlamaDecoderLayer.from_hf(hf, backend=backend)
        layer.mlp.tie_gate_up()  # single-process training: the gate/up GEMM reads the two weights in place
        layer.mlp.keep_y = keep_y
        if backend == "cutlass":  # its kernels in one parallel build, not one by one at their first calls
            layer.prebuild(batch * seq)
    x = torch.randn(batch, seq, config.hidden_size, device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    pos = torch.arange(seq, device=device)[None]
    cos_sin = LlamaRotaryEmbedding(config).to(device)(x, pos)  # once, as LlamaModel does
    compiled = (compile_fn or torch.compile)(hf, dynamic=False)
    hf_args = dict(attention_mask=None, position_embeddings=cos_sin)
    return {**{name: layer_calls(layer, x, dy) for name, layer in ours.items()},
            EAGER: layer_calls(hf, x, dy, **hf_args), COMPILED: layer_calls(compiled, x, dy, **hf_args)}


@dataclass
class LayerRow:
    tokens: int
    variant: str
    fwd_ms: float
    fwd_bwd_ms: float
    peak_mib: float | None  # one fwd+bwd; None for the floor (no layer)
    extra: dict = field(default_factory=dict)
    host_fwd_bwd_ms: float | None = None  # host time to launch one fwd+bwd (host_ms); None for the floor
    saved_mib: float | None = None  # what a training forward holds for its backward; None for the floor
    bench: str = "llama_layer"


def run_tokens(config, tokens: int, seq: int, iters: int, device="cuda", backend="cutlass", compile_fn=None,
               profile: int = 0, timeline: bool = False, without_y: bool = False, sustain_ms: float = 0) \
        -> tuple[list[LayerRow], dict[str, float], list[str]]:
    """One token count: (variant rows with the floor first, floor part -> ms, failures)."""
    batch = tokens // seq
    calls = variant_calls(config, batch, seq, device, backend, compile_fn, without_y)
    parts = floor_parts(config, batch, seq, device)
    steps, extra, failed = {}, {}, []
    outputs = {}
    for name, (fwd, fwd_bwd, _) in calls.items():
        try:
            with results_only_on_stdout():
                for step, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                    progress(f"llama_layer {tokens} tokens: {name} {step}, first call"
                             + (" (builds the kernels if not cached)" if name.startswith(CODA) else
                                " (compiles)" if name == COMPILED else ""))
                    t0 = time.perf_counter()
                    out = fn()
                    synchronize(device)
                    first = extra.setdefault(name, {})[f"first_{step}_s"] = round(time.perf_counter() - t0, 2)
                    progress(f"  done in {first} s")
                    if step == "fwd":
                        outputs[name] = out
                    del out
                    for _ in range(WARMUP):
                        fn()
            steps[(name, "fwd")], steps[(name, "fwd+bwd")] = fwd, fwd_bwd
        except Exception as e:  # noqa: BLE001  keep the other variants' numbers
            failed.append(f"{tokens} tokens {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    for name in outputs:
        if name != EAGER and EAGER in outputs:
            extra[name]["rel_err_vs_hf_eager"] = rel_err(outputs[name], outputs[EAGER])
    del outputs
    for fn in parts.values():
        for _ in range(WARMUP):
            fn()
    synchronize(device)
    progress(f"llama_layer {tokens} tokens: timing {len(steps)} variant calls and {len(parts)} floor parts, "
             + (f"each alone after {sustain_ms:g} ms of its own calls" if sustain_ms else f"{iters} rounds"))
    fns = {**{f"{n} {s}": fn for (n, s), fn in steps.items()}, **{f"floor {p}": fn for p, fn in parts.items()}}
    mallocs = cuda_mallocs(device)
    us, clocks = timed(fns, [()], iters, Timing(sustain_ms), warmup=0)
    ms = {name: t / 1e3 for name, t in us.items()}
    for name, r in clocks.items():  # sustained: what each variant's own load did to the clock
        progress(f"  {name}: {ms[name]:.3f} ms at {r['mhz'] or '?'} MHz, {r['watts'] or '?'} W")
        if not name.startswith("floor "):
            variant, step = name.rsplit(" ", 1)
            extra.setdefault(variant, {})[f"{step}_mhz_watts"] = (r["mhz"], r["watts"])
    if mallocs is not None:  # each one can stall the host (and so the GPU): after the warm-up there should be none
        progress(f"llama_layer {tokens} tokens: cudaMalloc calls by the caching allocator while timing: "
                 f"{cuda_mallocs(device) - mallocs}")
    part_ms = {p: ms[f"floor {p}"] for p in parts}
    fwd_floor = sum(t for p, t in part_ms.items() if is_forward(p))
    rows = [LayerRow(tokens, FLOOR, fwd_floor, sum(part_ms.values()), None, {"parts_ms": part_ms})]
    for name in calls:
        if (name, "fwd") in steps:
            fwd_bwd = steps[(name, "fwd+bwd")]
            rows.append(LayerRow(tokens, name, ms[f"{name} fwd"], ms[f"{name} fwd+bwd"], peak_mib(fwd_bwd),
                                 extra.get(name, {}), host_ms(fwd_bwd, iters), saved_mib(calls[name].train_fwd)))
    for name in calls if profile else ():
        if (name, "fwd+bwd") in steps:
            progress(f"llama_layer {tokens} tokens: {name} fwd+bwd, GPU kernels by total time:\n"
                     + profile_kernels(steps[(name, "fwd+bwd")], profile, timeline))
    return rows, part_ms, failed


# ---------------------------------------------------------------- report

def table(rows: list[LayerRow]) -> str:
    """Per token count: each variant's times, its ratio to the floor, coda_dsl's speedup over it, its memory
    (peak of a fwd+bwd, held by a training forward) and host ms per fwd+bwd."""
    opt = lambda v, f: "–" if v is None else f.format(v)  # noqa: E731
    out = []
    for r in rows:
        floor = next(f for f in rows if f.tokens == r.tokens and f.variant == FLOOR)
        coda = next((c for c in rows if c.tokens == r.tokens and c.variant == CODA), None)
        speed = ["–", "–"] if coda is None or r.variant in (CODA, FLOOR) else \
            [f"{r.fwd_ms / coda.fwd_ms:.2f}×", f"{r.fwd_bwd_ms / coda.fwd_bwd_ms:.2f}×"]
        out.append([r.tokens, r.variant, f"{r.fwd_ms:.2f}", f"{r.fwd_bwd_ms:.2f}", f"{r.fwd_ms / floor.fwd_ms:.3f}",
                    f"{r.fwd_bwd_ms / floor.fwd_bwd_ms:.3f}", *speed, opt(r.peak_mib, "{:.0f}"),
                    opt(r.saved_mib, "{:.0f}"), opt(r.host_fwd_bwd_ms, "{:.2f}")])
    return markdown(["tokens", "variant", "fwd (ms)", "fwd+bwd (ms)", "fwd × floor", "fwd+bwd × floor",
                     "coda_dsl speedup fwd", "coda_dsl speedup fwd+bwd", "peak fwd+bwd (MiB)", "held for bwd (MiB)",
                     "host ms per fwd+bwd"], out, numeric=9)


def parts_table(config, seq: int, rows: list[LayerRow]) -> str:
    out = []
    for r in (r for r in rows if r.variant == FLOOR):
        shapes = {p: f"{m}×{n}×{k}" for p, m, n, k in floor_gemms(config, r.tokens)}
        b = r.tokens // seq
        attn = f"B {b}, S {seq}, {config.num_attention_heads}/{config.num_key_value_heads} heads × {config.head_dim}"
        out += [[r.tokens, p, shapes.get(p, attn), f"{t:.3f}"] for p, t in r.extra["parts_ms"].items()]
    return markdown(["tokens", "floor part", "shape (M×N×K)", "ms"], out, numeric=1)


def report(config_name: str, config, seq: int, rows: list[LayerRow], failed: list[str], command: str,
           json_path=None) -> None:
    if rows:
        print(f"Llama decoder layer ({config_name}: hidden {config.hidden_size}, {config.num_attention_heads} heads, "
              f"{config.num_key_value_heads} KV heads, head_dim {config.head_dim}, intermediate "
              f"{config.intermediate_size}), bf16, seq {seq}; medians; speedup = variant time / coda_dsl time:\n")
        print(table(rows) + "\n")
        print("The floor's parts:\n")
        print(parts_table(config, seq, rows) + "\n")
    for f in failed:
        print(f"- FAILED {f}")
    path = save(rows, "llama_layer", command, failed=failed, config=config_name, seq=seq)
    if json_path and Path(json_path).resolve() != path.resolve():  # (--json $OUT/llama_layer.json is that file)
        shutil.copyfile(path, json_path)
        path = json_path
    progress(f"results: {path}")


def tokens_list(text: str) -> list[int]:
    import argparse
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers like 8192,16384, got {text!r}")
    return values


def parse(argv=None):
    p = parser("python -m bench.llama_layer", __doc__)
    p.add_argument("--config", choices=sorted(CONFIGS), default="8b", help="layer shape (default: Llama-3-8B)")
    p.add_argument("--tokens", type=tokens_list, default=TOKENS, help="token counts, comma-separated")
    p.add_argument("--seq", type=positive, default=2048, help="sequence length; batch = tokens / seq")
    p.add_argument("--iters", type=positive, default=20, help="timed rounds")
    p.add_argument("--json", metavar="PATH", help="also write the results' JSON here")
    p.add_argument("--profile", type=non_negative, default=0, metavar="N",
                   help="print each variant's N costliest GPU kernels of one fwd+bwd (stderr)")
    p.add_argument("--without-y", action="store_true",
                   help=f"also the variant '{CODA_WITHOUT_Y}': the layer's MLP keeps no y for the backward")
    add_timing(p, "each variant and floor part")
    p.add_argument("--timeline", action="store_true",
                   help="with --profile: also every kernel of one fwd+bwd right behind another, in order (stderr)")
    args = p.parse_args(argv)
    if args.timeline and not args.profile:
        p.error("--timeline lists the kernels of the --profile run: give --profile N too")
    bad = [t for t in args.tokens if t % args.seq]
    if args.seq <= 0 or bad:
        p.error(f"--tokens must be multiples of --seq {args.seq} (batch = tokens / seq); not: {bad}")
    return args


def main(argv=None, device="cuda", backend="cutlass", compile_fn=None) -> int:
    args = parse(argv)
    if device == "cuda" and no_gpu():
        return 1
    config = llama_config(args.config)
    rows, failed = [], []
    for tokens in args.tokens:
        r, _, f = run_tokens(config, tokens, args.seq, args.iters, device, backend, compile_fn, args.profile,
                             args.timeline, args.without_y, args.sustained)
        rows, failed = rows + r, failed + f
        if device == "cuda":
            torch.cuda.empty_cache()
    report(args.config, config, args.seq, rows, failed, command_line("python -m bench.llama_layer", argv), args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
