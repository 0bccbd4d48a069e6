"""Warm-path host overhead of a call: cache hit, checks, output allocation, argument packing, launch.

Each call twice: through the C++ warm path (runtime/warm.py), and through the Python path it replaces.

    python -m bench.host_overhead                  # on an sm_90 GPU (also: the kernel library's call alone)
    python -m bench.host_overhead --python-only    # anywhere: the Python part, kernel launch stubbed

Tiny shapes keep the GPU idle, so the host is the bottleneck: CPU time per call = wall time of N
back-to-back calls / N. Compares cd.gemm, a kept CompiledOp and a bare torch.matmul of the same size.
--python-only runs on CPU tensors with the kernel replaced by a no-op: what is left is coda_dsl's
own Python (checks, caches, output allocation), without the launch; twice, with the kernel call
stubbed in Python, and through the real ctypes call (runtime/kernel.py: packing, workspace) into a
no-op library with the kernels' two extern "C" functions (built with the C compiler, if there is one).
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import coda_dsl as cd
from coda_dsl.runtime import op as runtime

from .harness import no_gpu

ROUNDS = 5


@cd.epilogue
def bias_relu(acc, bias: cd.VecN, alpha: cd.Scalar):
    return cd.relu(alpha * acc + bias)


def per_call_us(fn, n: int = 2000) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(50):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e6


def in_turns(fns: dict, n: int, rounds: int = ROUNDS) -> dict[str, float]:
    """Each call's median µs over `rounds`, the calls taken in turn within a round: a drift of the host's
    speed hits them alike (one pass each gave torch.matmul 19.7 and 14.2 µs in two H200 runs)."""
    got = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            got[k].append(per_call_us(fn, n))
    return {k: statistics.median(v) for k, v in got.items()}


NOOP_LIBRARY = r"""#include <stdint.h>
int coda_workspace_size(const void* args, int64_t* size, char* message, int64_t message_size) { *size = 0; return 0; }
int coda_launch(const void* args, char* message, int64_t message_size) { return 0; }
"""


def _noop_library():
    """A kernel library that launches nothing, called like a real one (None without a C compiler)."""
    from coda_dsl.runtime import kernel
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    d = Path(tempfile.mkdtemp(prefix="coda_noop_"))
    (d / "noop.c").write_text(NOOP_LIBRARY)
    subprocess.run([cc, "-shared", "-fPIC", "-O2", str(d / "noop.c"), "-o", str(d / "noop.so")], check=True)
    kernel.current_stream = lambda device: 0  # CPU tensors: no CUDA stream to ask for
    return kernel.Kernel(ctypes.PyDLL(str(d / "noop.so")))


def _stub_kernels(kernel_call) -> None:
    """Kernels that do nothing (kernel_call), and the cutlass call path allowed on CPU tensors."""
    runtime.CompiledOp.load = lambda self: setattr(self, "_op", kernel_call) or self
    runtime.checks.require_cutlass = lambda *_: None
    runtime._choose_config = lambda spec, call, tune, key: runtime.Config()


def _launch_only(op, call):
    """A function that repeats the C++ side of op's launch: the argument block of one call(), captured,
    sent again through ctypes (no Python checks, packing or allocation; the outputs are overwritten)."""
    call()  # loads the kernel
    kernel = op._op
    blocks, send = [], kernel._launch
    kernel._launch = lambda block, message, size: blocks.append(block) or send(block, message, size)
    try:
        keep = call()  # the outputs stay allocated while the block points at them
    finally:
        kernel._launch = send
    block = blocks[-1]
    # the block's workspace (abi.h: the fifth int64 of CallArgs) was freed after the call: hold one
    size = struct.unpack_from("=q", block, 40)[0]
    workspace = torch.empty(size, dtype=torch.uint8, device=next(iter(keep.values())).device)
    block = block[:32] + struct.pack("=q", workspace.data_ptr() if size else 0) + block[40:]

    def again():
        if send(block, kernel._message, 1024):
            raise RuntimeError(kernel._message.value.decode(errors="replace"))
    again.keep = (keep, workspace)
    return again


def operands(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A, W and bias of the timed calls: tiny, so that the host is the bottleneck (kernel() compiles for them)."""
    return (torch.randn(128, 64, device=device, dtype=torch.bfloat16),
            torch.randn(128, 64, device=device, dtype=torch.bfloat16),
            torch.randn(128, device=device, dtype=torch.bfloat16))


def kernel(a, w, bias) -> cd.CompiledOp:
    """The kept op the bench times (and tests/prebuild_without_gpu.py builds ahead)."""
    return cd.compile(bias_relu, a, w, bias=bias, alpha=1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--python-only", action="store_true", help="CPU tensors, kernel launch stubbed out")
    args = p.parse_args(argv)
    if args.python_only:
        device, backend, n = "cpu", "cutlass", 20000
    elif no_gpu():
        return 1
    else:
        device, backend, n = "cuda", "auto", 2000
    a, w, bias = operands(device)
    matmul = {} if args.python_only else {"torch.matmul (reference point)": lambda: a @ w.t()}
    rows = {}
    stubs = [("", None)] if not args.python_only else \
        [(" (kernel call stubbed in Python)", lambda *args: None), (" (ctypes into a no-op library)", _noop_library())]
    warm_table = runtime.warm.table
    for label, kernel_call in stubs:
        if args.python_only:
            if kernel_call is None:
                print("no C compiler: the ctypes rows are left out", file=sys.stderr)
                continue
            runtime.clear()
            _stub_kernels(kernel_call)
        op = kernel(a, w, bias)
        gemm = lambda: cd.gemm(a, w, bias_relu, backend=backend, bias=bias, alpha=0.5)  # noqa: E731
        call = lambda: op(a, w, bias=bias, alpha=0.5)  # noqa: E731
        gemm(), call()
        if op._table:  # a kernel library (not a stand-in) and the C++ warm path: each call both ways
            rows |= in_turns({**matmul, f"cd.gemm(A, B, epilogue, ...), C++ warm path{label}": gemm,
                              f"CompiledOp(A, B, ...), C++ warm path{label}": call}, n)
        tables, table = dict(runtime._tables), op._table
        runtime._tables.clear()
        op._table = False
        runtime.warm.table = lambda names: False  # else cd.gemm's next call makes a new table, and uses it
        python = {f"cd.gemm(A, B, epilogue, ...), Python path{label}": gemm,
                  f"CompiledOp(A, B, ...), Python path{label}": call}
        if hasattr(op._op, "_launch"):  # a library called through ctypes: its coda_launch alone
            what = "CUTLASS's set-up + launch" if not args.python_only else "ctypes into a no-op library"
            python[f"coda_launch alone, one packed block ({what})"] = _launch_only(op, call)
        rows |= in_turns(python, n)
        runtime.warm.table = warm_table
        runtime._tables.clear()
        runtime._tables.update(tables)
        op._table = table
    what = "Python µs per call (launch stubbed)" if args.python_only else "host µs per call"
    base = rows.get("torch.matmul (reference point)")
    print(f"median of {ROUNDS} rounds, the calls in turn within each\n")
    print(f"| call | {what} |{' × torch.matmul |' if base else ''}\n|---|---:|{'---:|' if base else ''}")
    for k, v in rows.items():
        ratio = f" {v / base:.2f} |" if base and "coda_launch" not in k else " |" if base else ""
        print(f"| {k} | {v:.1f} |{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
