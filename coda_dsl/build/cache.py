"""The on-disk kernel cache: keys, entry validity, atomic writes, per-key file locks.

Layout: <cache_dir>/<key>/{kernel.cu, kernel.o, kernel.so, build.log, meta.json}, <key>.lock beside it,
.staging/ for builds in progress, failed/<key>/ for the source and log of the last failed build.
meta.json is written last and records each output's size, so a half-written or truncated entry is
detected (and rebuilt) instead of loaded.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from .paths import csrc_dir, templates_dir
from .tools import ARCH, toolchain

CODEGEN_VERSION = "1"  # bump when build flags change in a way the key can't see
KEY_RE = re.compile(r"^[0-9a-f]{24}$")
META = "meta.json"


def cache_dir() -> Path:
    env = os.environ.get("CODA_DSL_CACHE")
    if env:
        root = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "coda_dsl"
    root.mkdir(parents=True, exist_ok=True)
    return root


@functools.cache
def _sources_digest() -> str:
    """The template and the hand-written headers every kernel includes: editing them changes every key."""
    h = hashlib.sha256()
    for f in sorted([*templates_dir().glob("*.j2"), *csrc_dir().rglob("*.h")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def specialization_key(canonical: str) -> str:
    tc = toolchain()
    parts = [canonical, f"nvcc={tc.nvcc_version}", f"cutlass={tc.cutlass_version}",
             f"torch={tc.torch_version}", f"arch={ARCH}", f"codegen={CODEGEN_VERSION}",
             f"sources={_sources_digest()}"]
    # NUL separators: no two different part lists hash the same text.
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def entry_dir(key: str) -> Path:
    return cache_dir() / key


def read_meta(key: str) -> dict | None:
    try:
        meta = json.loads((entry_dir(key) / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("key") == key else None


def valid_output(key: str, name: str = "kernel.so") -> Path | None:
    """Path of a complete output `name` of entry `key`, or None if it is missing, partial or unrecorded."""
    files = (read_meta(key) or {}).get("files")
    size = files.get(name) if isinstance(files, dict) else None
    path = entry_dir(key) / name
    try:
        return path if isinstance(size, int) and path.stat().st_size == size else None
    except OSError:
        return None


def atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; a shared cache must be readable
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def commit_entry(key: str, files: dict[str, Path], meta: dict) -> Path:
    """Move finished build outputs into the entry dir, meta.json last. Caller holds the key's lock."""
    entry = entry_dir(key)
    if entry.exists() and not entry.is_dir():
        entry.unlink()
    entry.mkdir(exist_ok=True)
    (entry / META).unlink(missing_ok=True)  # invalidate first: readers never pair old meta with new files
    sizes = {}
    for name, src in files.items():
        sizes[name] = src.stat().st_size
        os.replace(src, entry / name)
    atomic_write(entry / META, json.dumps({**meta, "key": key, "files": sizes}, indent=1))
    return entry


@contextlib.contextmanager
def key_locks(keys):
    """Exclusive flock on <cache_dir>/<key>.lock for each key, taken in sorted order (no deadlock)."""
    with contextlib.ExitStack() as stack:
        for key in sorted(set(keys)):
            stack.enter_context(_lock(cache_dir() / f"{key}.lock"))
        yield


@contextlib.contextmanager
def _lock(path: Path):
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # clear_cache may have unlinked the file while we waited: then our lock guards nothing.
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)  # releases the flock


def _entry_keys() -> list[str]:
    return sorted(p.name for p in cache_dir().iterdir() if KEY_RE.match(p.name) and p.is_dir())


def cache_entries() -> list[dict]:
    out = []
    for key in _entry_keys():
        d = entry_dir(key)
        files = [p for p in d.iterdir() if p.is_file()]
        meta = read_meta(key) or {}
        src = d / "kernel.cu"
        out.append({"key": key, "size": sum(p.stat().st_size for p in files),
                    "mtime": max((p.stat().st_mtime for p in files), default=d.stat().st_mtime),
                    "has_so": valid_output(key) is not None,
                    "source": str(src) if src.exists() else None, "op_name": meta.get("op_name")})
    return out


def clear_cache() -> int:
    """Remove every entry (each under its lock, so no build in progress is disturbed) and old debris."""
    root = cache_dir()
    entries = set(_entry_keys())
    orphan_locks = {p.name[:-5] for p in root.glob("*.lock") if KEY_RE.match(p.name[:-5])}
    for key in sorted(entries | orphan_locks):
        lock = root / f"{key}.lock"
        with _lock(lock):
            shutil.rmtree(root / key, ignore_errors=True)
            lock.unlink(missing_ok=True)
    shutil.rmtree(root / "failed", ignore_errors=True)
    staging = root / ".staging"
    if staging.is_dir():  # only debris of crashed builds: live ones are younger than a day
        for d in staging.iterdir():
            with contextlib.suppress(OSError):
                if time.time() - d.stat().st_mtime > 86400:
                    shutil.rmtree(d, ignore_errors=True)
    return len(entries)
