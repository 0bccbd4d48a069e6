"""The kernel cache under damage, I/O errors, sharing, crashes and waits (issue 10, items 3-6 and 8).

Builds are faked (test_build's `fake` fixture) except the orphan test, which runs the real ninja on a
fake nvcc that only sleeps.
"""
import contextlib
import errno
import fcntl
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import coda_dsl.build as b
from coda_dsl import cli
from coda_dsl.build import builder, cache, tools as tcmod
from build_helpers import FAKE_TC, bk, quiet, unit

REPO = Path(__file__).resolve().parent.parent


# ---- 3. entries are verified, not trusted by size ---------------------------------------------------

def test_same_size_damage_is_rebuilt_before_loading(fake, loads, capsys):
    u = unit()
    [so] = b.build_units([u], log=quiet)
    good = so.read_bytes()
    so.write_bytes(b"\x01" * len(good))  # damaged, same size: loading it could kill the process
    assert b.load_library(u) == so
    assert len(fake.calls()) == 2 and loads == [good]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"coda_dsl: warning: cache entry {so.parent} is damaged (kernel.so does not match " \
                       "its recorded SHA-256): rebuilding it"


def test_hash_checked_once_per_process(fake, loads, monkeypatch):
    u = unit()
    b.build_units([u], log=quiet)
    hashed = []
    real = cache._sha256
    monkeypatch.setattr(cache, "_sha256", lambda p: hashed.append(p) or real(p))
    b.build_units([u], log=quiet)
    b.build_units([u], log=quiet)
    b.load_library(u)
    assert len(hashed) == 1 and len(fake.calls()) == 1


def test_load_failure_rebuilds_once(fake, loads, monkeypatch):
    u = unit()
    b.build_units([u], log=quiet)
    seen = []

    def flaky(path):
        seen.append(path)
        if len(seen) == 1:
            raise OSError(f"{path}: undefined symbol: _ZN3c10")
    monkeypatch.setattr(builder, "_dlopen", flaky)
    lines = []
    so = b.load_library(u, log=lines.append)
    assert len(seen) == 2 and len(fake.calls()) == 2 and b.load_library(u) == so
    assert lines[0].startswith(f"coda_dsl: warning: cannot load {so} (") and lines[0].endswith("rebuilding it")


def test_unloadable_library_is_a_clear_error(fake, monkeypatch):
    """The fake build writes a zeroed kernel.so: the real loader refuses it, before and after rebuilding."""
    monkeypatch.setattr(builder, "_loaded", {})
    u = unit()
    with pytest.raises(b.KernelLoadError, match=r"cannot load the kernel library .*kernel.so, even rebuilt"):
        b.load_library(u, log=quiet)
    assert len(fake.calls()) == 2


# ---- 4. cache I/O errors are clear ------------------------------------------------------------------

def test_cache_env_is_a_file_or_under_one(tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("")
    monkeypatch.setenv("CODA_DSL_CACHE", str(f))
    with pytest.raises(b.CacheError, match=f"CODA_DSL_CACHE={f}: kernel cache: {f}: exists and is not a directory: "
                       "remove it, or set CODA_DSL_CACHE to a directory$"):  # not `cache clear`: it needs the cache
        b.cache_dir()
    monkeypatch.setenv("CODA_DSL_CACHE", str(f / "sub" / "cache"))
    with pytest.raises(b.CacheError, match="a part of this path is a regular file.*set CODA_DSL_CACHE"):
        b.cache_dir()


def test_default_cache_unusable_falls_back_per_user(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "xdg"
    blocker.write_text("")  # ~/.cache a file, as in some containers
    monkeypatch.delenv("CODA_DSL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(cache, "_fallback_warned", False)
    root = b.cache_dir()
    assert root == tmp_path / "tmp" / f"coda_dsl-{os.geteuid()}" and root.is_dir()
    assert root.stat().st_mode & 0o777 == 0o700
    assert b.cache_dir() == root
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"coda_dsl: warning: cannot create the kernel cache {blocker}/coda_dsl")


def test_lock_of_wrong_type(fake):
    u = unit()
    lock = b.cache_dir() / f"{bk(u)}.lock"
    lock.mkdir()
    with pytest.raises(b.CacheError, match=f"{lock}: exists and is not a directory|{lock}.*cache clear"):
        b.build_units([u], log=quiet)
    b.clear_cache()
    assert b.build_units([u], log=quiet)[0].is_file()


def test_staging_of_wrong_type(fake):
    staging = b.cache_dir() / ".staging"
    staging.write_text("")
    with pytest.raises(b.CacheError, match=rf"{staging}: exists and is not a directory: remove it \(`coda-dsl cache clear`"):
        b.build_units([unit()], log=quiet)
    b.clear_cache()
    assert b.build_units([unit()], log=quiet)[0].is_file()


def test_so_that_is_a_directory_is_rebuilt(fake):
    u = unit()
    [so] = b.build_units([u], log=quiet)
    so.unlink()
    (so / "x").mkdir(parents=True)
    assert b.build_units([u], log=quiet) == [so] and so.is_file() and cache.valid_output(bk(u)) == so


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "no space left on the device"), (errno.EROFS, "read-only file system"),
                                         (errno.EACCES, "permission denied")])
def test_unwritable_cache_is_a_clear_error(fake, monkeypatch, code, words):
    """A full, read-only or forbidden cache (simulated: root may write anywhere here)."""
    def refuse(dir=None, **kw):
        raise OSError(code, os.strerror(code), str(dir))
    monkeypatch.setattr(cache.tempfile, "mkdtemp", refuse)  # the staging folder (cache.staging)
    with pytest.raises(b.CacheError, match=f"kernel cache: .*\\.staging: {words}.*CODA_DSL_CACHE"):
        b.build_units([unit()], log=quiet)


# ---- 5. shared caches -------------------------------------------------------------------------------

def _mode(p):
    return p.stat().st_mode & 0o7777


def test_group_shared_cache_is_group_writable(fake):
    root = b.cache_dir()
    os.chmod(root, 0o2775)
    u = unit()
    [so] = b.build_units([u], log=quiet)
    assert _mode(root / f"{bk(u)}.lock") == 0o664
    assert _mode(so.parent) == 0o2775 and _mode(root / ".staging") == 0o2775
    assert all(_mode(p) & 0o664 == 0o664 for p in so.parent.iterdir())


def test_private_cache_is_not_group_writable(fake):
    root = b.cache_dir()
    os.chmod(root, 0o755)
    u = unit()
    [so] = b.build_units([u], log=quiet)
    assert _mode(root / f"{bk(u)}.lock") == 0o644 and _mode(so.parent) == 0o755
    assert all(_mode(p) & 0o022 == 0 for p in so.parent.iterdir())


def _as_other_user(uid, gid, fn):
    """Run fn() in a forked child as uid/gid; return its exception text, or None."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        msg = b""
        try:
            os.setgroups([gid])
            os.setgid(gid)
            os.setuid(uid)
            fn()
        except BaseException as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}".encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out or None


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root")
def test_second_user_rebuilds_in_group_cache(monkeypatch):
    """User A builds a key in a setgid group cache; user B (same group) rebuilds it after damage."""
    gid, uid = 4242, 4243
    shared = Path(tempfile.mkdtemp(prefix="coda_shared_"))  # under /tmp: traversable by another user
    try:
        os.chown(shared, 0, gid)
        os.chmod(shared, 0o2775)
        monkeypatch.setenv("CODA_DSL_CACHE", str(shared))
        for mod in (cache, builder):
            monkeypatch.setattr(mod, "toolchain", lambda: FAKE_TC)

        def run(staging, targets, jobs, verbose, log):
            for t in targets:
                (staging / t).write_bytes(os.urandom(64))
            return 0, ""
        monkeypatch.setattr(builder, "_run_ninja", run)
        u = unit()
        [so] = b.build_units([u], log=quiet)
        (so.parent / "meta.json").unlink()  # damaged: the next user must rebuild it
        err = _as_other_user(uid, gid, lambda: b.build_units([u], log=quiet))
        assert err is None
        assert so.stat().st_uid == uid and cache.valid_output(bk(u)) == so
    finally:
        subprocess.run(["rm", "-rf", str(shared)])


# ---- 6. no orphans, no silent waits -----------------------------------------------------------------

ORPHAN_CHILD = """
import sys
sys.path[:0] = {paths!r}
import coda_dsl.build as b
from coda_dsl.build import builder, cache
from build_helpers import FAKE_TC
import dataclasses
tc = dataclasses.replace(FAKE_TC, nvcc={nvcc!r})
cache.toolchain = builder.toolchain = lambda: tc
b.build_units([b.BuildUnit(b.specialization_key("orphan"), "// x\\n")], compile_only=True, jobs=1)
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_build_leaves_no_compiler_and_no_staging(tmp_path, monkeypatch):
    pidfile = tmp_path / "nvcc.pid"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 60\n")
    nvcc.chmod(0o755)
    env = {**os.environ, "CODA_DSL_CACHE": str(tmp_path / "cache")}
    code = ORPHAN_CHILD.format(paths=[str(REPO), str(REPO / "tests")], nvcc=str(nvcc))
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert p.poll() is None and time.monotonic() < deadline, "the fake nvcc never started"
        time.sleep(0.1)
    compiler = int(pidfile.read_text())
    p.send_signal(signal.SIGKILL)
    p.wait()
    try:
        deadline = time.monotonic() + 10
        while _alive(compiler) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(compiler), "the compiler outlived the build that started it"
    finally:
        with contextlib.suppress(OSError):
            os.kill(compiler, signal.SIGKILL)
    staging = tmp_path / "cache" / ".staging"
    assert len(list(staging.iterdir())) == 1  # the killed build's folder, young but dead
    monkeypatch.setenv("CODA_DSL_CACHE", str(tmp_path / "cache"))
    b.clear_cache()
    assert list(staging.iterdir()) == []


def _hold(path: Path, pid: int = 4242) -> int:
    """Hold the flock of `path` as another builder would (pid written in it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{pid}\n".encode())
    return fd


def _in_thread(fn, timeout):
    box = {}

    def go():
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001
            box["error"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    return t, box


def test_waiting_is_announced_and_times_out(fake, monkeypatch):
    u = unit()
    monkeypatch.setattr(cache, "WAIT_NOTICE_S", 0.2)
    monkeypatch.setenv("CODA_DSL_LOCK_TIMEOUT", "1")
    fd = _hold(b.cache_dir() / f"{bk(u)}.lock")
    lines = []
    try:
        t, box = _in_thread(lambda: b.build_units([u], log=lines.append), 20)
        assert not t.is_alive(), "still waiting after 20 s despite CODA_DSL_LOCK_TIMEOUT=1"
    finally:
        os.close(fd)
    assert lines == ["coda_dsl: waiting for the build of ep_a held by pid 4242"]
    assert isinstance(box.get("error"), b.LockTimeoutError)
    assert "held by pid 4242" in str(box["error"]) and "CODA_DSL_LOCK_TIMEOUT" in str(box["error"])
    assert fake.calls() == []


def test_empty_cxx_is_unset(monkeypatch):
    """CXX= (set, empty) links with c++, as make does; it was an IndexError in `coda-dsl doctor`."""
    monkeypatch.setenv("CXX", "")
    assert tcmod.linker() == ["c++"]
    monkeypatch.setenv("CXX", "ccache g++")
    assert tcmod.linker() == ["ccache", "g++"]


def test_bad_lock_timeout(fake, monkeypatch):
    monkeypatch.setenv("CODA_DSL_LOCK_TIMEOUT", "soon")
    with pytest.raises(b.CacheError, match="CODA_DSL_LOCK_TIMEOUT=soon: expected a positive number"):
        b.build_units([unit()], log=quiet)
    monkeypatch.setenv("CODA_DSL_LOCK_TIMEOUT", "")  # empty is unset, as for CODA_DSL_CACHE
    assert cache.lock_timeout() == 1800


def test_clear_during_a_build_keeps_it_and_says_so(fake, capsys):
    us = [unit("a"), unit("b")]
    b.build_units(us, log=quiet)
    fd = _hold(b.cache_dir() / f"{bk(us[0])}.lock")
    try:
        t, box = _in_thread(b.clear_cache, 10)
        assert not t.is_alive(), "cache clear waited for a build"
    finally:
        os.close(fd)
    assert box["value"] == cache.Cleared(removed=1, busy=[f"{bk(us[0])} (pid 4242)"])
    assert cache.valid_output(bk(us[0])) and not cache.valid_output(bk(us[1]))
    fd = _hold(b.cache_dir() / f"{bk(us[0])}.lock")
    try:
        assert cli.main(["cache", "clear"]) == 0
    finally:
        os.close(fd)
    out = capsys.readouterr().out
    assert f"kept {bk(us[0])} (pid 4242): it is being built now" in out


def _cli_child_build(key, cu_text):
    b.build_units([b.BuildUnit(key, cu_text)], log=quiet)


def test_cli_build_that_only_waited_does_not_say_built(fake, capsys):
    fake.delay = 1.5
    spec = cli.specialization_from_options(cli.load_epilogue("coda_dsl.examples:bias_gelu"))
    ctx = multiprocessing.get_context("fork")
    other = ctx.Process(target=_cli_child_build, args=(spec.key, spec.cu_text))
    other.start()
    deadline = time.monotonic() + 30
    while not fake.calls():  # the other process holds the lock and builds
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert cli.main(["build", "coda_dsl.examples:bias_gelu"]) == 0
    other.join()
    out = capsys.readouterr().out
    assert "built:" not in out and "already in the cache:" in out and len(fake.calls()) == 1
    fake.delay = 0
    (b.cache_dir() / bk(spec.unit) / "meta.json").unlink()
    assert cli.main(["build", "coda_dsl.examples:bias_gelu"]) == 0
    assert "built:" in capsys.readouterr().out


# ---- 8. emit and explain need no CUDA toolkit -------------------------------------------------------

def test_emit_and_explain_without_toolkit(tmp_path):
    empty = tmp_path / "no_cuda"
    (empty / "bin").mkdir(parents=True)
    env = {**os.environ, "CUDA_HOME": str(empty), "PATH": str(empty / "bin"),
           "CODA_DSL_CUTLASS_DIR": str(tmp_path / "no_cutlass"), "CODA_DSL_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(REPO)}
    env.pop("CUDA_PATH", None)
    for cmd in ("emit", "explain"):
        r = subprocess.run([sys.executable, "-m", "coda_dsl", cmd, "coda_dsl.examples:residual_rms"],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert ("extern \"C\" int coda_launch" in r.stdout) if cmd == "emit" else \
            f"build key: unknown, no toolchain here (CUDA_HOME={empty}, but" in r.stdout


def test_same_plan_other_toolchain_same_op_other_entry(monkeypatch):
    import dataclasses
    ep = cli.load_epilogue("coda_dsl.examples:bias_gelu")
    seen = []
    for tc in (FAKE_TC, dataclasses.replace(FAKE_TC, nvcc_version="13.1.0")):
        monkeypatch.setattr(cache, "toolchain", lambda tc=tc: tc)
        spec = cli.specialization_from_options(ep)
        seen.append((spec.op_name, spec.cu_text, b.build_key(spec.key)))
    assert seen[0][:2] == seen[1][:2] and seen[0][2] != seen[1][2]
    other = cli.specialization_from_options(ep, ab_dtype="fp16")
    assert other.op_name != seen[0][0] and b.build_key(other.key) != seen[1][2]


def test_cuda_home_that_has_no_nvcc_is_an_error(monkeypatch):
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    with pytest.raises(b.ToolchainError, match="CUDA_HOME=/nonexistent, but /nonexistent/bin/nvcc is not an "
                                               "executable: point CUDA_HOME at a CUDA toolkit"):
        tcmod.find_nvcc()


def _fake_nvcc(tmp_path, script: str) -> str:
    """An executable nvcc that runs `script` (sh)."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\n" + script)
    nvcc.chmod(0o755)
    return str(nvcc)


def test_broken_nvcc_shows_its_own_error(tmp_path):
    nvcc = _fake_nvcc(tmp_path, "echo 'nvcc: error while loading shared libraries: libnvvm.so.4' >&2\nexit 127\n")
    with pytest.raises(b.ToolchainError, match=r"failed \(exit code 127\): nvcc: error while loading shared "
                                               r"libraries: libnvvm.so.4"):
        tcmod.nvcc_version(nvcc)


def test_nvcc_older_than_the_library_api_is_refused(tmp_path):
    """Kernel libraries load their GEMM with CUDA 12.8's runtime library API: an older nvcc cannot build them."""
    nvcc = _fake_nvcc(tmp_path, "echo 'Cuda compilation tools, release 12.6, V12.6.85'\n")
    with pytest.raises(b.ToolchainError, match=r"is CUDA 12\.6\.85; coda_dsl needs 12\.8 or later .*\n  fix: install "
                                               r"the CUDA toolkit 12\.8\+"):
        tcmod.nvcc_version(nvcc)
    nvcc = _fake_nvcc(tmp_path, "echo 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    assert tcmod.nvcc_version(nvcc) == "12.8.93"
    assert [tcmod.older_than_min_cuda(v) for v in ("11.8", "12.6", "12.8", "12.10", "13.0")] == \
        [True, True, False, False, False]


def test_a_lock_in_a_directory_nobody_may_write_says_permission_denied(cache_root, monkeypatch):
    """No lock file, and none can be made (a cache directory the user cannot write): the message says
    permission denied with the fix, not the read-only fallback's 'No such file or directory'."""
    from coda_dsl.build import cache
    real_open = os.open

    def denied(path, flags, *mode):
        if flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *mode)
    monkeypatch.setattr(cache.os, "open", denied)
    lock = cache_root / "0123456789abcdef01234567.lock"
    cache_root.mkdir(parents=True, exist_ok=True)
    with pytest.raises(cache.CacheError, match="permission denied(.|\\n)*make it writable"):
        cache._open_lock(lock)


def test_a_key_is_24_hex_digits_and_nothing_after():
    """An archive member or directory named by a key and a trailing newline is no key ('$' matched before
    it: such an entry was imported, and broke `cache list` across two lines)."""
    from coda_dsl.build import cache
    assert cache.KEY_RE.fullmatch("0123456789abcdef01234567")
    assert not cache.KEY_RE.fullmatch("0123456789abcdef01234567\n")
