"""Kernel configuration: a default per GPU model and shape, and measured choices persisted per device.

tune=True builds every candidate configuration of a specialization in parallel (one ninja run),
times each on the call's shapes with random data, and records the winner in
`<cache dir>/tuned.json`, keyed by the device (name, SM count, CUDA and driver version), the
specialization (everything but its configuration) and the shape bucket. A later call or process
with the same key uses the record: no build of the losers, no timing.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from .. import build
from ..errors import OperandError, SharedMemoryError
from ..passes.plan import Config
from .torch_compile import constant_under_compile


TUNE_ENV = "CODA_DSL_TUNE"


def _env_tuning() -> bool:
    """CODA_DSL_TUNE: 1/true/yes/on, or 0/false/no/off (or unset); anything else is off, with a warning."""
    value = os.environ.get(TUNE_ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value not in ("", "0", "false", "no", "off"):
        warnings.warn(f"coda_dsl: {TUNE_ENV}={value!r} is not 1/true/yes/on or 0/false/no/off: tuning stays off",
                      stacklevel=2)
    return False


on = _env_tuning()  # whether calls tune (set_tuning); a call's tune= overrides it


def set_tuning(enabled: bool) -> None:
    """set_tuning(True): tune every specialization on first use of a shape bucket (like tune=True on each
    call); False: untuned configs (a recorded choice is still used). The default comes from CODA_DSL_TUNE;
    a call's tune= overrides it. A choice is made once per process and shape bucket (runtime.clear()
    forgets them)."""
    global on
    if not isinstance(enabled, bool):  # "false" would be truthy
        raise OperandError(f"coda_dsl.set_tuning: enabled must be True or False, not {enabled!r}")
    on = enabled


DEFAULT = Config()  # cd.compile without config=: cooperative 128x256, cluster 2x1, swizzle 8
PINGPONG = Config((128, 128, 64), (2, 1), "pingpong")
PINGPONG_192 = Config((128, 192, 64), (2, 1), "pingpong")
CANDIDATES = [
    DEFAULT,
    PINGPONG,
    PINGPONG_192,
    Config(scheduler="streamk"),
    Config((256, 128, 64), (2, 1), "cooperative"),
    Config(epilogue_tile=(128, 64)),
    Config((128, 128, 64), (2, 1), "pingpong", swizzle=4),
    Config((128, 128, 64), (1, 2), "pingpong"),
]


def default(m: int, n: int, k: int, l: int = 1, gpu: str | None = None) -> tuple[Config, str]:
    """The configuration a call gets without tuning, and why. The rule is measured per GPU model: `gpu` is
    the GPU's name (None: the current CUDA device's; "" for no GPU). The Llama-3-8B layer's forward +
    backward per rule, × its floor at 8192 / 16384 tokens (`python -m bench.default_rule`'s method: each
    rule in a process of its own running bench.llama_layer, alternating; bench/results/history.md):
    - H100: the cooperative 128x256 tile at every shape: 1.034 / 1.012 against 1.056 / 1.072 for the H200's
      rule (one SXM card, one process per rule, one run each; another H100 gave the cooperative rule 1.063 /
      1.036). Under sustained load pingpong clocks lower there (bench.mlp --sustained: rms_swiglu_fwd 1.272x
      cuBLAS against 1.061x at 8192 x 14336 x 4096). The PCIe and NVL cards take it unmeasured.
    - H200, and GPUs not measured: pingpong at K < 8192, whose two warp groups overlap one tile's epilogue
      with the other's mainloop (128x192 where 192 divides N, else 128x128; bench.sweep: 0.94-1.02x cuBLAS
      against 1.00-1.09x), the cooperative 128x256 tile at K >= 8192 (its mainloop is the faster one once
      the epilogue is a small share of the tile's time) and below 4096 x 4096 outputs: 1.041-1.044 /
      1.021-1.038 (2 runs) against 1.055-1.084 / 1.011-1.040 (5 runs) for the H100's rule (forward
      1.017-1.019 against 1.05-1.08): a gain at 8192 tokens, none to tell at 16384.
    Swizzle 8 everywhere: one wave's A and B slices stay in L2."""
    gpu = gpu_name() if gpu is None else gpu
    if _model(gpu, "H100"):
        return DEFAULT, f"{gpu}: cooperative 128x256 at every shape, measured fastest on H100s (runtime/tune.py:default)"
    rule = f"{'no GPU here' if not gpu else gpu if measured(gpu) else gpu + ' (not measured)'}: the H200's rule"
    if m * l * n < 4096 * 4096:
        return DEFAULT, f"{rule}, M x N = {m * l} x {n} < 4096 x 4096: cooperative 128x256"
    if k >= 8192:
        return DEFAULT, f"{rule}, K = {k} >= 8192: the mainloop dominates, cooperative 128x256"
    if n % 192 == 0:
        return PINGPONG_192, f"{rule}, K = {k} < 8192: pingpong hides the epilogue; 192 divides N = {n}"
    return PINGPONG, f"{rule}, K = {k} < 8192: pingpong hides the epilogue; 192 does not divide N = {n}"


MEASURED = ("H100", "H200")  # the models whose rule default() was measured on


def measured(gpu: str) -> bool:
    """Whether default() has a measured rule for this GPU's name (others get the H200's, unmeasured)."""
    return any(_model(gpu, m) for m in MEASURED)


def _model(gpu: str, model: str) -> bool:
    """Whether a GPU's name names that model, in any case ("NVIDIA H100 80GB HBM3", "H100-SXM5", "h100": yes;
    "GH200": not an H200)."""
    return re.search(rf"(?<![A-Za-z0-9]){model}(?![0-9])", gpu, re.IGNORECASE) is not None


def gpu_name(device: torch.device | str | int | None = None) -> str:
    """The name default() reads its rule by: the CUDA device's (None, or no index: the current one), "" for none.
    `device` as torch takes it: a torch.device, "cuda:1", "cpu", or a CUDA index."""
    if isinstance(device, (str, int)):
        device = torch.device(device)  # an int: that CUDA device
    if device is not None and device.type != "cuda":
        return ""
    if device is None or device.index is None:
        if not torch.cuda.is_available():
            return ""
        return _cuda_name(torch.cuda.current_device())
    return _cuda_name(device.index)


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@constant_under_compile
def is_gpu(model: str, device: torch.device | str | int | None = None) -> bool:
    """Whether `device` (None: the current CUDA device) is a GPU of that model ("H100", "H200"; "GH200" is not
    an H200), for a choice measured per model, such as the library's tile configurations. A constant under
    torch.compile."""
    return _model(gpu_name(device), model)


def bucket(m: int, n: int, k: int, l: int) -> str:
    """Shapes that behave alike share a record: powers of two above each size."""
    p2 = lambda x: 1 << max(0, (x - 1).bit_length())  # noqa: E731
    return f"{p2(m)}x{p2(n)}x{p2(k)}x{l}"


@functools.cache
def device_key(device: torch.device) -> str:
    p = torch.cuda.get_device_properties(device)
    driver = torch._C._cuda_getDriverVersion() if hasattr(torch._C, "_cuda_getDriverVersion") else "?"
    return f"{p.name}|sm{p.major}{p.minor}|{p.multi_processor_count}sm|cuda{torch.version.cuda}|driver{driver}"


def _records_path() -> Path:
    return build.cache_dir() / "tuned.json"


def _load() -> dict:
    try:
        records = json.loads(_records_path().read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: tuning again is the safe answer
    # {device: {record key: {"config": text, ...}}}; what is not that shape is read as no record
    return {dev: per for dev, per in records.items() if isinstance(per, dict)} if isinstance(records, dict) else {}


def _store(device: str, key: str, config: Config, times: dict[str, float]) -> None:
    path = _records_path()
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = _load()
        records.setdefault(device, {})[key] = {"config": config.text, "us": times, "when": time.time()}
        build.atomic_write(path, json.dumps(records, indent=1, sort_keys=True))


def record_key(canonical: str, config: Config, m: int, n: int, k: int, l: int) -> str:
    base = canonical.replace(config.text, "*")  # the specialization without its configuration
    return f"{hashlib.sha256(base.encode()).hexdigest()[:20]}@{bucket(m, n, k, l)}"


def recorded(device: torch.device, canonical: str, config: Config, mnkl) -> Config | None:
    entry = _load().get(device_key(device), {}).get(record_key(canonical, config, *mnkl))
    try:
        return Config.parse(entry["config"]) if entry else None
    except (TypeError, KeyError, ValueError):  # a damaged record: tuning again is the safe answer
        return None


def tune(make_op, launch, device: torch.device, mnkl, log=None) -> Config:
    """make_op(config) -> CompiledOp; launch(op) runs it once on the call's operands."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    first = make_op(DEFAULT)
    hit = recorded(device, first.plan.canonical, DEFAULT, mnkl)
    if hit is not None:  # another process tuned this bucket meanwhile
        return hit
    ops = {}  # rendering the candidates only when they are timed
    for c in CANDIDATES:
        try:
            ops[c.text] = make_op(c)
        except SharedMemoryError:  # this epilogue's buffers do not fit at that config: not a candidate
            pass
    log(f"coda_dsl: tuning {first.epilogue.name} at M,N,K,L={mnkl}: {len(ops)} configurations")
    build.build_units([op.unit for op in ops.values()])
    times = round_robin({key: (lambda op=op: launch(op)) for key, op in ops.items()}, iters=20)
    for key, t in times.items():
        log(f"  {key:32s} {t:9.1f} us")
    best = min(times, key=times.get)
    log(f"coda_dsl: best {best}; recorded in {_records_path()}")
    _store(device_key(device), record_key(first.plan.canonical, DEFAULT, *mnkl), Config.parse(best), times)
    return Config.parse(best)


def round_robin(fns: dict[str, Callable], iters: int, warmup: int = 2,
                args: Callable[[int], tuple] = lambda call: ()) -> dict[str, float]:
    """Median µs of each fns[key](*args(call)), by CUDA events, the functions called in turn (every other
    round in reverse order, so that none always follows the same one): timed one after another, the later
    ones ran on a hotter, slower-clocked GPU. Nothing waits for the GPU until every call is queued.
    args(call): the arguments of the call-th call (a benchmark's rotation of input sets)."""
    for i in range(warmup):
        for fn in fns.values():
            fn(*args(i))
    events: dict[str, list] = {key: [] for key in fns}
    calls = 0
    for i in range(iters):
        for key, fn in (reversed if i % 2 else iter)(list(fns.items())):
            call_args = args(calls)
            calls += 1
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(*call_args)
            e.record()
            events[key].append((s, e))
    torch.cuda.synchronize()
    return {key: statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev) for key, ev in events.items()}
