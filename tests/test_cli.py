"""Tests of the `coda-dsl` command line (coda_dsl/cli.py). CPU only, no nvcc run: builds are faked,
and the toolchain behind specialization keys is a fixed fake, so keys are stable everywhere."""
import argparse
import os
import re
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch

import coda_dsl as cd
from coda_dsl import build, cli
from coda_dsl.build import cache
from coda_dsl.examples import residual_rms
from coda_dsl.runtime import op as runtime
from coda_dsl.runtime import call as call_checks
from build_helpers import FAKE_TC, real_toolchain_or_skip

REPO = Path(__file__).resolve().parent.parent
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(autouse=True)
def env(fake_toolchain):
    """Every test: a temporary cache and the fake toolchain (stable keys)."""


@pytest.fixture
def eps(tmp_path):
    path = tmp_path / "my_eps.py"
    path.write_text(textwrap.dedent("""
        import coda_dsl as cd

        @cd.epilogue
        def scaled(acc, res: cd.Tensor, s: cd.VecM, c: cd.Const):
            return {"D": acc * s * c + res, "f": cd.cast(acc, cd.float32)}

        def plain(x):
            return x
    """))
    return path


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def key_of(text):
    return next(line.split()[1] for line in text.splitlines() if line.strip().startswith("key "))


# ---- emit / explain ------------------------------------------------------------------------------

def test_emit_stdout_and_file(capsys, tmp_path):
    rc, out, _ = run(capsys, "emit", "coda_dsl.examples:residual_rms")
    assert rc == 0
    assert "Sm90TopologicalVisitor" in out and "extern \"C\" int coda_launch" in out
    dest = tmp_path / "k.cu"
    rc, out2, err = run(capsys, "emit", "coda_dsl.examples:residual_rms", "-o", dest)
    assert rc == 0 and out2 == "" and str(dest) in err
    assert dest.read_text() == out
    rc, _, err = run(capsys, "emit", "coda_dsl.examples:residual_rms", "-o", tmp_path / "missing" / "k.cu")
    assert rc != 0 and "cannot write" in err and "No such file or directory" in err and "Traceback" not in err


def test_emit_from_file(capsys, eps, monkeypatch):
    rc, out, _ = run(capsys, "emit", f"{eps}:scaled", "--const", "c=2")
    assert rc == 0 and "Sm90TopologicalVisitor" in out and "extern \"C\" int coda_launch" in out and "2.0f" in out
    source = eps.read_text()
    rc, _, err = run(capsys, "emit", f"{eps}:scaled", "--const", "c=2", "-o", eps)  # would overwrite the epilogue
    assert rc == 2 and "is Python source, which the .cu would replace" in err and eps.read_text() == source
    # the same file named as a module (found on sys.path), not by its path
    monkeypatch.syspath_prepend(str(eps.parent))
    rc, _, err = run(capsys, "emit", f"{eps.stem}:scaled", "--const", "c=2", "-o", eps)
    assert rc == 2 and "is Python source, which the .cu would replace" in err and eps.read_text() == source
    # a module that imports the epilogue from another: that one is Python source too
    reexport = eps.with_name("reexport.py")
    reexport.write_text(f"from {eps.stem} import scaled\n")
    rc, _, err = run(capsys, "emit", f"{reexport}:scaled", "--const", "c=2", "-o", eps)
    assert rc == 2 and "is Python source" in err and eps.read_text() == source
    rc, _, err = run(capsys, "emit", f"{eps}:scaled", "--const", "c=2", "-o", "")  # an unset "$VAR"
    assert rc == 2 and "-o names no file" in err
    rc, out, _ = run(capsys, "emit", f"{eps}:scaled", "--const", "c=2", "-o", "-")
    assert rc == 0 and "extern \"C\" int coda_launch" in out and not Path("-").exists()


def test_a_shape_past_32_bits_is_an_argument_error(capsys):
    for shape in ("2147483648x8x8", "99999999999999999999x8x8"):
        with pytest.raises(SystemExit):
            cli.main(["explain", "coda_dsl.examples:bias_gelu", "--shape", shape])
        err = capsys.readouterr().err
        assert "32-bit ints (at most 2147483647)" in err and "Traceback" not in err


def test_explain(capsys):
    rc, out, _ = run(capsys, "explain", "coda_dsl.examples:residual_rms")
    assert rc == 0
    assert "add(acc, residual)" in out and "out h_gamma" in out  # the IR
    for name in ("Acc", "Load_residual", "Load_gamma", "Store_h_gamma", "Sm90RowBroadcast", "Fn0"):
        assert name in out
    assert len(key_of(out)) == 24


def test_explain_half_width_output(capsys):
    rc, out, _ = run(capsys, "explain", "coda_dsl.library:swiglu_keep_preactivation")
    assert rc == 0 and "[M, N/2]" in out and "coda::PairStore" in out


def test_explain_shows_both_columns_of_a_pairwise_functor(capsys):
    rc, out, _ = run(capsys, "explain", "coda_dsl.library.rope:rope_tables")  # each pair rotated: two results
    assert rc == 0 and re.search(r"return \(even column: t\d+, odd column: t\d+\);", out)


def test_explain_shape_says_when_no_kernel_runs_it(capsys):
    rc, out, _ = run(capsys, "explain", "coda_dsl.examples:bias_gelu", "--shape", "77x104x36")
    assert rc == 0 and "note: no kernel runs this shape" in out and "K = 36 must be a multiple of 8" in out
    rc, out, _ = run(capsys, "explain", "coda_dsl.examples:bias_gelu", "--shape", "77x104x40", "--b-layout", "kn")
    assert rc == 0 and "note:" not in out
    rc, out, _ = run(capsys, "explain", "coda_dsl.examples:bias_gelu", "--shape", "77x100x40", "--b-layout", "kn")
    assert "B is read along N" in out and "N = 100 must be a multiple of 8" in out
    rc, out, err = run(capsys, "emit", "coda_dsl.examples:bias_gelu", "--shape", "77x104x36")  # emit says so too
    assert rc == 0 and "note: no kernel runs this shape" in err and "K = 36" in err and "note" not in out
    rc, _, err = run(capsys, "emit", "coda_dsl.examples:bias_gelu", "--shape", "77x104x40")
    assert rc == 0 and "note" not in err
    rc, out, _ = run(capsys, "explain", "coda_dsl.library:swiglu", "--shape", "4096x4097x4096")  # no call at all
    assert rc == 0 and "note: no call has this shape: N = 4097 is not a multiple of 2" in out
    assert "note: no call" not in run(capsys, "explain", "coda_dsl.library:swiglu", "--shape", "4096x4098x4096")[1]


def test_explain_without_a_kernel_still_shows_the_program(capsys):
    """RoPE's derived backward sums N/2-wide values into its operands' gradients: no kernel lowers that,
    and explain says so after the IR (exit 1)."""
    rc, out, _ = run(capsys, "explain", "coda_dsl.library:rope_positions", "--backward")
    assert rc == 1 and "## IR" in out and "out inv_freq" in out
    assert "## no kernel: it runs on the reference backend only" in out and "of values not N wide" in out


def test_options_change_key(capsys, eps):
    def key(*opts):
        rc, out, err = run(capsys, "explain", f"{eps}:scaled", *opts)
        assert rc == 0, err
        return key_of(out)

    base = key("--const", "c=2")
    variants = [key("--const", "c=3"), key("--const", "c=2", "--operand-dtype", "s=fp32"),
                key("--const", "c=2", "--dtype", "fp16"), key("--const", "c=2", "--b-layout", "kn"),
                key("--const", "c=2", "--config", "128x128x64_c1x1_pingpong")]
    assert base == key("--const", "c=2.0") and len({base, *variants}) == 1 + len(variants)


def test_key_matches_cd_compile(capsys, monkeypatch):
    """The CLI builds exactly what cd.gemm would for the same dtypes and layout."""
    monkeypatch.setattr(runtime.checks, "require_cutlass", lambda *_: None)  # CPU tensors: no build here
    m, n, k = 64, 128, 32
    a, w = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    r, g = torch.randn(m, n, dtype=torch.bfloat16), torch.randn(n, dtype=torch.float32)
    op = cd.compile(residual_rms, a, w, residual=r, gamma=g)
    rc, out, err = run(capsys, "explain", "coda_dsl.examples:residual_rms", "--operand-dtype", "gamma=fp32")
    assert rc == 0 and key_of(out) == op.key and "note" not in err
    # an operand the program does not read (here the backward's): said, since its dtype changes nothing
    rc, out, err = run(capsys, "explain", "coda_dsl.examples:residual_rms", "--backward", "--operand-dtype",
                       "residual=fp32")
    assert rc == 0 and "does not read 'residual', so its dtype changes nothing" in err


# ---- errors: one line on stderr, exit 2 ---------------------------------------------------------------

@pytest.mark.parametrize("target, words", [
    ("{eps}:nope", "has no 'nope'; its epilogues: scaled"),
    ("{eps}:plain", "not an epilogue"),
    ("coda_dsl.library:rms_consumer", "is a cd.epilogue_factory, which makes epilogues: the CLI takes an epilogue"),
    ("{eps}", "expected FILE.py:FUNCTION"),
    ("missing_file.py:f", "no such file"),
    ("coda_dsl.no_such_module:f", "no module named"),
    ("{bad}:f", "NameError"),
    ("{exits}:f", "called sys.exit(3)"),
    ("{folder}:f", "is a directory: name a .py file"),
    ("/dev/null:f", "/dev/null is not a regular file: name a .py file"),
    ("{text}:f", "is not a .py file: name a Python source file, or a module"),
])
def test_bad_target(capsys, eps, target, words):
    bad = eps.with_name("bad_eps.py")
    bad.write_text("import coda_dsl as cd\nundefined_name\n")
    exits = eps.with_name("exits.py")
    exits.write_text("import sys\nsys.exit(3)\n")  # a script run at import: one message, not a silent exit 3
    text = eps.with_name("eps.txt")
    text.write_text(eps.read_text())
    target = target.format(eps=eps, bad=bad, exits=exits, folder=eps.parent, text=text)
    rc, out, err = run(capsys, "emit", target)
    assert rc == 2 and out == ""
    assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("opts, words", [
    ((), "pass --const c=VALUE"),
    (("--const", "c=x"), "not a number"),
    (("--const", "c=1", "--const", "z=1"), "no cd.Const parameter 'z'"),
    (("--const", "c=1", "--const", "s=1"), "'s' is a cd.VecM, given at each call: drop --const s"),
    (("--const", "c=1", "--operand-dtype", "res=int8"), "dtype must be one of"),
    (("--const", "c=1", "--operand-dtype", "q=fp32"), "no tensor/vector operand 'q'"),
    (("--const", "c=1", "--config", "big"), "bad config"),
    (("--const", "c=1", "--config", "128x256x64_c2x1_cooperative_extra"), "unknown part 'extra'"),
    (("--const", "c=1", "--const", "c=2"), "--const c is given twice (1 and 2)"),
])
def test_bad_options(capsys, eps, opts, words):
    rc, _, err = run(capsys, "explain", f"{eps}:scaled", *opts)
    assert rc == 2 and words in err and "Traceback" not in err


def test_a_negative_shape_is_refused_by_its_own_check(capsys, eps):
    """argparse reads `--shape -1x8x8`'s value as an option ("expected one argument"): the CLI hands it to the
    shape's check instead."""
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", f"{eps}:scaled", "--const", "c=1", "--shape", "-1x8x8"])
    assert e.value.code == 2 and "M, N and K must be positive, got '-1x8x8'" in capsys.readouterr().err


def test_tracing_error_is_one_message(capsys, tmp_path):
    path = tmp_path / "trace_err.py"
    path.write_text("import coda_dsl as cd\n@cd.epilogue\ndef f(acc, x):\n    return acc\n")
    rc, _, err = run(capsys, "explain", f"{path}:f")
    assert rc == 2 and err.startswith("coda-dsl explain: error:") and "Traceback" not in err


def test_build_error_exit_2(capsys, monkeypatch):
    def fail(units, **kw):
        raise build.BuildError("/c/failed/k/kernel.cu", "/c/failed/k/build.log", "error: boom")
    monkeypatch.setattr(build, "build_units", fail)
    rc, _, err = run(capsys, "build", "coda_dsl.examples:bias_gelu")
    assert rc == 2 and "error: boom" in err and "Traceback" not in err


# ---- build / emit --check (build_units faked) ---------------------------------------------------------

def test_build_and_check_use_build_units(capsys, monkeypatch, tmp_path):
    calls = []

    def fake(units, compile_only=False, log=print, **kw):
        calls.append(([u.key for u in units], compile_only))
        return [tmp_path / "kernel.o"]
    monkeypatch.setattr(build, "build_units", fake)
    rc, out, _ = run(capsys, "build", "coda_dsl.examples:bias_gelu", "--compile-only")
    assert rc == 0 and "built:" in out
    rc, out, err = run(capsys, "emit", "coda_dsl.examples:bias_gelu", "--check")
    assert rc == 0 and "Sm90TopologicalVisitor" in out and "compile check passed" in err
    assert calls[0] == calls[1] and calls[0][1] is True


# ---- doctor / cache / demo / bench ------------------------------------------------------------------

def test_doctor(capsys):
    rc, out, _ = run(capsys, "doctor")
    for what in ("python", "torch", "nvcc", "CUTLASS", "ninja", "cache", "cutlass backend"):
        assert what in out
    try:
        build.tools.toolchain.__wrapped__()  # the real toolchain, not the fake
        ready = torch.version.cuda is not None
    except build.ToolchainError:
        ready = False
    assert rc == (0 if ready else 1)


def test_cpu_only_torch_fails_doctor_and_skips_real_compiles_with_one_reason(capsys, monkeypatch):
    monkeypatch.setattr(build, "toolchain", lambda: FAKE_TC)  # every other piece is present
    monkeypatch.setattr(torch.version, "cuda", None)
    reason = cli.torch_cuda_problem()
    assert f"torch {torch.__version__} is a CPU-only build" in reason and "CUDA tensors" in reason
    rc, out, _ = run(capsys, "doctor")
    assert rc == 1 and "FAIL  torch" in out and reason in out
    with pytest.raises(pytest.skip.Exception, match=re.escape(reason)):
        real_toolchain_or_skip()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert cli.torch_cuda_problem() is None and real_toolchain_or_skip() is FAKE_TC


def test_torch_of_a_cuda_without_the_library_api_fails_doctor_and_the_cutlass_backend(capsys, monkeypatch):
    """A torch built with CUDA 12.6 loads a runtime without cudaLibraryLoadData: doctor says so, an explicit
    cutlass call is refused with the fix, and auto runs the reference backend with a warning naming why."""
    from coda_dsl.runtime import checks, op
    monkeypatch.setattr(build, "toolchain", lambda: FAKE_TC)
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    reason = cli.torch_cuda_problem()
    assert reason == f"torch {torch.__version__} runs CUDA 12.6; kernel libraries need the CUDA 12.8+ runtime"
    rc, out, _ = run(capsys, "doctor")
    assert rc == 1 and "FAIL  torch" in out and reason in out and "install a torch built with CUDA 12.8+" in out
    monkeypatch.setattr(checks, "_capability", lambda index: (9, 0))  # an H100, as far as the checks know
    gpu = torch.device("cuda", 0)
    assert not checks.cutlass_runs_on(gpu)
    with pytest.raises(cd.UnsupportedError, match=re.escape(f"gemm: {reason}\n  fix: install a torch built with "
                                                            "CUDA 12.8+, or pass backend='reference'")):
        checks.require_cutlass("gemm", gpu)
    monkeypatch.setattr(op, "_warned_fallback", False)
    with pytest.warns(UserWarning, match=re.escape(f"coda_dsl: {reason}; running epilogues on the (slow) reference")):
        assert not op._cutlass_available(gpu)
    monkeypatch.setattr(checks, "_capability", lambda index: (8, 0))  # not Hopper: that is what the warning says
    monkeypatch.setattr(op, "_warned_fallback", False)
    with pytest.warns(UserWarning, match=re.escape("coda_dsl: no sm_90 GPU for tensors on cuda:0;")):
        assert not op._cutlass_available(gpu)
    monkeypatch.setattr(checks, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert checks.cutlass_runs_on(gpu) and cli.torch_cuda_problem() is None


def test_cache_list_clear(capsys, tmp_path):
    key = "0123456789abcdef01234567"
    staged = tmp_path / "kernel.so"
    staged.write_bytes(b"\0" * 2048)
    cache.commit_entry(key, {"kernel.so": staged}, {"op_name": "k0"})
    rc, out, _ = run(capsys, "cache", "list")
    assert rc == 0 and str(tmp_path / "cache") in out and key in out and " KB" in out and "yes" in out
    failed = tmp_path / "cache" / "failed"
    (failed / key).mkdir(parents=True)
    (failed / "notes.txt").write_text("mine")  # not a failed build's: clear leaves it
    rc, out, _ = run(capsys, "cache", "clear")
    assert rc == 0 and "removed 1 cache entry" in out
    assert not (failed / key).exists() and (failed / "notes.txt").read_text() == "mine"
    rc, out, _ = run(capsys, "cache", "list")
    assert rc == 0 and key not in out and "0 entries" in out


def test_cache_list_names_epilogue_and_config(capsys, tmp_path):
    spec = cli.specialization_from_options(residual_rms, config="128x192x64_c2x1_pingpong")
    staged = tmp_path / "kernel.cu"
    staged.write_text(spec.cu_text)
    cache.commit_entry(spec.key, {"kernel.cu": staged}, {"op_name": spec.op_name})
    staged.write_bytes(b"\0" * 16)
    cache.commit_entry("00000000000000000000beef", {"kernel.so": staged}, {})  # no kernel.cu: "?"
    rc, out, _ = run(capsys, "cache", "list")
    line = next(line for line in out.splitlines() if spec.key in line)
    assert rc == 0 and "residual_rms" in line and "tile 128x192x64, cluster 2x1, pingpong" in line
    assert " KB" in line and "no " in line
    assert "  epilogue " in out and "  config" in out
    line = next(line for line in out.splitlines() if "beef" in line)
    assert line.split()[1] == "?" and line.rstrip().endswith("?")


def _entry(tmp_path, key: str, so: bytes) -> None:
    staged, cu = tmp_path / "kernel.so", tmp_path / "kernel.cu"
    staged.write_bytes(so)
    cu.write_text("// Epilogue `e`\n")
    cache.commit_entry(key, {"kernel.so": staged, "kernel.cu": cu}, {"op_name": "k" + key[-2:]})


def test_export_replaces_only_a_regular_file(capsys, tmp_path):
    """An archive is written next to its name and moved over it: a link, pipe or device there is refused (as
    root, `export /dev/null` had made the device a regular file), and what a link names is left alone."""
    _entry(tmp_path, f"{1:024x}", b"\0" * 64)
    mine = tmp_path / "mine.txt"
    mine.write_text("mine")
    (tmp_path / "link.tar.gz").symlink_to(mine)
    os.mkfifo(tmp_path / "pipe.tar.gz")
    for name in ("link.tar.gz", "pipe.tar.gz"):
        rc, _, err = run(capsys, "cache", "export", tmp_path / name)
        assert rc != 0 and "is not a regular file" in err and "Traceback" not in err
    assert mine.read_text() == "mine" and (tmp_path / "link.tar.gz").is_symlink()
    assert not list(tmp_path.glob(".*.tmp"))
    rc, _, _ = run(capsys, "cache", "export", mine)  # a regular file: replaced
    assert rc == 0 and tarfile.is_tarfile(mine)


def test_clear_removes_a_staging_link_not_what_it_names(capsys, tmp_path):
    """.staging as a link is debris of the wrong type: clear unlinks it and leaves the folder it names whole."""
    users = tmp_path / "users"
    (users / "tmpabc").mkdir(parents=True)
    (users / "tmpabc" / "file").write_text("keep")
    cache.cache_dir().mkdir(parents=True, exist_ok=True)
    (cache.cache_dir() / ".staging").symlink_to(users)
    rc, _, _ = run(capsys, "cache", "clear")
    assert rc == 0 and not (cache.cache_dir() / ".staging").exists()
    assert (users / "tmpabc" / "file").read_text() == "keep"


def test_cache_export_import_round_trip(capsys, tmp_path, monkeypatch):
    """export packs each built kernel (kernel.so, kernel.cu, meta.json), in parts when asked; import into
    an empty cache gives the same entries, verified; a second import finds them present, and so does an
    import of two files holding the same kernels (not rejected)."""
    keys = [f"{i:024x}" for i in (1, 2, 3)]
    for k in keys:
        _entry(tmp_path, k, os.urandom(40_000))  # incompressible: the parts' sizes are the raw sizes
    rc, out, _ = run(capsys, "cache", "export", str(tmp_path / "all.tar.gz"))
    assert rc == 0 and "all.tar.gz" in out
    rc, out, _ = run(capsys, "cache", "export", str(tmp_path / "k.tar.gz"), "--part-mb", "0.05")
    parts = sorted(tmp_path.glob("k.part*.tar.gz"))
    assert rc == 0 and [p.name for p in parts] == [f"k.part{i}.tar.gz" for i in (1, 2, 3)]
    assert all(p.stat().st_size < 0.06 * 2**20 for p in parts)
    before = {k: (cache.entry_dir(k) / "kernel.so").read_bytes() for k in keys}
    monkeypatch.setenv("CODA_DSL_CACHE", str(tmp_path / "other"))
    rc, out, _ = run(capsys, "cache", "import", *map(str, parts))
    assert rc == 0 and "added 3, already present 0, rejected 0" in out
    assert {k: cache.check_output(k)[0].read_bytes() for k in keys} == before
    rc, out, _ = run(capsys, "cache", "import", str(tmp_path / "all.tar.gz"))
    assert rc == 0 and "added 0, already present 3, rejected 0" in out
    monkeypatch.setenv("CODA_DSL_CACHE", str(tmp_path / "third"))  # two exports of one kernel in one import
    rc, out, _ = run(capsys, "cache", "import", str(tmp_path / "all.tar.gz"), *map(str, parts))
    assert rc == 0 and "added 3, already present 0, rejected 0" in out
    rc, out, _ = run(capsys, "cache", "export", str(tmp_path / "k.tar.gz"))  # one file now: the parts go
    assert rc == 0 and not list(tmp_path.glob("k.part*.tar.gz")) and (tmp_path / "k.tar.gz").is_file()
    with tarfile.open(tmp_path / "empty.tar.gz", "w:gz"):
        pass
    rc, out, _ = run(capsys, "cache", "import", str(tmp_path / "empty.tar.gz"))
    assert rc == 1 and "an empty archive, with no kernel" in out


def test_a_damaged_kernel_is_listed_as_bad_and_said_skipped_by_export(capsys, tmp_path):
    good, bad = f"{1:024x}", f"{2:024x}"
    for k in (good, bad):
        _entry(tmp_path, k, b"kernel")
    (cache.entry_dir(bad) / "kernel.so").write_bytes(b"KERNEL")  # same size, other content
    rc, out, _ = run(capsys, "cache", "list")
    assert rc == 0 and f"bad {bad}: its kernel.so does not match its recorded SHA-256" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip().startswith(("0" * 20))}
    assert "yes" in rows[good] and "bad" in rows[bad]
    rc, out, _ = run(capsys, "cache", "export", str(tmp_path / "k.tar.gz"))
    assert rc == 0 and f"skipped {bad}: its kernel.so does not match" in out and good not in out


def test_compile_only_build_keeps_the_kernel_and_export_skips_an_edited_source(capsys, tmp_path, monkeypatch):
    """An imported entry (kernel.so, no kernel.o) that `build --compile-only` then compiles keeps its
    kernel.so (the new meta.json used to list the object alone: the next load rebuilt the kernel); a
    kernel.cu edited by hand in the cache is left out of an export, whose importer would reject the whole
    entry for it."""
    key = f"{7:024x}"
    _entry(tmp_path, key, b"kernel")
    obj = tmp_path / "kernel.o"
    obj.write_bytes(b"object")
    cu = tmp_path / "kernel.cu"
    cu.write_text("// Epilogue `e`\n")
    cache.commit_entry(key, {"kernel.cu": cu, "kernel.o": obj}, {"op_name": "k07"})
    assert cache.check_output(key)[0].read_bytes() == b"kernel" and cache.check_output(key, "kernel.o")[0]
    (cache.entry_dir(key) / "kernel.cu").write_text("// tried a change\n")
    rc, _, _ = run(capsys, "cache", "export", str(tmp_path / "k.tar.gz"))
    monkeypatch.setenv("CODA_DSL_CACHE", str(tmp_path / "other"))
    rc, out, _ = run(capsys, "cache", "import", str(tmp_path / "k.tar.gz"))
    assert rc == 0 and "added 1, already present 0, rejected 0" in out
    assert cache.check_output(key)[0].read_bytes() == b"kernel" and not (cache.entry_dir(key) / "kernel.cu").exists()


def test_cache_import_rejects_what_is_not_a_checked_entry(capsys, tmp_path, monkeypatch):
    """A member outside <key>/{kernel.so,kernel.cu,meta.json}, a link, a kernel.so that does not match its
    meta.json: reported and not added; the good entry beside them is added (its folder's own member passes
    unreported). A broken file: a clear error."""
    import io
    import json
    import tarfile
    good, bad = f"{1:024x}", f"{2:024x}"
    _entry(tmp_path, good, b"good")
    _entry(tmp_path, bad, b"bad!")
    path = tmp_path / "x.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        folder = tarfile.TarInfo(good)  # an entry's folder, as `tar czf x.tar.gz <key>` adds it: not rejected
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for k in (good, bad):
            for name in ("kernel.so", "meta.json"):
                data = (cache.entry_dir(k) / name).read_bytes()
                if k == bad and name == "kernel.so":
                    data = b"evil"  # same size, another hash
                info = tarfile.TarInfo(f"{k}/{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        for name in ("../escape", f"{good}/../../escape"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        link = tarfile.TarInfo(f"{good}/kernel.cu")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    monkeypatch.setenv("CODA_DSL_CACHE", str(tmp_path / "other"))
    rc, out, _ = run(capsys, "cache", "import", str(path))
    assert rc == 1 and "added 1, already present 0, rejected 4" in out
    assert f"rejected {bad}: kernel.so does not match" in out and "rejected ../escape" in out
    assert cache.check_output(good)[0].read_bytes() == b"good" and cache.check_output(bad)[0] is None
    assert json.loads((cache.entry_dir(good) / "meta.json").read_text())["op_name"] == "k01"
    assert not (tmp_path / "escape").exists() and not (tmp_path / "other" / "escape").exists()
    (tmp_path / "broken.tar.gz").write_bytes(path.read_bytes()[:100])
    rc, out, _ = run(capsys, "cache", "import", str(tmp_path / "broken.tar.gz"), str(path), str(path))
    assert rc == 1 and "broken.tar.gz: not a whole gzip'd tar file" in out  # reported with the other files' outcomes
    assert "added 0, already present 1, rejected" in out  # the good entry counted once though given twice
    for name, why in (("missing.tar.gz", "no such file"), ("", "a directory")):
        rc, _, err = run(capsys, "cache", "import", str(path), str(tmp_path / name))
        assert rc == 2 and f"cannot read {tmp_path / name}: {why}" in err  # before any file is imported
    for files, sha in (([1], {}), ({}, "abc")):  # a meta.json whose tables are of other types: rejected
        meta = json.loads((cache.entry_dir(good) / "meta.json").read_text())
        meta.update(key=f"{3:024x}", files=files, sha256=sha)
        odd = tmp_path / "odd.tar.gz"
        with tarfile.open(odd, "w:gz") as tar:
            for name, data in (("kernel.so", b"k"), ("meta.json", json.dumps(meta).encode())):
                info = tarfile.TarInfo(f"{3:024x}/{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        rc, out, _ = run(capsys, "cache", "import", str(odd))
        assert rc == 1 and "files and sha256 are not tables" in out
    for argv in (["export"], ["export", "a.tar.gz", "b.tar.gz"], ["import"], ["list", "x"], ["export", "--part-mb", "0",
                                                                                          "k.tar.gz"], []):
        with pytest.raises(SystemExit) as exited:  # argparse's usage error
            run(capsys, "cache", *argv)
        assert exited.value.code == 2 and "usage: coda-dsl" in capsys.readouterr().err
    rc, _, err = run(capsys, "cache", "export", str(tmp_path / "no" / "dir" / "k.tar.gz"))
    assert rc == 2 and "cannot write" in err and not list((tmp_path / "no").parent.glob(".k.tar.gz.tmp"))
    for folder in (str(tmp_path), "", "/"):  # a directory is not a file name: said, not a ValueError
        rc, _, err = run(capsys, "cache", "export", folder)
        assert rc == 2 and "is a directory: name the file to write" in err and "Traceback" not in err


def test_a_damaged_archive_is_rejected_whole(capsys, tmp_path, monkeypatch):
    """Bytes overwritten inside an export: tarfile would stop quietly at the first bad header (its entries then
    looked incomplete); the whole gzip stream is read first, so the file is reported damaged and nothing of it
    added."""
    for i in (1, 2, 3):
        _entry(tmp_path, f"{i:024x}", os.urandom(40_000))
    path = tmp_path / "all.tar.gz"
    assert run(capsys, "cache", "export", path)[0] == 0
    data = bytearray(path.read_bytes())
    for at in (len(data) // 3, len(data) // 2):
        damaged = tmp_path / f"damaged{at}.tar.gz"
        damaged.write_bytes(data[:at] + b"\xff" * 8 + data[at + 8:])
        monkeypatch.setenv("CODA_DSL_CACHE", str(tmp_path / f"other{at}"))
        rc, out, err = run(capsys, "cache", "import", damaged)
        assert rc == 1 and "added 0" in out and f"{damaged.name}: not a whole gzip'd tar file" in out, out + err


def test_every_command_and_option_has_help():
    subs = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = {c.dest: c.help for c in subs._choices_actions}
    assert set(listed) == set(subs.choices) and all(listed.values())
    for name, p in subs.choices.items():
        if name == "bench":
            continue  # `coda-dsl bench --help` is the benchmark's own help
        assert p.description, name
        for action in p._actions:
            assert action.help, (name, action.dest)


def test_help_literals_match_their_sources():
    from coda_dsl.ir.ops import DTYPES
    assert cli.DTYPE_NAMES == tuple(DTYPES) and cli.DEFAULT_CONFIG == cd.Config().text


def fresh_python(code: str) -> str:
    """stdout of `code` run in a fresh interpreter (this one has torch and more imported already)."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stdout[-300:] + res.stderr
    return res.stdout


def test_help_and_import_do_not_import_torch():
    """`coda-dsl --help` answers without importing torch (1-2 s); so do `import coda_dsl` and each command's
    --help. Run in a fresh interpreter: this one has torch already."""
    code = ("import sys, coda_dsl, coda_dsl.cli as cli\n"
            "for argv in [['--help']] + [[c, '--help'] for c in ('emit', 'explain', 'build', 'cache', "
            "'doctor', 'demo')]:\n"
            "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')")
    assert fresh_python(code).rstrip().endswith("no torch")


def test_loading_kernels_does_not_import_dynamo():
    """A process that only runs kernels (trace, key, find in the cache, call) never imports torch._dynamo
    (1.5 s of a fresh process's start on 2 cores); cd.linear's derivation marks its key function constant
    for Dynamo as torch.compiler.assume_constant_result would, without importing it."""
    code = ("import sys, torch, coda_dsl as cd, coda_dsl.nn\n"
            "from coda_dsl import cli\n"
            "op = cli.specialization_from_options(cli.load_epilogue('coda_dsl.examples:bias_gelu'), 'bf16')\n"
            "op.unit.key, cd.forward_epilogue(cd.library.swiglu)\n"
            "cd.gemm(torch.randn(8, 8), torch.randn(8, 8), cd.identity, backend='reference')\n"
            "print('dynamo imported' if 'torch._dynamo' in sys.modules else 'no dynamo')\n"
            "from coda_dsl.runtime.torch_compile import constant_under_compile\n"
            "marked = torch.compiler.assume_constant_result(lambda: 0)\n"
            "print(vars(marked) == vars(constant_under_compile(lambda: 0)) == {'_dynamo_marked_constant': True})")
    assert fresh_python(code).split() == ["no", "dynamo", "True"]


def test_license_is_named_in_setup():
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "Copyright (c)" in text and "the coda_dsl authors" in text
    setup = (REPO / "setup.py").read_text()
    assert 'license="BSD-3-Clause"' in setup and 'license_files=["LICENSE"]' in setup


@pytest.mark.skipif(HOPPER, reason="on a Hopper GPU the demo builds the kernel (slow)")
def test_demo_on_cpu(capsys):
    rc, out, _ = run(capsys, "demo", "--m", "64", "--n", "128", "--k", "32")
    assert rc == 0
    assert "[64, 128]" in out and "h_gamma" in out
    assert "No Hopper" in out and "coda-dsl emit coda_dsl.examples:residual_rms" in out


def test_bench_passes_args(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(cli.subprocess, "call", lambda argv, cwd: seen.append((argv, cwd)) or 0)
    rc, out, _ = run(capsys, "bench", "--shapes", "4096x4096x4096", "-h")
    if (REPO / "bench" / "__main__.py").is_file():
        assert rc == 0 and seen == [([sys.executable, "-m", "bench", "--shapes", "4096x4096x4096", "-h"], REPO)]
    else:
        assert rc == 1 and "bench/" in out


def test_python_dash_m():
    res = subprocess.run([sys.executable, "-m", "coda_dsl", "cache", "list"], capture_output=True, text=True,
                         cwd=REPO)
    assert res.returncode == 0 and "entries" in res.stdout
    res = subprocess.run([sys.executable, "-m", "coda_dsl", "explain", "nope.py:f"], capture_output=True,
                         text=True, cwd=REPO)
    assert res.returncode == 2 and res.stderr.strip() == "coda-dsl explain: error: no such file: nope.py"


def test_explain_shape_shows_the_default_config_and_why(capsys, monkeypatch):
    """The rule of this machine's GPU (none: the H200's), named with the reason."""
    from coda_dsl.runtime import tune
    for gpu, config, why in (("", "128x192x64_c2x1_pingpong", "no GPU here: the H200's rule"),
                             ("NVIDIA H100 80GB HBM3", "128x256x64_c2x1_cooperative", "measured fastest on H100s")):
        monkeypatch.setattr(tune, "gpu_name", lambda device=None, gpu=gpu: gpu)
        rc, out, _ = run(capsys, "explain", "coda_dsl.examples:bias_gelu", "--shape", "8192x6144x4096")
        assert rc == 0 and f"config {config}\n" in out and why in out
    for gpu, config in (("H100", "128x256x64_c2x1_cooperative"), ("H200", "128x192x64_c2x1_pingpong")):
        rc, out, _ = run(capsys, "explain", "coda_dsl.examples:bias_gelu", "--shape", "8192x6144x4096", "--gpu", gpu)
        assert rc == 0 and f"config {config}\n" in out and f"{gpu}: " in out  # whatever this machine has
    rc, _, err = run(capsys, "explain", "coda_dsl.examples:bias_gelu", "--gpu", "H100")
    assert rc != 0 and "give --shape too" in err
    rc, _, err = run(capsys, "explain", "coda_dsl.examples:bias_gelu", "--shape", "8192x6144x4096", "--gpu", " ")
    assert rc != 0 and "--gpu needs a GPU's name" in err
    rc, out, err = run(capsys, "explain", "coda_dsl.examples:bias_gelu", "--shape", "8192x6144x4096", "--gpu", "h200")
    assert "config 128x192x64_c2x1_pingpong\n" in out and "h200: the H200's rule" in out  # any case, measured
    assert "names none of" not in err
    for command in ("explain", "emit"):  # a typo gets the H200's rule, and says so
        rc, out, err = run(capsys, command, "coda_dsl.examples:bias_gelu", "--shape", "8192x6144x4096", "--gpu", "H10")
        assert rc == 0 and "--gpu 'H10' names none of H100, H200, whose rules were measured" in err
    rc, out, _ = run(capsys, "explain", "coda_dsl.examples:bias_gelu", "--shape", "8192x4096x4096",
                     "--config", "128x128x64_c1x1_cooperative")
    assert "config 128x128x64_c1x1_cooperative\n" in out and "(--config)" in out
    for bad in (["explain", "coda_dsl.examples:bias_gelu", "--shape", "8192x4096"],
                ["explain", "coda_dsl.examples:bias_gelu", "--shape", "0x4096x4096"], ["demo", "--m", "-4"]):
        with pytest.raises(SystemExit):  # argparse's usage error, not a traceback from deeper down
            cli.main(bad)


def test_cd_take_indices_are_int64_in_the_cli_as_in_cd_gemm():
    """The CLI's specialization of an epilogue with cd.take is the one cd.gemm makes (indices int64, not
    --dtype), so `coda-dsl build` builds the kernel a call will load."""
    from coda_dsl.runtime import op as runtime

    @cd.epilogue
    def pick(acc, target: cd.VecM):
        return {"D": acc, "t": cd.take(acc, target)}
    a, b = torch.randn(64, 32).bfloat16(), torch.randn(48, 32).bfloat16()
    call = call_checks.normalize(pick, a, b, {"target": torch.zeros(64, dtype=torch.int64)}, None)
    by_gemm = runtime.specialization(pick, call, call_checks._check_tensors(pick, call, cutlass=True), None, None)
    assert cli.specialization_from_options(pick, "bf16").key == by_gemm.key
    with pytest.raises(cli.CliError, match="which are int64"):
        cli.specialization_from_options(pick, "bf16", operand_dtypes={"target": "fp32"})
    # saying what they are anyway is no contradiction
    assert cli.specialization_from_options(pick, "bf16", operand_dtypes={"target": "int64"}).key == by_gemm.key


def test_emit_and_build_take_the_shapes_config(capsys, monkeypatch):
    """--shape gives emit and build the kernel cd.gemm would load for that shape (not the shape-free default)."""
    from coda_dsl.runtime import tune
    monkeypatch.setattr(tune, "default", lambda m, n, k, l=1, gpu=None: (tune.PINGPONG_192, "a rule by shape"))
    rc, out, _ = run(capsys, "emit", "coda_dsl.examples:bias_gelu", "--shape", "8192x6144x4096")
    assert rc == 0 and "KernelTmaWarpSpecializedPingpong" in out and "Shape<_128, _192, _64>" in out
    built = []
    monkeypatch.setattr(cli.build, "build_units", lambda units, **kw: built.extend(units) or ["x.so"])
    monkeypatch.setattr(cli.build.cache, "read_meta", lambda key: None)
    rc, _, _ = run(capsys, "build", "coda_dsl.examples:bias_gelu", "--shape", "8192x6144x4096")
    assert rc == 0 and "Shape<_128, _192, _64>" in built[0].cu_text


def test_backward_is_the_one_cd_linear_derives(capsys, tmp_path):
    """--backward shows what cd.linear runs: statistics with no derivative (an amax, e.g. an fp8 scale) left
    out rather than refused, the statistics' gradient and saved operands in fp32 (an output read back in its
    own dtype), --const checked as for the forward."""
    f = tmp_path / "eps.py"
    f.write_text("import coda_dsl as cd\n\n"
                 "@cd.epilogue\ndef scaled(acc, c: cd.Const):\n    y = cd.gelu(acc * c)\n"
                 "    return {'D': y, 'amax': cd.amax(y, axis=None), 'ss': cd.sum(y * y, axis='n').then(cd.rsqrt)}\n")
    rc, out, err = run(capsys, "explain", f"{f}:scaled", "--backward", "--const", "c=2")
    assert rc == 0, err
    assert "grad_amax" not in out and "grad_ss (fp32)" in out and "saved_ss (fp32)" in out and "grad_D (bf16)" in out
    for consts, message in (((), "pass --const c=VALUE"), (("c=2", "zz=1"), "no cd.Const parameter 'zz'")):
        rc, _, err = run(capsys, "explain", f"{f}:scaled", "--backward", *(a for c in consts for a in ("--const", c)))
        assert rc != 0 and message in err
    h = tmp_path / "total.py"  # a statistic of everything: its gradient and saved value are scalars, no dtype
    h.write_text("import coda_dsl as cd\n\n@cd.epilogue\ndef total(acc, eps: cd.Scalar):\n"
                 "    return {'D': acc, 't': cd.sum(acc * acc, axis=None).then(lambda s: cd.rsqrt(s + eps))}\n")
    for command in ("explain", "emit"):
        rc, out, err = run(capsys, command, f"{h}:total", "--backward")
        assert rc == 0, err
    assert "grad_t: scalar, saved_t: scalar" in run(capsys, "explain", f"{h}:total", "--backward")[1]
    r = tmp_path / "read_back.py"  # an output read back (saved_D) has --dtype's dtype; a cast output's gradient its own
    r.write_text("import coda_dsl as cd\n\n@cd.epilogue\ndef rms(acc, eps: cd.Scalar):\n    h = acc * 2.0\n"
                 "    return {'D': h, 'r': cd.sum(h * h, axis='n').then(lambda s: cd.rsqrt(s + eps))}\n\n"
                 "@cd.epilogue\ndef rms32(acc, eps: cd.Scalar):\n    h = acc * 2.0\n"
                 "    return {'D': cd.cast(h, 'fp32'), 'r': cd.sum(h * h, axis='n').then(lambda s: cd.rsqrt(s + eps))}\n")
    for fn, inputs in (("rms", "grad_D (bf16), grad_r (fp32), saved_D (bf16), saved_r (fp32)"),
                       ("rms32", "grad_D (fp32), grad_r (fp32), saved_r (fp32)")):  # (a cast is not read back)
        rc, out, err = run(capsys, "explain", f"{r}:{fn}", "--backward")
        assert rc == 0, err
        assert f"inputs:  {inputs}\n" in out
    g = tmp_path / "flat.py"  # a backward with no output: said so, not a traceback
    g.write_text("import coda_dsl as cd\n\n@cd.epilogue\ndef only_max(acc):\n    return {'m': cd.amax(acc, axis=None)}\n\n"
                 "@cd.epilogue\ndef steps(acc):\n    return cd.where(acc > 0, 1.0, 0.0) + cd.round(acc)\n")
    for command in ("explain", "emit"):
        for fn in ("only_max", "steps"):
            rc, _, err = run(capsys, command, f"{g}:{fn}", "--backward")
            assert rc == 2 and f"epilogue '{fn}' has no backward to show" in err and "Traceback" not in err


def test_explain_and_emit_backward(capsys):
    """The derived backward is an ordinary epilogue: explain lists its IR and plan, emit its .cu."""
    rc, out, _ = run(capsys, "explain", "coda_dsl.examples:bias_gelu", "--backward")
    assert rc == 0 and "epilogue bias_gelu_backward(bias: vec_n, grad_D: tensor)" in out
    assert "out acc:" in out and "out bias:" in out and "reduce[('sum', 'm')]" in out
    rc, out, _ = run(capsys, "emit", "coda_dsl.examples:bias_gelu", "--backward")
    assert rc == 0 and "coda::ColumnReduction<" in out and "Epilogue `bias_gelu_backward`" in out


def test_a_blank_cxx_means_unset(monkeypatch):
    """CXX="   " linked with nothing (doctor crashed on it): blank is unset, as empty is."""
    from coda_dsl.build import tools
    monkeypatch.setenv("CXX", "   ")
    assert tools.linker() == ["c++"]


def test_an_extra_argument_shows_its_commands_usage(capsys):
    with pytest.raises(SystemExit):
        cli.main(["doctor", "extra"])
    err = capsys.readouterr().err
    assert "usage: coda-dsl doctor" in err and "unrecognized arguments: extra" in err
