"""Toolchain discovery (nvcc, CUTLASS headers, ninja) and the flags that build one kernel."""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import CodaError
from .paths import csrc_dir

ARCH = "sm_90a"  # never plain sm_90: Sm90 kernels built for it compute nothing
# The oldest CUDA whose runtime has the library API (cudaLibraryLoadData, cudaLibraryGetKernel) that a
# kernel library loads its GEMM with (csrc/coda_dsl/evt.h): nvcc and torch's CUDA runtime alike.
MIN_CUDA = (12, 8)
MIN_CUDA_TEXT = ".".join(map(str, MIN_CUDA))


@functools.cache  # asked on every Python-path call that may run a kernel (runtime/checks.py: old_runtime)
def older_than_min_cuda(version: str) -> bool:
    """Whether a CUDA version ("12.6", "12.8.93") is older than MIN_CUDA."""
    return tuple(int(p) for p in re.findall(r"\d+", version)[:2]) < MIN_CUDA


class ToolchainError(CodaError, RuntimeError):
    """A compiler, header set or tool needed to build kernels is missing; the message says what to do."""


@dataclass(frozen=True)
class Toolchain:
    nvcc: str
    cuda_home: str
    nvcc_version: str
    cutlass_include: list[str]
    cutlass_version: str
    csrc_include: str


def find_nvcc() -> tuple[str, str]:
    """(nvcc path, CUDA home)."""
    looked = []
    var = next((v for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)), None)
    if var:  # a toolkit the user named: never silently another one
        home = os.environ[var]
        nvcc = Path(home) / "bin" / "nvcc"
        if os.access(nvcc, os.X_OK):
            return str(nvcc), str(Path(home))
        raise ToolchainError(f"{var}={home}, but {nvcc} is not an executable: point {var} at a CUDA toolkit "
                             f"{MIN_CUDA_TEXT}+ (the directory holding bin/nvcc), or unset it")
    for home in ["/usr/local/cuda"]:
        nvcc = Path(home) / "bin" / "nvcc"
        looked.append(str(nvcc))
        if os.access(nvcc, os.X_OK):
            return str(nvcc), str(Path(home))
    found = shutil.which("nvcc")
    looked.append("nvcc on PATH")
    if not found:
        raise ToolchainError(f"nvcc not found: install the CUDA toolkit {MIN_CUDA_TEXT}+ and set CUDA_HOME "
                             f"(looked in: {', '.join(looked)})")
    home = Path(found).resolve().parent.parent
    if not (home / "include" / "cuda_runtime.h").exists():
        home = _nvcc_top(found) or home  # nvcc on PATH may be a wrapper script outside the toolkit
    return found, str(home)


def _nvcc_top(nvcc: str) -> Path | None:
    """The toolkit root as nvcc itself reports it (`TOP=<home>/bin/..` in a dry run)."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.M)
    return Path(m.group(1).strip()).resolve() if m else None


def nvcc_version(nvcc: str) -> str:
    try:
        run = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"nvcc at {nvcc} does not run ({e}): reinstall the CUDA toolkit {MIN_CUDA_TEXT}+") from e
    out = run.stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    if run.returncode or not m:  # nvcc's own words say why (a missing library, a broken install)
        said = (run.stdout + run.stderr).strip() or "(no output)"
        how = f"failed (exit code {run.returncode})" if run.returncode else "printed no version"
        raise ToolchainError(f"`{nvcc} --version` {how}: {said}\n"
                             f"  fix: repair or reinstall the CUDA toolkit {MIN_CUDA_TEXT}+, or point CUDA_HOME at another")
    if older_than_min_cuda(m.group(1)):
        raise ToolchainError(f"nvcc at {nvcc} is CUDA {m.group(1)}; coda_dsl needs {MIN_CUDA_TEXT} or later (its kernel "
                             "libraries load their GEMM with the CUDA runtime's library API)\n"
                             f"  fix: install the CUDA toolkit {MIN_CUDA_TEXT}+ and point CUDA_HOME at it")
    return m.group(1)


def _header_version(include: Path) -> str:
    text = (include / "cutlass" / "version.h").read_text(errors="replace")
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


def find_cutlass() -> tuple[list[str], str]:
    """(include dirs, version). The wheel's package is located, not imported (importing it is slow)."""
    override = os.environ.get("CODA_DSL_CUTLASS_DIR")
    if override:
        root = Path(override).expanduser().resolve()
        if not (root / "include" / "cutlass" / "cutlass.h").exists():
            raise ToolchainError(f"CUTLASS headers not found: CODA_DSL_CUTLASS_DIR={override} has no "
                                 "include/cutlass/cutlass.h (point it at a CUTLASS checkout, or unset it "
                                 "and pip install nvidia-cutlass)")
        # A checkout is keyed by its header version and location: headers there may change.
        return ([str(root / "include"), str(root / "tools" / "util" / "include")],
                f"{_header_version(root / 'include')}@{root}")
    spec = importlib.util.find_spec("cutlass_library")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        src = Path(loc) / "source"
        if (src / "include" / "cutlass" / "cutlass.h").exists():
            try:
                version = importlib.metadata.version("nvidia-cutlass")
            except importlib.metadata.PackageNotFoundError:
                version = _header_version(src / "include")
            return [str(src / "include"), str(src / "tools" / "util" / "include")], version
    raise ToolchainError("CUTLASS headers not found: pip install nvidia-cutlass (its cutlass_library "
                         "package ships them), or set CODA_DSL_CUTLASS_DIR to a CUTLASS checkout "
                         "holding include/cutlass/cutlass.h")


@functools.cache
def toolchain() -> Toolchain:
    nvcc, cuda_home = find_nvcc()
    cutlass_include, cutlass_version = find_cutlass()
    return Toolchain(nvcc=nvcc, cuda_home=cuda_home, nvcc_version=nvcc_version(nvcc),
                     cutlass_include=cutlass_include, cutlass_version=cutlass_version, csrc_include=str(csrc_dir()))


def ninja_binary() -> str:
    try:
        import ninja
        path = Path(ninja.BIN_DIR) / "ninja"
        if os.access(path, os.X_OK):
            return str(path)
    except ImportError:
        pass
    found = shutil.which("ninja")
    if not found:
        raise ToolchainError("ninja not found: pip install ninja")
    return found


def _libcuda_args(cuda_home: str) -> list[str]:
    """libcuda for kernels that call the driver API (atomic EVT reductions fill their workspace with
    cuMemsetD32Async). Toolkit stubs when present, else the driver's own library, else nothing:
    a machine without either cannot run the kernel anyway."""
    stubs = Path(cuda_home) / "lib64" / "stubs"
    if (stubs / "libcuda.so").exists():
        return [f"-L{stubs}", "-lcuda"]
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/aarch64-linux-gnu", "/usr/lib/wsl/lib"):
        for name in ("libcuda.so", "libcuda.so.1"):
            if (Path(d) / name).exists():
                return [str(Path(d) / name)]
    return []


def compile_command(tc: Toolchain) -> list[str]:
    """nvcc `.cu -> .o` command without the input/output arguments. A kernel's translation unit
    includes CUTLASS and csrc/ only, no torch header (its interface is plain data: abi.h).
    C++20, as torch's own cpp_extension uses; CUTLASS 4.2 Hopper GEMMs build the same in C++20
    (checked on the EVT probe)."""
    includes = [*tc.cutlass_include, tc.csrc_include, str(Path(tc.cuda_home) / "include")]
    return [tc.nvcc, "-std=c++20", "-O3", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a",
            "--expt-relaxed-constexpr", "-ftemplate-backtrace-limit=0",
            "-Xcudafe", "--diag_suppress=esa_on_defaulted_function_ignored",
            "-Xcudafe", "--diag_suppress=2908",  # C++20 deprecates CUTLASS's implicit `this` captures
            "-Xcompiler", "-fPIC",
            *(f"-I{d}" for d in includes)]


def linker() -> list[str]:
    """The command that links kernel libraries: $CXX, else c++."""
    return shlex.split(os.environ.get("CXX", "")) or ["c++"]  # empty or blank: unset


def link_command(tc: Toolchain) -> tuple[list[str], list[str]]:
    """(linker, flags after `-shared <obj> -o <so>`): the CUDA runtime (the one torch has loaded, by
    its soname) and the driver API, nothing of torch."""
    cuda_lib = str(Path(tc.cuda_home) / "lib64")
    flags = [f"-L{cuda_lib}", "-lcudart", *_libcuda_args(tc.cuda_home)]
    return linker(), flags
