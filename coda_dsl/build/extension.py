"""A torch C++ extension built once per torch and Python version into the kernel cache (torch's own
builder: its flags, its lock on the build directory), loaded directly once a build has finished."""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

from .cache import atomic_write, cache_dir


def load_extension(name: str, source: Path, include: Path, depends: tuple[Path, ...] = ()):
    """The module built from `source` (with `include` on the include path; `depends`: headers it reads)."""
    import torch
    text = "".join(p.read_text() for p in (source, *depends))
    key = hashlib.sha256(f"{text}|{torch.__version__}|{sys.version}|{sys.platform}".encode()).hexdigest()[:16]
    directory = cache_dir() / f"{name}-{key}"
    if (directory / "ready").exists():  # written once a build has finished: the file is whole
        loader = importlib.machinery.ExtensionFileLoader(name, str(directory / f"{name}.so"))
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
        loader.exec_module(module)
        return module
    from torch.utils import cpp_extension
    print(f"coda_dsl: building {source.name} (C++, once per torch and Python version) ...", file=sys.stderr, flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    module = cpp_extension.load(name, [str(source)], extra_include_paths=[str(include)], extra_cflags=["-O2"],
                                build_directory=str(directory))  # torch's builder locks the directory
    atomic_write(directory / "ready", "")
    return module
