"""The default configuration's rule per GPU model, measured where it matters: the Llama-3-8B layer
(bench.llama_layer) with coda_dsl's kernels configured by each model's rule of runtime/tune.py:default,
all on this GPU, each rule in a process of its own, the rules' processes alternating over the rounds.

    python -m bench.default_rule [--rules H100,H200] [--rounds 2] [--tokens 8192,16384] [--iters 10]

A rule is named by the GPU model default() gives it to (not this machine's GPU, on which every rule
runs). Prints, per rule and token count, coda_dsl's forward and forward+backward time × the floor
(the layer's bare cuBLAS GEMMs + SDPA, timed in the same process), the median over the rounds, with
torch.compile's beside it; the JSON keeps every round. The rule this GPU should get is the one with
the lower forward+backward ratio (training's step); runtime/tune.py:default has the measured rules.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .harness import command, markdown, no_gpu, parser, positive, progress, save, subset
from .llama_layer import CODA, COMPILED, FLOOR, tokens_list

RULES = ("H100", "H200")  # the models runtime/tune.py:default has a rule of its own for


def under_rule(rule: str, module: str, args: list[str], **kw) -> subprocess.CompletedProcess:
    """`python -m module args` with default() reading the rule of GPU model `rule` (not this GPU's name), and
    no tuning record read (one would give both rules' processes the same recorded config)."""
    code = ("import os, runpy\nfrom coda_dsl.runtime import tune\n"
            "tune.gpu_name = lambda device=None: 'NVIDIA ' + os.environ['CODA_BENCH_RULE']\n"
            "tune.recorded = lambda *args: None\n"
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    env = {**os.environ, **kw.pop("env", {}), "CODA_BENCH_RULE": rule}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=Path(__file__).resolve().parent.parent, **kw)


@dataclass
class RuleRow:
    rule: str
    round: int
    tokens: int
    variant: str
    fwd_x_floor: float
    fwd_bwd_x_floor: float


def run_rule(rule: str, round_: int, tokens: list[int], iters: int) -> list[RuleRow]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "layer.json"
        args = ["--tokens", ",".join(map(str, tokens)), "--iters", str(iters), "--json", str(out)]
        progress(f"default_rule: round {round_}, the {rule}'s rule: python -m bench.llama_layer {' '.join(args)}")
        done = under_rule(rule, "bench.llama_layer", args, env={"OUT": tmp}, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())["rows"] if out.exists() else []
    floor = {r["tokens"]: r for r in rows if r["variant"] == FLOOR}
    timed = [r for r in rows if r["variant"] in (CODA, COMPILED) and r["tokens"] in floor]
    if sorted(r["tokens"] for r in timed if r["variant"] == CODA) != sorted(tokens):
        raise SystemExit(f"default_rule: bench.llama_layer under the {rule}'s rule did not time coda_dsl "
                         f"(exit {done.returncode}; its progress is above)")
    if done.returncode:  # a variant failed (torch.compile's, say): its rows are missing, coda_dsl's are kept
        progress(f"default_rule: bench.llama_layer exited {done.returncode} under the {rule}'s rule; keeping its rows")
    return [RuleRow(rule, round_, r["tokens"], r["variant"], r["fwd_ms"] / floor[r["tokens"]]["fwd_ms"],
                    r["fwd_bwd_ms"] / floor[r["tokens"]]["fwd_bwd_ms"]) for r in timed]


def report(rows: list[RuleRow], rules: list[str], tokens: list[int]) -> str:
    def median(rule, t, variant, field):
        values = [getattr(r, field) for r in rows if (r.rule, r.tokens, r.variant) == (rule, t, variant)]
        return f"{statistics.median(values):.3f}" if values else "–"
    out = [[t, rule, *(median(rule, t, v, f) for v in (CODA, COMPILED) for f in ("fwd_x_floor", "fwd_bwd_x_floor"))]
           for t in tokens for rule in rules]
    return markdown(["tokens", "rule of", "coda_dsl fwd × floor", "coda_dsl fwd+bwd × floor",
                     "torch.compile fwd × floor", "torch.compile fwd+bwd × floor"], out, numeric=4)


def main(argv=None) -> int:
    p = parser("python -m bench.default_rule", __doc__)
    p.add_argument("--rules", type=subset(RULES), default=list(RULES), help="GPU models whose rules to time "
                   f"(default: {','.join(RULES)})")
    p.add_argument("--rounds", type=positive, default=2, help="processes per rule, alternating (default 2)")
    p.add_argument("--tokens", type=tokens_list, default=[8192, 16384], help="token counts, comma-separated")
    p.add_argument("--iters", type=positive, default=10, help="bench.llama_layer's timed rounds per process")
    args = p.parse_args(argv)
    if no_gpu():
        return 1
    rows = []
    for i in range(args.rounds):
        for rule in (args.rules if i % 2 == 0 else args.rules[::-1]):
            rows += run_rule(rule, i, args.tokens, args.iters)
    print(f"Llama-3-8B layer under each GPU model's default-config rule, on this GPU; medians of {args.rounds} "
          "processes per rule:\n")
    print(report(rows, args.rules, args.tokens))
    progress(f"results: {save(rows, 'default_rule', command('python -m bench.default_rule', argv))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
