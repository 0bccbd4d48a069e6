"""`coda-dsl` (also `python -m coda_dsl`): emit, explain, build, cache, doctor, demo, bench.

Targets are `FILE.py:FUNCTION` or `package.module:FUNCTION`, where FUNCTION is an epilogue
(a function decorated with @cd.epilogue). Everything except `build`, `emit --check` and `demo`
on a Hopper GPU runs without a GPU or a compiler run.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable

# Only torch-free modules here: torch and the DSL (which needs it) are imported by the commands that
# use them, so that `coda-dsl --help` answers at once.
from . import build
from .build import ToolchainError
from .errors import CodaError, SharedMemoryError, UnsupportedError

if TYPE_CHECKING:
    from .dsl import Epilogue
    from .passes.plan import Config
    from .runtime.op import CompiledOp

# The --help texts spell out two values that live in torch-importing modules (test_cli checks them)
DTYPE_NAMES = ("bf16", "fp16", "fp32")  # ir.ops.DTYPES
DEFAULT_CONFIG = "128x256x64_c2x1_cooperative"  # Config().text

REPO_ROOT = Path(__file__).resolve().parent.parent


class CliError(CodaError):
    """A bad command line or target; printed as one line, exit code 2."""


def _err(*args) -> None:
    print(*args, file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Targets and specializations
# ---------------------------------------------------------------------------------------------
def _import(where: str):
    if not (where.endswith(".py") or os.sep in where or Path(where).is_file()):
        return importlib.import_module(where)
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise CliError(f"{where} is a directory: name a .py file" if path.is_dir() else
                       f"{where} is not a regular file: name a .py file" if path.exists() else f"no such file: {where}")
    if path.suffix != ".py":  # Python imports only .py sources
        raise CliError(f"{where} is not a .py file: name a Python source file, or a module (pkg.module:FUNCTION)")
    # The file's directory on sys.path, as `python FILE.py` would have it, so its own imports work.
    sys.path.insert(0, str(path.parent))
    name = f"_coda_dsl_target_{path.stem}"  # never shadows a real module (e.g. a user's test.py)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module


def load_epilogue(target: str) -> Epilogue:
    """`path/to/file.py:fn` or `pkg.module:fn` -> the Epilogue object it names."""
    from .dsl import Epilogue
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise CliError(f"expected FILE.py:FUNCTION or module:FUNCTION, got {target!r}")
    try:
        module = _import(where)
    except CodaError:
        raise  # tracing errors already name the user's line
    except ModuleNotFoundError as e:
        if e.name and where.startswith(e.name):
            raise CliError(f"no module named {where!r} (a file needs its path: {where.replace('.', '/')}.py)") from None
        raise CliError(f"cannot import {where}: {e}") from None
    except SystemExit as e:
        raise CliError(f"importing {where} called sys.exit({e.code!r}): guard its script part with "
                       "`if __name__ == \"__main__\":`") from None
    except Exception as e:  # the user's module failed: say where, without a traceback
        tb = traceback.extract_tb(e.__traceback__)
        file, line = (e.filename, e.lineno) if isinstance(e, SyntaxError) else \
            (tb[-1].filename, tb[-1].lineno) if tb else (None, None)
        at = f" ({Path(file).name}:{line})" if file else ""
        msg = e.msg if isinstance(e, SyntaxError) else e
        raise CliError(f"importing {where} failed: {type(e).__name__}: {msg}{at}") from None
    obj = getattr(module, attr, None)
    if isinstance(obj, Epilogue):
        return obj
    found = sorted(k for k, v in vars(module).items() if isinstance(v, Epilogue) and not k.startswith("_"))
    have = f"; its epilogues: {', '.join(found)}" if found else "; it defines no epilogue"
    if obj is None:
        raise CliError(f"{where} has no {attr!r}{have}")
    if getattr(obj, "makes_epilogues", False):
        raise CliError(f"{attr!r} in {where} is a cd.epilogue_factory, which makes epilogues: the CLI takes an "
                       f"epilogue; name one it makes in a file (ep = {attr}(...)) and pass FILE.py:ep{have}")
    raise CliError(f"{attr!r} in {where} is of type {type(obj).__name__}, not an epilogue: decorate it with "
                   f"@cd.epilogue{have}")


def _pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise CliError(f"{flag} expects NAME=VALUE, got {item!r}")
        if name.strip() in out:
            raise CliError(f"{flag} {name.strip()} is given twice ({out[name.strip()]} and {value.strip()}): give it once")
        out[name.strip()] = value.strip()
    return out


def specialization_from_options(ep: Epilogue, ab_dtype: str = "bf16", b_layout: str = "nk",
                   operand_dtypes: dict[str, str] | None = None, consts: dict[str, str | float] | None = None,
                   config: Config | str | None = None, a_layout: str = "mk") -> CompiledOp:
    """Signature -> plan -> key -> .cu, from options alone (no tensors, no GPU). Every tensor/vector
    operand defaults to ab_dtype and every output to its own dtype or ab_dtype, as in cd.gemm."""
    from .ir.graph import LOAD_KINDS
    from .ir.ops import DTYPES
    from .passes.plan import Config
    from .ir.ops import INDEX_DTYPE
    from .runtime.call import index_operands
    from .runtime.op import CompiledOp, signature
    if ab_dtype not in ("bf16", "fp16"):
        raise CliError(f"--dtype must be bf16 or fp16 (the dtype of A and B), not {ab_dtype!r}")
    if b_layout not in ("nk", "kn"):
        raise CliError(f"--b-layout must be nk or kn, not {b_layout!r}")
    if a_layout not in ("mk", "km"):
        raise CliError(f"--a-layout must be mk or km, not {a_layout!r}")
    kinds = {p.name: p.kind for p in ep.params}
    indices = index_operands(ep)
    operand_dtypes = dict(operand_dtypes or {})
    for name, dt in operand_dtypes.items():
        if kinds.get(name) not in LOAD_KINDS:
            loads = [n for n, k in kinds.items() if k in LOAD_KINDS]
            raise CliError(f"--operand-dtype {name}: epilogue '{ep.name}' has no tensor/vector operand "
                           f"{name!r} (it has: {', '.join(loads) or 'none'})")
        if name in indices:
            if dt == "int64":
                continue
            raise CliError(f"--operand-dtype {name}={dt}: '{name}' holds column indices (cd.take, cd.onehot), "
                           "which are int64 (leave it out of --operand-dtype)")
        if dt not in DTYPES:
            raise CliError(f"--operand-dtype {name}={dt}: dtype must be one of {', '.join(DTYPES)}")
    dtypes = {n: INDEX_DTYPE if n in indices else operand_dtypes.get(n, ab_dtype)
              for n, k in kinds.items() if k in LOAD_KINDS}

    values = _const_values(ep, consts or {})
    if isinstance(config, str):
        try:
            config = Config.parse(config)
        except ValueError as e:
            raise CliError(str(e)) from None

    return CompiledOp.create(ep, signature(ep, ab_dtype, b_layout, dtypes, values, config, a_layout=a_layout))


def _const_values(ep: Epilogue, consts: dict[str, str | float]) -> dict[str, float]:
    """--const values, checked against the epilogue's cd.Const parameters: one number for each."""
    kinds = {p.name: p.kind for p in ep.params}
    values = {}
    for name, v in consts.items():
        if kinds.get(name) != "const":
            declared = [n for n, k in kinds.items() if k == "const"]
            from .dsl.types import annotation_of  # (here: the dsl package imports torch, which --help must not)
            kind = f"; {name!r} is a {annotation_of(kinds[name])}, given at each call: drop --const {name}" \
                if name in kinds else ""
            raise CliError(f"--const {name}: epilogue '{ep.name}' has no cd.Const parameter {name!r} "
                           f"(it has: {', '.join(declared) or 'none'}){kind}")
        try:
            values[name] = float(v)
        except ValueError:
            raise CliError(f"--const {name}={v}: not a number") from None
    missing = [n for n, k in kinds.items() if k == "const" and n not in values]
    if missing:
        raise CliError(f"epilogue '{ep.name}' needs a value for its cd.Const parameter(s) "
                       f"{', '.join(missing)}: pass --const {missing[0]}=VALUE")
    return values


def _epilogue_from_args(args) -> tuple[Epilogue, dict, dict]:
    """The epilogue the command works on, its --const values and operand dtypes other than --dtype's. With
    --backward: the backward cd.linear runs (consts bound), whose operands grad_<output> and saved_<output>
    (an output read back, or a statistic) have that output's dtype, as cd.linear passes them: fp32 for a
    statistic, the declared dtype of a cast output, else --dtype's."""
    ep = load_epilogue(args.target)
    consts = _pairs(args.const, "--const")
    if not getattr(args, "backward", False):
        return ep, consts, {}
    from .ir.graph import LOAD_KINDS, reduction_of
    from .passes.autodiff import GRAD, SAVED
    from .runtime.autograd import derived_backward
    back = derived_backward(ep, **_const_values(ep, consts))
    if not back.program.outputs:
        raise CliError(f"epilogue '{ep.name}' has no backward to show: no output passes a gradient to A, B or an "
                       "operand (rounding and comparisons have a zero gradient; cd.max, cd.min and cd.amax "
                       "statistics have no derivative yet)")
    dtypes = {prefix + o.name: "fp32" if reduction_of(o.node) is not None else o.dtype
              for o in ep.program.outputs for prefix in (GRAD, SAVED)}
    # (a statistic of everything is a cd.Scalar: no dtype)
    return back, {}, {p.name: dtypes[p.name] for p in back.params if p.kind in LOAD_KINDS and dtypes.get(p.name)}


def _spec_from_args(args, epilogue: tuple[Epilogue, dict, dict] | None = None) -> tuple[Epilogue, CompiledOp]:
    ep, consts, dtypes = epilogue or _epilogue_from_args(args)
    given = _pairs(args.operand_dtype, "--operand-dtype")
    dtypes = {**dtypes, **given}
    config = args.config
    if args.gpu is not None and not args.shape:
        raise CliError("--gpu names the GPU whose rule picks the configuration for --shape: give --shape too")
    if args.gpu is not None and not args.gpu.strip():
        raise CliError("--gpu needs a GPU's name, e.g. H100 or H200")
    if args.shape and not config:  # the configuration cd.gemm would pick, untuned, for this shape
        from .runtime.tune import MEASURED, default, measured
        if args.gpu is not None and not measured(args.gpu):  # a typo of H100 must not pass unnoticed
            _err(f"coda-dsl: --gpu {args.gpu!r} names none of {', '.join(MEASURED)}, whose rules were measured: "
                 "it gets the H200's rule")
        config = default(*args.shape, gpu=args.gpu)[0].text
    spec = specialization_from_options(ep, args.dtype, args.b_layout, dtypes, consts, config, args.a_layout)
    for name in given:
        if name not in spec.plan.inputs:  # declared, never read: the dtype changes nothing
            _err(f"note: --operand-dtype {name}: epilogue '{ep.name}' does not read '{name}', so its dtype changes "
                 "nothing")
    return ep, spec


def _shape_notes(spec: CompiledOp, shape: tuple[int, int, int]) -> list[str]:
    """Why no call, or no kernel, runs this shape (what cd.gemm checks of a shape before launching)."""
    from .runtime.call import n_problem
    notes = []
    if problem := n_problem(spec.epilogue, shape[1]):
        notes.append(f"no call has this shape: {problem}; cd.gemm refuses it on every backend")
    try:  # TMA's 16-byte groups
        spec.check_widths(_meta_call(shape, spec.plan.signature))
    except UnsupportedError as e:
        notes.append("no kernel runs this shape (backend='auto' falls back to the reference backend): "
                     + str(e).splitlines()[0])
    return notes


def _meta_call(shape: tuple[int, int, int], sig):
    """A call of this shape and signature's dtypes and layouts, on no device (what checks of shapes read)."""
    import torch

    from .ir.ops import DTYPES
    from .runtime.call import Call
    (m, n, k), dt = shape, DTYPES[sig.ab_dtype]
    empty = lambda rows, cols, stored: (torch.empty(rows, cols, dtype=dt, device="meta") if stored else  # noqa: E731
                                        torch.empty(cols, rows, dtype=dt, device="meta").t())
    try:
        return Call(empty(m, k, sig.a_layout == "mk"), empty(n, k, sig.b_layout == "nk"), {}, {}, {})
    except RuntimeError as e:  # e.g. M x K past what a tensor's byte size can hold
        raise CliError(f"--shape {m}x{n}x{k}: no tensor holds A or B of that size ({str(e).splitlines()[0]})") from None


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------
BACKWARD_HELP = "the backward cd.linear derives for the epilogue (run as torch ops in training), instead of it"


def cmd_emit(args) -> int:
    _, spec = _spec_from_args(args)
    for note in _shape_notes(spec, args.shape) if args.shape else ():
        _err(f"note: {note}")  # stderr: stdout may be the .cu itself
    if args.output == "":
        raise CliError("-o names no file: give a file name, or leave -o out (or -o -) to print the .cu")
    if args.output not in (None, "-"):
        where = args.target.rpartition(":")[0]  # a file, or a module (imported by now)
        source = Path(where) if Path(where).is_file() else getattr(sys.modules.get(where), "__file__", None)
        if Path(args.output).suffix == ".py" or (
                source and Path(args.output).exists() and os.path.samefile(source, args.output)):
            raise CliError(f"-o {args.output} is Python source, which the .cu would replace: name a .cu file")
        try:
            Path(args.output).write_text(spec.cu_text)
        except OSError as e:
            raise CliError(f"cannot write {args.output}: {e.strerror or e}") from None
        _err(f"wrote {args.output} (key {spec.key}, op coda_dsl::{spec.op_name})")
    elif sys.stdout is None:  # started with stdout closed
        raise CliError("stdout is closed: write the .cu to a file with -o FILE")
    else:
        try:
            sys.stdout.write(spec.cu_text)
            sys.stdout.flush()
        except BrokenPipeError:  # the reader stopped (`| head`): --check still runs
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if args.check:
        # stdout may be the .cu itself: progress goes to stderr
        obj = build.build_units([spec.unit], compile_only=True, log=_err)[0]
        _err(f"nvcc compile check passed: {obj}")
    return 0


def cmd_explain(args) -> int:
    from .codegen.cpp import functor as cpp_functor
    from .codegen.evt import node as cpp_node
    from .ir import format_program
    from .passes.plan import OUTPUT_SHAPES
    ep, consts, dtypes = _epilogue_from_args(args)
    try:
        ep, spec = _spec_from_args(args, (ep, consts, dtypes))
    except SharedMemoryError:  # another config would build: its message names one
        raise
    except UnsupportedError as e:  # no kernel for it: still show the program, then why
        print(f"# epilogue {ep.name} ({ep.defined_at})\n\n## IR\n{format_program(ep.program)}")
        print(f"\n## no kernel: it runs on the reference backend only\n  {e}")
        return 1
    plan, sig = spec.plan, spec.plan.signature
    print(f"# epilogue {ep.name} ({ep.defined_at})")
    consts = ", ".join(f"{k}={v:g}" for k, v in sig.consts)
    print(f"\n## IR{f' (consts bound: {consts})' if consts else ''}\n{format_program(spec.program)}")
    print(f"\n## EVT plan: {'Sm90EVT' if len(plan.nodes) == 2 else 'Sm90TopologicalVisitor'} over {len(plan.nodes)} nodes, children first; "
          + (f"the last yields D ({plan.d_dtype})" if plan.d_dtype else "CUTLASS's D is not stored (outputs below)"))
    width = max(len(n.name) for n in plan.nodes)
    for i, n in enumerate(plan.nodes):
        kids = ", ".join(map(str, n.children)) or "-"
        print(f"  [{i}] {n.name:<{width}}  <- ({kids})  {cpp_node(n).type}" + (f"  // {n.comment}" if n.comment else ""))
    print("\n## functors")
    for f in map(cpp_functor, plan.functors):
        print(f"  {f.name}({', '.join(f'x{i}' for i in range(f.arity))})" + (f"  // {f.text}" if f.text else ""))
        result = f"return (even column: {f.result}, odd column: {f.result_odd});" if f.pairwise else f"return {f.result};"
        for line in [*f.body, result]:
            print(f"    {line}")
    print("\n## binding")
    print(f"  inputs:  {', '.join(f'{n} ({d})' for n, d in sig.operand_dtypes if n in plan.inputs) or '-'}")
    print(f"  scalars: {', '.join(plan.scalars) or '-'}")
    outs = ([f"D ({plan.d_dtype}, [M, N])"] if plan.d_dtype else []) + [
        f"{n} ({d}, {OUTPUT_SHAPES[k][0]})" for n, d, k in plan.outputs]
    print(f"  outputs: {', '.join(outs)}")
    print(f"\n## specialization\n  A/B {sig.ab_dtype}, A layout {sig.a_layout}, B layout {sig.b_layout}, "
          f"config {sig.config.text}")
    if args.shape:
        from .runtime.tune import default
        print(f"  config for M x N x K = {' x '.join(map(str, args.shape))}: " +
              (f"{args.config} (--config)" if args.config else default(*args.shape, gpu=args.gpu)[1]))
        for note in _shape_notes(spec, args.shape):
            print(f"  note: {note}")
    print(f"  key {spec.key}  (op coda_dsl::{spec.op_name})")
    try:  # the cache entry also depends on the toolchain; explaining needs none
        print(f"  build key {build.build_key(spec.key)}  (its cache entry with this toolchain)")
    except ToolchainError as e:
        print(f"  build key: unknown, no toolchain here ({e})")
    print(f"  canonical: {plan.canonical}")
    return 0


def cmd_build(args) -> int:
    _, spec = _spec_from_args(args)
    start = time.time()
    path = build.build_units([spec.unit], compile_only=args.compile_only, log=_err)[0]
    # Built here, or found (perhaps after waiting for another process's build)?
    meta = build.cache.read_meta(build.build_key(spec.key)) or {}
    ours = meta.get("pid", os.getpid()) == os.getpid() and meta.get("created", start) >= start
    print(f"{'built' if ours else 'already in the cache'}: {path}")
    return 0


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _age(seconds: float) -> str:
    for unit, s in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= s:
            return f"{seconds / s:.0f}{unit}"
    return f"{seconds:.0f}s"


def cmd_cache(args) -> int:
    root = build.cache_dir()
    if args.action == "export":
        done = build.export_cache(Path(args.file), max(1, int(args.part_mb * 2**20)) if args.part_mb else None)
        for p in done.parts:
            print(f"wrote {p} ({_size(p.stat().st_size)})")
        for why in done.skipped:
            print(f"  skipped {why}")
        return 0
    if args.action == "import":
        got = build.import_cache([Path(f) for f in args.files])
        print(f"{root}: added {len(got.added)}, already present {len(got.present)}, rejected {len(got.rejected)}")
        for why in got.rejected:
            print(f"  rejected {why}")
        return 1 if got.rejected else 0
    if args.action == "clear":
        cleared = build.clear_cache()
        n = cleared.removed
        print(f"removed {n} cache entr{'y' if n == 1 else 'ies'} from {root}")
        for busy in cleared.busy:
            print(f"  kept {busy}: it is being built now; clear again once that build is done")
        return 0
    entries = build.cache_entries(verify=True)
    print(f"cache {root}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, "
          f"{_size(sum(e['size'] for e in entries))}")
    if entries:
        from .codegen import file_header_fields
        rows = [(e, *file_header_fields(e["cu_path"])) for e in sorted(entries, key=lambda e: -e["mtime"])]
        width = max(len("epilogue"), *(len(name) for _, name, _ in rows))
        print(f"  {'key':<24}  {'epilogue':<{width}}  {'size':>9}  {'age':>4}  .so  config")
        now = time.time()
        for e, name, config in rows:
            so = "yes" if e["has_so"] else "bad" if e["so_problem"] else "no"
            print(f"  {e['key']:<24}  {name:<{width}}  {_size(e['size']):>9}  {_age(now - e['mtime']):>4}  "
                  f"{so:<3}  {config}")
        for e in entries:
            if e["so_problem"]:
                print(f"  bad {e['key']}: its {e['so_problem']} (rebuilt at its next use; `coda-dsl cache clear` "
                      "removes it)")
    return 0


def _probe(fn):
    """(value, None) or (None, message) for one doctor check."""
    try:
        return fn(), None
    except (ToolchainError, OSError, ImportError, RuntimeError) as e:
        return None, str(e)


def _probe_row(row, what: str, fn, fix: str, describe) -> object:
    """One doctor row from a probe: ok with describe(value), or FAIL with the probe's message and `fix`."""
    value, err = _probe(fn)
    if err:
        row("FAIL", what, err, fix)
    else:
        row("ok", what, describe(value))
    return value


def torch_cuda_problem() -> str | None:
    """Why kernels cannot run with the installed torch (a CPU-only build, or one of a CUDA older than
    tools.MIN_CUDA), else None. The one check behind doctor's torch line; the real-nvcc compile tests skip
    with its message."""
    import torch

    from .runtime.checks import old_runtime
    if not torch.version.cuda:
        return (f"torch {torch.__version__} is a CPU-only build: it cannot make the CUDA tensors, streams and "
                "workspaces that kernels run on")
    return old_runtime()


def cmd_doctor(args) -> int:
    from .build import tools  # the per-piece probes behind toolchain(), to say which piece is missing
    rows: list[tuple[str, str, str, str]] = []  # (status, what, detail, fix)

    def row(status, what, detail, fix=""):
        rows.append((status, what, detail, fix))

    row("ok", "python", f"{platform.python_version()} ({sys.executable})")
    import torch
    problem = torch_cuda_problem()
    if problem:
        row("FAIL", "torch", problem, f"install a torch built with CUDA {tools.MIN_CUDA_TEXT}+ "
                                      "(https://pytorch.org/get-started/locally/)")
    else:
        row("ok", "torch", f"{torch.__version__}, CUDA {torch.version.cuda} build")
    _probe_row(row, "nvcc", lambda: (nv := tools.find_nvcc()) + (tools.nvcc_version(nv[0]),),
               f"a CUDA toolkit {tools.MIN_CUDA_TEXT}+: install one, or point CUDA_HOME at one",
               lambda n: f"{n[0]} ({n[2]}; CUDA_HOME {n[1]})")
    pip_cutlass = "pip install nvidia-cutlass"
    _probe_row(row, "CUTLASS", tools.find_cutlass, f"point CODA_DSL_CUTLASS_DIR at a CUTLASS checkout, or unset it and "
               f"{pip_cutlass}" if os.environ.get("CODA_DSL_CUTLASS_DIR") else pip_cutlass,
               lambda c: f"{c[1]} headers in {c[0][0]}")
    version = lambda tool: subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    _probe_row(row, "ninja", tools.ninja_binary, "pip install ninja", lambda n: f"{n} ({version(n)})")
    cxx = tools.linker()[0]
    if shutil.which(cxx):
        row("ok", "c++", f"{shutil.which(cxx)} (links the kernel libraries)")
    else:
        row("FAIL", "c++", f"{cxx} not found", "install a C++ compiler (g++), or set CXX")
    template = build.templates_dir() / "kernel.cu.j2"
    if template.is_file() and build.csrc_dir().is_dir():
        row("ok", "templates", str(template.parent))
    else:
        row("FAIL", "templates", f"{template} or {build.csrc_dir()} missing", "reinstall coda_dsl")
    try:
        root = build.cache_dir()
        ok = os.access(root, os.W_OK)
        n = len(build.cache_entries())
        row("ok" if ok else "FAIL", "cache", f"{root} ({n} entr{'y' if n == 1 else 'ies'})"
            + ("" if ok else ", not writable"), "" if ok else "set CODA_DSL_CACHE to a writable directory")
    except OSError as e:
        row("FAIL", "cache", str(e), "set CODA_DSL_CACHE to a writable directory")

    hopper = False
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            hopper |= cap == (9, 0)
            row("ok" if cap == (9, 0) else "warn", f"GPU {i}", f"{torch.cuda.get_device_name(i)}, sm_{cap[0]}{cap[1]}")
    else:
        row("warn", "GPU", "no GPU visible to torch", "kernels can still be generated, compile-checked and "
            "built; cd.gemm runs on the reference backend (slow)")
    can_build = not any(r[0] == "FAIL" for r in rows)
    if can_build and hopper:
        row("ok", "cutlass backend", "can run here")
    else:
        row("warn", "cutlass backend", "cannot run here: " + ("it needs an sm_90 (Hopper) GPU" if not hopper
                                                             else "kernels cannot be built"),
            "run on an H100/H200" if not hopper else "fix the FAIL lines above")

    width = max(len(r[1]) for r in rows)
    for status, what, detail, fix in rows:
        print(f"  {status:<4}  {what:<{width}}  {detail}")
        if fix and status != "ok":
            print(f"  {'':<4}  {'':<{width}}  {'fix' if status == 'FAIL' else 'note'}: {fix}")
    print("ready to build kernels" if can_build else "cannot build kernels: fix the FAIL lines above")
    return 0 if can_build else 1


def _rel_err(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def cmd_demo(args) -> int:
    import torch

    import coda_dsl as cd
    from .examples import residual_rms

    m, n, k = args.m, args.n, args.k
    gen = torch.Generator().manual_seed(0)
    try:
        x = torch.randn(m, k, generator=gen, dtype=torch.bfloat16)
        w = torch.randn(n, k, generator=gen, dtype=torch.bfloat16) / k ** 0.5
        r = torch.randn(m, n, generator=gen, dtype=torch.bfloat16)
        g = torch.rand(n, generator=gen, dtype=torch.bfloat16) + 0.5
    except RuntimeError as e:  # the CPU allocator's "can't allocate memory"
        raise CliError(f"cannot make the inputs of M={m}, N={n}, K={k} in this machine's memory ({str(e)[:200]}): "
                       "pass smaller --m/--n/--k") from None
    print(f"residual_rms: D = x @ w.T + residual, h_gamma = D * gamma   (M={m}, N={n}, K={k}, bf16)")

    hopper = [i for i in range(torch.cuda.device_count()) if torch.cuda.get_device_capability(i) == (9, 0)] \
        if torch.cuda.is_available() else []
    if hopper:
        dev = torch.device("cuda", hopper[0])
        x, w, r, g = (t.to(dev) for t in (x, w, r, g))
        print(f"GPU: {torch.cuda.get_device_name(dev)}; building (or loading from the cache) the fused kernel ...")
        out = cd.gemm(x, w, residual_rms, residual=r, gamma=g, backend="cutlass")
        torch.cuda.synchronize(dev)
        ref = cd.gemm(x, w, residual_rms, residual=r, gamma=g, backend="reference")
        ok = True
        for name, t in out.items():
            err = _rel_err(t, ref[name])
            ok &= err <= 1e-2
            print(f"  {name:<8} {list(t.shape)} {t.dtype}  rel. error vs reference {err:.2e}"
                  f"{'' if err <= 1e-2 else '  (above 1e-2!)'}")
        print("fused CUTLASS kernel matches the reference backend" if ok else "MISMATCH with the reference backend")
        return 0 if ok else 1

    reason = ("no GPU is visible to torch" if not torch.cuda.is_available() else
              "the GPU(s) here are not sm_90: " + ", ".join(
                  f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                  for i in range(torch.cuda.device_count())))
    out = cd.gemm(x, w, residual_rms, residual=r, gamma=g, backend="reference")
    for name, t in out.items():
        print(f"  {name:<8} {list(t.shape)} {t.dtype}  (reference backend, CPU)")
    print(f"No Hopper (sm_90) GPU found ({reason}), so the fused kernel was not run: the outputs above come "
          "from the reference backend (plain PyTorch).")
    print("To see the CUDA kernel it would run:  coda-dsl emit coda_dsl.examples:residual_rms")
    return 0


def cmd_bench(args, extra: list[str]) -> int:
    # `python -m bench` needs the package's __main__; an empty bench/ dir would be a namespace package
    if not (REPO_ROOT / "bench" / "__main__.py").is_file():
        print("benchmarks live in the repository's bench/ directory (not part of an installed package): "
              "from a checkout of coda_dsl, run `python -m bench`")
        return 1
    return subprocess.call([sys.executable, "-m", "bench", *extra], cwd=REPO_ROOT)


# ---------------------------------------------------------------------------------------------
# Argument parsing
# ---------------------------------------------------------------------------------------------
def _target_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="FILE.py:FUNCTION", help="an epilogue: path/to/file.py:fn or package.module:fn")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"), help="dtype of A and B (default bf16)")
    p.add_argument("--a-layout", default="mk", choices=("mk", "km"),
                   help="mk: A is [M, K] row-major (default); km: [K, M] storage (A passed as X.t())")
    p.add_argument("--b-layout", default="nk", choices=("nk", "kn"),
                   help="nk: B is [N, K] like an nn.Linear weight (default); kn: [K, N] storage")
    p.add_argument("--operand-dtype", action="append", metavar="NAME=DTYPE",
                   help=f"dtype of a tensor/vector operand ({'|'.join(DTYPE_NAMES)}; default: --dtype); repeatable")
    p.add_argument("--const", action="append", metavar="NAME=VALUE", help="value of a cd.Const parameter; repeatable")
    p.add_argument("--config", metavar="TILE_CLUSTER_SCHEDULE", help=f"kernel config (default {DEFAULT_CONFIG})")
    p.add_argument("--shape", type=_shape, metavar="MxNxK",
                   help="the configuration cd.gemm picks for this problem size untuned (unless --config)")
    p.add_argument("--gpu", metavar="NAME", help="with --shape: the GPU model whose rule picks it, e.g. H100 or H200 "
                   "(default: this machine's GPU; on a machine without one, the H200's rule)")


def _shape(text: str) -> tuple[int, int, int]:
    """'8192x4096x4096' -> (8192, 4096, 4096), for argparse."""
    try:
        m, n, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxNxK like 8192x4096x4096, got {text!r}") from None
    if min(m, n, k) < 1:
        raise argparse.ArgumentTypeError(f"M, N and K must be positive, got {text!r}")
    from .passes.plan import MAX_DIM
    if max(m, n, k) > MAX_DIM:
        raise argparse.ArgumentTypeError(f"{text!r}: the kernels take M, N and K as 32-bit ints (at most {MAX_DIM})")
    return m, n, k


def number_type(convert: Callable, what: str, zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number `convert` reads (int or float), above 0 (or at least 0 with zero)."""
    def parse(text: str):
        try:
            v = convert(text)
        except ValueError:
            v = None
        if v is None or not (0 <= v if zero else 0 < v) or v == float("inf"):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    return parse


positive = number_type(int, "a positive integer")  # sizes and counts (bench's options too)
_positive_float = number_type(float, "a positive number")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="coda-dsl", description="GEMM epilogues in Python, fused into CUTLASS "
                                 "Hopper kernels. `coda-dsl COMMAND --help` describes each command.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, func, help, description, **kw):
        p = sub.add_parser(name, help=help, description=description, **kw)
        p.set_defaults(func=func, parser=p)  # (main's errors then show this command's usage)
        return p

    p = command("emit", cmd_emit, "print the generated .cu of an epilogue",
                "Print the CUDA C++ (.cu) generated for one specialization of an epilogue: the file "
                "that a build compiles. Needs no GPU and, without --check, no compiler.")
    _target_options(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write the .cu here instead of stdout (-: stdout)")
    p.add_argument("--backward", action="store_true", help=BACKWARD_HELP)
    p.add_argument("--check", action="store_true", help="also compile-check it with nvcc (no GPU needed)")

    p = command("explain", cmd_explain, "print the IR, the EVT plan and the keys",
                "Print what an epilogue lowers to: its IR, the CUTLASS epilogue visitor tree (nodes, fused "
                "functors, operand bindings), the specialization key and the build key that names its kernel "
                "in the cache.")
    _target_options(p)
    p.add_argument("--backward", action="store_true", help=BACKWARD_HELP)

    p = command("build", cmd_build, "build an epilogue's kernel into the cache",
                "Build one specialization of an epilogue's kernel (two nvcc passes, then link) into the cache, so that "
                "the first cd.gemm call with those dtypes and that config loads it instead of building it.")
    _target_options(p)
    p.add_argument("--compile-only", action="store_true", help="compile both nvcc passes, no link")

    p = command("cache", cmd_cache, "list, clear, export or import built kernels ($CODA_DSL_CACHE)",
                "List the kernels in the build cache (epilogue, config, size, age), remove them all, or "
                "move them between machines: export packs every built kernel into a .tar.gz, import adds "
                "such files' kernels to this cache (each checked against its recorded SHA-256), e.g. for "
                "GPU nodes without a compiler or a fresh machine. The cache is $CODA_DSL_CACHE, else "
                "$XDG_CACHE_HOME/coda_dsl or ~/.cache/coda_dsl.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION",
                               help="list, clear, export FILE or import FILE... (`coda-dsl cache ACTION --help`)")
    actions.add_parser("list", help="one line per built kernel", description="One line per built kernel.")
    actions.add_parser("clear", help="remove every cache entry", description="Remove every cache entry.")
    q = actions.add_parser("export", help="pack every built kernel into a .tar.gz",
                           description="Pack every built (linked) kernel into FILE, a .tar.gz.")
    q.add_argument("file", metavar="FILE", help="the .tar.gz to write")
    q.add_argument("--part-mb", type=_positive_float, metavar="MB",
                   help="split into FILE.part1.tar.gz, ... of at most about MB each")
    q = actions.add_parser("import", help="add the kernels of exported files to this cache",
                           description="Add the kernels of exported .tar.gz files to this cache, each checked "
                                       "against its recorded SHA-256.")
    q.add_argument("files", nargs="+", metavar="FILE", help="the .tar.gz files (or parts) to read")

    command("doctor", cmd_doctor, "check the toolchain and GPU",
            "Check what building and running kernels needs: a CUDA build of torch, nvcc, the CUTLASS "
            "headers, ninja, a C++ compiler, a writable cache and an sm_90 GPU. Exits with 1 when kernels "
            "cannot be built.")

    p = command("demo", cmd_demo, "run the residual_rms example (fused on Hopper, reference elsewhere)",
                "Run the README's residual_rms example on random bf16 data. On an sm_90 GPU it builds (or "
                "loads) the fused kernel and checks it against the reference backend; elsewhere it runs the "
                "reference backend on the CPU.")
    p.add_argument("--m", type=positive, default=512, help="rows of A and of the outputs (default 512)")
    p.add_argument("--n", type=positive, default=1024, help="columns of the outputs, rows of B (default 1024)")
    p.add_argument("--k", type=positive, default=256, help="the reduction dimension, columns of A and B (default 256)")

    # add_help=False: `coda-dsl bench --help` is the benchmark's own help
    command("bench", cmd_bench, "run the benchmarks from a checkout (python -m bench ARGS; bench --help "
            "describes them)", None, add_help=False)
    return ap


def joined_negative_values(argv: list[str], options: tuple[str, ...] = ("--shape",)) -> list[str]:
    """`--shape -1x8x8` as `--shape=-1x8x8`: argparse would take a value starting with '-' for an option and
    say --shape lacks its argument, where the shape's own check says what is wrong with it."""
    out = []
    for arg in argv:
        if out and out[-1] in options and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args, extra = ap.parse_known_args(joined_negative_values(sys.argv[1:] if argv is None else argv))
    if args.command != "bench" and extra:
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args, extra) if args.command == "bench" else args.func(args)
    except CodaError as e:
        _err(f"coda-dsl {args.command}: error: {e}")
        return 2
    except KeyboardInterrupt:
        _err(f"coda-dsl {args.command}: interrupted")
        return 130
    except BrokenPipeError:  # e.g. `coda-dsl emit ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
