"""Parallel ninja builds of kernel translation units into the cache, and loading them into torch."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import CodaError
from .cache import (build_key, cache_dir, cache_io, check_output, commit_entry, entry_dir, invalidate, key_locks,
                    make_dir)
from .cache import staging as staging_folder
from .tools import Toolchain, compile_command, link_command, ninja_binary, toolchain


@dataclass
class BuildUnit:
    key: str     # specialization key (cache.specialization_key); the entry is under its build_key()
    cu_text: str  # the full .cu
    op_name: str = ""  # the kernel's name in its messages (coda_dsl::<op_name>); informational here
    epilogue: str = ""  # what the unit computes, for messages (waiting on another process's build)


class KernelLoadError(CodaError, RuntimeError):
    """A built kernel library cannot be loaded, even after rebuilding it."""


class BuildError(CodaError):
    """A kernel failed to build. Its kernel.cu and log are kept under cache_dir()/failed/<key>/."""

    def __init__(self, cu_path, log_path, first_error, action="nvcc failed to compile"):
        self.cu_path, self.log_path, self.first_error, self.action = \
            str(cu_path), str(log_path), first_error, action
        super().__init__(f"{action} {cu_path}\n  first error: {first_error}\n  full log: {log_path}")

    def __reduce__(self):  # picklable across processes despite the custom __init__
        return type(self), (self.cu_path, self.log_path, self.first_error, self.action)


DEVICE_PASS = "-fatbin -DCODA_DEVICE_PASS"  # nvcc options of the device pass (templates/kernel.cu.j2)
STEP_LOGS = ("host.log", "device.log", "embed.log", "link.log")  # a unit's steps, in build order


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _default_jobs(n_units: int) -> int:
    # Two nvcc passes per kernel; one nvcc of a CUTLASS Hopper kernel peaked at ~3.7 GB (cicc, measured
    # before the split): more parallel jobs than RAM/4 GB would swap or OOM.
    ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**30
    return max(1, min(2 * n_units, _cpus(), max(1, ram_gb // 4)))


def _ninja_file(tc: Toolchain, keys: list[str], compile_only: bool) -> str:
    """Per kernel, two nvcc passes over its kernel.cu that run in parallel (bench/results/build_phases.md):
    the device pass compiles the GEMM kernel alone into kernel.fatbin (no host compile), the host pass
    the launcher into kernel.o (the GEMM kernel not instantiated); the link embeds the fatbinary."""
    def cmd(args: list[str]) -> str:  # shell-quoted, with ninja's `$` escaped
        return " ".join(shlex.quote(a) for a in args).replace("$", "$$")

    cc = cmd(compile_command(tc))
    ld, ld_flags = link_command(tc)

    # Each command echoes itself into its log (so it can be rerun by hand) and writes $out.tmp then
    # renames it, so an output that exists is a complete one. The steps log apart (the passes run at
    # once); _merge_logs joins the logs into build.log in the order the steps run.
    def rule(name: str, command: str, description: str) -> list[str]:
        echo = f"echo {shlex.quote(f'$$ {command} -o $out')} > $log"
        return [f"rule {name}", f"  command = {echo} && {command} -o $out.tmp >> $log 2>&1 && mv -f $out.tmp $out",
                f"  description = {description}"]

    lines = ["ninja_required_version = 1.3",
             *rule("cc", f"{cc} -c $in", "nvcc (host pass) $in"),
             *rule("dev", f"{cc} {DEVICE_PASS} $in", "nvcc (device pass) $in"),
             *rule("embed", f"{cmd(ld)} -c $in", "embed $in"),
             *rule("ld", f"{cmd(ld)} -shared $in {cmd(ld_flags)}", "link $out")]
    for k in keys:
        lines += [f"build {k}/kernel.o: cc {k}/kernel.cu", f"  log = {k}/{STEP_LOGS[0]}",
                  f"build {k}/kernel.fatbin: dev {k}/kernel.cu", f"  log = {k}/{STEP_LOGS[1]}"]
        if not compile_only:
            lines += [f"build {k}/fatbin.o: embed {k}/fatbin.S | {k}/kernel.fatbin", f"  log = {k}/{STEP_LOGS[2]}",
                      f"build {k}/kernel.so: ld {k}/kernel.o {k}/fatbin.o", f"  log = {k}/{STEP_LOGS[3]}"]
    return "\n".join(lines) + "\n"


def _fatbin_asm(k: str) -> str:
    """fatbin.S of kernel k: its fatbinary as the hidden symbol coda_fatbin (csrc/coda_dsl/evt.h); the
    path is relative to ninja's folder, where the assembler runs. `%progbits`, not `@progbits`: on
    aarch64 (Grace Hopper) `@` starts a comment."""
    return (".section .rodata\n.balign 16\n.globl coda_fatbin\n.hidden coda_fatbin\ncoda_fatbin:\n"
            f'.incbin "{k}/kernel.fatbin"\n.section .note.GNU-stack,"",%progbits\n')


def _output(compile_only: bool) -> str:
    """The file a build of a kernel hands back, and its cache entry is complete with: the library, or the
    host pass's object (a compile check)."""
    return "kernel.o" if compile_only else "kernel.so"


def _targets(k: str, compile_only: bool) -> list[str]:
    """What ninja builds for kernel k: its library, or both passes' outputs (a compile check)."""
    return [f"{k}/{_output(compile_only)}", *([f"{k}/kernel.fatbin"] if compile_only else [])]


def _merge_logs(udir: Path) -> None:
    """The steps' logs joined into build.log (the one log a unit keeps), in the order the steps run."""
    texts = []
    for name in STEP_LOGS:
        with contextlib.suppress(OSError):
            texts.append((udir / name).read_text(errors="replace"))
    (udir / "build.log").write_text("".join(texts))


# Runs ninja in a session of its own, under this watchdog: when the building process dies (even by
# kill -9) or asks it to stop (SIGTERM), it stops ninja with SIGTERM, which ninja passes on to the process
# group of every command it runs (nvcc and its cudafe++, cicc, ptxas), then kills what is left.
_WATCHDOG = """
import os, signal, subprocess, sys, time
parent, stop = int(sys.argv[1]), []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
p = subprocess.Popen(sys.argv[2:])
while p.poll() is None:
    if stop or os.getppid() != parent:
        p.terminate()
        try:
            p.wait(10)
        finally:
            os.killpg(0, signal.SIGKILL)
    time.sleep(0.2)
sys.exit(p.returncode)
"""
_watchdogs: set[int] = set()  # builds in progress, stopped if the interpreter exits


@atexit.register
def _stop_builds() -> None:
    for pid in list(_watchdogs):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


PROGRESS_EVERY = 60.0  # seconds between the progress lines of a long build (one kernel takes ≈30 s)
_STATUS = re.compile(r"\[(\d+)/(\d+)\] ")  # ninja's status prefix, NINJA_STATUS="[%f/%t] " (finished/total)


class _Progress:
    """Feeds on ninja's status lines; every PROGRESS_EVERY seconds logs how much of the build is done, so
    that a build of many kernels (minutes to an hour) is not silent between its first and last line."""

    def __init__(self, log, clock=time.monotonic):
        self.log, self.clock = log, clock
        self.t0 = clock()
        self.due = self.t0 + PROGRESS_EVERY

    def __call__(self, line: str) -> None:
        m = _STATUS.match(line)
        now = self.clock()
        if m and now >= self.due:
            done, total = map(int, m.groups())
            self.log(f"coda_dsl: build {100 * done // max(total, 1)}% done ({done} of {total} steps) "
                     f"after {now - self.t0:.0f} s")
            self.due = now + PROGRESS_EVERY


def _run_ninja(staging: Path, targets: list[str], jobs: int, verbose: bool, log) -> tuple[int, str]:
    """Run ninja on staging/build.ninja (-k 0: a failing unit does not stop the others), streaming its
    status lines when verbose, else a progress line now and then. Returns (exit code, combined output).
    Tests replace this to avoid nvcc."""
    args = [ninja_binary(), "-C", str(staging), "-j", str(jobs), "-k", "0", *targets]
    out = []
    progress = _Progress(log)
    p = subprocess.Popen([sys.executable, "-S", "-c", _WATCHDOG, str(os.getpid()), *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
                         env={**os.environ, "NINJA_STATUS": "[%f/%t] "})
    _watchdogs.add(p.pid)
    try:
        for line in p.stdout:
            out.append(line)
            if verbose:
                log(line.rstrip("\n"))
            else:
                progress(line)
        p.wait()
    finally:
        if p.returncode is None:  # interrupted (KeyboardInterrupt, an error): stop the compilers with us
            p.terminate()
            p.wait()
        _watchdogs.discard(p.pid)
        p.stdout.close()
    return p.returncode, "".join(out)


# causes named outright, before the first line that says "error" (a full disk fails the link with
# "collect2: error: ld returned 1" after ld's "No space left on device"; a missing $CXX, "sh: 1: c++: not
# found", before ninja's "build stopped")
_CAUSES = ("no space left on device", ": not found", "permission denied")


def _first_error(*texts: str) -> str:
    lines = [ln.strip() for t in texts for ln in t.splitlines() if not ln.startswith("$ ")]  # no echoed commands
    for cause in _CAUSES:
        for line in lines:
            if cause in line.lower() and "warning" not in line.lower():
                return line
    for line in lines:
        if "error" in line.lower():
            return line
    tails = [ln for ln in lines if ln]
    return tails[-1] if tails else "(no compiler output)"


def _fail(bkey: str, udir: Path, ninja_out: str, compile_only: bool) -> BuildError:
    """Keep the failing kernel.cu and log under failed/<build key>/ (paths in the log rewritten to point there)."""
    dest = cache_dir() / "failed" / bkey
    shutil.rmtree(dest, ignore_errors=True)
    make_dir(make_dir(cache_dir() / "failed") / bkey)
    src = dest / "kernel.cu"
    shutil.copyfile(udir / "kernel.cu", src)
    try:
        text = (udir / "build.log").read_text(errors="replace")
    except OSError:
        text = ""
    text = text.replace(f"{bkey}/kernel.cu", str(src))
    if not text.strip():  # the tool never ran (ninja itself failed): its output is the log
        text = ninja_out
    (dest / "build.log").write_text(text)
    linked = (udir / "kernel.o").exists() and (udir / "kernel.fatbin").exists() and not compile_only
    return BuildError(src, dest / "build.log", _first_error(text, ninja_out),
                      action="c++ failed to link" if linked else "nvcc failed to compile")


def _build(units: list[BuildUnit], bkeys: dict[str, str], tc: Toolchain, compile_only: bool, jobs: int | None,
           verbose: bool, log) -> None:
    """Build `units` (each in the folder of its build key, bkeys[unit.key]) in one staging folder, which
    this process holds a flock on while it lives, so that `cache clear` removes only the folders of
    builds that died."""
    with staging_folder() as staging:
        keys = [bkeys[u.key] for u in units]
        with cache_io():
            for u, k in zip(units, keys):
                (staging / k).mkdir()
                (staging / k / "kernel.cu").write_text(u.cu_text)
                if not compile_only:
                    (staging / k / "fatbin.S").write_text(_fatbin_asm(k))
            (staging / "build.ninja").write_text(_ninja_file(tc, keys, compile_only))
        jobs = jobs or _default_jobs(len(units))
        n = len(units)
        what = f"{n} kernel specialization{'s' if n > 1 else ''}"
        # ≈30 s: a kernel's two passes at once took 28-33 s on 16 cores, 27.5 s on 2 (bench/results/build_phases.md)
        log(f"coda_dsl: {'compile-checking' if compile_only else 'building'} {what} with nvcc "
            f"(≈30 s each on {_cpus()} cores, -j {jobs}) ...")
        t0 = time.monotonic()
        targets = [t for k in keys for t in _targets(k, compile_only)]
        _, ninja_out = _run_ninja(staging, targets, jobs, verbose, log)
        for k in keys:
            _merge_logs(staging / k)
        if verbose:  # compiler output goes to the per-unit logs, which start with the exact commands
            for k in keys:
                with contextlib.suppress(OSError):
                    log(f"--- {k}/build.log ---\n{(staging / k / 'build.log').read_text(errors='replace')}")
        failed = []
        with cache_io():
            for u, k in zip(units, keys):
                udir = staging / k
                if not all((staging / t).exists() for t in _targets(k, compile_only)):
                    failed.append(_fail(k, udir, ninja_out, compile_only))
                    continue
                names = dict.fromkeys(["kernel.cu", "build.log", "kernel.o", _output(compile_only)])
                commit_entry(k, {f: udir / f for f in names if (udir / f).exists()},
                             {"op_name": u.op_name, "specialization_key": u.key, "pid": os.getpid(),
                              "created": time.time(), "build_seconds": round(time.monotonic() - t0, 1),
                              "toolchain": {"nvcc": tc.nvcc_version, "cutlass": tc.cutlass_version}})
        dt = time.monotonic() - t0
        log(f"coda_dsl: done in {dt:.1f} s: {n - len(failed)} built, {len(failed)} failed"
            if failed else f"coda_dsl: built {what} in {dt:.1f} s")
        for e in failed[1:]:
            log(f"coda_dsl: also failed: {e.cu_path} (log: {e.log_path})")
        if failed:
            raise failed[0]


def build_units(units: list[BuildUnit], *, compile_only: bool = False, jobs: int | None = None,
                verbose: bool = False, log=print) -> list[Path]:
    """Build every unit whose cache entry is missing or damaged, in one parallel ninja run; return each
    unit's .so (or .o with compile_only). Per-key file locks make concurrent callers wait, not rebuild."""
    tc = toolchain()
    out_name = _output(compile_only)
    bkeys = {u.key: build_key(u.key) for u in units}
    unique = list({u.key: u for u in units}.values())
    paths = [entry_dir(bkeys[u.key]) / out_name for u in units]
    # complete entries need no lock (as load_library: a read-only cache still serves them); the others are
    # checked again under their locks (another process may have built them meanwhile)
    missing = [u for u in unique if check_output(bkeys[u.key], out_name)[0] is None]
    if not missing:
        return paths
    with key_locks([bkeys[u.key] for u in missing], {bkeys[u.key]: u.epilogue or u.op_name for u in missing}, log):
        todo = []
        for u in missing:
            path, problem = check_output(bkeys[u.key], out_name)
            if path is None:
                if problem:
                    log(f"coda_dsl: warning: cache entry {entry_dir(bkeys[u.key])} is damaged ({problem}): "
                        "rebuilding it")
                todo.append(u)
        if todo:
            _build(todo, bkeys, tc, compile_only, jobs, verbose, log)
    return paths


_loaded: dict[str, Path] = {}
_handles: dict[str, ctypes.CDLL] = {}
_load_lock = threading.Lock()


def _dlopen(path: Path) -> ctypes.CDLL:
    """Open a kernel library (its symbols stay local to it). A PyDLL: calls into it hold the GIL, as a
    launch is short, and the caller's message buffer is then never shared between threads."""
    return ctypes.PyDLL(str(path))


def load_library(unit: BuildUnit, log=print) -> Path:
    """Memory -> disk cache (its content hash checked once per process) -> build; then open the .so
    once per process (library() hands it out). A .so that fails to load is rebuilt once."""
    so = _loaded.get(unit.key)
    if so is not None:
        return so
    bkey = build_key(unit.key)
    so = check_output(bkey)[0] or build_units([unit], log=log)[0]
    with _load_lock:
        if unit.key not in _loaded:
            try:
                handle = _dlopen(so)
            except OSError as e:
                log(f"coda_dsl: warning: cannot load {so} ({e}): rebuilding it")
                with key_locks([bkey]):
                    invalidate(bkey)
                so = build_units([unit], log=log)[0]
                try:
                    handle = _dlopen(so)
                except OSError as e2:
                    raise KernelLoadError(f"cannot load the kernel library {so}, even rebuilt: {e2}\n"
                                          "  fix: run `coda-dsl doctor` (a CUDA install that differs "
                                          "from the one it was built with?)") from None
            _handles[unit.key] = handle
            _loaded[unit.key] = so
    return _loaded[unit.key]


def library(unit: BuildUnit, log=print) -> ctypes.CDLL:
    """The opened kernel library of `unit` (load_library() first: built or found, opened once)."""
    load_library(unit, log)
    return _handles[unit.key]
