"""bench/llama_layer.py and bench/train_llama.py without a GPU: arguments, the floor's GEMM shapes, the
tables, a whole layer-benchmark run on the CPU (reference backend, host timing) and a short training
run whose coda_dsl loss curve must match HF's."""
from __future__ import annotations

import copy
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ lives at the repository root

from bench import llama_layer as ll  # noqa: E402
from bench import harness  # noqa: E402
from bench import train_llama as tl  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- llama_layer

def test_floor_gemms_of_llama3_8b():
    """By hand: QKV N = (32 + 2 * 8) * 128 = 6144, gate/up N = 2 * 14336; dgrad swaps N and K, wgrad is
    [N, K] contracted over the tokens."""
    t = 8192
    assert ll.floor_gemms(ll.llama_config("8b"), t) == [
        ("qkv fwd", t, 6144, 4096), ("qkv dgrad", t, 4096, 6144), ("qkv wgrad", 6144, 4096, t),
        ("o fwd", t, 4096, 4096), ("o dgrad", t, 4096, 4096), ("o wgrad", 4096, 4096, t),
        ("gate_up fwd", t, 28672, 4096), ("gate_up dgrad", t, 4096, 28672), ("gate_up wgrad", 28672, 4096, t),
        ("down fwd", t, 4096, 14336), ("down dgrad", t, 14336, 4096), ("down wgrad", 4096, 14336, t)]


def test_floor_parts_compute_those_shapes():
    config = ll.llama_config("tiny")
    parts = ll.floor_parts(config, 2, 16, "cpu")
    gemms = ll.floor_gemms(config, 32)
    assert list(parts) == [p for p, *_ in gemms] + ["attention fwd", "attention bwd"]
    for part, m, n, _ in gemms:
        assert parts[part]().shape == (m, n), part
    assert parts["attention fwd"]().shape == (2, 4, 16, 32)
    dq, dk, dv = parts["attention bwd"]()
    assert dq.shape == (2, 4, 16, 32) and dk.shape == dv.shape == (2, 2, 16, 32)
    assert parts["attention bwd"]()[0].shape == dq.shape  # the retained graph runs again
    assert [p for p in parts if ll.is_forward(p)] == ["qkv fwd", "o fwd", "gate_up fwd", "down fwd", "attention fwd"]


def test_fwd_bwd_returns_gradients_without_accumulating():
    from coda_dsl import nn as cdnn
    config = ll.llama_config("tiny")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer as HFLayer
    layer = cdnn.LlamaDecoderLayer.from_hf(HFLayer(config, 0), backend="reference")
    x = torch.randn(1, 8, config.hidden_size)
    fwd, fwd_bwd, train_fwd = ll.layer_calls(layer, x, torch.randn_like(x))
    assert not fwd().requires_grad and train_fwd().requires_grad
    grads = fwd_bwd()
    assert len(grads) == 1 + 9 and grads[0].shape == x.shape
    assert all(p.grad is None for p in layer.parameters())


def test_layer_arguments(capsys):
    args = ll.parse([])
    assert (args.config, args.tokens, args.seq, args.iters, args.json) == ("8b", [8192, 16384], 2048, 20, None)
    assert ll.parse(["--tokens", "4096", "--seq", "1024", "--config", "1b"]).tokens == [4096]
    assert ll.parse(["--profile", "5", "--timeline"]).timeline
    for bad in (["--tokens", "3000"], ["--tokens", "8192,x"], ["--config", "70b"], ["--token", "8192"],
                ["--timeline"]):
        with pytest.raises(SystemExit) as e:
            ll.parse(bad)
        assert e.value.code == 2, bad
    assert "multiples of --seq 2048" in capsys.readouterr().err


@pytest.mark.parametrize("entry", [ll.main, tl.main])
def test_no_cuda_exits_with_one_line(entry, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert entry([]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "CUDA" in err


def test_layer_table():
    rows = [ll.LayerRow(8192, ll.FLOOR, 6.0, 16.0, None, {"parts_ms": {}}),
            ll.LayerRow(8192, ll.CODA, 6.6, 16.8, 5000.0, {}, 4.0, 1100.2),
            ll.LayerRow(8192, ll.EAGER, 9.9, 21.0, 9000.0, {}, 3.0, 1500.0),
            ll.LayerRow(8192, ll.COMPILED, 7.92, 18.48, 7000.4, {}, 2.5, 800.0)]
    lines = ll.table(rows).splitlines()
    assert lines[0].endswith("| peak fwd+bwd (MiB) | held for bwd (MiB) | host ms per fwd+bwd |")
    assert lines[1] == "|---|---|" + "---:|" * 9
    assert lines[2] == "| 8192 | floor (cuBLAS GEMMs + SDPA) | 6.00 | 16.00 | 1.000 | 1.000 | – | – | – | – | – |"
    assert lines[3] == "| 8192 | coda_dsl | 6.60 | 16.80 | 1.100 | 1.050 | – | – | 5000 | 1100 | 4.00 |"
    assert lines[5] == "| 8192 | HF torch.compile | 7.92 | 18.48 | 1.320 | 1.155 | 1.20× | 1.10× | 7000 | 800 | 2.50 |"


@pytest.fixture
def host_timing(monkeypatch, tmp_path):
    """The layer benchmark on the CPU: one host-timed call per fn instead of CUDA events; no memory stats."""
    monkeypatch.setenv("OUT", str(tmp_path))
    timed = []

    def round_robin(fns, sets, iters, warmup=2):
        timed.append(list(fns))
        out = {}
        for name, fn in fns.items():
            t = time.perf_counter()
            fn(*sets[0])
            out[name] = (time.perf_counter() - t) * 1e6
        return out
    monkeypatch.setattr(harness, "round_robin", round_robin)
    monkeypatch.setattr(ll, "peak_mib", lambda fn: fn() is not None and 1.0)
    monkeypatch.setattr(ll, "saved_mib", lambda fn: fn().requires_grad and 2.0)
    monkeypatch.setattr(ll, "host_ms", lambda fn, iters: fn() is not None and 3.0)
    return tmp_path, timed


def test_layer_bench_runs_on_cpu(host_timing, capsys):
    tmp, timed = host_timing
    argv = ["--config", "tiny", "--tokens", "32,64", "--seq", "16", "--iters", "1", "--json", str(tmp / "x.json")]
    assert ll.main(argv, device="cpu", backend="reference", compile_fn=lambda f, **kw: f) == 0
    out = capsys.readouterr().out
    for tokens in (32, 64):
        for v in ll.VARIANTS:
            assert f"| {tokens} | {v} |" in out
        assert f"| {tokens} | gate_up wgrad | 704×128×{tokens} |" in out
        assert f"| {tokens} | attention bwd | B {tokens // 16}, S 16, 4/2 heads × 32 |" in out
    # every variant's fwd and fwd+bwd and every floor part timed in the same round-robin
    assert timed[0] == [f"{v} {s}" for v in ll.VARIANTS for s in ("fwd", "fwd+bwd")] + \
        [f"floor {p}" for p, *_ in ll.floor_gemms(ll.llama_config("tiny"), 32)] + ["floor attention fwd",
                                                                                   "floor attention bwd"]
    data = json.loads((tmp / "x.json").read_text())
    assert data == json.loads((tmp / "llama_layer.json").read_text())
    assert data["meta"]["command"] == "python -m bench.llama_layer " + " ".join(argv) and data["meta"]["failed"] == []
    rows = data["rows"]
    assert [(r["tokens"], r["variant"]) for r in rows] == [(t, v) for t in (32, 64) for v in (ll.FLOOR, *ll.VARIANTS)]
    floor = rows[0]
    assert floor["fwd_ms"] == pytest.approx(sum(t for p, t in floor["extra"]["parts_ms"].items() if p.endswith("fwd")))
    assert floor["fwd_bwd_ms"] == pytest.approx(sum(floor["extra"]["parts_ms"].values()))
    assert len(timed) == 2  # one round-robin per token count
    assert all(r["host_fwd_bwd_ms"] == 3.0 and r["saved_mib"] == 2.0 for r in rows if r["variant"] != ll.FLOOR)
    # bf16, the same weights: coda_dsl and "compiled" HF (eager here) agree with HF eager
    assert rows[1]["extra"]["rel_err_vs_hf_eager"] < 2e-2 and rows[3]["extra"]["rel_err_vs_hf_eager"] == 0


def test_layer_bench_without_y_adds_a_variant(host_timing, capsys):
    """--without-y: coda_dsl's layer a second time, its MLP keeping no y; the same output as the first."""
    argv = ["--config", "tiny", "--tokens", "32", "--seq", "16", "--iters", "1", "--without-y"]
    assert ll.main(argv, device="cpu", backend="reference", compile_fn=lambda f, **kw: f) == 0
    assert f"| 32 | {ll.CODA_WITHOUT_Y} |" in capsys.readouterr().out
    rows = json.loads((host_timing[0] / "llama_layer.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == [ll.FLOOR, ll.CODA, ll.CODA_WITHOUT_Y, ll.EAGER, ll.COMPILED]
    assert rows[2]["extra"]["rel_err_vs_hf_eager"] == pytest.approx(rows[1]["extra"]["rel_err_vs_hf_eager"])


def test_layer_bench_sustained_times_each_alone_and_records_the_clocks(host_timing, capsys, monkeypatch):
    """--sustained MS: harness.sustained instead of the round-robin; each variant's MHz and W kept."""
    seen = []

    def sustained(fns, sets, iters, ms):
        seen.append(ms)
        return {name: {"us": 1000.0, "mhz": 1500.0, "watts": 600.0} for name in fns}
    monkeypatch.setattr(harness, "sustained", sustained)
    argv = ["--config", "tiny", "--tokens", "32", "--seq", "16", "--iters", "1", "--sustained", "50"]
    assert ll.main(argv, device="cpu", backend="reference", compile_fn=lambda f, **kw: f) == 0
    assert seen == [50.0] and host_timing[1] == []  # no round-robin
    assert "| 32 | coda_dsl | 1.00 | 1.00 |" in capsys.readouterr().out
    rows = json.loads((host_timing[0] / "llama_layer.json").read_text())["rows"]
    assert rows[1]["extra"]["fwd+bwd_mhz_watts"] == [1500.0, 600.0]


def test_layer_bench_reports_a_failing_variant(host_timing, capsys):
    class Broken(torch.nn.Module):  # as torch.compile's module: the layer's parameters, a failing call
        def __init__(self, layer, **kw):
            super().__init__()
            self.layer = layer

        def forward(self, *a, **k):
            raise RuntimeError("boom")
    # --json naming the file the bench writes anyway ($OUT/llama_layer.json): no copy onto itself
    json_path = str(host_timing[0] / "llama_layer.json")
    assert ll.main(["--config", "tiny", "--tokens", "32", "--seq", "16", "--iters", "1", "--json", json_path],
                   device="cpu", backend="reference", compile_fn=Broken) == 1
    assert json.loads(Path(json_path).read_text())["meta"]["failed"]
    out = capsys.readouterr().out
    assert "- FAILED 32 tokens HF torch.compile: RuntimeError: boom" in out
    assert "| 32 | coda_dsl |" in out and "| 32 | HF torch.compile |" not in out


# ---------------------------------------------------------------- train_llama

def test_markov_batches():
    b = tl.markov_batches(50, 3, 4, 20, seed=1)
    assert b.shape == (3, 4, 21) and b.dtype == torch.int64 and 0 <= b.min() and b.max() < 50
    assert torch.equal(b, tl.markov_batches(50, 3, 4, 20, seed=1))
    assert not torch.equal(b, tl.markov_batches(50, 3, 4, 20, seed=2))
    successors = {}
    for row in b.reshape(-1, 21).tolist():
        for a, c in zip(row, row[1:]):
            successors.setdefault(a, set()).add(c)
    assert max(len(s) for s in successors.values()) <= tl.SUCCESSORS  # learnable: few successors per token


def test_train_arguments():
    args = tl.parse([])
    assert (args.steps, args.batch, args.seq, args.layers, args.device, args.backend) == (200, 16, 128, 4, "cuda", "auto")
    assert args.compile_modes == ["default", "reduce-overhead"]
    assert tl.parse(["--compile-modes", "reduce-overhead"]).compile_modes == ["reduce-overhead"]
    for bad in (["--steps", "0"], ["--compile-modes", "max-autotune"], ["--compile-modes", ","]):
        with pytest.raises(SystemExit):
            tl.parse(bad)


def test_training_matches_hf_on_cpu(tmp_path, monkeypatch, capsys):
    """fp32 on the CPU: the coda_dsl model's loss curve is HF's within 1e-3 at every step."""
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--device", "cpu", "--backend", "reference", "--steps", "6", "--batch", "2", "--seq", "16", "--layers", "2",
            "--lr", "3e-3"]
    assert tl.main(argv) == 0
    out, err = capsys.readouterr()
    assert "| HF eager |" in out and "| coda_dsl |" in out and "torch.compile" not in out  # no compile on the CPU
    data = json.loads((tmp_path / "train_llama.json").read_text())
    assert data["meta"]["command"] == "python -m bench.train_llama " + " ".join(argv)
    hf, coda = data["rows"]
    assert (hf["variant"], coda["variant"]) == (tl.HF, tl.CODA) and len(hf["losses"]) == len(coda["losses"]) == 6
    assert hf["losses"][0] == pytest.approx(math.log(512), abs=0.5)  # starts near uniform
    assert len(set(hf["losses"])) == 6  # the weights do change
    assert max(abs(a - b) for a, b in zip(hf["losses"], coda["losses"])) < 1e-3
    assert data["meta"]["max_abs_diff_vs_hf_eager"]["coda_dsl"] < 1e-3
    assert coda["tokens_per_s"] > 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # a fresh venv (CI): the script says so and writes no PNG
        assert not (tmp_path / "train_llama.png").exists() and "matplotlib is not installed" in err
    else:
        assert (tmp_path / "train_llama.png").read_bytes()[:8] == PNG


def test_a_failing_compiled_variant_loses_no_other_curve(monkeypatch, capsys):
    def train(name, model, batches, lr, device, mode=None):
        if mode == "reduce-overhead" or name == "broken eager":
            raise RuntimeError("cudagraphs said no")
        return tl.Curve(name, [1.0], 1.0, 0.0)
    monkeypatch.setattr(tl, "train", train)
    runs = [(tl.HF, lambda: None, None), (tl.compiled_name(tl.COMPILED, "reduce-overhead"), lambda: None, "reduce-overhead"),
            (tl.CODA_COMPILED, lambda: None, "default")]
    curves, failed = tl.train_all(runs, None, 1e-3, "cuda")
    assert [c.variant for c in curves] == [tl.HF, tl.CODA_COMPILED] and failed == [runs[1][0]]
    assert "HF torch.compile (reduce-overhead): FAILED, left out of the results: RuntimeError: cudagraphs said no" \
        in capsys.readouterr().err
    with pytest.raises(RuntimeError):  # an eager variant's failure is the bench's
        tl.train_all([("broken eager", lambda: None, None)], None, 1e-3, "cuda")


def test_coda_model_copies_the_weights():
    init = tl.initial_model(2, "cpu", torch.float32)
    coda = tl.CodaLM(init, "reference")
    names = dict(init.named_parameters())
    assert len(list(coda.parameters())) == len(names)
    for name, p in coda.named_parameters():
        hf_name = name if name.startswith("lm_head") else "model." + name
        assert torch.equal(p, names[hf_name]) and p.data_ptr() != names[hf_name].data_ptr(), name
    assert init.model.rotary_emb.inv_freq.dtype == torch.float32


# ---------------------------------------------------------------- on an sm_90 GPU (the lead's H200 run)

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU; none visible to torch")


@gpu
def test_layer_bench_smoke_gpu(tmp_path, monkeypatch, capsys):
    """The tiny config through the real path: cutlass kernels, torch.compile, CUDA events, memory stats."""
    monkeypatch.setenv("OUT", str(tmp_path))
    assert ll.main(["--config", "tiny", "--tokens", "512", "--seq", "256", "--iters", "3"]) == 0
    rows = json.loads((tmp_path / "llama_layer.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == [ll.FLOOR, *ll.VARIANTS]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > r["fwd_ms"] for r in rows)
    assert all(r["peak_mib"] > 0 and r["saved_mib"] > 0 for r in rows[1:])
    assert rows[1]["extra"]["rel_err_vs_hf_eager"] < 2e-2 and rows[3]["extra"]["rel_err_vs_hf_eager"] < 2e-2


@gpu
def test_training_smoke_gpu(tmp_path, monkeypatch):
    """bf16 on the GPU: a few steps, the curves within bf16 noise of each other (loose: chaotic divergence)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    assert tl.main(["--steps", "30", "--batch", "4", "--seq", "64", "--layers", "2", "--lr", "3e-3",
                    "--no-compile", "--backend", "cutlass"]) == 0
    hf, coda = json.loads((tmp_path / "train_llama.json").read_text())["rows"]
    assert max(abs(a - b) for a, b in zip(hf["losses"], coda["losses"])) < 0.1
    loss = coda["losses"]
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.1  # fp32 on the CPU: 6.31 -> 6.09


def test_train_table_measures_each_variant_against_fp32_when_there_is_one():
    curve = lambda name, losses: tl.Curve(name, losses, 100.0, 0.0)  # noqa: E731
    curves = [curve(tl.HF, [3.0, 2.0]), curve(tl.FP32, [3.0, 2.01]), curve(tl.CODA, [3.03, 2.0])]
    rows = {line.split("|")[1].strip(): [x.strip() for x in line.split("|")[2:-1]] for line in tl.table(curves).splitlines()[2:]}
    assert rows[tl.CODA][:3] == ["2.0000", "3.00e-02", "3.00e-02"] and rows[tl.FP32][1:3] == ["1.00e-02", "–"]
    assert "HF eager fp32" not in tl.table(curves[::2]).splitlines()[0]  # fp32 training: no such column


def test_train_plot_draws_every_variant(tmp_path):
    """The PNG of a GPU run's seven curves (a dash pattern among their styles: it failed on the H100 once)."""
    pytest.importorskip("matplotlib")
    names = (tl.HF, tl.FP32, tl.CODA, *(tl.compiled_name(n, m) for n in (tl.COMPILED, tl.CODA_COMPILED)
                                         for m in tl.COMPILE_MODES))
    curves = [tl.Curve(name, [3.0 - i / 10, 2.0], 100.0, 0.0) for i, name in enumerate(names)]
    assert tl.plot(curves, tmp_path / "t.png", "title") == tmp_path / "t.png" and (tmp_path / "t.png").stat().st_size


def test_bf16_gradients_are_as_close_to_fp32_as_hfs():
    """The README's claim about train_llama's bf16 curves: at the first step, every parameter's bf16
    gradient of the coda_dsl model (reference backend: the kernels' fp32 epilogue math and roundings) is
    at least as close to the fp32 gradient as HF's own bf16 gradient is (10 % slack per parameter)."""
    init = tl.initial_model(2, "cpu", torch.float32)
    batch = tl.markov_batches(512, 1, 4, 64)[0]

    def grads(model):
        model(batch[:, :-1], batch[:, 1:]).backward()
        return {n.removeprefix("model."): p.grad.float() for n, p in model.named_parameters()}
    fp32 = grads(copy.deepcopy(init))
    hf16 = copy.deepcopy(init).to(torch.bfloat16)
    hf16.model.rotary_emb.inv_freq = init.model.rotary_emb.inv_freq  # as initial_model keeps it
    hf, coda = grads(copy.deepcopy(hf16)), grads(tl.CodaLM(hf16, "reference"))
    err = lambda g, n: ((g[n] - fp32[n]).norm() / fp32[n].norm()).item()  # noqa: E731
    worse = {n: (err(coda, n), err(hf, n)) for n in fp32 if err(coda, n) > 1.1 * err(hf, n)}
    assert not worse, worse


# ---------------------------------------------------------------- default_rule

def test_default_rule_runs_a_module_under_another_gpus_rule():
    """The rule a process runs under is the named GPU model's, whatever this machine has (here through
    `coda-dsl explain --shape`, which prints the configuration default() gives)."""
    from bench import default_rule as dr
    for rule, config, why in (("H100", "128x256x64_c2x1_cooperative", "NVIDIA H100: cooperative"),
                              ("H200", "128x192x64_c2x1_pingpong", "NVIDIA H200: the H200's rule")):
        done = dr.under_rule(rule, "coda_dsl", ["explain", "coda_dsl.examples:bias_gelu", "--shape", "8192x6144x4096"],
                             capture_output=True, text=True)
        assert done.returncode == 0 and f"config {config}\n" in done.stdout and why in done.stdout, done.stderr


def test_default_rule_table_takes_medians_per_rule():
    from bench import default_rule as dr
    rows = [dr.RuleRow(rule, i, 8192, variant, f, 1.0 + f / 10)
            for i, f in enumerate((1.0, 1.2, 1.1)) for rule in ("H100", "H200") for variant in (dr.CODA, dr.COMPILED)]
    table = dr.report(rows, ["H100", "H200"], [8192])
    assert "| 8192 | H100 | 1.100 | 1.110 | 1.100 | 1.110 |" in table and table.count("\n") == 3


def test_default_rule_without_a_gpu_exits_with_one(monkeypatch):
    from bench import default_rule as dr
    monkeypatch.setattr(dr, "no_gpu", lambda: True)
    assert dr.main(["--rounds", "1"]) == 1


def test_default_rule_takes_only_the_models_with_a_rule(capsys):
    from bench import default_rule as dr
    with pytest.raises(SystemExit):
        dr.main(["--rules", "A100"])
    assert "choose from H100, H200" in capsys.readouterr().err
    for bad in (["--rounds", "0"], ["--iters", "-1"]):
        with pytest.raises(SystemExit):
            dr.main(bad)
        assert "expected a positive integer" in capsys.readouterr().err


def test_default_rule_reads_the_layer_bench_json(monkeypatch):
    """run_rule's ratios come from bench.llama_layer's JSON; a run that timed coda_dsl is kept even when
    another variant failed (exit 1), one that did not is an error."""
    from bench import default_rule as dr

    def fake(rows, rc):
        def under_rule(rule, module, args, **kw):
            Path(args[args.index("--json") + 1]).write_text(json.dumps({"rows": rows}))
            return type("Done", (), {"returncode": rc})()
        monkeypatch.setattr(dr, "under_rule", under_rule)
    floor = {"tokens": 8192, "variant": dr.FLOOR, "fwd_ms": 2.0, "fwd_bwd_ms": 8.0}
    coda = {"tokens": 8192, "variant": dr.CODA, "fwd_ms": 2.2, "fwd_bwd_ms": 8.4}
    fake([floor, coda], 1)  # torch.compile's variant failed: its row is missing
    (row,) = dr.run_rule("H200", 0, [8192], 1)
    assert (row.rule, row.variant) == ("H200", dr.CODA) and row.fwd_x_floor == pytest.approx(1.1)
    assert row.fwd_bwd_x_floor == pytest.approx(1.05)
    fake([floor], 1)
    with pytest.raises(SystemExit, match="did not time coda_dsl"):
        dr.run_rule("H100", 0, [8192], 1)
