"""The warm call path in C++ (csrc/coda_dsl/warm.cpp): a table per CompiledOp, and per cd.gemm epilogue and
options, of call layouts the Python path checked and launched. A later call of one of them is matched,
its outputs allocated and its kernel launched in one C++ call; any other call answers None and takes
the Python path (runtime/op.py), which checks it and adds its layout where the C++ path can repeat its
launch exactly (no batch folded into M, no operand copied, no output staged).

The extension is built with torch's own C++ extension builder once per torch and Python version, into
the kernel cache (about 20 s on 2 cores), at the first launch that wants it. Where it cannot be built
(no C++ compiler) the Python path serves every call, after one warning. CODA_DSL_WARM=0 turns it off.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
import warnings

import torch

from .. import build
from ..build.paths import csrc_dir
from ..errors import KernelError

ENABLED = os.environ.get("CODA_DSL_WARM", "1").strip() != "0"
_module = None
_failed = False
_lock = threading.Lock()


def _directory():
    sources = "".join((csrc_dir() / "coda_dsl" / f).read_text() for f in ("warm.cpp", "abi.h"))
    key = hashlib.sha256(f"{sources}|{torch.__version__}|{sys.version}|{sys.platform}".encode()).hexdigest()[:16]
    return build.cache_dir() / f"warm-{key}"


def _load():
    """The extension module, built first if this torch and Python have none yet."""
    directory = _directory()
    if (directory / "ready").exists():  # written once a build has finished: the file is whole
        loader = importlib.machinery.ExtensionFileLoader("coda_warm", str(directory / "coda_warm.so"))
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader("coda_warm", loader))
        loader.exec_module(module)
        return module
    from torch.utils import cpp_extension
    print("coda_dsl: building the warm call path (C++, once per torch and Python version) ...",
          file=sys.stderr, flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    module = cpp_extension.load("coda_warm", [str(csrc_dir() / "coda_dsl" / "warm.cpp")],  # locks the directory
                                extra_include_paths=[str(csrc_dir())], extra_cflags=["-O2"],
                                build_directory=str(directory))
    build.atomic_write(directory / "ready", "")
    return module


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
    """A new, empty table for calls with these operand names (None where the extension is unavailable)."""
    m = module()
    return m.Table(tuple(names)) if m is not None else None


def add(table, kernel, tensors: list, n_scalars: int, inputs: list, outputs: list, scalars: list,
        consts: list) -> None:
    """Offers the layout of a launch that just ran (the table keeps it once, and only the newest layouts): `tensors` and `n_scalars` as the kernel got them (abi.h).
    inputs: (call value, its slot among `tensors`, the tensor), call value 0: A, 1: B, 2 + i: operand i,
    slot -1: matched but not read; outputs: (name, slot, the tensor allocated for it); scalars: (call
    value, its index among the scalars, -1: matched but not read); consts: (call value, the value the
    kernel was built for)."""
    block, workspace_size = kernel.template(tensors, n_scalars)
    table.add(inputs, scalars, consts, [(name, tuple(t.shape), t, slot) for name, slot, t in outputs], block,
              workspace_size, kernel.launch_address)
