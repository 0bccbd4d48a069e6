"""A small Llama trained on a synthetic next-token task (issue 16), from the SAME initial weights, as
Hugging Face's model and with coda_dsl's layers: the loss curves must agree.

    python -m bench.train_llama [--steps 200] [--batch 16] [--seq 128] [--lr 1e-3] [--layers 4]
                                [--device cuda|cpu] [--backend auto|cutlass|reference] [--no-compile]
                                [--compile-modes default,reduce-overhead]

Model: transformers' LlamaModel (embedding, decoder layers, final norm) + a linear LM head, hidden
256, 4 heads of 64, 2 KV heads, intermediate 688 (every GEMM N and K a multiple of 8), vocabulary
512. Variants, each trained with AdamW for --steps steps on the same batches:
- "HF eager": the model as transformers runs it (SDPA attention), F.cross_entropy on fp32 logits;
- "HF eager fp32" (bf16 runs only): HF's model in fp32 from the same weights, the precision's truth:
  the bf16 variants' distances from it and from HF eager show how much of a gap is bf16 rounding;
- "HF torch.compile" (GPU only; --no-compile skips it): the same under torch.compile (default mode);
- "coda_dsl": every decoder layer replaced by coda_dsl.nn.LlamaDecoderLayer.from_hf(...) (the norm
  statistic passed from layer to layer), the LM head + loss by coda_dsl.library.linear_cross_entropy;
- "coda_dsl + torch.compile" (GPU only; --no-compile skips it): that model under torch.compile (default
  mode), as one would run HF's: at this size every variant is bound by host time per launch;
- both compiled models again in torch.compile's "reduce-overhead" mode (each compiled graph replayed as a
  CUDA graph: launches cost no host time), named "... (reduce-overhead)"; --compile-modes chooses.
Data: sequences of a fixed random Markov chain in which each token has SUCCESSORS possible next
tokens, equally likely, so the best reachable loss is about ln(SUCCESSORS) (the start: ln(512) = 6.24).
Precision: on the GPU every variant has bf16 parameters and activations (the coda_dsl layer has no
fp32-master / bf16-compute mode; AdamW updates the bf16 parameters in place); on the CPU, fp32.
The coda_dsl model's kernels are built first, in one parallel run (cd.prebuild of one step).
Tokens/s: steps after the first WARMUP_STEPS (kernel builds, compilation), host-timed between two
synchronizations; no synchronization inside the loop (the losses are read after the last step).
Writes train_llama.json (curves, command) and train_llama.png to bench/results/ (or $OUT).
"""
from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import coda_dsl as cd

from .harness import markdown, no_gpu, out_dir, parser, positive, progress, results_only_on_stdout, save
from .harness import command as command_line

SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=688,
             vocab_size=512, rope_theta=500000.0, rms_norm_eps=1e-5, attn_implementation="sdpa")
SUCCESSORS = 4
WARMUP_STEPS = 10
HF, FP32, COMPILED, CODA = "HF eager", "HF eager fp32", "HF torch.compile", "coda_dsl"
CODA_COMPILED = CODA + " + torch.compile"
COMPILE_MODES = ("default", "reduce-overhead")  # torch.compile's modes the compiled variants run in


def compiled_name(name: str, mode: str) -> str:
    """COMPILED or CODA_COMPILED in torch.compile's `mode`: the default mode keeps the plain name."""
    return name if mode == "default" else f"{name} ({mode})"


def markov_batches(vocab: int, steps: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """[steps, batch, seq + 1] int64 tokens of one fixed random Markov chain: each token's successor is
    one of SUCCESSORS tokens of a random table, uniformly."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=g)
    n = steps * batch
    tokens = torch.empty(n, seq + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(seq):
        tokens[:, t + 1] = table[tokens[:, t], torch.randint(0, SUCCESSORS, (n,), generator=g)]
    return tokens.view(steps, batch, seq + 1)


class HFLM(nn.Module):
    """transformers' LlamaModel + a linear LM head; forward returns the mean next-token loss."""

    def __init__(self, config):
        super().__init__()
        from transformers import LlamaModel
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, ids, targets):
        h = self.model(input_ids=ids, use_cache=False).last_hidden_state  # training: no KV cache
        return F.cross_entropy(self.lm_head(h).flatten(0, 1).float(), targets.flatten())


class CodaLM(nn.Module):
    """A copy of an HFLM whose decoder layers are coda_dsl's and whose LM head + loss is
    linear_cross_entropy (no logits in memory); the embedding and the final norm are HF's modules."""

    def __init__(self, hf: HFLM, backend: str):
        super().__init__()
        from coda_dsl import nn as cdnn
        self.embed_tokens = copy.deepcopy(hf.model.embed_tokens)
        self.layers = nn.ModuleList(cdnn.LlamaDecoderLayer.from_hf(layer, backend=backend) for layer in hf.model.layers)
        self.norm = copy.deepcopy(hf.model.norm)
        self.lm_head = copy.deepcopy(hf.lm_head)
        self.backend = backend

    def forward(self, ids, targets):
        from coda_dsl.library import linear_cross_entropy
        h, rstd = self.embed_tokens(ids), None
        for layer in self.layers:  # each layer's down epilogue emits the next one's input rstd
            h, rstd = layer(h, input_rstd=rstd, return_rstd=True)
        h = self.norm(h)
        return linear_cross_entropy(h.flatten(0, 1), self.lm_head.weight, targets.flatten(), backend=self.backend)


def prebuilt(model: CodaLM, batch: torch.Tensor) -> CodaLM:
    """The model with every kernel of its training step built in one parallel ninja run (cd.prebuild of
    one step on the first batch, its GEMMs on the reference backend meanwhile), not one after another
    in the first step; no gradient left behind."""
    cd.prebuild(lambda: model(batch[:, :-1], batch[:, 1:]).backward())
    model.zero_grad(set_to_none=True)
    return model


def initial_model(layers: int, device, dtype, seed: int = 0) -> HFLM:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    config = LlamaConfig(**SMALL, num_hidden_layers=layers)
    torch.manual_seed(seed)
    model = HFLM(config).to(device=device, dtype=dtype)
    # .to(dtype) rounds HF's RoPE frequencies too; from_pretrained(dtype=...) keeps them fp32, so do the same
    model.model.rotary_emb.inv_freq = LlamaRotaryEmbedding(config).inv_freq.to(device)
    return model


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Curve:
    variant: str
    losses: list[float]
    tokens_per_s: float
    first_step_s: float  # includes kernel builds / compilation
    extra: dict = field(default_factory=dict)
    bench: str = "train_llama"


def train(name: str, model: nn.Module, batches: torch.Tensor, lr: float, device, compile_mode: str | None = None) -> Curve:
    """AdamW on every parameter, one step per batch (the model under torch.compile in `compile_mode`, if
    given); the loss is read back only after the last step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    step_fn = torch.compile(model, mode=compile_mode) if compile_mode else model
    graphed = compile_mode == "reduce-overhead"
    steps = batches.shape[0]
    timed_from = min(WARMUP_STEPS, steps - 1)
    losses = []
    t0 = t_timed = time.perf_counter()
    first = 0.0
    for i, b in enumerate(batches):
        if i == timed_from:
            synchronize(device)
            t_timed = time.perf_counter()
        if graphed:  # a new training step: the last one's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        loss = step_fn(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone() if graphed else loss.detach())  # (a graph's output is overwritten)
        if i == 0:
            synchronize(device)
            first = time.perf_counter() - t0
            progress(f"train_llama {name}: first step {first:.1f} s")
    synchronize(device)
    elapsed = time.perf_counter() - t_timed
    tokens = (steps - timed_from) * batches.shape[1] * (batches.shape[2] - 1)
    curve = torch.stack(losses).float().tolist()
    progress(f"train_llama {name}: final loss {curve[-1]:.4f}, {tokens / elapsed:.0f} tokens/s")
    return Curve(name, curve, tokens / elapsed, round(first, 2))


def train_all(runs: list, batches: torch.Tensor, lr: float, device) -> tuple[list[Curve], list[str]]:
    """train() each (name, make the model, compile mode or None) -> (curves, names of the variants that
    failed). A compiled variant's failure (in torch.compile's machinery) is reported and left out, so that
    it loses not the other variants' curves; an eager variant's is raised."""
    curves, failed = [], []
    for name, make, mode in runs:
        try:
            curves.append(train(name, make(), batches, lr, device, mode))
        except Exception as e:
            if mode is None:
                raise
            progress(f"train_llama {name}: FAILED, left out of the results: {type(e).__name__}: {e}")
            failed.append(name)
    return curves, failed


def max_diff(a: Curve, b: Curve) -> float:
    return max(abs(x - y) for x, y in zip(a.losses, b.losses))


def table(curves: list[Curve]) -> str:
    """A row per variant; with an fp32 run (bf16 training), each one's distance from it too."""
    ref, truth = curves[0], next((c for c in curves if c.variant == FP32), None)
    refs = [ref] + ([truth] if truth else [])
    return markdown(["variant", "final loss", *(f"max abs(loss − {r.variant}) over steps" for r in refs), "tokens/s",
                     "tokens/s vs " + ref.variant],
                    [[c.variant, f"{c.losses[-1]:.4f}", *("–" if c is r else f"{max_diff(c, r):.2e}" for r in refs),
                      f"{c.tokens_per_s:.0f}", f"{c.tokens_per_s / ref.tokens_per_s:.2f}×"] for c in curves],
                    numeric=3 + len(refs))


def plot(curves: list[Curve], path, title: str):
    """The loss curves as a PNG; None (with a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("train_llama: matplotlib is not installed, so no PNG (pip install matplotlib)")
        return None
    fig, (ax, dax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    steps = range(1, len(curves[0].losses) + 1)
    looks = {HF: ("-", "C0"), COMPILED: ("--", "C1"), CODA: (":", "C2"), FP32: ("-.", "C3"),
             CODA_COMPILED: ((0, (1, 3)), "C4"), compiled_name(COMPILED, "reduce-overhead"): ((0, (5, 2)), "C5"),
             compiled_name(CODA_COMPILED, "reduce-overhead"): ((0, (3, 1, 1, 1)), "C6")}  # in both panels
    for c in curves:
        style, color = looks[c.variant]
        ax.plot(steps, c.losses, linestyle=style, color=color, label=c.variant)
        if c is not curves[0]:  # the curves overlap: their difference shows the agreement
            dax.plot(steps, [a - b for a, b in zip(c.losses, curves[0].losses)], linestyle=style, color=color,
                     label=c.variant)
    ax.axhline(math.log(SUCCESSORS), color="gray", lw=0.8, ls="-.", label=f"ln {SUCCESSORS} (best reachable)")
    ax.set(ylabel="loss (next-token cross-entropy)", title=title)
    ax.legend()
    dax.axhline(0, color="gray", lw=0.8)
    dax.set(xlabel="step", ylabel=f"loss − {curves[0].variant}")
    dax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse(argv=None):
    p = parser("python -m bench.train_llama", __doc__)
    p.add_argument("--steps", type=positive, default=200)
    p.add_argument("--batch", type=positive, default=16)
    p.add_argument("--seq", type=positive, default=128)
    p.add_argument("--layers", type=positive, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="initial weights and data")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--backend", choices=cd.BACKENDS, default="auto",
                   help="cd.gemm's backend for the coda_dsl layers and loss")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants (always off on the CPU)")
    p.add_argument("--compile-modes", default=",".join(COMPILE_MODES),
                   help="torch.compile modes of the compiled variants, comma-separated (default %(default)s)")
    args = p.parse_args(argv)
    if min(args.steps, args.batch, args.seq, args.layers) <= 0:
        p.error("--steps, --batch, --seq and --layers must be positive")
    args.compile_modes = [m for m in args.compile_modes.split(",") if m]
    if not args.compile_modes or (bad := [m for m in args.compile_modes if m not in COMPILE_MODES]):
        p.error(f"--compile-modes takes some of {', '.join(COMPILE_MODES)}, comma-separated"
                + (f"; got {', '.join(bad)}" if args.compile_modes else ""))
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cuda" and no_gpu():
        return 1
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    init = initial_model(args.layers, args.device, dtype, args.seed)
    batches = markov_batches(init.model.config.vocab_size, args.steps, args.batch, args.seq, args.seed).to(args.device)
    modes = args.compile_modes if args.device == "cuda" and not args.no_compile else []

    def hf():
        return copy.deepcopy(init)

    def coda():
        return prebuilt(CodaLM(init, args.backend), batches[0])

    runs = [(HF, hf, None)]
    if dtype != torch.float32:  # what bf16 itself does to the curve: HF in fp32 from the same weights
        runs.append((FP32, lambda: hf().float(), None))
    runs += [(compiled_name(COMPILED, m), hf, m) for m in modes]
    runs.append((CODA, coda, None))
    runs += [(compiled_name(CODA_COMPILED, m), coda, m) for m in modes]
    with results_only_on_stdout():
        curves, failed = train_all(runs, batches, args.lr, args.device)
    command = command_line("python -m bench.train_llama", argv)
    print(f"{args.layers}-layer Llama (hidden 256, vocabulary 512), {args.steps} steps of {args.batch}×{args.seq} "
          f"tokens, AdamW lr {args.lr}, {str(dtype).removeprefix('torch.')} on {args.device}; "
          f"best reachable loss ln {SUCCESSORS} = {math.log(SUCCESSORS):.3f}:\n")
    print(table(curves))
    diffs = {c.variant: max_diff(c, curves[0]) for c in curves[1:]}
    truth = {c.variant: max_diff(c, t) for t in curves if t.variant == FP32 for c in curves if c is not t}
    path = save(curves, "train_llama", command, dtype=str(dtype), max_abs_diff_vs_hf_eager=diffs,
                **({"max_abs_diff_vs_hf_eager_fp32": truth} if truth else {}), **({"failed": failed} if failed else {}))
    png = plot(curves, out_dir() / "train_llama.png", f"{args.layers}-layer Llama, Markov next-token task ({args.device})")
    progress(f"results: {path}" + (f", {png}" if png else ""))
    if failed:
        progress(f"train_llama: {len(failed)} variant(s) failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
