"""The benchmark harness without a GPU: the plan (--dry-run), the exit without CUDA, the tables, the
JSON writer and the chart. The measurements themselves need an sm_90 GPU (tests/gpu_check.sh)."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

import coda_dsl as cd
from coda_dsl.runtime import op as runtime_op

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ lives at the repository root

from bench import __main__ as bench_main  # noqa: E402
from bench import cross_entropy, epilogues, harness, host_overhead, linear_backward, mlp, sweep  # noqa: E402
from bench.harness import FLOOR, Row  # noqa: E402
from build_helpers import FAKE_TC  # noqa: E402


def _rows() -> list[Row]:
    rows = []
    for case, lt in (("identity", None), ("bias_gelu", 1.02)):
        for shape, floor in (("4096×4096×4096", 176.0), ("8192×4096×14336", 1300.0)):
            ratios = {FLOOR: 1.0, "coda_dsl fused": 1.05, "eager": 1.1, "torch.compile": 0.98}
            if lt:
                ratios["cuBLASLt fused"] = lt
            rows += [Row(case, shape, v, floor * r, 1e3 / r, r, {"rel_err_vs_eager": 1e-5} if v.startswith("coda")
                         else {}) for v, r in ratios.items()]
    return rows


def test_dry_run_prints_every_case_shape_and_variant(capsys):
    assert bench_main.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for name, case in epilogues.CASES.items():
        for s in case.shapes:
            assert f"| {name} | {harness.fmt(s)} |" in out
    assert "8192×28672×4096" in out and "8192×12288×4096" in out  # gated, rope: their own shapes only
    assert out.count("| swiglu |") == out.count("| geglu |") == 2 and out.count("cuBLASLt fused") == 9  # bias_gelu only
    assert "| cross_entropy | 8192×4096×128256 (M×d×V) |" in out
    assert "42 epilogue measurements" in out


def test_dry_run_options(capsys):
    args = ["--dry-run", "--only", "swiglu,rope", "--shapes", "1024x2048x512", "--autotune", "--ce-shape", "64x32x100"]
    assert bench_main.main(args) == 0
    out = capsys.readouterr().out
    assert out.count("1024×2048×512") == 2 and "torch.compile (max-autotune)" in out
    assert "cross_entropy" not in out  # not picked by --only
    assert bench_main.main(["--dry-run", "--only", "cross_entropy", "--ce-shape", "64x32x100"]) == 0
    out = capsys.readouterr().out
    assert "64×32×100" in out and "identity" not in out
    assert epilogues.main(["--dry-run", "--only", "rope", "--compile-dynamic"]) == 0
    assert "torch.compile (dynamic)" in capsys.readouterr().out
    assert cross_entropy.main(["--dry-run", "--shape", "128x64x1000", "--chunk-rows", "256,512"]) == 0
    out = capsys.readouterr().out
    assert "128×64×1000" in out and "coda_dsl (chunk 256), coda_dsl (chunk 512)" in out


@pytest.mark.parametrize("args", [["--only", "nope"], ["--shapes", "4096x4096"], ["--ce-shape", "1x2x0"],
                                  ["--shape", "8x8x8"]])  # --shape is not an abbreviation of --shapes here
def test_bad_arguments(args, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main.main(args)
    assert e.value.code == 2


@pytest.mark.parametrize("module, args, words", [
    ("epilogues", ["--iters", "0"], "expected a positive integer, got '0'"),  # (a median of no timings, after the builds)
    ("epilogues", ["--shapes", "-1x8x8"], "expected three positive integers"),  # not "expected one argument"
    ("epilogues", ["--sustained", "-1"], "expected milliseconds >= 0"),
    ("sweep", ["--configs", "bogus"], "bogus"),
    ("sweep", ["--iters", "-3"], "expected a positive integer"),
    ("cross_entropy", ["--chunk-rows", "0,256"], "expected a positive integer, got '0'"),
    ("cross_entropy", ["--profile", "-2"], "expected an integer >= 0, got '-2'"),
    ("llama_layer", ["--seq", "0"], "expected a positive integer"),
    ("train_llama", ["--steps", "0"], "expected a positive integer"),
])
def test_bad_counts_and_configs_are_usage_errors(module, args, words, capsys):
    """Each bench module refuses them while parsing (exit 2, the option named), before any build or GPU work."""
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"bench.{module}").main([*args, "--dry-run"] if module != "train_llama" else args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err and "Traceback" not in err


@pytest.mark.parametrize("entry", [bench_main.main, epilogues.main, cross_entropy.main, linear_backward.main])
def test_no_cuda_exits_with_one_line(entry, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert entry([]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "CUDA" in err


@pytest.fixture
def fake_events(monkeypatch):
    """CUDA events on a fake GPU clock that each variant call advances by its ms; the calls in order.
    The host polls an event twice before "the GPU" is done. Returns (calls, variant(name, ms))."""
    clock, calls = [0.0], []

    class Event:
        def __init__(self, enable_timing=False):
            self.t, self.polls = None, 0

        def record(self):
            self.t = clock[0]

        def query(self):
            self.polls += 1
            return self.polls > 2

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t  # ms

    def variant(name, ms):
        def fn(x):
            calls.append(name)
            clock[0] += ms
        return fn
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(harness.time, "sleep", lambda s: None)
    return calls, variant


def test_round_robin_alternates_the_order_and_takes_each_variants_median(fake_events):
    """harness.round_robin: the call order reverses every other round, warm-up calls are not timed, each
    variant's median is its own (in µs), and every timed call takes the next input set of the rotation
    (a round on one set gave every variant but the first L2-warm inputs)."""
    calls, variant = fake_events
    seen = []

    def on(name, ms):
        fn = variant(name, ms)
        return lambda x: (seen.append((name, x)), fn(x))
    us = harness.round_robin({"a": on("a", 1.0), "b": on("b", 3.0)}, [(0,), (1,), (2,)], iters=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert us == {"a": 1000.0, "b": 3000.0}
    assert seen[2:] == [("a", 0), ("b", 1), ("b", 2), ("a", 0), ("a", 1), ("b", 2)]


@pytest.mark.parametrize("nvml", [True, False])
def test_sustained_times_each_variant_alone_after_its_warm_up(fake_events, monkeypatch, nvml):
    """harness.sustained: an untimed block of every variant first, then rounds in alternating order of
    blocks of one variant's calls, the timed ones after its warm-up; µs per timed call over all rounds,
    and NVML's clock and power (None without NVML)."""
    calls, variant = fake_events

    def no_nvml():
        raise ModuleNotFoundError("pynvml")
    monkeypatch.setattr(torch.cuda, "clock_rate", (lambda: 1500) if nvml else no_nvml)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda: 650_000)
    fast, slow, n_a = variant("a", 1.0), variant("a", 3.0), []

    def a(x):  # 1 ms until its first round's block is over, then 3 ms
        n_a.append(x)
        return (fast if len(n_a) <= 6 else slow)(x)
    got = harness.sustained({"a": a, "b": variant("b", 2.0), "c": variant("c", 4.0)}, [(0,)], iters=3, warm_ms=0,
                            rounds=2)
    # a first call and one to size the warm-up each; an untimed warm call each; then per round and variant
    # one warm call and ceil(3 / 2) = 2 timed, the second round in reverse order
    assert calls == ["a", "a", "b", "b", "c", "c"] + ["a", "b", "c"] + \
        ["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["c"] * 3 + ["b"] * 3 + ["a"] * 3
    assert got["a"]["us"] == 2000.0  # the median of both rounds' calls: 1, 1, 3, 3 ms
    assert got["b"]["us"] == 2000.0 and got["c"]["us"] == 4000.0
    assert (got["a"]["mhz"], got["a"]["watts"]) == ((1500.0, 650.0) if nvml else (None, None))
    with pytest.raises(ValueError, match="rounds"):
        harness.sustained({"a": a}, [(0,)], iters=3, rounds=0)


def test_tables_and_json(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = _rows()
    detail, summary = harness.table(rows), epilogues.summary(rows)
    assert detail.splitlines()[1] == "|---|---|---|---:|---:|---:|"
    assert "| bias_gelu | 8192×4096×14336 | cuBLASLt fused | 1326.0 | 980 | 1.020 |" in detail
    assert "| identity | 4096×4096×4096 | 176 | 1.050 | 1.100 | 0.980 | – |" in summary  # no cuBLASLt for identity
    path = harness.save(rows, "epilogues", "python -m bench --iters 5", failed=["x"])
    assert path == tmp_path / "epilogues.json"
    data = json.loads(path.read_text())
    assert data["meta"]["command"] == "python -m bench --iters 5" and data["meta"]["failed"] == ["x"]
    assert {"device", "torch", "cuda", "time"} <= set(data["meta"])
    assert len(data["rows"]) == len(rows) and data["rows"][1]["extra"] == {"rel_err_vs_eager": 1e-5}


def test_recorded_command_names_the_settings_that_change_timings(monkeypatch):
    """A run under CODA_DSL_TUNE=1 says so in its command line; unset ones are left out."""
    for name in harness.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert harness.command("python -m bench.epilogues", ["--graph"]) == "python -m bench.epilogues --graph"
    monkeypatch.setenv("CODA_DSL_TUNE", "1")
    assert harness.command("python -m bench.epilogues", ["--graph"]) == "CODA_DSL_TUNE=1 python -m bench.epilogues --graph"


def test_cross_entropy_rows_and_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    raw = [("forward+backward", "eager", 60e3, 12000.0, {}), ("forward", "eager", 20e3, 8000.0, {}),
           ("forward", "coda_dsl", 16e3, 400.0, {"warnings": ["UserWarning: reference backend"]}),
           ("forward+backward", "coda_dsl", 40e3, 3000.0, {})]
    rows = cross_entropy._rows((8192, 4096, 128256), raw)
    assert [(r.step, r.variant) for r in rows] == [("forward", "eager"), ("forward", "coda_dsl"),
                                                   ("forward+backward", "eager"), ("forward+backward", "coda_dsl")]
    assert rows[1].speedup == pytest.approx(1.25) and rows[1].memory == pytest.approx(0.05)
    assert rows[3].speedup == pytest.approx(1.5) and rows[3].memory == pytest.approx(0.25)
    cross_entropy.report(rows, ["torch.compile forward: OutOfMemoryError"], "python -m bench.cross_entropy")
    out = capsys.readouterr().out
    assert "| 8192×4096×128256 | forward | coda_dsl | 16.00 | 538 | 1.25× | 400 | 0.05× |" in out
    assert "- coda_dsl, forward: UserWarning: reference backend" in out and "- FAILED torch.compile forward" in out
    assert json.loads((tmp_path / "cross_entropy.json").read_text())["rows"][0]["step"] == "forward"


def test_chart(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.chart import chart
    path = chart(_rows(), tmp_path / "epilogues.png")
    assert path == tmp_path / "epilogues.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    from bench.chart import chart
    assert chart(_rows(), tmp_path / "x.png") is None and not (tmp_path / "x.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """The benchmarks' plumbing on the CPU: reference-backend kernels, eager "torch.compile", wall-clock
    timing, no memory statistics. Catches wiring mistakes before they cost GPU time."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(bench_main, "no_gpu", lambda: False)
    monkeypatch.setattr(torch, "compile", lambda f, **kw: f)
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)

    def time_us(fn, sets, iters=50, warmup=10):
        t = time.perf_counter()
        fn(*sets[0])
        return (time.perf_counter() - t) * 1e6
    for mod in (harness, linear_backward, cross_entropy):
        monkeypatch.setattr(mod, "round_robin", lambda variants, sets, iters, warmup=2:
                            {name: time_us(fn, sets) for name, fn in variants.items()})
    monkeypatch.setattr(linear_backward, "no_gpu", lambda: False)
    monkeypatch.setattr(linear_backward, "prebuild", lambda todo, with_dy=False, configs=(): None)
    monkeypatch.setattr(linear_backward, "rotation", lambda make, nbytes: [make(), make()])
    monkeypatch.setattr(linear_backward, "_r", lambda *s, grad=True: torch.randn(*s).bfloat16().requires_grad_(grad))
    monkeypatch.setattr(epilogues, "rotation", lambda make, nbytes: [make(), make()])
    monkeypatch.setattr(epilogues, "_r", lambda *s: torch.randn(*s, dtype=torch.bfloat16))
    monkeypatch.setattr(epilogues.runtime, "prebuild", lambda ops: None)
    monkeypatch.setattr(epilogues, "kernels", lambda todo, config=None: {
        (c.name, s): lambda a, w, ep=c.epilogue, cfg=config, **o: cd.gemm(a, w, ep, backend="reference", config=cfg, **o)
        for c, s in todo})
    monkeypatch.setattr(cross_entropy, "kernels", lambda configs=(None,): [])
    monkeypatch.setattr(cross_entropy, "_inputs", lambda m, d, v: (
        torch.randn(m, d, dtype=torch.bfloat16), torch.randn(v, d, dtype=torch.bfloat16) * d ** -0.5,
        torch.randint(0, v, (m,))))
    # restored by value: monkeypatch would delete a torch config alias it cannot find in the
    # module's __dict__ (pytest 9.2), breaking the next test that reads it
    limit = getattr(*epilogues.RECOMPILE_LIMIT)
    yield tmp_path
    setattr(*epilogues.RECOMPILE_LIMIT, limit)


def test_whole_run_on_fake_gpu(fake_gpu, capsys):
    args = ["--only", "bias_gelu,residual_sumsq,swiglu,cross_entropy", "--shapes", "64x128x32",
            "--ce-shape", "64x32x100", "--iters", "5"]
    assert bench_main.main(args) == 0
    out = capsys.readouterr().out
    assert "| bias_gelu | 64×128×32 | cuBLASLt fused |" in out and "| swiglu | 64×128×32 | eager |" in out
    assert "| 64×32×100 | forward+backward | coda_dsl |" in out
    ep = json.loads((fake_gpu / "epilogues.json").read_text())
    assert ep["meta"]["command"] == "python -m bench " + " ".join(args)
    assert ep["meta"]["failed"] == [] and ep["meta"]["complete"]
    assert len(ep["rows"]) == 5 + 4 + 4
    fused = [r for r in ep["rows"] if r["variant"] == "coda_dsl fused"]
    assert all(r["extra"]["rel_err_vs_eager"] < 2e-2 for r in fused)
    assert all("compile_s" in r["extra"] for r in ep["rows"] if r["variant"] == "torch.compile")
    ce = json.loads((fake_gpu / "cross_entropy.json").read_text())["rows"]
    assert [(r["step"], r["variant"]) for r in ce] == [(s, v) for s in cross_entropy.STEPS
                                                      for v in ("eager", "torch.compile", "coda_dsl")]
    assert all(r["extra"]["rel_err_vs_eager"] < 2e-2 for r in ce if r["variant"] != "eager")
    checked = {r["variant"] for r in ep["rows"] if "rel_err_vs_eager" in r["extra"]}
    assert checked == {"coda_dsl fused", "torch.compile", "cuBLASLt fused"}  # every variant of the epilogue


def test_epilogue_bench_sustained_keeps_the_clocks(fake_gpu, capsys, monkeypatch):
    """--sustained MS: harness.sustained instead of the round-robin, NVML's readings in every row's JSON."""
    monkeypatch.setattr(epilogues, "no_gpu", lambda: False)
    monkeypatch.setattr(harness, "sustained", lambda fns, sets, iters, ms: {
        name: {"us": 10.0 * (i + 1), "mhz": 1400.0, "watts": 690.0} for i, name in enumerate(fns)})
    assert epilogues.main(["--only", "bias_gelu", "--shapes", "64x128x32", "--iters", "2", "--sustained", "5"]) == 0
    rows = json.loads((fake_gpu / "epilogues.json").read_text())["rows"]
    assert len(rows) == 5 and all(r["extra"]["mhz"] == 1400.0 and r["extra"]["watts"] == 690.0 for r in rows)
    assert {r["variant"]: r["vs_gemm"] for r in rows}[FLOOR] == 1.0


def test_graph_replays_time_each_variant_per_call(fake_events, monkeypatch):
    """harness.graph_replays: each variant warmed up twice, then `calls` calls (the sets in turn) captured in
    its own graph; the graphs replayed round-robin; µs per call (a replay's time / calls)."""
    calls, variant = fake_events
    fns, inputs = {"a": variant("a", 1.0), "b": variant("b", 3.0)}, []

    class Graph:
        def replay(self):
            for name in self.names:
                fns[name](0)

    @contextlib.contextmanager
    def graph(g):
        start = len(calls)
        yield
        g.names = calls[start:]

    class Stream:
        def wait_stream(self, other):
            pass
    for name, value in (("CUDAGraph", Graph), ("graph", graph), ("Stream", Stream), ("current_stream", Stream),
                        ("stream", lambda s: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, value)
    recorded = {n: (lambda x, fn=fn: (inputs.append(x), fn(x))) for n, fn in fns.items()}
    us = harness.graph_replays(recorded, [(0,), (1,), (2,)], iters=3, calls=4)
    assert calls[:12] == ["a"] * 6 + ["b"] * 6 and inputs[:6] == [0, 1, 0, 1, 2, 0]  # 2 warm-up, 4 captured
    assert us == {"a": 1000.0, "b": 3000.0}


def test_epilogue_bench_graph_times_replays(fake_gpu, monkeypatch):
    """--graph: harness.graph_replays instead of the round-robin; not with --sustained."""
    monkeypatch.setattr(epilogues, "no_gpu", lambda: False)
    monkeypatch.setattr(harness, "graph_replays", lambda fns, sets, iters: {name: 10.0 * (i + 1)
                                                                            for i, name in enumerate(fns)})
    assert epilogues.main(["--only", "bias_gelu", "--shapes", "64x128x32", "--iters", "2", "--graph"]) == 0
    rows = json.loads((fake_gpu / "epilogues.json").read_text())["rows"]
    assert sorted(r["us"] for r in rows) == [10.0, 20.0, 30.0, 40.0, 50.0]
    with pytest.raises(SystemExit) as e:
        epilogues.main(["--graph", "--sustained", "5", "--dry-run"])
    assert e.value.code == 2


def test_a_variant_that_computes_something_else_times_nothing(fake_gpu, monkeypatch):
    """A variant whose outputs are not eager's (a silently failed fusion, say) fails its case and shape
    before anything is timed: no row of a wrong variant can be published."""
    monkeypatch.setattr(epilogues, "no_gpu", lambda: False)
    case = epilogues.CASES["bias_gelu"]
    monkeypatch.setitem(epilogues.CASES, "bias_gelu", dataclasses.replace(case, cublaslt=lambda a, w, **o: a @ w.t()))
    assert epilogues.main(["--only", "bias_gelu", "--shapes", "64x128x32", "--iters", "2"]) == 1
    ep = json.loads((fake_gpu / "epilogues.json").read_text())
    assert ep["rows"] == [] and "cuBLASLt fused" in ep["meta"]["failed"][0] and "nothing timed" in ep["meta"]["failed"][0]


def test_one_config_for_every_kernel_on_fake_gpu(fake_gpu, monkeypatch):
    """--config reaches every coda_dsl kernel (the fake's kernels run cd.gemm with it); a bad one is refused."""
    seen = []
    gemm = cd.gemm
    monkeypatch.setattr(epilogues, "no_gpu", lambda: False)
    monkeypatch.setattr(cd, "gemm", lambda *a, config=None, **k: seen.append(config) or gemm(*a, config=config, **k))
    assert epilogues.main(["--only", "identity", "--shapes", "64x128x32", "--iters", "2",
                           "--config", "128x128x64_c2x1_pingpong"]) == 0
    assert seen and set(seen) == {"128x128x64_c2x1_pingpong"}
    with pytest.raises(SystemExit) as e:
        epilogues.main(["--config", "128x128", "--dry-run"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        epilogues.main(["--config", "128x128x64_c2x1_pingpong", "--tune", "--dry-run"])  # one or the other
    assert e.value.code == 2


def test_cross_entropy_other_chunk_rows_on_fake_gpu(fake_gpu, capsys, monkeypatch):
    monkeypatch.setattr(cross_entropy, "no_gpu", lambda: False)
    assert cross_entropy.main(["--shape", "64x32x100", "--chunk-rows", "16", "--iters", "2"]) == 0
    assert "| 64×32×100 | forward+backward | coda_dsl (chunk 16) |" in capsys.readouterr().out
    rows = json.loads((fake_gpu / "cross_entropy.json").read_text())["rows"]
    assert [r["extra"]["chunk_rows"] for r in rows if r["variant"] == "coda_dsl (chunk 16)"] == [16, 16]


@pytest.mark.parametrize("timing", ["round-robin", "--sustained", "--graph"])
def test_sweep_on_fake_gpu(fake_gpu, capsys, monkeypatch, timing):
    """bench.sweep's plumbing: a kernel that did not build is reported and left out of its table, the others
    are checked against eager PyTorch and timed round-robin, (--sustained) alone, with NVML's readings in
    the JSON, or (--graph) from graph replays."""
    configs = ["128x256x64_c2x1_cooperative", "128x128x64_c2x1_pingpong"]

    def built(cases, cfgs):
        ops = {(c.name, cfg.text): (lambda a, w, ep=c.epilogue, **o: cd.gemm(a, w, ep, backend="reference", **o))
               for c in cases for cfg in cfgs if cfg.text != configs[1] or c.name != "bias_gelu"}
        return ops, [f"bias_gelu {configs[1]}: did not build"]
    timed = lambda fns, sets, iters: {n: 100.0 * (i + 1) for i, n in enumerate(fns)}  # noqa: E731
    for name, value in (("no_gpu", lambda: False), ("built_kernels", built), ("cublas_kernel", lambda m, n, k: "k"),
                        ("rotation", lambda make, nbytes: [make(), make()])):
        monkeypatch.setattr(sweep, name, value)
    monkeypatch.setattr(harness, "round_robin", lambda fns, sets, iters, warmup=2: timed(fns, sets, iters))
    monkeypatch.setattr(harness, "sustained", lambda fns, sets, iters, ms: {
        n: {"us": us, "mhz": 1400.0, "watts": 690.0} for n, us in timed(fns, sets, iters).items()})
    replayed = []
    monkeypatch.setattr(harness, "graph_replays",
                        lambda fns, sets, iters: replayed.append(list(fns)) or timed(fns, sets, iters))
    argv = ["--only", "identity,bias_gelu", "--shapes", "64x128x32", "--configs", ",".join(configs), "--iters", "2"]
    extra = {"round-robin": [], "--sustained": ["--sustained", "5"], "--graph": ["--graph"]}[timing]
    assert sweep.main(argv + extra) == 1  # a failed build fails the run
    out = capsys.readouterr().out
    assert "| 64×128×32 | 100 | 2.000 | 3.000 |" in out  # identity: both configs
    assert "| 64×128×32 | 100 | 2.000 | – |" in out  # bias_gelu: the pingpong kernel did not build
    assert f"- FAILED bias_gelu {configs[1]}: did not build" in out and out.count("- FAILED") == 1  # the rest agree
    rows = json.loads((fake_gpu / "sweep.json").read_text())["rows"]
    sustained = timing == "--sustained"
    assert len(rows) == 5 and all((r["extra"] == {"mhz": 1400.0, "watts": 690.0}) == sustained for r in rows)
    assert len(replayed) == (2 if timing == "--graph" else 0)  # one graph set per epilogue and shape


def test_sweep_of_the_cross_entropy_logits_gemm(fake_gpu, capsys, monkeypatch):
    """`--only identity,ce_logits`: the cross-entropy's statistics epilogue (its fp16 logits checked against
    A @ W^T) on the same configurations as the identity, each with its own table; its default shape is one
    4096-row chunk at Llama-3's vocabulary."""
    ops = lambda cases, cfgs: ({(c.name, cfg.text): (lambda a, w, ep=c.epilogue, **o: cd.gemm(  # noqa: E731
        a, w, ep, backend="reference", **o)) for c in cases for cfg in cfgs}, [])
    for name, value in (("no_gpu", lambda: False), ("built_kernels", ops), ("cublas_kernel", lambda m, n, k: "k"),
                        ("rotation", lambda make, nbytes: [make(), make()]),
                        ("_targets", lambda m, n: torch.randint(0, n, (m,)))):
        monkeypatch.setattr(sweep, name, value)
    monkeypatch.setattr(harness, "round_robin", lambda fns, sets, iters, warmup=2: {n: 100.0 for n in fns})
    argv = ["--only", "identity,ce_logits", "--shapes", "64x136x32", "--configs", "128x128x64_c2x1_pingpong"]
    assert sweep.main(argv + ["--iters", "2"]) == 0
    out = capsys.readouterr().out
    assert "### identity" in out and "### ce_logits" in out and out.count("| 64×136×32 | 100 | 1.000 |") == 2
    assert sweep.SHAPES["ce_logits"] == ((4096, 128256, 4096),)


def test_sweep_of_the_derived_bias_gelu_kernels(fake_gpu, capsys, monkeypatch):
    """`--only bias_gelu_keep_acc,bias_gelu_backward`: cd.linear's forward kernel and the derived backward in
    dY's GEMM, each checked against PyTorch (D; the accumulator's gradient by torch.autograd) and timed."""
    ops = lambda cases, cfgs: ({(c.name, cfg.text): (lambda a, w, ep=c.epilogue, **o: cd.gemm(  # noqa: E731
        a, w, ep, backend="reference", **o)) for c in cases for cfg in cfgs}, [])
    for name, value in (("no_gpu", lambda: False), ("built_kernels", ops), ("cublas_kernel", lambda m, n, k: "k"),
                        ("rotation", lambda make, nbytes: [make(), make()])):
        monkeypatch.setattr(sweep, name, value)
    monkeypatch.setattr(harness, "round_robin", lambda fns, sets, iters, warmup=2: {n: 100.0 for n in fns})
    argv = ["--only", "bias_gelu_keep_acc,bias_gelu_backward", "--shapes", "64x136x32",
            "--configs", "128x128x64_c2x1_pingpong", "--iters", "2"]
    assert sweep.main(argv) == 0  # (a kernel off PyTorch's result by 2e-2 would fail the run)
    out = capsys.readouterr().out
    assert "### bias_gelu_backward" in out and out.count("| 64×136×32 | 100 | 1.000 |") == 2


def test_linear_backward_on_fake_gpu(fake_gpu, capsys):
    assert linear_backward.main(["--dry-run"]) == 0
    assert "| swiglu | 8192×14336×4096 |" in capsys.readouterr().out
    assert linear_backward.main(["--shapes", "64x128x32", "--iters", "2", "--with-dy"]) == 0
    out, err = capsys.readouterr()
    for name in linear_backward.CASES:
        for variant in (linear_backward.FLOOR, "coda_dsl cd.linear", "eager", "torch.compile"):
            assert f"| {name} | 64×128×32 | {variant} |" in out
        for variant in (linear_backward.FLOOR_DY, linear_backward.IN_DY, "coda_dsl cd.linear", "torch.compile"):
            assert f"| {name} +dY | 64×128×32 | {variant} |" in out
    # cd.linear's gradients, and those of the backward epilogue in dY's GEMM, agree with eager PyTorch's
    assert "differ" not in err
    rows = json.loads((fake_gpu / "linear_backward.json").read_text())["rows"]
    assert len(rows) == 12 + 15 and all(r["vs_gemm"] > 0 for r in rows)
    cfg = "128x128x64_c1x2_pingpong"  # --configs: the fused kernels in dY's GEMM again, on that config
    assert linear_backward.main(["--only", "bias_gelu", "--shapes", "64x128x32", "--iters", "2", "--with-dy",
                                 "--configs", cfg]) == 0
    out, err = capsys.readouterr()
    assert f"| bias_gelu +dY | 64×128×32 | {linear_backward.IN_DY} [{cfg}] |" in out and "differ" not in err


def test_linear_backward_prebuild_compiles_what_the_steps_call(monkeypatch):
    """prebuild(with_dy=True) compiles, for each case, the forward kernel and the backward epilogue in dY's
    GEMM with operands those epilogues accept (checked here by running them on the reference backend)."""
    compiled, built = [], []

    def compile_(ep, a, b, config=None, **operands):
        cd.gemm(a, b, ep, backend="reference", **operands)  # operand names, kinds and shapes fit the epilogue
        compiled.append((ep.name, config))
    monkeypatch.setattr(linear_backward, "_r", lambda *s, grad=True: torch.randn(*s).bfloat16().requires_grad_(grad))
    monkeypatch.setattr(cd, "compile", compile_)
    monkeypatch.setattr("coda_dsl.runtime.op.prebuild", lambda ops: built.append(ops))
    linear_backward.prebuild([(name, (8192, 14336, 4096)) for name in linear_backward.CASES], with_dy=True)
    assert len(compiled) == 2 * len(linear_backward.CASES) and len(built) == 1
    assert {name for name, _ in compiled} == {f"{c}{suffix}" for c in linear_backward.CASES
                                              for suffix in ("", "_backward_fused")}
    compiled.clear()  # --configs: both kernels on each config too, in the same ninja run
    linear_backward.prebuild([("swiglu", (8192, 14336, 4096))], with_dy=True, configs=["128x128x64_c1x2_pingpong"])
    assert len(compiled) == 4 and compiled[2:] == [("swiglu", "128x128x64_c1x2_pingpong"),
                                                   ("swiglu_backward_fused", "128x128x64_c1x2_pingpong")]


def test_mlp_on_fake_gpu(fake_gpu, capsys, monkeypatch):
    for name, value in (("no_gpu", lambda: False), ("prebuild", lambda steps, configs, todo: None),
                        ("rotation", lambda make, nbytes: [make(), make()]), ("BACKEND", "reference"),
                        ("DEVICE", "cpu")):
        monkeypatch.setattr(mlp, name, value)
    monkeypatch.setattr(harness, "sustained", lambda fns, sets, iters, ms: {
        name: {"us": us, "mhz": 1500.0, "watts": None} for name, us in harness.round_robin(fns, sets, iters).items()})
    assert mlp.main(["--shapes", "32x64x48", "--steps", "dY", "--iters", "2", "--sustained", "5"]) == 0
    out = capsys.readouterr().out
    assert "| MHz | W |" in out and "| 1500 | – |" in out
    assert mlp.main(["--shapes", "32x64x48", "--configs", "default,cooperative", "--iters", "2",
                     "--steps", ",".join(mlp.STEPS)]) == 0
    out, err = capsys.readouterr()
    assert "| gate_up | 32×64×48 | torch.compile (gate, up GEMMs + SwiGLU) |" in out
    assert "| dY | 32×64×48 | torch.compile (mm + SwiGLU backward) |" in out
    assert "differs" not in err  # every coda_dsl variant's first output agrees with eager PyTorch's
    rows = json.loads((fake_gpu / "mlp.json").read_text())["rows"]
    assert len(rows) == sum(2 + 2 * len(s.epilogues) for s in mlp.STEPS.values())
    assert all(r["extra"]["rel_err"] < 1e-2 for r in rows if r["variant"].startswith("coda_dsl")
               and "identity" not in r["variant"])
    assert sum("coda_dsl identity" in r["variant"] for r in rows) == 2 * len(mlp.STEPS)
    assert mlp.main(["--steps", "gate_up", "--shapes", "32x64x48", "--iters", "1"]) == 0
    assert "| dY |" not in capsys.readouterr().out
    for flag, bad, said in (("--configs", "fastest", "'fastest' is none of"), ("--steps", "down", "unknown ['down']")):
        with pytest.raises(SystemExit):
            mlp.main([flag, bad])
        assert f"{flag}: {said}" in capsys.readouterr().err
    assert mlp._config("128x128x64_c1x2_pingpong_s4", (8192, 14336, 4096), "dY") == "128x128x64_c1x2_pingpong_s4"


def test_mlp_prebuild_builds_each_kernel_once(monkeypatch):
    """One cd.compile per (epilogue, config) of the run, with the operands each step's epilogue takes."""
    built = []
    monkeypatch.setattr(mlp, "DEVICE", "cpu")
    monkeypatch.setattr(mlp.cd, "compile", lambda ep, a, b, config, **o: built.append((ep, config, tuple(sorted(o)))))
    monkeypatch.setattr(runtime_op, "prebuild", lambda ops: None)
    mlp.prebuild(list(mlp.STEPS), ["default", "cooperative"], [(8192, 14336, 4096)])
    # per config: each step's epilogues, and its identity (the step's own layouts)
    assert len(built) == 2 * sum(len(s.epilogues) for s in mlp.STEPS.values())
    assert {ep for ep, _, _ in built} == {ep for s in mlp.STEPS.values() for ep in s.epilogues.values()}
    assert all(o == tuple(sorted(p.name for p in ep.params)) for ep, _, o in built)


def test_failures_are_reported_and_the_rest_measured(fake_gpu, capsys, monkeypatch):
    def broken(a, w):
        raise RuntimeError("boom")
    monkeypatch.setitem(epilogues.CASES, "identity", epilogues.Case("identity", cd.identity, lambda m, n: {}, broken))
    assert bench_main.main(["--only", "identity,residual_add", "--shapes", "64x128x32"]) == 1
    out = capsys.readouterr().out
    assert "- FAILED identity 64×128×32: torch.compile: RuntimeError: boom" in out
    assert "| residual_add | 64×128×32 | coda_dsl fused |" in out


def test_host_overhead_python_only_runs_without_a_gpu(monkeypatch, capsys):
    from coda_dsl.runtime import kernel, warm
    from coda_dsl.runtime import op as runtime
    for owner, name in ((runtime.CompiledOp, "load"), (runtime.checks, "require_cutlass"), (runtime, "_choose_config"),
                        (kernel, "current_stream")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the script stubs them
    calls = []
    monkeypatch.setattr(host_overhead, "per_call_us", lambda fn, n: calls.append(fn()) or 1.0)
    assert host_overhead.main(["--python-only"]) == 0
    out = capsys.readouterr().out
    for how in ["kernel call stubbed in Python"] + (["ctypes into a no-op library"] if shutil.which("cc") else []):
        assert f"| cd.gemm(A, B, epilogue, ...), Python path ({how}) | 1.0 |" in out
        assert f"| CompiledOp(A, B, ...), Python path ({how}) | 1.0 |" in out
    if shutil.which("cc") and warm.module() is not None:  # a real library call: also through the C++ warm path
        assert "| cd.gemm(A, B, epilogue, ...), C++ warm path (ctypes into a no-op library) | 1.0 |" in out
        assert "| CompiledOp(A, B, ...), C++ warm path (ctypes into a no-op library) | 1.0 |" in out
    if shutil.which("cc"):  # and the library's call alone, with the block of one call
        assert "| coda_launch alone, one packed block (ctypes into a no-op library) | 1.0 |" in out
    assert calls.count(None) == (host_overhead.ROUNDS if shutil.which("cc") else 0)  # coda_launch alone's
    assert all(c is None or isinstance(c, dict) and "D" in c for c in calls)  # each call returned its outputs
    runtime.clear()  # its ops hold the stubs


def test_build_time_table_without_building(monkeypatch, capsys):
    """bench.build_time's plan and table, with the builds and the fresh-process load faked: 10 distinct
    specializations (the 3 representatives first), the serial builds one unit each, then the 3 together."""
    from bench import build_time
    from coda_dsl import build
    triples = build_time.specs(10)
    assert len({u.key for u in build_time.units(triples)}) == 10
    assert [ep.split(":")[1] for ep, _, _ in triples[:3]] == ["identity", "bias_gelu", "residual_rms"]
    with pytest.raises(SystemExit):
        build_time.specs(len(build_time.REPRESENTATIVES) * len(build_time.VARIANTS) + 1)
    timed, untimed = [], []
    monkeypatch.setattr(build_time, "_timed_build", lambda us, jobs: timed.append(len(us)) or 2.5)
    monkeypatch.setattr(build, "build_units", lambda us, **kw: untimed.append(len(us)))
    monkeypatch.setattr(build_time, "warm_load", lambda triples, env: (0.25, 1.5, 0.5))
    monkeypatch.setattr(build, "toolchain", lambda: FAKE_TC)
    before = os.environ.get("CODA_DSL_CACHE")
    assert build_time.main([]) == 0
    assert os.environ.get("CODA_DSL_CACHE") == before  # main pointed it at its temporary caches, then back
    out = capsys.readouterr().out
    assert timed == [1, 1, 1, 3] and untimed == [7]
    assert "| cold build, alone: bias_gelu | 2.5 |" in out
    assert "| fresh process: import + load 10, torch's import included | 2.25 |" in out


def test_profiled_kernel_names_show_the_epilogue_and_config(monkeypatch, tmp_path):
    """A coda_dsl GEMM's profiled name (k<key>_gemm) and a finishing kernel's (the specialization's
    namespace in its template arguments) become the epilogue and config, read from the cached kernel.cu;
    other names stay, cut to 150."""
    from coda_dsl import build, cli
    from coda_dsl.codegen import header_fields
    op = cli.specialization_from_options(epilogues.CASES["bias_gelu"].epilogue, "bf16")
    (tmp_path / "kernel.cu").write_text(op.cu_text)
    monkeypatch.setattr(build, "cache_entries", lambda: [{"key": op.key, "cu_path": str(tmp_path / "kernel.cu")},
                                                         {"key": "0" * 24, "cu_path": None}])
    labels = harness.specialization_labels()
    name, config = header_fields(op.cu_text)
    assert labels == {op.op_name: f"{name} [{config}]", "k" + "0" * 20: "? [?]"} and name == "bias_gelu"
    assert op.op_name + "_ns" in op.cu_text  # what the finishing kernels' names carry
    gemm = op.op_name + "_gemm"
    assert f"\n{gemm}(CUTLASS_GRID_CONSTANT" in op.cu_text  # the GEMM kernel's name
    assert harness.kernel_name(gemm, labels) == f"coda_dsl bias_gelu [{config}]: GEMM"[:150]
    finish = f"void coda::finish_rows<coda::Plus, {op.op_name}_ns::Fn1<float>, {op.op_name}_ns::Scalars>(float const*)"
    assert harness.kernel_name(finish, labels) == f"coda_dsl bias_gelu [{config}]: coda::finish_rows"[:150]
    assert harness.kernel_name(gemm.replace(op.op_name, "k" + "1" * 20), labels).endswith("k" + "1" * 20 + ": GEMM")
    nvjet = "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN" + "_" * 200
    assert harness.kernel_name(nvjet, labels) == nvjet[:150]
