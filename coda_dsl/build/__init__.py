"""Build layer: specialization keys, the on-disk kernel cache, toolchain discovery, parallel ninja
builds and file locks. Knows nothing of what a kernel computes (DESIGN.md §4)."""
from .builder import BuildError, BuildUnit, KernelLoadError, build_units, library, load_library
from .extension import load_extension
from .cache import (CODEGEN_VERSION, CacheError, LockTimeoutError, atomic_write, build_key, cache_dir,
                    cache_entries, clear_cache, export_cache, import_cache, specialization_key, valid_output)
from .paths import csrc_dir, templates_dir
from .tools import ARCH, Toolchain, ToolchainError, toolchain

__all__ = ["ARCH", "CODEGEN_VERSION", "BuildError", "BuildUnit", "CacheError", "KernelLoadError", "LockTimeoutError",
           "Toolchain", "ToolchainError", "atomic_write", "build_key", "build_units", "cache_dir", "cache_entries",
           "clear_cache", "csrc_dir", "export_cache", "import_cache", "library", "load_extension", "load_library",
           "specialization_key", "templates_dir", "toolchain", "valid_output"]
