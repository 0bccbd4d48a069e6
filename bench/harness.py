"""Timing and reporting shared by the benchmarks: CUDA events, median after warm-up, inputs rotated
so that each iteration reads operands that are not in L2, ratios against the bare cuBLAS GEMM,
markdown tables, JSON results, shape arguments."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from coda_dsl.cli import joined_negative_values, number_type, positive  # noqa: F401  (positive: the modules' type)
from coda_dsl.runtime.tune import TUNE_ENV
from coda_dsl.runtime.tune import round_robin as tuner_round_robin
from coda_dsl.runtime.warm import ENV as WARM_ENV

RESULTS = Path(__file__).resolve().parent / "results"
FLOOR = "cuBLAS GEMM (floor)"


def progress(msg: str) -> None:
    """Progress goes to stderr, so that stdout holds only the result tables."""
    print(msg, file=sys.stderr, flush=True)


def results_only_on_stdout():
    """Around a run: what the build and the library print then is progress (stderr), not results."""
    return contextlib.redirect_stdout(sys.stderr)


def no_gpu() -> bool:
    """True, after a one-line message, when there is no sm_90 GPU: every benchmark then exits with 1."""
    if not torch.cuda.is_available():
        progress("benchmarks need a CUDA GPU (the fused kernels need sm_90); none is visible")
        return True
    if torch.cuda.get_device_capability(0) != (9, 0):
        progress(f"benchmarks need an sm_90 GPU for the fused kernels; found {torch.cuda.get_device_name(0)}")
        return True
    return False


SETTINGS = (TUNE_ENV, WARM_ENV)  # process-wide switches that change timings


def command(prog: str, argv=None) -> str:
    """The command line recorded with the results: those of coda_dsl's SETTINGS the environment sets, `prog`
    and its arguments (sys.argv's when argv is None)."""
    settings = [f"{name}={os.environ[name]}" for name in SETTINGS if name in os.environ]
    return " ".join([*settings, prog, *(sys.argv[1:] if argv is None else argv)])


def rel_err(got, ref) -> float:
    """‖got − ref‖ / ‖ref‖ in fp32; for tuples of tensors, the largest over the pairs."""
    pairs = zip(got, ref) if isinstance(ref, tuple) else [(got, ref)]
    return max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in pairs)


def background(fn: Callable, *args) -> Future:
    """fn(*args) in a thread, e.g. the nvcc builds (subprocesses) while torch.compile works in the main thread."""
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def rotation(make: Callable[[], tuple], bytes_per_set: int, l2_bytes: int | None = None) -> list[tuple]:
    """Enough independent input sets that cycling through them always misses L2 (>= 3x L2 in total), and at
    least 2: with one, a weight that fits L2 (32 MB at 8192x4096x4096) stays there from the previous call."""
    l2 = l2_bytes or torch.cuda.get_device_properties(0).L2_cache_size
    n = max(2, min(8, -(-3 * l2 // max(bytes_per_set, 1))))
    return [make() for _ in range(n)]


def round_robin(variants: dict[str, Callable], sets: list[tuple], iters: int, warmup: int = 2) -> dict[str, float]:
    """Median µs of each variant(*set): the library's tuner's round_robin (the variants in turn, every other
    round reversed), every call on the next set of the rotation, so no call finds its inputs in L2 from
    the one before. An H200 under sustained load clocks ~10 % below one that just idled: timed one after
    another, whichever ran first (often the cuBLAS floor) would look faster."""
    return tuner_round_robin(variants, iters, warmup, lambda call: sets[call % len(sets)])


def peak_mib(fn: Callable, *args) -> float:
    """Peak memory allocated during one fn(*args) beyond what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn(*args)
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def sustained(variants: dict[str, Callable], sets: list[tuple], iters: int, warm_ms: float = 300.0,
              rounds: int = 3) -> dict[str, dict]:
    """Each variant alone, in blocks: warm_ms of its calls, then its share of the `iters` timed ones; the
    GPU's clocks settle where that variant's own power draw puts them, as in training, where one mix of
    kernels runs for hours (round_robin instead averages the clocks over all variants). First an untimed
    block of every variant brings the GPU from the idle of building and checking to the load's
    temperature; then `rounds` rounds of blocks, in alternating order (forward, reversed, ...). Per
    variant: the median µs of its timed calls (each between two CUDA events, so one slow call does not
    move it), and the SM clock (MHz) and board power (W) that NVML read while they ran, medians of the
    second half of each block's samples (None without NVML). NVML's power is an average over up to a
    second: with warm_ms under that, a block's W still carries some of the block before it."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    names, warm, timed = list(variants), {}, -(-iters // rounds)
    for name, fn in variants.items():  # first call (builds, compiles), then one to size the warm-up
        fn(*sets[0])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*sets[0])
        torch.cuda.synchronize()
        warm[name] = max(1, int(warm_ms / 1e3 / max(time.perf_counter() - t0, 1e-6)))
    for name in names:  # untimed: the GPU at the load's temperature before the first timed block
        for i in range(warm[name]):
            variants[name](*sets[i % len(sets)])
    times, late = {n: [] for n in names}, {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fn = variants[name]
            for i in range(warm[name]):
                fn(*sets[i % len(sets)])
            events = [torch.cuda.Event(enable_timing=True) for _ in range(timed + 1)]
            events[0].record()
            for i in range(timed):
                fn(*sets[i % len(sets)])
                events[i + 1].record()
            samples = []
            while not events[-1].query():
                samples.append(_clock_and_power())
                time.sleep(0.005)
            events[-1].synchronize()
            times[name] += [a.elapsed_time(b) * 1e3 for a, b in zip(events, events[1:])]
            late[name] += samples[len(samples) // 2:]
    return {n: {"us": statistics.median(times[n]), "mhz": _median([c for c, _ in late[n]]),
                "watts": _median([w for _, w in late[n]])} for n in names}


@dataclass(frozen=True)
class Timing:
    """How timed() measures: round-robin (the default); with sustain_ms each variant alone after that many
    ms of its own calls (sustained); with graph from CUDA graph replays (graph_replays)."""
    sustain_ms: float = 0
    graph: bool = False

    @classmethod
    def of(cls, args) -> Timing:
        """From the options add_timing added."""
        return cls(args.sustained, getattr(args, "graph", False))


def add_timing(p, what: str = "each variant", graph: bool = False) -> None:
    """The timing options of every benchmark that times with timed(): --sustained MS, and where the variants
    can be captured in CUDA graphs (graph=True), --graph instead."""
    group = p.add_mutually_exclusive_group() if graph else p
    group.add_argument("--sustained", type=milliseconds, default=0, metavar="MS",
                       help=f"time {what} alone after MS ms of its own calls, as training runs, with the SM clock "
                            "and board power (default: round-robin)")
    if graph:
        group.add_argument("--graph", action="store_true",
                           help="time CUDA graph replays of each variant's calls: the GPU's time alone, without the "
                                "host's (small shapes, where round-robin measures the host too)")


def graph_replays(variants: dict[str, Callable], sets: list[tuple], iters: int, calls: int = 20) -> dict[str, float]:
    """Median µs per call of each variant, each captured in a CUDA graph of `calls` calls (the rotation's
    sets in turn) and the graphs replayed in turn as round_robin does: the GPU's time alone, without the
    host's. At small shapes round-robin measures the host too (torch.matmul spends ~25 µs of host time
    per call, as long as a 2048³ GEMM runs). A variant that cannot be captured raises."""
    graphs = {}
    for name, fn in variants.items():
        side = torch.cuda.Stream()  # warmed up on a side stream, then captured, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(2):
                fn(*sets[i % len(sets)])
        torch.cuda.current_stream().wait_stream(side)
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            for i in range(calls):
                fn(*sets[i % len(sets)])
    per_replay = tuner_round_robin({name: g.replay for name, g in graphs.items()}, iters, warmup=1)
    return {name: us / calls for name, us in per_replay.items()}


def timed(variants: dict[str, Callable], sets: list[tuple], iters: int, timing: Timing = Timing(),
          warmup: int = 2) -> tuple[dict[str, float], dict[str, dict]]:
    """µs per variant as `timing` says; sustained runs also give each variant's SM clock and board power
    ({"mhz", "watts"})."""
    if timing.graph:
        return graph_replays(variants, sets, iters), {}
    if not timing.sustain_ms:
        return round_robin(variants, sets, iters, warmup), {}
    steady = sustained(variants, sets, iters, timing.sustain_ms)
    return ({n: r["us"] for n, r in steady.items()},
            {n: {k: v for k, v in r.items() if k != "us"} for n, r in steady.items()})


def _clock_and_power() -> tuple[float | None, float | None]:
    try:
        return float(torch.cuda.clock_rate()), torch.cuda.power_draw() / 1e3
    except Exception:  # noqa: BLE001  no NVML (pynvml) here: the times still stand
        return None, None


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


@dataclass
class Row:
    bench: str
    shape: str
    variant: str
    us: float
    tflops: float
    vs_gemm: float  # time / bare cuBLAS GEMM time (the floor)
    extra: dict = field(default_factory=dict)


def markdown(header: list[str], rows: list[list], numeric: int = 0) -> str:
    """A markdown table whose last `numeric` columns are right-aligned."""
    rule = "|" + "---|" * (len(header) - numeric) + "---:|" * numeric
    return "\n".join(["| " + " | ".join(header) + " |", rule] + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def table(rows: list[Row]) -> str:
    return markdown(["bench", "shape (M×N×K)", "variant", "time (µs)", "TFLOP/s", "× cuBLAS GEMM"],
                    [[r.bench, r.shape, r.variant, f"{r.us:.1f}", f"{r.tflops:.0f}", f"{r.vs_gemm:.3f}"]
                     for r in rows], numeric=3)


def out_dir() -> Path:
    """$OUT if set (the GPU check collects it), else bench/results/."""
    d = Path(os.environ.get("OUT") or RESULTS)
    d.mkdir(parents=True, exist_ok=True)
    return d


def save(rows: list, name: str, command: str, **meta) -> Path:
    """rows (dataclasses) as out_dir()/name.json, with the command and the machine it ran on."""
    gpu = torch.cuda.is_available()
    meta = {"command": command, "device": torch.cuda.get_device_name(0) if gpu else "none (no CUDA)",
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if gpu else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            **meta}
    out = out_dir() / f"{name}.json"
    out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    return out


def fmt(shape) -> str:
    return "×".join(map(str, shape))


def shape(text: str) -> tuple[int, int, int]:
    """'MxNxK' -> (M, N, K); an argparse type."""
    try:
        dims = tuple(int(x) for x in text.strip().lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f"expected three positive integers like 4096x4096x4096, got {text!r}")
    return dims


def shapes(text: str) -> list[tuple[int, int, int]]:
    return [shape(s) for s in text.split(",")]


non_negative = number_type(int, "an integer >= 0", zero=True)  # 0: off
milliseconds = number_type(float, "milliseconds >= 0", zero=True)  # 0: off


def config_text(text: str) -> str:
    """An argparse type: a cd.Config's text (e.g. 128x128x64_c2x1_pingpong), checked."""
    import coda_dsl as cd
    try:
        return cd.Config.parse(text).text
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def config_texts(text: str) -> list[str]:
    """An argparse type: comma-separated cd.Config texts, each checked."""
    return [config_text(c) for c in text.split(",")]


def subset(choices) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated subset of `choices`."""
    def parse(text: str) -> list[str]:
        picked = [s.strip() for s in text.split(",") if s.strip()]
        unknown = [s for s in picked if s not in choices]
        if unknown or not picked:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (got {text!r})")
        return picked
    return parse


class _Parser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):  # --shapes -1x8x8: the shape's check answers
        return super().parse_known_args(joined_negative_values(sys.argv[1:] if args is None else list(args),
                                                               ("--shape", "--shapes")), namespace)


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    # allow_abbrev=False: --shape must not silently mean --shapes
    return _Parser(prog=prog, description=doc, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)


def compile_mode(autotune: bool) -> str | None:
    """torch.compile's mode: default, or --autotune's (CUDA graphs off: the timings launch eagerly)."""
    return "max-autotune-no-cudagraphs" if autotune else None


def compile_label(autotune: bool, dynamic: bool = False) -> str:
    opts = [o for o, on in (("max-autotune", autotune), ("dynamic", dynamic)) if on]
    return "torch.compile" + (f" ({', '.join(opts)})" if opts else "")


def profile_kernels(fn: Callable, top: int, timeline: bool = False) -> str:
    """One fn() under torch.profiler: its `top` costliest GPU kernels, a line each, the GPU total, and
    how long the GPU sat idle between the first kernel and the last (host-bound gaps), with the
    kernels that waited longest. timeline: then every kernel of a fn() launched right behind another
    (the host ahead, the GPU under load), in order: its start (ms from the first) and duration.
    coda_dsl's kernels are named by their epilogue and config (kernel_name)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    labels = specialization_labels()
    lines = _costliest(prof, top, labels)
    if timeline:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda._sleep(1)  # a marker between the two calls
            fn()
            torch.cuda.synchronize()
        spans = _kernel_spans(prof)
        marker = max(i for i, (_, _, name) in enumerate(spans) if "spin_kernel" in name)
        spans = spans[marker + 1:]
        lines.append(f"every kernel of a call right behind another ({len(spans)}; start and duration in ms):")
        lines += [f"{(s - spans[0][0]) / 1e3:8.3f} {(e - s) / 1e3:7.3f}  {kernel_name(name, labels)}"
                  for s, e, name in spans]
    return "\n".join(lines)


def specialization_labels() -> dict[str, str]:
    """op_name -> "epilogue [config]" of every kernel in the disk cache (its kernel.cu's header)."""
    from coda_dsl import build
    from coda_dsl.codegen import file_header_fields, op_name
    return {op_name(e["key"]): "{} [{}]".format(*file_header_fields(e["cu_path"])) for e in build.cache_entries()}


def kernel_name(name: str, labels: dict[str, str]) -> str:
    """A profiled kernel's name for a table, at most 150 characters. coda_dsl's carry their op name: the
    GEMM's is k<key>_gemm, a finishing kernel's has the specialization's namespace (k<key>_ns) in its
    template arguments: "coda_dsl <epilogue> [<config>]: GEMM" (or the finishing kernel's name)."""
    from coda_dsl.codegen import SYMBOL_OP_NAME, gemm_kernel
    m = SYMBOL_OP_NAME.search(name)
    if m is None:
        return name[:150]
    what = "GEMM" if name == gemm_kernel(m[0]) else name.split("<")[0].removeprefix("void ")
    return f"coda_dsl {labels.get(m[0], m[0])}: {what}"[:150]


def _kernel_spans(prof) -> list[tuple[float, float, str]]:
    """(start, end in µs, name) of each GPU kernel, memset and copy a profile saw, in order."""
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)


def _costliest(prof, top: int, labels: dict[str, str]) -> list[str]:
    """profile_kernels' summary lines: the costliest kernels, the GPU total and its idle gaps."""
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in kernels) / 1e3
    lines = [f"{e.device_time_total / 1e3:8.3f} ms {e.count:4d}x  {kernel_name(e.key, labels)}" for e in kernels[:top]]
    spans = _kernel_spans(prof)
    waits, reach = [], spans[0][1] if spans else 0
    for start, end, name in spans[1:]:
        if start > reach:
            waits.append((start - reach, name))
        reach = max(reach, end)
    waits.sort(reverse=True)
    lines.append(f"{total:8.3f} ms total GPU time; GPU idle {sum(w for w, _ in waits) / 1e3:.3f} ms "
                 f"between the first and the last kernel, in {len(waits)} gaps; the longest before:")
    lines += [f"{w / 1e3:8.3f} ms  {kernel_name(name, labels)}" for w, name in waits[:max(3, top // 2)]]
    return lines
