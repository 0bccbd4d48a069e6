"""Timing and reporting shared by the benchmarks: CUDA events, median after warm-up, inputs rotated
so that each iteration reads operands that are not in L2, ratios against the bare cuBLAS GEMM."""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def rotation(make: Callable[[], tuple], bytes_per_set: int, l2_bytes: int | None = None) -> list[tuple]:
    """Enough independent input sets that cycling through them always misses L2 (>= 3x L2 in total)."""
    l2 = l2_bytes or torch.cuda.get_device_properties(0).L2_cache_size
    n = max(1, min(8, -(-3 * l2 // max(bytes_per_set, 1))))
    return [make() for _ in range(n)]


def time_us(fn: Callable, sets: list[tuple], iters: int = 50, warmup: int = 10) -> float:
    """Median time of fn(*set) in microseconds, by CUDA events, rotating through `sets`."""
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = sets[i % len(sets)]
        s.record()
        fn(*args)
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in times)


@dataclass
class Row:
    bench: str
    shape: str
    variant: str
    us: float
    tflops: float
    vs_gemm: float  # time / bare cuBLAS GEMM time (the floor)
    extra: dict = field(default_factory=dict)


def table(rows: list[Row]) -> str:
    lines = ["| bench | shape (M×N×K) | variant | time (µs) | TFLOP/s | × cuBLAS GEMM |",
             "|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.bench} | {r.shape} | {r.variant} | {r.us:.1f} | {r.tflops:.0f} | {r.vs_gemm:.3f} |")
    return "\n".join(lines)


def save(rows: list[Row], name: str, command: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(os.environ.get("OUT", RESULTS)) / f"{name}.json"
    meta = {"command": command, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    return out
