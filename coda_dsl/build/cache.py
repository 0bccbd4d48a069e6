"""The on-disk kernel cache: keys, entry validity, atomic writes, per-key file locks, I/O errors.

Layout: <cache_dir>/<build key>/{kernel.cu, kernel.o, kernel.so, build.log, meta.json}, <build key>.lock
beside it, .staging/ for builds in progress, failed/<build key>/ for the kernel.cu and log of the last
failed build. meta.json is written last and records each output's size and SHA-256, so a half-written,
truncated or damaged entry is detected (and rebuilt) instead of loaded.

Two keys: the specialization key (plan + codegen; it names the torch op and is in the .cu) and the
build key (specialization key + toolchain versions; it names the cache entry). Emitting a kernel needs
no toolchain; only building does.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import gzip
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CodaError
from . import paths
from .tools import ARCH, toolchain

CODEGEN_VERSION = "2"  # 2: kernels link no torch library  # bump when build flags change in a way the key can't see
KEY_RE = re.compile(r"[0-9a-f]{24}")  # fullmatch: "$" would also take a trailing newline
META = "meta.json"
WAIT_NOTICE_S = 3.0  # a process waiting on another's build lock says so after this long


class CacheError(CodaError, OSError):
    """The kernel cache cannot be read or written; the message names the path and the fix."""


class LockTimeoutError(CacheError):
    """Waited longer than CODA_DSL_LOCK_TIMEOUT for another process's build of the same kernel."""


def cache_error(e: OSError, path=None, root: bool = False) -> CacheError:
    """A clear CacheError for an OSError met on a cache path (root: the cache directory itself, which
    `coda-dsl cache clear` cannot fix): what is wrong there and what to do."""
    where = str(path or e.filename or "the kernel cache")
    code = e.errno
    if code == errno.ENOTDIR:
        what, fix = "a part of this path is a regular file, not a directory", \
            "remove that file, or set CODA_DSL_CACHE to a directory"
    elif code in (errno.EEXIST, errno.EISDIR):
        what = "is a directory where a file belongs" if code == errno.EISDIR else \
            "exists and is not a directory"
        fix = "remove it, or set CODA_DSL_CACHE to a directory" if root else \
            "remove it (`coda-dsl cache clear` removes such debris)"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = "read-only file system" if code == errno.EROFS else "permission denied"
        fix = ("make it writable (a cache shared by a group must be group-writable or setgid: see README, "
               "How caching works), or set CODA_DSL_CACHE to a directory you can write")
    elif code in (errno.ENOSPC, errno.EDQUOT):
        what, fix = "no space left on the device (or disk quota exceeded)", \
            "free some space (`coda-dsl cache clear`), or set CODA_DSL_CACHE to another file system"
    else:
        what, fix = e.strerror or str(e), "check the path, or set CODA_DSL_CACHE to another directory"
    return CacheError(f"kernel cache: {where}: {what}: {fix}")


@contextlib.contextmanager
def cache_io(path=None):
    """Turn an OSError of the cache's file operations into one clear CacheError."""
    try:
        yield
    except CacheError:
        raise
    except OSError as e:
        raise cache_error(e, path) from e


def _shared(directory: Path) -> bool:
    """A directory that is setgid or group-writable is shared by a group: what we create in it is too."""
    try:
        return bool(directory.stat().st_mode & (stat.S_ISGID | stat.S_IWGRP))
    except OSError:
        return False


def _set_mode(path: Path, fd: int | None = None) -> None:
    """rw-r--r-- (rwxr-xr-x for directories), group-writable inside a shared directory. Only the owner
    may chmod: someone else's file keeps its mode."""
    st = os.fstat(fd) if fd is not None else path.lstat()
    if st.st_uid != os.geteuid():
        return
    shared = _shared(path.parent)
    if stat.S_ISDIR(st.st_mode):
        mode = 0o775 if shared else 0o755
        mode |= stat.S_ISGID if shared and path.parent.stat().st_mode & stat.S_ISGID else 0
    else:
        mode = (st.st_mode & 0o111) | (0o664 if shared else 0o644)
    if stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode) if fd is not None else os.chmod(path, mode)


def make_dir(path: Path) -> Path:
    """mkdir (if missing) with the cache's permissions."""
    path.mkdir(exist_ok=True)
    _set_mode(path)
    return path


_fallback_warned = False


def cache_dir() -> Path:
    env = os.environ.get("CODA_DSL_CACHE")
    if env:
        root = Path(env).expanduser()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # the user chose this place: say what is wrong with it rather than go elsewhere
            raise CacheError(f"CODA_DSL_CACHE={env}: {cache_error(e, e.filename or root, root=True)}") from None
        return root
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "coda_dsl"
    try:
        root.mkdir(parents=True, exist_ok=True)
        return root
    except OSError as e:
        return _fallback_dir(root, e)


def _fallback_dir(default: Path, why: OSError) -> Path:
    """A per-user cache in the temporary directory, when the default location cannot be created (a
    read-only home, ~/.cache being a file): a slower start beats no kernels."""
    global _fallback_warned
    root = Path(tempfile.gettempdir()) / f"coda_dsl-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    st = root.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():  # someone else's: never use it
        raise CacheError(f"kernel cache: cannot create {default} ({why.strerror}), and the fallback {root} is "
                         "not a directory of yours: set CODA_DSL_CACHE to a directory you can write")
    if not _fallback_warned:
        _fallback_warned = True
        print(f"coda_dsl: warning: cannot create the kernel cache {default} ({why.strerror}); using {root} "
              "(set CODA_DSL_CACHE to choose)", file=sys.stderr)
    return root


@functools.cache
def _generator_digest() -> str:
    """paths.generator_sources(), hashed (the canonical text holds plans as data): editing one changes every key."""
    h = hashlib.sha256()
    for f in paths.generator_sources():
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _hash(parts: list[str]) -> str:
    # NUL separators: no two different part lists hash the same text.
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def specialization_key(canonical: str) -> str:
    """The key of a plan: it names the torch op and appears in the .cu. No toolchain needed."""
    return _hash([canonical, f"arch={ARCH}", f"codegen={CODEGEN_VERSION}", f"sources={_generator_digest()}"])


def build_key(key: str) -> str:
    """The cache entry of specialization `key` built by this toolchain: an upgrade of nvcc or CUTLASS builds
    anew, under the same op name; torch's does not (a kernel library includes and links nothing of torch,
    so kernels built under one torch, or exported from another machine, load under another)."""
    tc = toolchain()
    return _hash([key, f"nvcc={tc.nvcc_version}", f"cutlass={tc.cutlass_version}"])


def entry_dir(key: str) -> Path:
    return cache_dir() / key


def read_meta(key: str) -> dict | None:
    try:
        meta = json.loads((entry_dir(key) / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("key") == key else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_verified: dict[str, tuple] = {}  # path -> (inode, size, mtime) whose content hash matched in this process


def check_output(key: str, name: str = "kernel.so", verify: bool = True) -> tuple[Path | None, str | None]:
    """(path, None) for a complete output `name` of entry `key`; (None, None) when the entry has none;
    (None, what is wrong) when it has a damaged one. `verify`: also check its content hash, once per
    process (a .so damaged but kept at its size would crash the process that loads it)."""
    meta = read_meta(key)
    path = entry_dir(key) / name
    try:
        st = path.stat()
    except OSError:
        st = None
    if meta is None:
        return None, (None if st is None else "meta.json is missing or unreadable")
    size = (meta.get("files") or {}).get(name) if isinstance(meta.get("files"), dict) else None
    digest = (meta.get("sha256") or {}).get(name) if isinstance(meta.get("sha256"), dict) else None
    if size is None:
        return None, None  # not built (e.g. compile-only entries have no .so)
    if st is None:
        return None, f"{name} is missing"
    if not stat.S_ISREG(st.st_mode):
        return None, f"{name} is not a regular file"
    if st.st_size != size:
        return None, f"{name} has {st.st_size} bytes, {size} were written"
    if verify:
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if _verified.get(str(path)) != stamp:
            try:
                ok = digest is not None and _sha256(path) == digest
            except OSError as e:
                return None, f"{name} cannot be read ({e.strerror})"
            if not ok:
                return None, f"{name} does not match its recorded SHA-256"
            _verified[str(path)] = stamp
    return path, None


def valid_output(key: str, name: str = "kernel.so") -> Path | None:
    """Path of a complete output `name` of entry `key` (size checked; the hash on first use), or None."""
    return check_output(key, name, verify=False)[0]


def invalidate(key: str) -> None:
    """Mark entry `key` for rebuilding (its loaded .so failed). Caller holds the key's lock."""
    (entry_dir(key) / META).unlink(missing_ok=True)


def atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        _set_mode(Path(tmp), fd)  # mkstemp makes 0600; a shared cache must be readable (writable by a group)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _remove(path: Path) -> None:
    """Remove a file, link or directory tree, whatever it is."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def commit_entry(key: str, files: dict[str, Path], meta: dict) -> Path:
    """Move finished build outputs into the entry dir, meta.json last. The entry's other complete outputs
    stay in it (a compile-only build of an imported or linked entry keeps its kernel.so). Caller holds
    the key's lock."""
    entry = entry_dir(key)
    if entry.is_symlink() or (entry.exists() and not entry.is_dir()):
        entry.unlink()
    make_dir(entry)
    old = read_meta(key) or {}
    kept = [n for n in old.get("files") or {} if n not in files and valid_output(key, n) is not None]
    recorded = old.get("sha256") if isinstance(old.get("sha256"), dict) else {}
    sizes = {n: old["files"][n] for n in kept}  # (valid_output read them: a dict)
    digests = {n: recorded.get(n) for n in kept}  # (none: the first load's check rebuilds it)
    (entry / META).unlink(missing_ok=True)  # invalidate first: readers never pair old meta with new files
    for name, src in files.items():
        sizes[name], digests[name] = src.stat().st_size, _sha256(src)
        dst = entry / name
        if dst.is_dir() and not dst.is_symlink():  # debris: os.replace cannot overwrite a directory
            shutil.rmtree(dst)
        os.replace(src, dst)
        _set_mode(dst)
    atomic_write(entry / META, json.dumps({**meta, "key": key, "files": sizes, "sha256": digests}, indent=1))
    return entry


# ---- locks ------------------------------------------------------------------------------------------

def lock_timeout() -> float:
    text = os.environ.get("CODA_DSL_LOCK_TIMEOUT") or "1800"  # empty: unset, as for CODA_DSL_CACHE
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise CacheError(f"CODA_DSL_LOCK_TIMEOUT={text}: expected a positive number of seconds (default 1800)")
    return value


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().split()[0]
    except (OSError, IndexError):
        return "another process"
    return f"pid {pid}" if pid.isdigit() else "another process"


def _open_lock(path: Path) -> int:
    with cache_io(path):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError as denied:  # someone else's lock file: flock needs no write access
            if not path.exists():  # no lock file, and none can be made: the directory is not writable
                raise denied
            fd = os.open(path, os.O_RDONLY)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EEXIST, "not a regular file", str(path))
        _set_mode(path, fd)
        return fd


@contextlib.contextmanager
def _lock(path: Path, label: str = "", log=None):
    """Exclusive flock on `path`. Waiting on another process says so (once, through `log`) after
    WAIT_NOTICE_S and gives up after CODA_DSL_LOCK_TIMEOUT seconds."""
    timeout, start, told = lock_timeout(), time.monotonic(), False
    while True:
        fd = _open_lock(path)
        while not _try_flock(fd):
            waited = time.monotonic() - start
            if waited > timeout:
                os.close(fd)
                raise LockTimeoutError(
                    f"gave up after {waited:.0f} s waiting for the build of {label or path.stem} held by "
                    f"{_holder(path)} (lock {path}): if that process is stuck, end it; or set "
                    "CODA_DSL_LOCK_TIMEOUT (seconds) to wait longer")
            if log and not told and waited >= WAIT_NOTICE_S:
                told = True
                log(f"coda_dsl: waiting for the build of {label or path.stem} held by {_holder(path)}")
            time.sleep(0.1)
        # clear_cache may have unlinked the file while we waited: then our lock guards nothing.
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        with contextlib.suppress(OSError):  # who holds it, for the processes that wait
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


@contextlib.contextmanager
def key_locks(keys, labels: dict[str, str] | None = None, log=None):
    """Exclusive flock on <cache_dir>/<key>.lock for each key, taken in sorted order (no deadlock)."""
    with contextlib.ExitStack() as stack:
        for key in sorted(set(keys)):
            stack.enter_context(_lock(cache_dir() / f"{key}.lock", (labels or {}).get(key, ""), log))
        yield


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


# ---- listing and clearing ---------------------------------------------------------------------------

def _entry_keys() -> list[str]:
    with cache_io(cache_dir()):
        return sorted(p.name for p in cache_dir().iterdir() if KEY_RE.fullmatch(p.name) and p.is_dir())


def cache_entries(verify: bool = False) -> list[dict]:
    """Each entry's key, size, age, source and kernel.so state: has_so, and so_problem (what is wrong with a
    damaged one; verify: its content hash checked too, else only its size)."""
    out = []
    for key in _entry_keys():
        d = entry_dir(key)
        with contextlib.suppress(OSError):  # an entry removed while we look is simply not listed
            files = [p for p in d.iterdir() if p.is_file()]
            meta = read_meta(key) or {}
            src = d / "kernel.cu"
            so, problem = check_output(key, verify=verify)
            out.append({"key": key, "size": sum(p.stat().st_size for p in files),
                        "mtime": max((p.stat().st_mtime for p in files), default=d.stat().st_mtime),
                        "has_so": so is not None, "so_problem": problem,
                        "cu_path": str(src) if src.exists() else None, "op_name": meta.get("op_name")})
    return out


# ---- export and import ------------------------------------------------------------------------------

PORTABLE = ("kernel.so", "kernel.cu", META)  # what an exported entry carries (no objects, no logs)


@dataclass
class Exported:
    parts: list[Path]  # the files written
    skipped: list[str]  # "<key>: its kernel.so ..." for each entry left out for a damaged kernel.so


def export_cache(path: Path, part_bytes: int | None = None) -> Exported:
    """Pack every entry that has a complete kernel.so (its kernel.cu and meta.json with it) into
    gzip'd tar files, e.g. to fill the cache of a GPU node that has no compiler, or of the next run on
    a machine whose disk does not persist: `path`, or with part_bytes, path.part1.tar.gz, ... of at
    most about part_bytes each (an entry is never split); the parts an earlier export left under that name
    beyond these are removed, so that FILE.part*.tar.gz is this export alone. Entries being built are skipped."""
    if path.is_dir() or not path.name:  # "", ".", "/": no file name to write
        raise CacheError(f"{path} is a directory: name the file to write, e.g. "
                         f"{path.absolute() / 'kernels.tar.gz'}")
    states = {k: check_output(k) for k in _entry_keys()}
    keys = [k for k, (so, _) in states.items() if so is not None]
    skipped = [f"{k}: its {why}" for k, (so, why) in states.items() if so is None and why]
    if not keys:
        raise CacheError(f"no built kernel to export in {cache_dir()} (an entry counts once its kernel.so is "
                         "complete and matches its meta.json: not while it is being built, nor after a "
                         "compile-only build, which links none)")
    # each entry's files as recorded: a kernel.cu edited by hand in the cache stays behind (with it the
    # importer would reject the whole entry)
    packed = {k: [n for n in PORTABLE if n == META or check_output(k, n)[0] is not None] for k in keys}
    base = path.name[:-len(".tar.gz")] if path.name.endswith(".tar.gz") else path.name
    parts: list[list[str]] = [[]]
    filled = 0  # raw bytes in the last part; gzip only shrinks them, so a part stays below part_bytes
    for k in keys:
        size = sum((entry_dir(k) / n).stat().st_size for n in packed[k])
        if part_bytes and parts[-1] and filled + size > part_bytes:
            parts.append([])
            filled = 0
        parts[-1].append(k)
        filled += size
    out = [path] if len(parts) == 1 else [path.with_name(f"{base}.part{i}.tar.gz") for i in range(1, len(parts) + 1)]
    for dest in out:  # each archive replaces what is there: only ever a regular file
        if dest.is_symlink() or (dest.exists() and not dest.is_file()):
            raise CacheError(f"{dest} exists and is not a regular file (a link, device, pipe or folder): name a new "
                             "file, or remove it first")
    for dest, part in zip(out, parts):
        tmp = dest.with_name(f".{dest.name}.tmp")
        try:
            with tarfile.open(tmp, "w:gz") as tar:
                for k in part:
                    for name in packed[k]:
                        tar.add(entry_dir(k) / name, arcname=f"{k}/{name}", recursive=False)
            os.replace(tmp, dest)
        except BaseException as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)  # no half-written file left beside the ones asked for
            if isinstance(e, OSError):
                raise CacheError(f"cannot write {dest}: {e.strerror or e}") from None
            raise
    i = len(out) + 1 if len(out) > 1 else 1
    while (stale := path.with_name(f"{base}.part{i}.tar.gz")).is_file() and not stale.is_symlink():
        stale.unlink()
        i += 1
    return Exported(out, skipped)


@dataclass
class Imported:
    added: list[str] = field(default_factory=list)  # keys now in the cache
    present: list[str] = field(default_factory=list)  # keys the cache had already
    rejected: list[str] = field(default_factory=list)  # "<key or member>: why"


def import_cache(paths: list[Path]) -> Imported:
    """Add the entries of export_cache's files to this cache. Each member must be <key>/<kernel.so,
    kernel.cu or meta.json>, a regular file, and each kernel.so must match the size and SHA-256 its
    meta.json records; anything else is rejected and reported, never extracted (a <key> folder's own member,
    which plain `tar` adds, is skipped). An entry the cache
    already has complete is left as it is. The cache still looks entries up by build key, so one
    built with another nvcc or CUTLASS is stored but never loaded."""
    for path in paths:  # all of them before the first is read: a typo imports nothing
        if not Path(path).is_file():
            raise CacheError(f"cannot read {path}: {'a directory' if Path(path).is_dir() else 'no such file'}"
                             " (give the files `coda-dsl cache export` wrote)")
    result = Imported()
    for path in paths:
        try:
            _unpack(path, result)
        except CacheError:  # the cache's own files (cache_io): the message names the cache
            raise
        except (tarfile.TarError, EOFError) as e:  # the other files' entries still count
            result.rejected.append(f"{path}: not a whole gzip'd tar file of `coda-dsl cache export` ({e})")
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):  # writing its members into the cache
                raise cache_error(e, cache_dir()) from e
            result.rejected.append(f"{path}: cannot read it ({e.strerror or e})")
    return result


def _unpack(path: Path, result: Imported) -> None:
    try:
        with tarfile.open(path, "r:gz") as tar, staging("import-") as tmp:
            if not tar.getmembers():  # (export never writes one)
                result.rejected.append(f"{path}: an empty archive, with no kernel")
                return
            _commit_members(tar, tmp, result)
    except (gzip.BadGzipFile, zlib.error) as e:
        raise tarfile.ReadError(f"damaged: {e}") from None


def _commit_members(tar: tarfile.TarFile, tmp: Path, result: Imported) -> None:
    got: dict[str, dict[str, Path]] = {}
    for m in tar.getmembers():
        key, _, name = m.name.partition("/")
        if m.isdir() and KEY_RE.fullmatch(m.name.rstrip("/")):  # an entry's folder, as plain `tar` adds it
            continue
        if not (KEY_RE.fullmatch(key) and name in PORTABLE and m.isreg()):
            result.rejected.append(f"{m.name}: not <key>/{{{','.join(PORTABLE)}}} as a regular file")
            continue
        dst = tmp / key / name
        dst.parent.mkdir(exist_ok=True)
        with tar.extractfile(m) as src, open(dst, "wb") as f:
            shutil.copyfileobj(src, f)
        got.setdefault(key, {})[name] = dst
    # the rest of the stream before anything is committed: tarfile stops quietly at a damaged header, and gzip
    # checks its CRC only at the end
    while tar.fileobj.read(1 << 20):
        pass
    for key, files in sorted(got.items()):
        outcome = _import_entry(key, files)
        if outcome == "added":
            result.added.append(key)
        elif outcome == "present":
            if key not in result.added + result.present:  # once, if two files of this import hold it
                result.present.append(key)
        else:
            result.rejected.append(f"{key}: {outcome}")


def _import_entry(key: str, files: dict[str, Path]) -> str:
    """'added', 'present', or why the entry was rejected."""
    try:
        meta = json.loads(files.pop(META).read_text()) if META in files else None
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or meta.get("key") != key:
        return "no meta.json of this key"
    if "kernel.so" not in files:
        return "no kernel.so"
    sizes, digests = meta.get("files") or {}, meta.get("sha256") or {}
    if not isinstance(sizes, dict) or not isinstance(digests, dict):
        return "its meta.json's files and sha256 are not tables of file names"
    for name, f in files.items():
        if sizes.get(name) != f.stat().st_size or digests.get(name) != _sha256(f):
            return f"{name} does not match the size and SHA-256 its meta.json records"
    with key_locks([key]), cache_io(entry_dir(key)):
        if check_output(key)[0] is not None:
            return "present"
        commit_entry(key, files, {k: v for k, v in meta.items() if k not in ("key", "files", "sha256")})
    return "added"


@dataclass
class Cleared:
    removed: int = 0
    busy: list[str] = field(default_factory=list)  # "<key> (pid N)": entries being built now, kept


def clear_cache() -> Cleared:
    """Remove every entry not being built right now, the debris of crashed builds (staging folders whose
    builder is gone, a lock or .staging of the wrong type) and failed builds. Never waits."""
    root = cache_dir()
    result = Cleared()
    with cache_io(root):
        entries = set(_entry_keys())
        locks = {p.name[:-5] for p in root.glob("*.lock") if KEY_RE.fullmatch(p.name[:-5])}
        for key in sorted(entries | locks):
            lock = root / f"{key}.lock"
            if lock.exists() and not lock.is_file():  # debris no process can hold
                _remove(lock)
            fd = _open_lock(lock)
            try:
                if not _try_flock(fd):  # a build holds it: its entry is kept, and said so
                    result.busy.append(f"{key} ({_holder(lock)})")
                    continue
                _remove(root / key)
                lock.unlink(missing_ok=True)
                result.removed += key in entries
            finally:
                os.close(fd)
        failed = root / "failed"
        if failed.is_dir() and not failed.is_symlink():  # its <key> folders only: nothing else of the user's
            for d in failed.iterdir():
                if KEY_RE.fullmatch(d.name):
                    _remove(d)
            with contextlib.suppress(OSError):
                failed.rmdir()
        else:  # debris of the wrong type
            _remove(failed)
        staging = root / ".staging"
        if staging.is_symlink() or (staging.exists() and not staging.is_dir()):  # debris: never what a link names
            _remove(staging)
        elif staging.is_dir():
            for d in staging.iterdir():
                if not staging_in_use(d):
                    _remove(d)
    return result


@contextlib.contextmanager
def staging(prefix: str = "tmp"):
    """A fresh folder under <cache>/.staging for work that ends in commit_entry (a build, an import), held
    by a flock while it lives so that `cache clear` removes only the folders of processes that died
    (staging_in_use); removed at the end."""
    with cache_io():
        d = Path(tempfile.mkdtemp(dir=make_dir(cache_dir() / ".staging"), prefix=prefix))
    held = os.open(d, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
        os.close(held)


def staging_in_use(d: Path) -> bool:
    """A live build holds a flock on its staging folder (see builder._build); a crashed one does not."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return False
    try:
        return not _try_flock(fd)
    finally:
        os.close(fd)
