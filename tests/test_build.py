"""Tests of coda_dsl.build: keys, cache validity, locking, errors, toolchain discovery.

Builds are mocked (builder._run_ninja) except four real nvcc runs: a failing 3-line .cu (error format),
a compile-only build of a tiny TU with CUTLASS and coda_dsl's headers (proves the flags), and host
programs of the per-launch swizzle rule (csrc/coda_dsl/schedule.h) and of RoPE's angle reduction
(csrc/coda_dsl/functional.h).
"""
import json
import math
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import coda_dsl.build as b
from coda_dsl.build import builder, cache, paths, tools as tcmod
from build_helpers import FAKE_TC, bk, quiet, unit

HAVE_NVCC = any(os.access(p, os.X_OK) for p in [os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"),
                "bin/nvcc"), "/usr/local/cuda/bin/nvcc"]) or shutil.which("nvcc") is not None
needs_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not installed")


# ---- keys and cache dir -------------------------------------------------------------------------

def test_key_stable_and_sensitive(fake, monkeypatch):
    k = b.specialization_key("ir: D = acc * 2; bf16; tile 128x256")
    assert k == b.specialization_key("ir: D = acc * 2; bf16; tile 128x256")
    assert len(k) == 24 and int(k, 16) >= 0
    assert k != b.specialization_key("ir: D = acc * 3; bf16; tile 128x256")
    bk = b.build_key(k)
    assert len(bk) == 24 and bk != k and bk == b.build_key(k)
    assert bk != b.build_key(b.specialization_key("ir: D = acc * 3; bf16; tile 128x256"))
    import dataclasses
    newer = dataclasses.replace(FAKE_TC, nvcc_version="13.1.0")
    monkeypatch.setattr(cache, "toolchain", lambda: newer)
    # a new toolchain: the same op (name, .cu), a new cache entry
    assert k == b.specialization_key("ir: D = acc * 2; bf16; tile 128x256") and b.build_key(k) != bk
    monkeypatch.setattr(cache, "toolchain", lambda: FAKE_TC)
    monkeypatch.setattr(cache, "CODEGEN_VERSION", "999")
    assert k != b.specialization_key("ir: D = acc * 2; bf16; tile 128x256")


def test_specialization_key_needs_no_toolchain(monkeypatch):
    """Emitting names the op from the plan alone: no nvcc, no CUTLASS needed."""
    def missing():
        raise b.ToolchainError("no toolchain here")
    monkeypatch.setattr(cache, "toolchain", missing)
    assert len(b.specialization_key("p")) == 24
    with pytest.raises(b.ToolchainError):
        b.build_key(b.specialization_key("p"))


def test_key_covers_every_version_and_nested_headers(fake, monkeypatch, tmp_path):
    """An nvcc or CUTLASS upgrade is a new build key (a torch upgrade is not: kernels use nothing of torch);
    an edit of any csrc header (also in a subfolder) a new specialization key (and so a new build key)."""
    import dataclasses
    k = b.specialization_key("p")
    bk = b.build_key(k)
    for field, value in (("nvcc_version", "99.9"), ("cutlass_version", "9.9.9")):
        monkeypatch.setattr(cache, "toolchain", lambda tc=dataclasses.replace(FAKE_TC, **{field: value}): tc)
        assert b.specialization_key("p") == k and b.build_key(k) != bk, field
    monkeypatch.setattr(cache, "toolchain", lambda: FAKE_TC)
    header = tmp_path / "csrc" / "coda_dsl" / "nested" / "x.h"
    header.parent.mkdir(parents=True)
    header.write_text("// one")
    monkeypatch.setattr(paths, "csrc_dir", lambda: tmp_path / "csrc")
    cache._generator_digest.cache_clear()
    try:
        before = b.specialization_key("p")
        header.write_text("// two")
        cache._generator_digest.cache_clear()
        assert b.specialization_key("p") != before
        assert b.build_key(b.specialization_key("p")) != b.build_key(before)
    finally:
        cache._generator_digest.cache_clear()  # recomputed from the real csrc/ once the patch is undone


def test_cutlass_checkouts_are_keyed_by_location(tmp_path, monkeypatch):
    versions = []
    for name in ("one", "two"):
        inc = tmp_path / name / "include" / "cutlass"
        inc.mkdir(parents=True)
        (inc / "cutlass.h").write_text("")
        (inc / "version.h").write_text("#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n")
        monkeypatch.setenv("CODA_DSL_CUTLASS_DIR", str(tmp_path / name))
        versions.append(tcmod.find_cutlass()[1])
    assert versions[0] != versions[1]


def test_cuda_home_comes_first(tmp_path, monkeypatch):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert tcmod.find_nvcc() == (str(nvcc), str(tmp_path))


def test_atomic_write_is_world_readable(tmp_path):
    f = tmp_path / "meta.json"
    old = os.umask(0o022)
    try:
        cache.atomic_write(f, "{}")
    finally:
        os.umask(old)
    assert f.stat().st_mode & 0o777 == 0o644  # a shared cache: other users read the entries


def test_clear_keeps_staging_of_live_builds(fake):
    """A live build holds a flock on its staging folder (as _build does); a crashed one left none, however
    young its folder is."""
    import fcntl
    staging = b.cache_dir() / ".staging"
    live, crashed = staging / "live", staging / "crashed"
    for d in (live, crashed):
        d.mkdir(parents=True)
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        b.clear_cache()
    finally:
        os.close(fd)
    assert live.is_dir() and not crashed.exists()


def test_ninja_writes_outputs_through_a_temporary(fake):
    """A killed compiler must not leave a partial object that ninja counts as built."""
    text = builder._ninja_file(FAKE_TC, ["k"], False)
    commands = [ln for ln in text.splitlines() if ln.strip().startswith("command =")]
    assert len(commands) == 4  # host pass, device pass, fatbinary embedding, link
    assert all("-o $out.tmp" in c and c.endswith("&& mv -f $out.tmp $out") for c in commands)


def test_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("CODA_DSL_CACHE", str(tmp_path / "x" / "y"))
    assert b.cache_dir() == tmp_path / "x" / "y" and b.cache_dir().is_dir()
    monkeypatch.delenv("CODA_DSL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert b.cache_dir() == tmp_path / "xdg" / "coda_dsl"


def test_paths_point_at_repo_dirs():
    from coda_dsl.build.paths import csrc_dir, templates_dir
    repo = Path(__file__).resolve().parent.parent
    assert csrc_dir() in (repo / "csrc", repo / "coda_dsl" / "_data" / "csrc")
    assert templates_dir() in (repo / "templates", repo / "coda_dsl" / "_data" / "templates")


# ---- cache validity ---------------------------------------------------------------------------

def test_build_then_cached(fake):
    u = unit()
    lines = []
    [so] = b.build_units([u], log=lines.append)
    assert so == b.cache_dir() / bk(u) / "kernel.so" and so.exists()
    assert len(lines) == 2 and "building 1 kernel specialization" in lines[0]
    assert json.loads((so.parent / "meta.json").read_text())["key"] == bk(u)
    assert (so.parent / "kernel.cu").read_text() == u.cu_text
    lines.clear()
    assert b.build_units([u], log=lines.append) == [so]
    assert len(fake.calls()) == 1 and lines == []  # warm: silent, no ninja
    assert not list((b.cache_dir() / ".staging").iterdir())  # staging cleaned up


def test_complete_entries_need_no_lock(fake, monkeypatch):
    """Units whose entries are complete are answered without taking their build locks: a read-only cache
    (where a lock file cannot be made) still serves what it holds, as loading a kernel does."""
    u = unit()
    [so] = b.build_units([u], log=quiet)

    def no_locks(*a, **k):
        raise b.CacheError("read-only file system")
    monkeypatch.setattr(builder, "key_locks", no_locks)
    assert b.build_units([u], log=quiet) == [so]
    with pytest.raises(b.CacheError, match="read-only"):  # a missing one still needs its lock
        b.build_units([unit("other")], log=quiet)


@pytest.mark.parametrize("corrupt", ["meta_garbage", "meta_other_key", "no_meta", "so_missing",
                                     "so_truncated", "entry_is_file"])
def test_corrupt_entry_is_rebuilt(fake, corrupt):
    u = unit()
    [so] = b.build_units([u], log=quiet)
    entry = so.parent
    if corrupt == "meta_garbage":
        (entry / "meta.json").write_text("{not json")
    elif corrupt == "meta_other_key":
        (entry / "meta.json").write_text(json.dumps({"key": "0" * 24, "files": {"kernel.so": 128}}))
    elif corrupt == "no_meta":
        (entry / "meta.json").unlink()
    elif corrupt == "so_missing":
        so.unlink()
    elif corrupt == "so_truncated":
        so.write_bytes(b"\0" * 10)
    else:
        shutil.rmtree(entry)
        entry.write_text("junk")
    assert cache.valid_output(bk(u)) is None
    assert [e["has_so"] for e in b.cache_entries()] in ([], [False])
    assert b.build_units([u], log=quiet) == [so]
    assert len(fake.calls()) == 2 and cache.valid_output(bk(u)) == so


def test_compile_only_never_makes_entry_valid(fake):
    u = unit()
    [o] = b.build_units([u], compile_only=True, log=quiet)
    assert o.name == "kernel.o" and o.exists()
    assert cache.valid_output(bk(u)) is None and not b.cache_entries()[0]["has_so"]
    b.build_units([u], log=quiet)  # the .so still gets built ...
    assert cache.valid_output(bk(u)) is not None
    b.build_units([u], compile_only=True, log=quiet)  # ... and its .o serves later compile checks
    assert fake.calls() == [f"{bk(u)}/kernel.o {bk(u)}/kernel.fatbin", f"{bk(u)}/kernel.so"]


def test_many_units_one_ninja_call_and_dedupe(fake):
    us = [unit("a"), unit("b"), unit("c")]
    paths = b.build_units(us + [us[0]], log=quiet)
    assert len(fake.calls()) == 1 and len(fake.calls()[0].split()) == 3
    assert paths[0] == paths[3] and len(set(paths)) == 3


def test_cache_entries_and_clear(fake):
    us = [unit("a"), unit("b")]
    b.build_units(us, log=quiet)
    entries = b.cache_entries()
    assert {e["key"] for e in entries} == {bk(u) for u in us}
    e = entries[0]
    assert e["has_so"] and e["size"] > 0 and e["mtime"] > 0 and Path(e["cu_path"]).exists()
    assert b.clear_cache() == cache.Cleared(removed=2)
    assert b.cache_entries() == [] and not list(b.cache_dir().glob("*.lock"))


def test_partial_failure_keeps_good_units(fake, monkeypatch):
    good, bad = unit("good"), unit("bad")
    ok_run = builder._run_ninja

    def run(staging, targets, jobs, verbose, log):
        ok_run(staging, [t for t in targets if not t.startswith(bk(bad))], jobs, verbose, log)
        (staging / bk(bad) / "device.log").write_text(f"$ nvcc -fatbin {bk(bad)}/kernel.cu\n"
                                                      f"{bk(bad)}/kernel.cu(1): error: boom\n")
        return 1, "FAILED"

    monkeypatch.setattr(builder, "_run_ninja", run)
    with pytest.raises(b.BuildError) as ei:
        b.build_units([good, bad], log=quiet)
    assert cache.valid_output(bk(good)) is not None and cache.valid_output(bk(bad)) is None
    failed = b.cache_dir() / "failed" / bk(bad)
    assert ei.value.first_error == f"{failed}/kernel.cu(1): error: boom"  # path rewritten to the kept copy


def test_load_library_loads_once(fake, loads, monkeypatch):
    u = unit()
    so = b.load_library(u)
    assert b.load_library(u) == so and loads == [so.read_bytes()] and len(fake.calls()) == 1
    monkeypatch.setattr(builder, "_loaded", {})  # a new process: found on disk, not rebuilt
    assert b.load_library(u) == so and len(fake.calls()) == 1


# ---- concurrency ------------------------------------------------------------------------------

def test_threads_build_same_key_once(fake):
    fake.delay = 0.5
    u = unit()
    results, errors = [], []

    def go():
        try:
            results.append(b.build_units([u], log=quiet)[0])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=go) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and len(set(results)) == 1 and len(fake.calls()) == 1


def _proc_build(key, cu_text, q):
    try:
        q.put(str(b.build_units([b.BuildUnit(key, cu_text)], log=quiet)[0]))
    except Exception as e:  # pragma: no cover
        q.put(repr(e))


def test_processes_build_same_key_once(fake):
    fake.delay = 0.5
    u = unit()
    ctx = multiprocessing.get_context("fork")  # children inherit the mocked build
    q = ctx.Queue()
    ps = [ctx.Process(target=_proc_build, args=(u.key, u.cu_text, q)) for _ in range(3)]
    for p in ps:
        p.start()
    out = [q.get(timeout=60) for _ in ps]
    for p in ps:
        p.join()
    assert out == [str(b.cache_dir() / bk(u) / "kernel.so")] * 3
    assert len(fake.calls()) == 1


# ---- toolchain --------------------------------------------------------------------------------

@needs_nvcc
def test_toolchain_found(cache_root):
    tc = b.toolchain()
    assert os.access(tc.nvcc, os.X_OK) and Path(tc.cuda_home, "bin", "nvcc").exists()
    assert tc.nvcc_version.count(".") == 2
    assert Path(tc.cutlass_include[0], "cutlass", "cutlass.h").exists()
    assert tc.cutlass_version and Path(tc.csrc_include).is_dir()
    assert b.toolchain() is tc  # cached


def test_toolchain_error_without_cutlass(cache_root, monkeypatch, tmp_path):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cutlass_library" else real(name, *a))
    monkeypatch.setattr(tcmod, "find_nvcc", lambda: ("/fake/nvcc", "/fake"))
    monkeypatch.setenv("CODA_DSL_CUTLASS_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(b.ToolchainError, match="CUTLASS headers not found"):
        b.toolchain()
    monkeypatch.delenv("CODA_DSL_CUTLASS_DIR")
    with pytest.raises(b.ToolchainError, match="pip install nvidia-cutlass"):
        b.toolchain()


def test_toolchain_error_without_nvcc(cache_root, monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(tcmod.os, "access", lambda *a: False)
    monkeypatch.setattr(tcmod.shutil, "which", lambda *a: None)
    with pytest.raises(b.ToolchainError, match="nvcc not found: install the CUDA toolkit"):
        b.toolchain()


def test_first_error_names_the_cause():
    """A build log's named cause comes before the first line saying "error": a full disk fails the link as
    collect2's "error" after ld's "No space left on device"; a missing $CXX as the shell's "not found"
    before ninja gives up. A warning is not a cause."""
    from coda_dsl.build.builder import _first_error
    full = "/usr/bin/ld: final link failed: No space left on device\ncollect2: error: ld returned 1 exit status\n"
    assert _first_error(full) == "/usr/bin/ld: final link failed: No space left on device"
    no_cxx = ("FAILED: k/kernel.so\n/bin/sh: 1: /nonexistent/c++: not found\n"
              "ninja: build stopped: cannot make progress due to previous errors.\n")
    assert _first_error(no_cxx) == "/bin/sh: 1: /nonexistent/c++: not found"
    nvcc = "k.cu(3): warning #1: include file not found: x\nk.cu(9): error: expected a \";\"\n"
    assert _first_error(nvcc) == 'k.cu(9): error: expected a ";"'
    assert _first_error("$ nvcc -c k.cu\n") == "(no compiler output)"


# ---- real nvcc --------------------------------------------------------------------------------

@needs_nvcc
def test_long_builds_report_progress():
    """Without verbose, a long build logs its share of finished ninja steps every PROGRESS_EVERY seconds,
    read from the status prefix that _run_ninja sets (NINJA_STATUS), and nothing in between."""
    now, logged = [0.0], []
    progress = builder._Progress(logged.append, clock=lambda: now[0])
    for t, line in [(10, "[1/360] nvcc (host pass) a/kernel.cu"), (59, "[2/360] embed a/kernel.fatbin"),
                    (61, "nvcc warning: not a status line"), (62, "[90/360] link a/kernel.so"),
                    (100, "[120/360] link b/kernel.so"), (130, "[359/360] link c/kernel.so")]:
        now[0] = t
        progress(line)
    assert logged == ["coda_dsl: build 25% done (90 of 360 steps) after 62 s",
                      "coda_dsl: build 99% done (359 of 360 steps) after 130 s"]


def test_build_error_format_real_nvcc(cache_root):
    u = b.BuildUnit(key=b.specialization_key("syntax error"),
                    cu_text="__global__ void k(float* x) {\n  x[0] = 1.0f\n}\n")
    with pytest.raises(b.BuildError) as ei:
        b.build_units([u], compile_only=True, log=quiet)
    e = ei.value
    failed = b.cache_dir() / "failed" / bk(u)
    assert str(e).splitlines() == [f"nvcc failed to compile {failed / 'kernel.cu'}",
                                   f"  first error: {e.first_error}", f"  full log: {failed / 'build.log'}"]
    assert "error" in e.first_error and e.first_error.startswith(f"{failed / 'kernel.cu'}(")
    assert Path(e.cu_path).read_text() == u.cu_text and Path(e.log_path).exists()
    assert not (b.cache_dir() / bk(u) / "meta.json").exists()


TINY_TU = r"""
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include "coda_dsl/abi.h"
__global__ void coda_tiny(float* x) { x[threadIdx.x] *= 2.f; }
extern "C" int coda_tiny_launch(float* x, void* stream, char* message, int64_t message_size) {
  return coda::guarded(message, message_size, [&] { coda_tiny<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(x); });
}
"""


@needs_nvcc
def test_real_compile_only_build(cache_root):
    u = b.BuildUnit(key=b.specialization_key("tiny tu"), cu_text=TINY_TU)
    [o] = b.build_units([u], compile_only=True, log=quiet)
    assert o.exists() and o.stat().st_size > 0
    log = (o.parent / "build.log").read_text()
    assert "-gencode=arch=compute_90a,code=sm_90a" in log and "-std=c++20" in log
    host, device = (i for i, ln in enumerate(log.splitlines()) if ln.startswith("$ "))  # both passes, in order
    assert " -c " in log.splitlines()[host] and "-fatbin -DCODA_DEVICE_PASS" in log.splitlines()[device]


# (tile M, tile N, cluster M, cluster N, M, N, the config's swizzle) -> the swizzle a launch takes
SWIZZLE_CASES = [
    ((128, 256, 2, 1, 777, 4104, 8), 1),      # 7 x 17 tiles: run as 16 x 24 = 384 with 8, as 8 x 17 = 136 with 1
    ((128, 256, 2, 1, 1000, 8200, 8), 1),     # 8 x 33: 16 x 40 with 8, 8 x 33 with 1
    ((128, 128, 2, 1, 1536, 128256, 8), 2),   # 12 x 1002: 16128 with 8, 16064 with 4, 12024 with 2
    ((128, 128, 2, 1, 4096, 128256, 8), 8),   # 32 x 1002: 32256 with 8, within 2 % of 32064
    ((128, 128, 2, 1, 8192, 14336, 8), 8),    # whole groups: Llama's shapes keep 8
    ((128, 192, 2, 1, 8192, 6144, 8), 8),
    ((128, 256, 2, 1, 8192, 4096, 4), 4),     # never more than the config's
    ((128, 128, 1, 2, 8192, 28672, 8), 8),
]


def _host_program(tmp_path, name: str, source: str) -> Path:
    """A host program of coda_dsl's and CUTLASS's headers, built with nvcc as the kernels are."""
    tc = b.toolchain()
    src, exe = tmp_path / f"{name}.cu", tmp_path / name
    src.write_text(source)
    includes = [f"-I{d}" for d in (*tc.cutlass_include, tc.csrc_include)]
    subprocess.run([tc.nvcc, "-std=c++20", "--expt-relaxed-constexpr", *includes, str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    return exe


@needs_nvcc
def test_swizzle_per_launch(tmp_path):
    """csrc/coda_dsl/schedule.h's rule, compiled on the host with CUTLASS's own rounding."""
    calls = "\n".join(f"  std::printf(\"%d\\n\", coda::swizzle_for<Shape<Int<{tm}>, Int<{tn}>, _64>, "
                      f"Shape<Int<{cm}>, Int<{cn}>, _1>>({m}, {n}, {most}));"
                      for (tm, tn, cm, cn, m, n, most), _ in SWIZZLE_CASES)
    exe = _host_program(tmp_path, "swizzle", f"#include <cstdio>\n#include \"coda_dsl/schedule.h\"\n"
                        f"using namespace cute;\nint main() {{\n{calls}\n  return 0;\n}}\n")
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    assert [int(g) for g in got] == [want for _, want in SWIZZLE_CASES]


@needs_nvcc
def test_rope_angle_reduction(tmp_path):
    """csrc/coda_dsl/functional.h's reduce_angle, compiled on the host: RoPE's fp32 angles (positions up to
    131071, base 500000, head_dim 128) land in [-pi, pi] (past it by at most a rounding step of k) with the
    sine and cosine of the same fp32 angle, to 3e-7 (the kernels then take __sinf/__cosf of it: test_gpu.py's
    RoPE tests)."""
    pos = torch.cat((torch.arange(0, 131072, 61), torch.tensor([131071]))).float()
    angles = (pos[:, None] * (1.0 / 500000.0 ** (torch.arange(0, 128, 2).float() / 128))).flatten()
    (tmp_path / "angles").write_bytes(angles.numpy().tobytes())
    exe = _host_program(tmp_path, "reduce", '#include <cstdio>\n#include "coda_dsl/functional.h"\n'
                        "int main(int, char** argv) {\n  FILE* in = std::fopen(argv[1], \"rb\");\n"
                        "  FILE* out = std::fopen(argv[2], \"wb\");\n  float x;\n"
                        "  for (float r; std::fread(&x, 4, 1, in) == 1;)\n"
                        "    r = coda::reduce_angle(x), std::fwrite(&r, 4, 1, out);\n"
                        "  return std::fclose(in) | std::fclose(out);\n}\n")
    subprocess.run([str(exe), str(tmp_path / "angles"), str(tmp_path / "reduced")], check=True)
    r = torch.frombuffer(bytearray((tmp_path / "reduced").read_bytes()), dtype=torch.float32).double()
    x = angles.double()
    # k = rint(x / 2pi) in fp32 may be off by one near a half turn: |r| up to pi + 2pi ulp(x / 2pi)
    assert r.shape == x.shape and r.abs().max() <= math.pi + 0.02
    assert max((r.sin() - x.sin()).abs().max(), (r.cos() - x.cos()).abs().max()) <= 3e-7


def _prebuild_dry_run(cache, sets: str) -> str:
    """tests/prebuild_without_gpu.py --dry-run's output for these sets (a fresh cache: nothing built)."""
    r = subprocess.run([sys.executable, "tests/prebuild_without_gpu.py", "--sets", sets, "--dry-run"],
                       cwd=Path(__file__).resolve().parents[1], env={**os.environ, "CODA_DSL_CACHE": str(cache)},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@needs_nvcc
def test_gpu_suite_kernels_found_without_a_gpu(tmp_path):
    """tests/prebuild_without_gpu.py (kernels built here, imported on a GPU machine) finds the GPU suite's kernels
    under each GPU model's rule: one key each, the H100's and H200's differing only in the cross-entropy's."""
    out = _prebuild_dry_run(tmp_path, "gpu")
    rows = [line.split() for line in out.splitlines() if len(line.split()) == 3 and len(line.split()[0]) == 24]
    assert len(rows) == len({k for k, _, _ in rows}) > 60
    h100 = int(re.search(r"as NVIDIA H100.*, (\d+) new", out)[1])  # listed last
    assert 0 < h100 < len(rows) and all(ep.startswith("ce_") for _, _, ep in rows[-h100:])


@needs_nvcc
def test_benchmark_kernels_found_without_a_gpu(tmp_path):
    """The benchmarks' sets find kernels under each GPU's rule; the cross-entropy bench's default kernels are the
    ones cd.linear_cross_entropy launches on that GPU (its own tile on H100s), not the H200's on both; the
    host-overhead bench's one tiny kernel is the same under both rules."""
    out = _prebuild_dry_run(tmp_path, "epilogues,cross_entropy,train_llama,host_overhead")
    found = {(s, g): (int(n), int(new)) for s, g, n, new in
             re.findall(r"^(\w+) as NVIDIA (H\d00).*: (\d+) kernels, (\d+) new", out, re.MULTILINE)}
    assert len(found) == 8 and all(n > 0 for n, _ in found.values()), out
    assert found["cross_entropy", "H100"] == (2, 2)
    assert found["host_overhead", "H200"] == (1, 1) and found["host_overhead", "H100"] == (1, 0)
    assert found["epilogues", "H200"][0] >= 7 * 2  # the H200's rule: more than one configuration per epilogue
