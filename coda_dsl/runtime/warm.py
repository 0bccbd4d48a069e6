"""The warm call path in C++ (runtime/warm.cpp): a table per CompiledOp, and per cd.gemm epilogue and
options, of call layouts the Python path checked and launched. A later call of one of them is matched,
its outputs allocated and its kernel launched in one C++ call; any other call answers None and takes
the Python path (runtime/op.py), which checks it and adds its layout where the C++ path can repeat its
launch exactly (no batch folded into M, no operand copied, no output staged).

The extension is built once per torch and Python version into the kernel cache (build/extension.py; about
20 s on 2 cores), at the first launch that wants it. Where it cannot be built (no C++ compiler) the Python
path serves every call, after one warning. CODA_DSL_WARM=0 turns it off.
"""
from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

from .. import build
from ..errors import KernelError

ENV = "CODA_DSL_WARM"
ENABLED = os.environ.get(ENV, "1").strip() != "0"
_module = None
_failed = False
_lock = threading.Lock()


def _load():  # it fills the kernels' argument block: abi.h is part of it
    return build.load_extension("coda_warm", Path(__file__).with_name("warm.cpp"), build.csrc_dir(),
                                (build.csrc_dir() / "coda_dsl" / "abi.h",))


def module():
    """The loaded extension, or None (turned off, or it failed to build: warned once)."""
    global _module, _failed
    if _module is None and ENABLED and not _failed:
        with _lock:
            if _module is None and not _failed:
                try:
                    m = _load()
                    m.set_error_type(KernelError)
                    _module = m
                except Exception as e:  # noqa: BLE001 (a compiler missing or failing: the Python path serves)
                    _failed = True
                    warnings.warn(f"coda_dsl: the C++ warm call path is not available ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); calls take the Python path "
                                  "(a few µs more each). CODA_DSL_WARM=0 silences this.", stacklevel=3)
    return _module


def table(names):
    """A new, empty table for calls with these operand names; False where the extension is unavailable (so
    a caller keeps the answer and does not ask again)."""
    m = module()
    return m.Table(tuple(names)) if m is not None else False


def add(table, kernel, tensors: list, n_scalars: int, inputs: list, outputs: list, scalars: list,
        consts: list) -> None:
    """Offers the layout of a launch that just ran (the table keeps it once, and only the newest layouts):
    `tensors` and `n_scalars` as the kernel got them (abi.h). inputs: (call value, its slot among `tensors`,
    the tensor), call value 0: A, 1: B, 2 + i: operand i, slot -1: matched but not read; outputs: (name,
    slot, the tensor allocated for it); scalars: (call value, its index among the scalars, -1: matched but
    not read); consts: (call value, the value the kernel was built for)."""
    block, workspace_size = kernel.template(tensors, n_scalars)
    table.add(inputs, scalars, consts, [(name, tuple(t.shape), t, slot) for name, slot, t in outputs], block,
              workspace_size, kernel.launch_address)
