"""The call into a kernel library (runtime/kernel.py <-> csrc/coda_dsl/abi.h), on CPU: a stub library
with the same two extern "C" functions, built with the C compiler, records what it receives; the
tests check that every tensor, scalar, the stream, the device and the workspace arrive as the
generated launcher reads them, and that a refusal comes back as a KernelError."""
import ctypes
import shutil
import subprocess

import pytest
import torch

import coda_dsl as cd
from coda_dsl import build
from coda_dsl.runtime import kernel as kmod
from coda_dsl.runtime import op as runtime
from build_helpers import warm_path_or_skip

STUB = r"""
#include <stdint.h>
#include <string.h>
typedef struct { int64_t data, dim, sizes[3], strides[3]; } TensorArg;  /* abi.h's TensorArg */
typedef struct { int64_t n_tensors, n_scalars, device, stream, workspace, workspace_size; } CallArgs;

TensorArg seen[16];
double seen_scalars[128];  /* room for an epilogue of many operands */
int64_t seen_n, seen_n_scalars, seen_ws_size, queries, launches;
int64_t seen_device, seen_stream, seen_ws;

static int refuse(const CallArgs* a, char* message, int64_t size) {
  const TensorArg* t = (const TensorArg*)(a + 1);
  const double* s = (const double*)(t + a->n_tensors);
  if (a->n_scalars > 0 && s[0] < 0) {  /* a negative first scalar: refuse, as CUTLASS's can_implement would */
    strncpy(message, "coda_dsl::stub (epilogue stub): CUTLASS cannot run this problem", size - 1);
    message[size - 1] = 0;
    return 1;
  }
  return 0;
}

int coda_workspace_size(const CallArgs* a, int64_t* size, char* message, int64_t message_size) {
  ++queries;
  if (refuse(a, message, message_size)) return 1;
  const TensorArg* t = (const TensorArg*)(a + 1);
  *size = t[0].sizes[t[0].dim - 2] * 4;  /* M floats: depends on the shape only */
  return 0;
}

int coda_launch(const CallArgs* a, char* message, int64_t message_size) {
  ++launches;
  if (refuse(a, message, message_size)) return 1;
  const TensorArg* t = (const TensorArg*)(a + 1);
  memcpy(seen, t, a->n_tensors * sizeof(TensorArg));
  memcpy(seen_scalars, t + a->n_tensors, a->n_scalars * sizeof(double));
  seen_n = a->n_tensors; seen_n_scalars = a->n_scalars; seen_device = a->device; seen_stream = a->stream;
  seen_ws = a->workspace; seen_ws_size = a->workspace_size;
  return 0;
}
"""


class Seen:
    """What the stub recorded."""

    def __init__(self, lib):
        self.lib = lib

    def int(self, name):
        return ctypes.c_int64.in_dll(self.lib, name).value

    def tensors(self):
        arr = (ctypes.c_int64 * (8 * 16)).in_dll(self.lib, "seen")
        return [tuple(arr[8 * i:8 * i + 8]) for i in range(self.int("seen_n"))]

    def scalars(self):
        arr = (ctypes.c_double * 128).in_dll(self.lib, "seen_scalars")
        return list(arr[:self.int("seen_n_scalars")])


@pytest.fixture
def stub(tmp_path, monkeypatch):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stub kernel library")
    src, so = tmp_path / "stub.c", tmp_path / "stub.so"
    src.write_text(STUB)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", str(src), "-o", str(so)], check=True)
    monkeypatch.setattr(kmod, "current_stream", lambda device: 0xC0DA)  # no GPU here: a recognisable value
    lib = ctypes.PyDLL(str(so))
    return kmod.Kernel(lib), Seen(lib)


def expected(t: torch.Tensor) -> tuple:
    pad = (0,) * (3 - t.dim())
    return (t.data_ptr(), t.dim(), *t.shape, *pad, *t.stride(), *pad)


def test_tensors_scalars_stream_and_workspace_arrive(stub):
    k, seen = stub
    a = torch.randn(2, 32, 16)
    b = torch.randn(16, 8).t()  # a transposed view: shape [8, 16], strides (1, 8)
    d = torch.empty(2, 32, 8)
    vec, stat = torch.randn(8), torch.empty(())  # a 0-d output: a whole-tensor statistic
    k(a, b, d, [vec], [0.5, -0.0], [stat])
    assert seen.tensors() == [expected(t) for t in (a, b, d, vec, stat)]
    assert seen.scalars() == [0.5, -0.0] and str(seen.scalars()[1]) == "-0.0"
    assert seen.int("seen_stream") == 0xC0DA and seen.int("seen_device") == -1
    assert seen.int("seen_ws_size") == 32 * 4 and seen.int("seen_ws")  # the size the query gave, allocated


def test_without_d_and_workspace(stub):
    k, seen = stub
    a, b, out = torch.randn(0, 16), torch.randn(8, 16), torch.empty(0)
    k(a, b, None, [], [], [out])  # M = 0: no workspace, so a null pointer
    assert seen.tensors() == [expected(t) for t in (a, b, out)]
    assert seen.int("seen_ws_size") == 0 and seen.int("seen_ws") == 0


def test_workspace_size_asked_once_per_shape(stub):
    k, seen = stub
    b = torch.randn(8, 16)
    for m in (32, 32, 64, 32):
        k(torch.randn(m, 16), b, None, [], [], [])
        assert seen.int("seen_ws_size") == m * 4
    assert seen.int("queries") == 2 and seen.int("launches") == 4


def test_refusal_is_a_kernel_error_with_the_kernels_message(stub):
    k, seen = stub
    a, b = torch.randn(32, 16), torch.randn(8, 16)
    with pytest.raises(cd.KernelError, match=r"^coda_dsl::stub \(epilogue stub\): CUTLASS cannot run this problem$"):
        k(a, b, None, [], [-1.0], [])
    assert isinstance(cd.KernelError("x"), RuntimeError)  # what a failing torch op raised before


def test_compiled_op_passes_operands_in_the_plans_order(stub, fake_kernels, monkeypatch):
    """A CompiledOp down to the C call: A, B, D, the plan's operands, then its outputs; scalars by plan."""
    k, seen = stub
    monkeypatch.setattr(runtime.CompiledOp, "load", lambda self: setattr(self, "_op", k) or self)

    @cd.epilogue
    def ep(acc, residual: cd.Tensor, bias: cd.VecN, alpha: cd.Scalar, beta: cd.Scalar):
        y = alpha * acc + bias + beta * residual
        return {"D": y, "rowsum": cd.sum(y, axis="n")}

    a, b = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    residual, bias = torch.randn(64, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    op = cd.compile(ep, a, b, residual=residual, bias=bias, alpha=2.0, beta=3.0)
    out = op(a, b, residual=residual, bias=bias, alpha=2.0, beta=3.0)
    operands = {"residual": residual, "bias": bias}
    order = [a, b, out["D"], *[operands[i] for i in op.plan.inputs], out["rowsum"]]
    assert seen.tensors() == [expected(t) for t in order]
    assert seen.scalars() == [{"alpha": 2.0, "beta": 3.0}[s] for s in op.plan.scalars]


def test_warm_calls_of_one_layout_pass_their_own_pointers_and_scalars(stub, fake_kernels, monkeypatch):
    """The argument block is packed once per call layout: later calls of that layout, through a kept op
    and through cd.gemm, still pass their own tensors and scalars; another layout (a transposed B, a
    batch folded into M) gets its own block; every block equals a fresh pack of the same call."""
    k, seen = stub
    monkeypatch.setattr(runtime.CompiledOp, "load", lambda self: setattr(self, "_op", k) or self)
    packed, pack = [], kmod.Packer.pack

    def recording(self, tensors, scalars, stream, ws):  # (the block sent, a fresh pack of the same call)
        fresh = kmod.Packer(tensors, len(scalars), self.device, self.workspace_size)
        packed.append((pack(self, tensors, scalars, stream, ws), pack(fresh, tensors, scalars, stream, ws)))
        return packed[-1][0]
    monkeypatch.setattr(kmod.Packer, "pack", recording)

    @cd.epilogue
    def ep(acc, bias: cd.VecN, alpha: cd.Scalar):
        return alpha * acc + bias

    bf = dict(dtype=torch.bfloat16)
    op = cd.compile(ep, torch.randn(64, 32, **bf), torch.randn(16, 32, **bf), bias=torch.randn(16, **bf), alpha=1.0)
    calls = [(torch.randn(64, 32, **bf), torch.randn(16, 32, **bf), alpha) for alpha in (1.0, -0.0, 7.5)]
    calls += [(torch.randn(64, 32, **bf), torch.randn(32, 16, **bf).t(), 2.0),  # B transposed: another layout
              (torch.randn(2, 32, 32, **bf), torch.randn(16, 32, **bf), 3.0)]  # a batch of 2 folded into M
    kept = [c for c in calls if c[1].stride(-1) == 1]  # a kept op is compiled for one layout of B
    for via, todo in (("op", kept), ("gemm", calls)):
        for a, b, alpha in todo:
            bias = torch.randn(16, **bf)
            out = op(a, b, bias=bias, alpha=alpha) if via == "op" else \
                cd.gemm(a, b, ep, backend="cutlass", bias=bias, alpha=alpha)
            folded = a.reshape(-1, a.shape[-1])
            assert seen.tensors() == [expected(t) for t in (folded, b, out["D"].reshape(-1, 16), bias)]
            assert seen.scalars() == [alpha] and str(seen.scalars()[0]) == str(alpha)
    assert seen.int("launches") == len(kept) + len(calls) and all(got == fresh for got, fresh in packed)


def test_library_is_opened_once(stub, tmp_path, monkeypatch):
    """build.library hands out the one handle load_library opened."""
    opened = []
    monkeypatch.setattr(build.builder, "_dlopen", lambda p: opened.append(p) or object())
    monkeypatch.setattr(build.builder, "_loaded", {})
    monkeypatch.setattr(build.builder, "_handles", {})
    so = tmp_path / "stub.so"
    monkeypatch.setattr(build.builder, "check_output", lambda key, name="kernel.so": (so, None))
    u = build.BuildUnit(build.specialization_key("abi"), "// src\n")
    h = build.library(u)
    assert build.library(u) is h and opened == [so]


def test_kernel_sources_include_no_torch_or_python_header():
    """A kernel TU compiles CUTLASS and csrc/ only (the build-time win of issue 14): no torch, ATen, c10,
    pybind11 or Python header in the golden sources or in any header they include."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent
    files = sorted((root / "golden").glob("*.cu")) + sorted(build.csrc_dir().glob("coda_dsl/*.h"))
    assert len(files) > 40
    banned = re.compile(r'#\s*include\s*[<"](torch|ATen|c10|pybind11|Python\.h)')
    assert [f.name for f in files if banned.search(f.read_text())] == []


# ---- the C++ warm path (runtime/warm.py, runtime/warm.cpp) ---------------------------------------
@pytest.fixture
def warm_path(stub, fake_kernels, monkeypatch):
    """The stub library behind every CompiledOp, the C++ warm path built, and a count of the launches the
    Python path made (the others came from C++)."""
    warm_path_or_skip()
    k, seen = stub
    monkeypatch.setattr(runtime.CompiledOp, "load", lambda self: setattr(self, "_op", k) or self)
    python, call = [], kmod.Kernel.__call__
    monkeypatch.setattr(kmod.Kernel, "__call__", lambda self, *a, **kw: python.append(1) or call(self, *a, **kw))
    return seen, python


@cd.epilogue
def warm_ep(acc, residual: cd.Tensor, bias: cd.VecN, unused: cd.VecM, alpha: cd.Scalar, beta: cd.Scalar,
            k: cd.Const):
    y = alpha * acc + bias + k * residual
    return {"D": y, "rowsum": cd.sum(y, axis="n")}


def _warm_operands(m=64, n=16, alpha=2.0, k=3.0, **kw):
    bf = dict(dtype=torch.bfloat16)
    ops = dict(residual=torch.randn(m, n, **bf), bias=torch.randn(n, **bf), unused=torch.randn(m, **bf),
               alpha=alpha, beta=1.0, k=k)
    return {**ops, **kw}


def _runner(via: str, a, b):
    """The kept op's call or cd.gemm's, and the kept op."""
    op = cd.compile(warm_ep, a, b, **_warm_operands())
    if via == "op":
        return (lambda a, b, **o: op(a, b, **o)), op
    return (lambda a, b, **o: cd.gemm(a, b, warm_ep, backend="cutlass", **o)), op


@pytest.mark.parametrize("via", ["op", "gemm"])
def test_warm_path_launches_what_the_python_path_launches(warm_path, via):
    """After its first call, a layout is launched from C++ with each call's own tensors, scalars and freshly
    allocated outputs, exactly as the Python path packs them; the outputs come back in the same order."""
    seen, python = warm_path
    bf = dict(dtype=torch.bfloat16)
    run, op = _runner(via, torch.randn(64, 32, **bf), torch.randn(16, 32, **bf))
    for i, alpha in enumerate((2.0, -0.0, 7.5, 1)):  # an int scalar too: a number like any other
        a, b, ops = torch.randn(64, 32, **bf), torch.randn(16, 32, **bf), _warm_operands(alpha=alpha)
        out = run(a, b, **ops)
        assert list(out) == ["D", "rowsum"] and out["D"].shape == (64, 16) and out["rowsum"].dtype == torch.float32
        inputs = [ops[i] for i in op.plan.inputs]
        assert seen.tensors() == [expected(t) for t in (a, b, out["D"], *inputs, out["rowsum"])]
        assert seen.scalars() == [float({"alpha": alpha, "beta": 1.0}[s]) for s in op.plan.scalars]
        assert str(seen.scalars()[op.plan.scalars.index("alpha")]) == str(float(alpha))
        assert seen.int("seen_ws_size") == 64 * 4 and seen.int("seen_ws") != 0
        assert len(python) == 1, f"call {i} took the Python path"  # all but the first from C++
    assert seen.int("launches") == 4


@pytest.mark.parametrize("via", ["op", "gemm"])
def test_warm_path_leaves_every_other_call_to_the_python_path(warm_path, via):
    """What C++ cannot match takes the Python path: its checks still refuse what they refuse, autograd still
    records a call that needs it, a new layout is checked (then added), other cd.Const values build their own."""
    import numpy as np
    seen, python = warm_path
    bf = dict(dtype=torch.bfloat16)
    a, b = torch.randn(64, 32, **bf), torch.randn(16, 32, **bf)
    run, op = _runner(via, a, b)
    run(a, b, **_warm_operands())
    run(a, b, **_warm_operands())
    assert len(python) == 1
    if via == "op":  # a kept op is built for bf16 operands
        with pytest.raises(cd.OperandError, match="compiled for other operands"):
            run(a, b, **_warm_operands(bias=torch.randn(16)))
    with pytest.raises(cd.OperandError, match="operand 'unused' has shape"):  # not read by the kernel: checked
        run(a, b, **_warm_operands(unused=torch.randn(63, **bf)))
    before = len(python)
    run(a, b, **_warm_operands(alpha=np.float32(0.5)))  # a numpy scalar: the Python path (its key has the type)
    assert len(python) == before + 1
    x = torch.randn(64, 32, **bf, requires_grad=True)
    out = run(x, b, **_warm_operands())  # autograd records it: the Python path, outputs linked to x
    assert len(python) == before + 2 and out["D"].requires_grad
    with torch.no_grad():
        run(x, b, **_warm_operands())  # no gradient wanted: C++
    assert len(python) == before + 2
    run(torch.randn(32, 32, **bf), b, **_warm_operands(m=32))  # a new shape: checked, then added
    run(torch.randn(32, 32, **bf), b, **_warm_operands(m=32))
    assert len(python) == before + 3
    if via == "gemm":
        run(a, b, **_warm_operands(k=-0.0))  # another cd.Const: another kernel, through Python once
        run(a, b, **_warm_operands(k=-0.0))
        run(a, b, **_warm_operands(k=0.0))  # and -0.0 is not 0.0
        assert len(python) == before + 5
    else:
        with pytest.raises(cd.OperandError, match="compiled for other operands"):
            run(a, b, **_warm_operands(k=4.0))


def test_warm_path_refusal_is_a_kernel_error(warm_path):
    """A launch refused in C++ raises the library's message, as from the Python path."""
    seen, python = warm_path
    bf = dict(dtype=torch.bfloat16)
    a, b, ops = torch.randn(64, 32, **bf), torch.randn(16, 32, **bf), _warm_operands()
    run, op = _runner("gemm", a, b)
    run(a, b, **ops)
    with pytest.raises(cd.KernelError, match="CUTLASS cannot run this problem"):
        run(a, b, **{**ops, op.plan.scalars[0]: -1.0})  # the stub refuses a negative first scalar
    assert len(python) == 1


def test_warm_path_unavailable_is_one_warning(stub, fake_kernels, monkeypatch):
    """Where the extension cannot be built, one warning, and every call takes the Python path."""
    import warnings
    from coda_dsl.runtime import warm
    k, seen = stub
    monkeypatch.setattr(runtime.CompiledOp, "load", lambda self: setattr(self, "_op", k) or self)
    monkeypatch.setattr(warm, "_module", None)
    monkeypatch.setattr(warm, "_failed", False)
    monkeypatch.setattr(warm, "_load", lambda: (_ for _ in ()).throw(RuntimeError("c++: not found")))
    bf = dict(dtype=torch.bfloat16)
    a, b = torch.randn(64, 32, **bf), torch.randn(16, 32, **bf)
    with pytest.warns(UserWarning, match=r"C\+\+ warm call path is not available \(RuntimeError: c\+\+: not found\)"):
        cd.gemm(a, b, warm_ep, backend="cutlass", **_warm_operands())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        for _ in range(2):
            out = cd.gemm(a, b, warm_ep, backend="cutlass", **_warm_operands())
    assert seen.int("launches") == 3 and seen.tensors()[2] == expected(out["D"])


def test_warm_path_keeps_the_newest_layouts_and_takes_them_again(warm_path):
    """A table holds the newest 256 layouts; an older one is offered again at its next (Python) call, as is a
    layout whose first call autograd recorded."""
    seen, python = warm_path
    bf = dict(dtype=torch.bfloat16)
    b = torch.randn(16, 32, **bf)
    ms = [8 * (i + 1) for i in range(260)]
    for m in ms:  # 260 layouts: the first 4 are dropped
        cd.gemm(torch.randn(m, 32, **bf), b, warm_ep, backend="cutlass", **_warm_operands(m=m))
    assert len(python) == 260
    for m in ms[-3:] + ms[:1] + ms[:1]:  # the newest from C++; the oldest through Python once, then C++
        cd.gemm(torch.randn(m, 32, **bf), b, warm_ep, backend="cutlass", **_warm_operands(m=m))
    assert len(python) == 261
    x = torch.randn(64, 32, **bf, requires_grad=True)
    run = lambda: cd.gemm(x, b, warm_ep, backend="cutlass", **_warm_operands(m=64))  # noqa: E731
    run()  # recorded by autograd: the Python path, not offered
    with torch.no_grad():
        run(), run()  # offered at the first, from C++ at the second
    assert len(python) == 263


def test_warm_path_leaves_calls_with_many_operands_to_python(warm_path):
    """An epilogue with more operands than the C++ path matches: every call takes the Python path, none fails."""
    seen, python = warm_path
    n = 70
    src = "def many(acc, " + ", ".join(f"s{i}: cd.Scalar" for i in range(n)) + "):\n    return acc"
    src += "".join(f" + s{i}" for i in range(n)) + "\n"
    scope = {"cd": cd}
    exec(src, scope)  # noqa: S102 (an epilogue of 70 operands, written out)
    many = cd.epilogue(scope["many"])
    bf = dict(dtype=torch.bfloat16)
    a, b = torch.randn(64, 32, **bf), torch.randn(16, 32, **bf)
    ops = {f"s{i}": float(i) for i in range(n)}
    op = cd.compile(many, a, b, **ops)
    for _ in range(2):
        assert list(op(a, b, **ops)) == ["D"] and list(cd.gemm(a, b, many, backend="cutlass", **ops)) == ["D"]
    assert len(python) == 4 and seen.scalars()[:3] == [float(ops[s]) for s in op.plan.scalars[:3]]


def test_warm_path_leaves_calls_under_a_dispatch_mode_to_python(warm_path):
    """Under a TorchDispatchMode the allocations are the mode's to see (and may run code that calls again):
    the Python path, as for torch's own ops."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen, python = warm_path
    bf = dict(dtype=torch.bfloat16)
    a, b = torch.randn(64, 32, **bf), torch.randn(16, 32, **bf)
    op = cd.compile(warm_ep, a, b, **_warm_operands())
    op(a, b, **_warm_operands())
    op(a, b, **_warm_operands())
    seen_ops = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen_ops.append(func)
            if len(seen_ops) == 1:  # code that calls the op again, with a new layout, mid-call
                op(torch.randn(32, 32, **bf), b, **_warm_operands(m=32))
            return func(*args, **(kwargs or {}))

    with Mode():
        out = op(a, b, **_warm_operands())
    assert len(python) == 3 and torch.ops.aten.empty.memory_format in seen_ops and list(out) == ["D", "rowsum"]
