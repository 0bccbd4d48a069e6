"""Call-time errors: OperandError / UnsupportedError whose message names the epilogue, the operand
and a fix. Layout checks of the cutlass backend are exercised on CPU tensors through
runtime.op._check_tensors (no GPU needed)."""
import warnings

import pytest
import torch

import coda_dsl as cd
from coda_dsl import CodaError, OperandError, UnsupportedError
from coda_dsl.runtime import op as runtime
from coda_dsl.runtime import call as call_checks
from epilogues import pairs_with_full_width_operands

M, N, K = 77, 104, 40


@cd.epilogue
def ep_all(acc, residual: cd.Tensor, bias: cd.VecN, scale: cd.VecM, alpha: cd.Scalar):
    return acc * scale + bias + alpha * residual


def operands(dtype=torch.bfloat16, m=M, n=N):
    return dict(residual=torch.randn(m, n).to(dtype), bias=torch.randn(n).to(dtype), scale=torch.randn(m),
                alpha=0.5)


def ab(m=M, n=N, k=K, dtype=torch.bfloat16):
    return torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)


def error_of(exc_type, *args, backend="reference", **kw):
    with pytest.raises(exc_type) as info:
        cd.gemm(*args, backend=backend, **kw)
    return str(info.value)


def names_epilogue(msg, ep=ep_all):
    return f"epilogue '{ep.name}'" in msg and ep.defined_at in msg


def test_valid_call_passes():
    a, b = ab()
    assert cd.gemm(a, b, ep_all, backend="reference", **operands())["D"].shape == (M, N)


def test_missing_operand():
    a, b = ab()
    ops = operands()
    del ops["bias"]
    msg = error_of(OperandError, a, b, ep_all, **ops)
    assert names_epilogue(msg) and "missing operand(s) ['bias']" in msg
    assert "fix:" in msg and "['residual', 'bias', 'scale', 'alpha']" in msg


def test_unexpected_operand():
    a, b = ab()
    msg = error_of(OperandError, a, b, ep_all, **operands(), biass=torch.randn(N))
    assert names_epilogue(msg) and "unexpected operand(s) ['biass']" in msg and "fix:" in msg


def test_missing_and_unexpected_together():
    a, b = ab()
    ops = operands()
    ops["Bias"] = ops.pop("bias")
    msg = error_of(OperandError, a, b, ep_all, **ops)
    assert "unexpected operand(s) ['Bias']" in msg and "missing operand(s) ['bias']" in msg


def test_misspelt_backend_is_named():
    a, b = ab()
    assert "fix: backend='reference'" in error_of(OperandError, a, b, ep_all, backend="referenc", **operands())


def test_bool_scalar_is_refused():
    a, b = ab()
    msg = error_of(OperandError, a, b, ep_all, **{**operands(), "alpha": True})
    assert "'alpha' (scalar) must be a number, got True" in msg and "fix: pass 1.0" in msg

    @cd.epilogue
    def switched(acc, on: cd.Const):  # a cd.Const may select, as a flag
        return acc * on
    torch.testing.assert_close(cd.gemm(a, b, switched, on=True, backend="reference")["D"], cd.gemm(a, b)["D"])


def test_misspelt_keyword_is_named_in_the_fix():
    """cd.gemm's keywords and the operands share the call's keyword arguments: a misspelt backend= is an
    unknown operand, whose fix names the keyword it looks like."""
    a, b = ab()
    msg = error_of(OperandError, a, b, ep_all, backnd="reference", **operands())
    assert "unexpected operand(s) ['backnd']" in msg and "backnd= looks like the keyword backend=" in msg
    assert "looks like" not in error_of(OperandError, a, b, cd.identity, bias=torch.randn(N))


def test_epilogue_passed_by_keyword_is_explained():
    a, b = ab()
    with pytest.raises(OperandError, match=r"the epilogue is positional: cd.gemm\(A, B, ep_all, ...\), "
                                           r"not epilogue=ep_all"):
        cd.gemm(a, b, epilogue=ep_all, **operands())
    with pytest.raises(OperandError, match=r"the epilogue is positional: cd.linear\(A, B, ep_all, ...\)"):
        cd.linear(a, b, epilogue=ep_all, **operands())


def test_epilogue_in_another_arguments_place_is_explained():
    """cd.compile takes the epilogue first, cd.gemm and cd.linear third: either mix-up names the order
    (a tensor in the epilogue's place was once asked for its truth value)."""
    a, b = ab()
    for call, order in ((lambda: cd.gemm(ep_all, a, b), r"cd.gemm\(A, B, epilogue, ...\)"),
                        (lambda: cd.linear(ep_all, a, b), r"cd.linear\(A, B, epilogue, ...\)"),
                        (lambda: cd.compile(a, b, ep_all), r"cd.compile\(epilogue, A, B, ...\)")):
        with pytest.raises(OperandError, match="a tensor was passed where the epilogue goes: the order is " + order):
            call()


def test_operands_to_an_epilogue_without_any():
    a, b = ab()
    msg = error_of(OperandError, a, b, cd.identity, bias=torch.randn(N))
    assert "'identity'" in msg and "['bias']" in msg and "no operands" in msg


@pytest.mark.parametrize("name, bad, expected", [
    ("residual", torch.randn(M, N + 1), f"[{M}, {N}]"),
    ("residual", torch.randn(N, M), f"[{M}, {N}]"),
    ("residual", torch.randn(M * N), f"[{M}, {N}]"),
    ("bias", torch.randn(N + 8), f"[{N}]"),
    ("bias", torch.randn(M), f"[{N}]"),
    ("scale", torch.randn(N), f"[{M}]"),
    ("scale", torch.randn(M, 1), f"[{M}]"),
])
def test_wrong_operand_shape(name, bad, expected):
    a, b = ab()
    ops = operands()
    ops[name] = bad.to(ops[name].dtype)
    msg = error_of(OperandError, a, b, ep_all, **ops)
    assert names_epilogue(msg) and f"operand '{name}'" in msg
    assert f"has shape {list(bad.shape)}" in msg and f"expected {expected}" in msg


def test_wrong_operand_shape_gives_a_fix():
    a, b = ab()
    ops = operands()
    ops["bias"] = torch.randn(M).bfloat16()
    assert "fix:" in error_of(OperandError, a, b, ep_all, **ops)


def test_k_mismatch():
    a, _ = ab()
    msg = error_of(OperandError, a, torch.randn(N, K + 3).bfloat16(), ep_all, **operands())
    assert names_epilogue(msg) and "K mismatch" in msg and f"[{M}, {K}]" in msg and f"[{N}, {K + 3}]" in msg
    assert "fix:" in msg and "[N, K]" in msg
    assert "B.t()" not in msg  # B does not look transposed


def test_k_mismatch_hints_transposed_b():
    a, _ = ab()
    msg = error_of(OperandError, a, torch.randn(K, N).bfloat16(), ep_all, **operands())
    assert "K mismatch" in msg and "B looks like [K, N]" in msg and "B.t()" in msg


def test_ab_dtype_mismatch():
    a, b = ab()
    msg = error_of(OperandError, a, b.half(), ep_all, **operands())
    assert names_epilogue(msg) and "torch.bfloat16" in msg and "torch.float16" in msg and "fix:" in msg


@pytest.mark.parametrize("which", ["A", "B"])
def test_ab_not_tensors(which):
    a, b = ab()
    args = (a.tolist(), b) if which == "A" else (a, b.float().numpy())
    msg = error_of(OperandError, *args, ep_all, **operands())
    assert names_epilogue(msg) and f"{which} must be a torch.Tensor" in msg


def test_ab_wrong_rank():
    a, b = ab()
    msg = error_of(OperandError, a.reshape(-1), b, ep_all, **operands())
    assert "A must be 2-D or 3-D" in msg


def test_batched_b_needs_batched_a():
    a, b = ab()
    msg = error_of(OperandError, torch.randn(2, M, K).bfloat16(), torch.randn(3, N, K).bfloat16(), ep_all,
                   **operands())
    assert "batched B" in msg and "[3, M, K]" in msg


def test_non_tensor_for_tensor_operand():
    a, b = ab()
    ops = operands()
    ops["residual"] = [[1.0] * N] * M
    msg = error_of(OperandError, a, b, ep_all, **ops)
    assert names_epilogue(msg) and "operand 'residual' must be a torch.Tensor, got list" in msg


def test_unsupported_operand_dtype():
    a, b = ab()
    ops = operands()
    ops["bias"] = torch.randn(N, dtype=torch.float64)
    msg = error_of(OperandError, a, b, ep_all, **ops)
    assert "operand 'bias'" in msg and "float64" in msg and "fix:" in msg


def test_fp64_runs_on_the_reference_backend_in_fp64():
    """fp64 A and B (as torch.autograd.gradcheck passes them): math and every output in fp64, a reduction
    too; an fp64 operand beside bf16 A/B, or fp64 on the cutlass path, is refused with the fix."""
    @cd.epilogue
    def with_stat(acc, residual: cd.Tensor, bias: cd.VecN, scale: cd.VecM, alpha: cd.Scalar):
        h = acc * scale + bias + alpha * residual
        return {"D": h, "ss": cd.sum(h * h, axis="n")}
    a, b = ab(dtype=torch.float64)
    ops = operands(torch.float64)
    got = cd.gemm(a, b, with_stat, backend="reference", **ops)
    want = (a @ b.t()) * ops["scale"][:, None].double() + ops["bias"] + 0.5 * ops["residual"]
    assert got["D"].dtype == got["ss"].dtype == torch.float64
    torch.testing.assert_close(got["D"], want, rtol=1e-12, atol=1e-12)  # fp64, not rounded through fp32
    torch.testing.assert_close(got["ss"], want.square().sum(1), rtol=1e-12, atol=1e-10)
    a16, b16 = ab()
    msg = error_of(OperandError, a16, b16, ep_all, **{**operands(), "residual": ops["residual"]})
    assert "operand 'residual' is torch.float64" in msg and "A and B in fp64" in msg
    msg = error_of(OperandError, a, b, ep_all, out={"D": torch.empty(M, N)}, **ops)
    assert "out['D']" in msg and "torch.float64" in msg


def test_unsupported_ab_dtype():
    msg = error_of(OperandError, torch.ones(M, K, dtype=torch.int32), torch.ones(N, K, dtype=torch.int32), ep_all,
                   **operands())
    assert "A has dtype torch.int32" in msg and "fix:" in msg
    a, b = ab()  # an integer operand (positions, say): fp32 keeps its values, bf16 would round them past 256
    msg = error_of(OperandError, a, b, ep_all, **{**operands(), "scale": torch.arange(M)})
    assert "operand 'scale' has dtype torch.int64" in msg and "fix: pass scale.float()" in msg


def test_tensor_for_scalar():
    a, b = ab()
    ops = operands()
    ops["alpha"] = torch.tensor(0.5)
    msg = error_of(OperandError, a, b, ep_all, **ops)
    assert names_epilogue(msg) and "scalar 'alpha' was given as a tensor" in msg
    assert "fix:" in msg and "float(alpha)" in msg


@pytest.mark.parametrize("bad", ["0.5", None, [0.5], torch.ones(3)])
def test_non_number_for_scalar(bad):
    a, b = ab()
    ops = operands()
    ops["alpha"] = bad
    msg = error_of(OperandError, a, b, ep_all, **ops)
    assert "'alpha' (scalar) must be a number" in msg


def test_numpy_scalars_are_numbers():
    import numpy as np
    a, b = ab()
    ops = operands()
    want = cd.gemm(a, b, ep_all, backend="reference", **ops)["D"]
    for v in (np.float32(0.5), np.float64(0.5)):
        got = cd.gemm(a, b, ep_all, backend="reference", **{**ops, "alpha": v})["D"]
        torch.testing.assert_close(got, want)


def test_numpy_consts_select_their_own_kernel(fake_kernels):
    """A cd.Const is keyed by its value, not its type: two numpy values are two kernels (warm path too), and
    a compiled op refuses another value."""
    import numpy as np

    @cd.epilogue
    def scaled(acc, c: cd.Const):
        return acc * c

    a, b = ab()
    keys = []
    for c in (np.float32(2.0), np.float32(3.0), np.float32(2.0), 2.0, 2):
        cd.gemm(a, b, scaled, backend="cutlass", c=c)
        keys.append(fake_kernels[-1][0].key)
    assert keys[0] != keys[1] and keys[0] == keys[2] == keys[3] == keys[4]
    op = cd.compile(scaled, a, b, c=np.float32(2.0))
    op(a, b, c=np.float32(2.0))
    with pytest.raises(OperandError, match="cd.Const values"):
        op(a, b, c=np.float32(3.0))


def test_non_number_for_const():
    @cd.epilogue
    def with_const(acc, c: cd.Const):
        return acc * c

    a, b = ab()
    msg = error_of(OperandError, a, b, with_const, c="2")
    assert "'with_const'" in msg and "'c' (const) must be a number" in msg


def test_out_with_unknown_name():
    a, b = ab()
    msg = error_of(OperandError, a, b, ep_all, **operands(), out={"E": torch.empty(M, N)})
    assert names_epilogue(msg) and "'E'" in msg and "['D']" in msg


def test_out_with_wrong_shape():
    a, b = ab()
    with pytest.raises(OperandError, match="out\\['D'\\]"):
        cd.gemm(a, b, ep_all, backend="reference", **operands(), out={"D": torch.empty(2, M, N,
                                                                                      dtype=torch.bfloat16)})


def test_not_an_epilogue():
    """A plain function is refused with a coda_dsl error (a TypeError too, the Python category) and the fix."""
    a, b = ab()
    for call in (cd.gemm, cd.linear):
        with pytest.raises(cd.EpilogueError, match=r"decorated with @cd\.epilogue.*\n  fix: put @cd\.epilogue"):
            call(a, b, lambda acc: acc, backend="reference")
    with pytest.raises(cd.EpilogueError, match=r"^cd\.compile: the epilogue must be a function decorated"):
        cd.compile(lambda acc: acc, a, b)
    assert issubclass(cd.EpilogueError, TypeError) and issubclass(cd.EpilogueError, cd.CodaError)


@pytest.mark.parametrize("option", ["backend", "tune"])
def test_compile_refuses_the_options_of_gemm_by_name(option):
    """cd.compile(..., backend=...) was reported as an unexpected operand 'backend'."""
    a, b = ab()
    with pytest.raises(cd.OperandError, match=f"cd.compile: {option}= is an option of cd.gemm, not of cd.compile"):
        cd.compile(cd.identity, a, b, **{option: "reference" if option == "backend" else True})


def test_unknown_backend():
    a, b = ab()
    with pytest.raises(ValueError) as info:
        cd.gemm(a, b, ep_all, backend="triton", **operands())
    msg = str(info.value)
    assert "'triton'" in msg and "'cutlass'" in msg and "'reference'" in msg and "'auto'" in msg


def test_unknown_backend_is_a_coda_error_naming_the_epilogue():
    a, b = ab()
    with pytest.raises(CodaError) as info:
        cd.gemm(a, b, ep_all, backend="triton", **operands())
    assert names_epilogue(str(info.value))


def test_cutlass_backend_without_gpu():
    a, b = ab()
    msg = error_of(UnsupportedError, a, b, ep_all, backend="cutlass", **operands())
    assert names_epilogue(msg) and "sm_90" in msg and "backend='reference'" in msg
    assert isinstance(UnsupportedError("x"), NotImplementedError)


def test_auto_backend_on_cpu_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setattr(runtime, "_warned_fallback", False)
    a, b = ab()
    ops = operands()
    with pytest.warns(UserWarning, match="reference backend") as rec:
        d = cd.gemm(a, b, ep_all, **ops)["D"]
    assert any("test_runtime_errors.py" in w.filename for w in rec), [w.filename for w in rec]
    ref = cd.gemm(a, b, ep_all, backend="reference", **ops)["D"]
    assert torch.equal(d, ref)
    with warnings.catch_warnings():  # warned once per process
        warnings.simplefilter("error")
        cd.gemm(a, b, ep_all, **ops)


# ---------------------------------------------------------------------------------------------
# cutlass layout checks, on CPU tensors
# ---------------------------------------------------------------------------------------------
def check(a, b, ep=ep_all, **ops):
    call = call_checks.normalize(ep, a, b, ops or operands())
    return call_checks._check_tensors(ep, call, cutlass=True)


def layout_error(*args, **kw):
    with pytest.raises(OperandError) as info:
        check(*args, **kw)
    return str(info.value)


def offset_view(shape, dtype=torch.bfloat16):
    """A contiguous tensor whose data pointer is one element past a 16-byte boundary."""
    n = 1
    for s in shape:
        n *= s
    base = torch.empty(n + 8, dtype=dtype)
    assert base.data_ptr() % 16 == 0
    return base[1:n + 1].view(shape).normal_()


def test_fp64_is_refused_by_the_cutlass_path():
    a, b = ab(dtype=torch.float64)
    assert "A is torch.float64" in layout_error(a, b, **operands(torch.float64))
    assert "operand 'bias' is torch.float64" in layout_error(*ab(), **{**operands(), "bias": torch.randn(N).double()})


def test_layout_valid():
    a, b = ab()
    dtypes = check(a, b)
    assert dtypes == {"residual": "bf16", "bias": "bf16", "scale": "fp32"}
    check(a, torch.randn(K, N).bfloat16().t())  # [K, N] storage passed as W.t(): accepted
    check(torch.randn(K, 80).bfloat16()[:, :M].t(), b)  # A as [K, M] storage (rows padded to 16 bytes) as X.t()
    msg = layout_error(torch.randn(K, M).bfloat16().t(), b)  # [K, 77] storage: TMA cannot address its rows
    assert "A's row stride 77 is not a multiple of 8 elements" in msg


def test_contiguous_dimension_fills_16_byte_groups():
    """Padded rows let TMA address A = X.t() with M = 77 and B = W.t() with N = 1001, but the mainloop reads
    their contiguous dimension in whole 16-byte groups: refused before CUTLASS's bare "Invalid status"."""
    b = torch.randn(N, K).bfloat16()
    for a, b, along, extent in ((torch.randn(K, 80).bfloat16()[:, :M].t(), b, "M", M),
                                (torch.randn(M, K).bfloat16(), torch.randn(K, 1008).bfloat16()[:, :1001].t(), "N", 1001)):
        ops = operands(n=b.shape[0])
        ops["residual"] = torch.randn(M, 1008).bfloat16()[:, :b.shape[0]]
        call = call_checks.normalize(ep_all, a, b, ops)
        op = runtime.specialization(ep_all, call, call_checks._check_tensors(ep_all, call, cutlass=True), None, None)
        with pytest.raises(UnsupportedError) as info:
            op.check_widths(call)
        msg = str(info.value)
        assert f"read along {along}" in msg and f"{along} = {extent} must be a multiple of 8" in msg and "fix:" in msg
    b = torch.randn(1001, K).bfloat16()  # read along K, fine; but D's rows are stored in 16-byte groups too
    call = call_checks.normalize(cd.identity, ab()[0], b, {})
    op = runtime.specialization(cd.identity, call, call_checks._check_tensors(cd.identity, call, cutlass=True), None, None)
    with pytest.raises(UnsupportedError, match=r"output 'D' is \[M, 1001\] torch.bfloat16(.|\n)*must be a multiple of 8"):
        op.check_widths(call)


def test_an_empty_reduction_dimension(fake_kernels):
    """K = 0: the accumulator is 0. The reference applies the epilogue to it; the cutlass backend refuses
    (its mainloop waits for a first k-tile) with the fix, before any launch, so "auto" falls back."""
    ops = operands()
    with pytest.raises(UnsupportedError, match=r"K = 0 \(A and B have no columns\)(.|\n)*backend='reference'"):
        cd.gemm(torch.randn(M, 0).bfloat16(), torch.randn(N, 0).bfloat16(), ep_all, backend="cutlass", **ops)
    assert fake_kernels == []
    got = cd.gemm(torch.randn(M, 0).bfloat16(), torch.randn(N, 0).bfloat16(), ep_all, backend="reference", **ops)
    want = cd.gemm(torch.zeros(M, 8).bfloat16(), torch.zeros(N, 8).bfloat16(), ep_all, backend="reference", **ops)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_layout_a_contiguous_along_neither_dim():
    a, b = ab()
    msg = layout_error(torch.randn(M, 2 * K).bfloat16()[:, ::2], b)
    assert names_epilogue(msg) and "A must be contiguous along K ([M, K]) or along M" in msg and "A.contiguous()" in msg


def test_a_layout_selects_the_specialization():
    """A passed as X.t() ([K, M] storage) is another specialization (LayoutA ColumnMajor), same results."""
    a, b = ab()
    at = a.t().contiguous().t()
    call, call_t = call_checks.normalize(ep_all, a, b, operands()), call_checks.normalize(ep_all, at, b, operands())
    assert runtime.layouts(call) == ("mk", "nk") and runtime.layouts(call_t) == ("km", "nk")
    assert runtime.call_key(ep_all, call, {}, None) != runtime.call_key(ep_all, call_t, {}, None)
    from coda_dsl import cli
    km = cli.specialization_from_options(ep_all, a_layout="km", operand_dtypes={"scale": "fp32"})
    mk = cli.specialization_from_options(ep_all, operand_dtypes={"scale": "fp32"})
    assert "using LayoutA = cutlass::layout::ColumnMajor;" in km.cu_text and km.key != mk.key
    assert "using LayoutA = cutlass::layout::RowMajor;" in mk.cu_text
    ops = operands()
    torch.testing.assert_close(cd.gemm(at, b, ep_all, backend="reference", **ops)["D"],
                               cd.gemm(a, b, ep_all, backend="reference", **ops)["D"])
    # a 3-D A passed transposed with one 2-D weight: folding L into M would copy A into the other layout
    a3 = torch.randn(2, K, 80).bfloat16().transpose(-1, -2)
    with pytest.raises(UnsupportedError, match="needs A contiguous along K"):
        call_checks.fold_batch(cd.identity, call_checks.normalize(cd.identity, a3, b, {}))


def test_layout_operand_not_contiguous_in_last_dim():
    a, b = ab()
    ops = operands()
    ops["residual"] = ops["residual"].t().contiguous().t()
    msg = layout_error(a, b, **ops)
    assert "operand 'residual' must be contiguous" in msg and "fix: pass residual.contiguous()" in msg  # as code


def test_layout_vector_not_contiguous():
    a, b = ab()
    ops = operands()
    ops["bias"] = torch.randn(2 * N).bfloat16()[::2]
    msg = layout_error(a, b, **ops)
    assert "operand 'bias' must be contiguous" in msg


def test_layout_misaligned_pointer():
    a, b = ab()
    msg = layout_error(offset_view((M, K)), b)
    assert "A's data pointer is not 16-byte aligned" in msg and "A.clone()" in msg
    ops = operands()
    ops["residual"] = offset_view((M, N))
    msg = layout_error(a, b, **ops)
    assert "operand 'residual'" in msg and "16-byte aligned" in msg
    ops = operands()
    ops["scale"] = offset_view((M,), torch.float32)
    assert "operand 'scale'" in layout_error(a, b, **ops)


def test_layout_row_stride_not_multiple_of_8():
    a, b = ab(k=1001)
    msg = layout_error(a, b)
    assert "A's row stride 1001 is not a multiple of 8 elements" in msg and "fix:" in msg
    ops = operands(n=1001)
    a, b = ab(n=1001)
    msg = layout_error(a, b, **ops)  # N = 1001: the [M, N] residual's rows are misaligned
    assert "operand 'residual'" in msg and "multiple of 8" in msg


def test_layout_b_row_stride_checked_in_both_layouts():
    a = torch.randn(M, 64).bfloat16()
    b_kn = torch.randn(64, 1001).bfloat16().t()  # [K, N] storage with N = 1001
    ops = operands(n=1001)
    ops["residual"] = torch.randn(M, 1008).bfloat16()[:, :1001]  # padded rows: aligned
    msg = layout_error(a, b_kn, **ops)
    assert "B's row stride 1001 is not a multiple of 8" in msg
    check(a, torch.randn(64, 1008).bfloat16()[:, :1001].t(), **ops)  # padded [K, N] storage: accepted


def test_layout_b_strided_in_both_dims():
    a, _ = ab()
    b = torch.randn(N, 2 * K).bfloat16()[:, ::2]
    msg = layout_error(a, b)
    assert "B must be contiguous along K" in msg and "W.t()" in msg


def test_layout_fp32_ab_rejected():
    a, b = ab(dtype=torch.float32)
    msg = layout_error(a, b)
    assert names_epilogue(msg) and "bf16 or fp16" in msg and "A.bfloat16()" in msg


def test_reference_backend_needs_no_alignment(rel):
    """What the cutlass checks reject still runs on the reference backend."""
    a, b = ab(k=1001)
    a = offset_view((M, 1001))
    ops = operands()
    ops["residual"] = ops["residual"].t().contiguous().t()
    d = cd.gemm(a, b, ep_all, backend="reference", **ops)["D"]
    ref = (a.double() @ b.double().T) * ops["scale"].double()[:, None] + ops["bias"].double() \
        + 0.5 * ops["residual"].double()
    assert rel(d, ref) <= 1e-2


def test_compiled_op_rejects_other_operands(fake_kernels):
    """A kept op reads memory as the types it was compiled for: another dtype, B layout, operand
    dtype or Const value is an error, not a silent reinterpretation (checked before any launch)."""
    @cd.epilogue
    def scaled(acc, bias: cd.VecN, c: cd.Const):
        return acc * c + bias

    a, b, bias = (torch.randn(*s).bfloat16() for s in ((64, 64), (64, 64), (64,)))
    op = cd.compile(scaled, a, b, bias=bias, c=2.0)
    for args, kw, what in [((a.half(), b.half()), dict(bias=bias, c=2.0), "A/B dtype"),
                           ((a, b.t().contiguous().t()), dict(bias=bias, c=2.0), "B layout"),
                           ((a, b), dict(bias=bias.float(), c=2.0), "operand dtypes"),
                           ((a, b), dict(bias=bias, c=3.0), "cd.Const values")]:
        with pytest.raises(cd.OperandError, match=what):
            op(*args, **kw)
    acc_op = cd.compile(scaled, a, b, bias=bias, c=2.0, accumulate=True, out={"D": torch.zeros(64, 64)})
    with pytest.raises(cd.OperandError, match="out=\\{'D'"):
        acc_op(a, b, bias=bias, c=2.0)


def test_batched_gemm_rejects_an_unbatched_tensor_operand(fake_kernels):
    """The kernel reads one [M, N] slice per batch: a 2-D operand of a batched GEMM would be read
    past its end (the reference backend broadcasts it), so the cutlass backend refuses it."""
    @cd.epilogue
    def add(acc, residual: cd.Tensor):
        return acc + residual

    a, b, r = torch.randn(2, 64, 64).bfloat16(), torch.randn(2, 64, 64).bfloat16(), torch.randn(64, 64).bfloat16()
    with pytest.raises(cd.UnsupportedError, match="expand"):
        cd.compile(add, a, b, residual=r)


def bad_calls(a, b, ops):
    """Calls that differ from a valid one in one property each; all must fail, the first two only for a
    kept op (cd.gemm builds another specialization for them)."""
    r = ops["residual"]
    yield (a.half(), b.half()), ops, "op"
    yield (a, b), {**ops, "residual": r.float()}, "op"
    yield (a[:, :-8], b), ops, "both"
    yield (a, b), {**ops, "residual": r[:-1]}, "both"
    yield (a, b), {**ops, "bias": offset_view((N,))}, "both"
    yield (a, b), {k: v for k, v in ops.items() if k != "alpha"}, "both"
    yield (a, b), {**ops, "extra": 1.0}, "both"
    yield (a, b), {**ops, "alpha": torch.tensor(0.5)}, "both"
    yield (a, b), {**ops, "alpha": "0.5"}, "both"


def test_kernel_outputs_have_no_derivative_like_the_reference(fake_kernels):
    """The cutlass path, cold and warm, cd.gemm and a kept op: autograd records the call, and a backward
    through it raises (its outputs were plain tensors: the gradient through them was silently lost)."""
    a, b = ab()
    ops = operands()
    op = cd.compile(ep_all, a, b, **ops)
    calls = {"op": op, "gemm": lambda *x, **y: cd.gemm(*x, ep_all, backend="cutlass", **y)}
    for name, call in calls.items():
        for _ in ("cold", "warm"):
            x = a.detach().clone().requires_grad_()
            d = call(x, b, **ops)["D"]
            with pytest.raises(cd.UnsupportedError, match="cd.gemm has no derivative"):
                d.float().sum().backward()
        with torch.no_grad():
            assert not call(x, b, **ops)["D"].requires_grad
        assert not call(a, b, **ops)["D"].requires_grad
        with pytest.raises(cd.OperandError, match="out= with inputs that require grad"):
            call(x, b, out={"D": torch.empty(M, N, dtype=a.dtype)}, **ops)


def test_warm_calls_skip_checks_but_not_bad_calls(fake_kernels, monkeypatch):
    """A call layout that passed the checks is remembered, so a warm call does not repeat them; any
    call that differs in shape, dtype, alignment, operand names or kinds is checked again."""
    a, b = ab()
    ops = operands()
    op = cd.compile(ep_all, a, b, **ops)
    checked = []
    normalize = call_checks.normalize
    monkeypatch.setattr(runtime, "normalize", lambda *args: checked.append(1) or normalize(*args))
    calls = {"op": op, "gemm": lambda *x, **y: cd.gemm(*x, ep_all, backend="cutlass", **y)}
    for call in calls.values():
        call(a, b, **ops)
        n_checked = len(checked)
        a2, b2 = ab()  # same layouts, other tensors and values
        d = call(a2, b2, **{**operands(), "alpha": 2.0})["D"]
        assert d.shape == (M, N) and fake_kernels[-1][1][0] is a2 and fake_kernels[-1][1][4] == [2.0]
        assert len(checked) == n_checked
    for args, kw, bad_for in bad_calls(a, b, ops):
        n = len(fake_kernels)
        for name, call in calls.items():
            if bad_for in ("both", name):
                with pytest.raises(CodaError):
                    call(*args, **kw)
        assert len(fake_kernels) == n


def test_prebuild_of_a_function_builds_what_its_calls_need(fake_kernels, monkeypatch):
    """cd.prebuild(fn): fn runs once with each call whose kernel is not loaded computed by the reference
    backend (same results, no launch), and the kernels those calls need are built in one run, each once;
    later calls launch them. An error inside fn ends the collecting."""
    builds = []
    monkeypatch.setattr(runtime.build, "build_units", lambda units, jobs=None: builds.append([u.key for u in units]))
    a, b = ab()
    ops = operands()

    def step():
        d = cd.gemm(a, b, ep_all, backend="cutlass", **ops)["D"]
        cd.gemm(a, b, ep_all, backend="cutlass", **ops)  # the same kernel: noted once
        return cd.gemm(d.bfloat16(), b[:, :N].t().contiguous(), cd.identity, backend="cutlass")["D"]

    want = cd.gemm(cd.gemm(a, b, ep_all, backend="reference", **ops)["D"].bfloat16(), b[:, :N].t().contiguous(),
                   cd.identity, backend="reference")["D"]
    got = []
    assert cd.prebuild(lambda: got.append(step())) == 2
    assert len(builds) == 1 and len(set(builds[0])) == 2 and fake_kernels == []
    torch.testing.assert_close(got[0], want)
    step()
    assert [op.epilogue.name for op, _ in fake_kernels] == ["ep_all", "ep_all", "identity"]
    with pytest.warns(UserWarning, match="no kernel to build(.|\n)*coda-dsl build"):  # all loaded: says so
        assert cd.prebuild(step) == 0
    assert len(builds) == 1

    def fails():
        cd.gemm(a, b, cd.identity, backend="cutlass")
        raise ValueError("inside fn")
    with pytest.raises(ValueError):
        cd.prebuild(fails)
    assert runtime._collected is None and len(builds) == 1
    assert cd.prebuild(cd.compile(cd.identity, a, b)) == 1 and len(builds) == 2  # one op, not a function
    for wrong in ([ep_all], ep_all, ["coda_dsl.examples:bias_gelu"], 42):  # epilogues, names: not CompiledOps
        with pytest.raises(OperandError, match="not a CompiledOp(.|\n)*fix: cd.prebuild"):
            cd.prebuild(wrong)
    with pytest.raises(OperandError) as e:  # cd.gemm's arguments: described by dtype and shape, not their values
        cd.prebuild([(ep_all, a, b)])
    assert f"got tuple (Epilogue, torch.bfloat16 {list(a.shape)}" in str(e.value) and "tensor(" not in str(e.value)
    assert len(builds) == 2


def test_warm_calls_check_output_aliasing_every_time(fake_kernels):
    a, b = ab()
    ops = operands()
    out = {"D": torch.empty(M, N, dtype=torch.bfloat16)}
    cd.gemm(a, b, ep_all, backend="cutlass", out=out, **ops)
    aliased = {**ops, "residual": out["D"]}  # same layout as a valid residual, but it is the output
    with pytest.raises(OperandError, match="shares memory with input residual"):
        cd.gemm(a, b, ep_all, backend="cutlass", out=out, **aliased)
    with pytest.raises(OperandError, match="shares memory"):
        cd.compile(ep_all, a, b, **ops)(a, b, out=out, **aliased)
    with pytest.raises(OperandError, match="out\\['D'\\] is"):
        cd.gemm(a, b, ep_all, backend="cutlass", out={"D": torch.empty(M, N + 8, dtype=torch.bfloat16)}, **ops)


def test_warm_path_keeps_the_error_types(fake_kernels):
    """Arguments the layout key cannot hash or read still get the checks' OperandError."""
    @cd.epilogue
    def scaled(acc, bias: cd.VecN, c: cd.Const):
        return acc * c + bias

    a, b = ab()
    bias = torch.randn(N).bfloat16()
    op = cd.compile(scaled, a, b, bias=bias, c=2.0)
    op(a, b, bias=bias, c=2.0)
    cd.gemm(a, b, scaled, backend="cutlass", bias=bias, c=2.0)
    for call in (op, lambda *x, **y: cd.gemm(*x, scaled, backend="cutlass", **y)):
        with pytest.raises(OperandError, match="must be a number"):
            call(a, b, bias=bias, c=[2.0])
        with pytest.raises(OperandError, match="out must be a dict"):
            call(a, b, bias=bias, c=2.0, out=[torch.empty(M, N)])
        with pytest.raises(OperandError, match="out must be a dict"):
            call(a, b, bias=bias, c=2.0, out=torch.empty(M, N))
        with pytest.raises(OperandError):
            call(a, b, bias=bias.to_sparse(), c=2.0)


def test_const_values_select_kernels_by_spelling(fake_kernels):
    """-0.0 and 0.0 are different kernels (1/c is -inf or inf); every NaN is the same kernel."""
    @cd.epilogue
    def divided(acc, c: cd.Const):
        return acc / c

    a, b = ab()
    nan = float("nan")
    assert cd.compile(divided, a, b, c=0.0).key != cd.compile(divided, a, b, c=-0.0).key
    assert cd.compile(divided, a, b, c=nan) is cd.compile(divided, a, b, c=float("nan"))
    for c in (0.0, -0.0):
        cd.gemm(a, b, divided, backend="cutlass", c=c)
    assert len({op.key for op, _ in fake_kernels[-2:]}) == 2  # the warm path tells them apart
    with pytest.raises(OperandError, match="cd.Const values"):
        cd.compile(divided, a, b, c=0.0)(a, b, c=-0.0)
    cd.compile(divided, a, b, c=nan)(a, b, c=float("nan"))  # any NaN is the NaN it was compiled for


def test_call_key_tells_b_layouts_and_out_dtypes_apart():
    """The in-memory cache of specializations: B as [N, K] or as [K, N] storage, and an fp32 or a bf16
    out["D"], are different kernels."""
    a, b = ab()
    key = lambda b, out=None: runtime.call_key(cd.identity, call_checks.normalize(cd.identity, a, b, {}, out), {}, out)  # noqa: E731
    assert key(b) != key(b.t().contiguous().t())
    assert key(b, {"D": torch.empty(M, N)}) != key(b, {"D": torch.empty(M, N).bfloat16()})


def test_deterministic_and_accumulate_select_their_own_kernels(fake_kernels):
    """After an atomic call of a layout, deterministic=True launches the deterministic kernel (and back); after a
    plain call with out=, accumulate=True the accumulating one: both are part of the specialization's key."""
    @cd.epilogue
    def summed(acc):
        return {"D": acc, "s": cd.sum(acc, axis="n")}

    a, b = ab()
    for deterministic in (False, True, False):
        cd.gemm(a, b, summed, backend="cutlass", deterministic=deterministic)
    d = torch.zeros(M, N)
    for accumulate in (False, True, False):
        cd.gemm(a, b, backend="cutlass", out={"D": d}, accumulate=accumulate)
    chosen = [(op.plan.signature.deterministic, op.plan.signature.accumulate) for op, _ in fake_kernels]
    assert chosen == [(False, False), (True, False), (False, False), (False, False), (False, True), (False, False)]


def test_layout_checks_every_stride_and_index_dtype():
    """A misaligned batch stride (not only the row stride) and int32 cd.take indices are refused."""
    a = torch.empty(3 * (M * K + 1)).bfloat16().as_strided((3, M, K), (M * K + 1, K, 1))
    with pytest.raises(OperandError, match="stride"):
        runtime.checks.tma_layout("here", "A", a)

    @cd.epilogue
    def gathered(acc, t: cd.VecM):
        return {"D": acc, "z": cd.take(acc, t)}

    with pytest.raises(OperandError, match=r"int64(.|\n)*fix: pass t\.long\(\)"):  # the bare name, as code spells it
        check(*ab(), ep=gathered, t=torch.zeros(M, dtype=torch.int32))


def test_folded_batch_writes_the_callers_out_tensors(fake_kernels):
    """A 3-D A with a 2-D B runs as one [L*M] GEMM: out= tensors must be views of that block (a copy
    would leave the caller's tensor unwritten), per-batch VecN operands are refused, and an
    allocated half-width output is [L, M, N/2]."""
    a, b = torch.randn(3, M, K).bfloat16(), ab()[1]
    not_a_view = torch.empty(M, 3, N).bfloat16().transpose(0, 1)
    with pytest.raises(OperandError, match="cannot be viewed"):
        cd.gemm(a, b, backend="cutlass", out={"D": not_a_view})
    bias_per_batch = torch.randn(3, N).bfloat16()
    with pytest.raises(UnsupportedError, match="per-batch VecN"):
        cd.gemm(a, b, pairs_with_full_width_operands, backend="cutlass", bias=bias_per_batch,
                rs=torch.randn(3, M).bfloat16(), s=1.0)
    out = cd.gemm(a, b, pairs_with_full_width_operands, backend="cutlass", bias=torch.randn(N).bfloat16(),
                  rs=torch.randn(3, M).bfloat16(), s=1.0)
    assert out["D"].shape == (3, M, N) and out["h"].shape == (3, M, N // 2)

    @cd.epilogue
    def column_statistics(acc):
        return {"D": acc, "cols": cd.sum(acc, axis="m"), "all": cd.amax(acc, axis=None)}
    with pytest.raises(UnsupportedError, match=r"reductions over m \['cols', 'all'\] cannot be computed per batch"):
        cd.gemm(a, b, column_statistics, backend="cutlass")


def test_batched_statistics_into_padded_rows_are_refused(fake_kernels):
    """A batched statistic is written at l * N (l * M) + its column (row): out= rows with padding between
    them would get batch l's values in batch l - 1's padding. The error says so; a contiguous one is used."""
    @cd.epilogue
    def statistics(acc):
        return {"D": acc, "cols": cd.sum(acc, axis="m"), "rows": cd.amax(acc, axis="n")}
    a, b = torch.randn(3, M, K).bfloat16(), torch.randn(3, N, K).bfloat16()
    for name, padded in (("cols", torch.empty(3, N + 8)[:, :N]), ("rows", torch.empty(3, M + 8)[:, :M])):
        with pytest.raises(OperandError, match=rf"out\['{name}'\] must be contiguous: the kernel writes one batch"):
            cd.gemm(a, b, statistics, backend="cutlass", out={name: padded})
    cols = torch.empty(3, N)
    assert cd.gemm(a, b, statistics, backend="cutlass", out={"cols": cols})["cols"] is cols


def test_overlapping_views_alias(fake_kernels):
    a, b = ab()
    buf = torch.empty(M + 8, N).bfloat16()
    with pytest.raises(OperandError, match="shares memory with input residual"):
        cd.gemm(a, b, ep_all, backend="cutlass", out={"D": buf[8:]}, **{**operands(), "residual": buf[:M]})


def test_tuning_later_replaces_the_warm_choice(fake_kernels, monkeypatch):
    """A bucket used first without tuning is tuned on a later tune=True call, and calls after that
    launch the tuned configuration (the warm path forgets its earlier choice)."""
    tunings = []
    tuned = cd.Config((256, 128, 64), (2, 1), "cooperative")
    monkeypatch.setattr(runtime.tuning, "tune", lambda *args, **kw: tunings.append(1) or tuned)
    a, b = ab()
    for tune in (False, True, False):
        cd.gemm(a, b, backend="cutlass", tune=tune)
    chosen = [op.plan.signature.config for op, _ in fake_kernels]
    assert tunings == [1] and chosen == [runtime.tuning.default(M, N, K, gpu="")[0], tuned, tuned]


# ---- issue 10, item 7: call-path defects ------------------------------------------------------------

REQUIRE_CUTLASS = runtime.checks.require_cutlass  # the real one (fake_kernels replaces it)


@cd.epilogue
def two_outputs(acc, residual: cd.Tensor):
    return {"D": acc + residual, "aux": acc * 2.0}


def cutlass_and_reference(fake_kernels):
    """cd.gemm on both backends (the cutlass one with fake kernels, on CPU tensors)."""
    return {"reference": lambda *a, **k: cd.gemm(*a, backend="reference", **k),
            "cutlass": lambda *a, **k: cd.gemm(*a, backend="cutlass", **k)}


@pytest.mark.parametrize("name, bad", [("residual", (1, M, N)), ("bias", (1, N)), ("scale", (1, M))])
def test_unbatched_call_refuses_batch_of_one_operands(fake_kernels, name, bad):
    """A 2-D call has no batch: a [1, ...] operand would make [1, M, N] outputs; it is refused on both
    backends, while a batched call of one batch takes it."""
    a, b = ab()
    ops = {**operands(), name: torch.randn(bad).bfloat16()}
    for call in cutlass_and_reference(fake_kernels).values():
        with pytest.raises(OperandError, match=rf"operand '{name}' has shape .*the call is not batched"):
            call(a, b, ep_all, **ops)
    d = cd.gemm(a[None], b[None], ep_all, backend="reference", **ops)["D"]
    assert d.shape == (1, M, N)


@pytest.mark.parametrize("batched_b", [True, False])
def test_take_with_a_shared_index_in_a_batched_call(batched_b, seed):
    @cd.epilogue
    def picked(acc, index: cd.VecM):
        return {"D": acc, "t": cd.take(acc, index, axis="n")}

    a = torch.randn(3, M, K)
    b = torch.randn(3, N, K) if batched_b else torch.randn(N, K)
    index = torch.randint(-2, N + 2, (M,))
    t = cd.gemm(a, b, picked, backend="reference", index=index)["t"]
    acc = a @ b.transpose(-1, -2)
    inside = (index >= 0) & (index < N)
    expected = torch.where(inside, acc[:, torch.arange(M), index.clamp(0, N - 1)], 0.0)
    assert t.shape == (3, M) and torch.allclose(t, expected, atol=1e-4)


@cd.epilogue
def statistics(acc, index: cd.VecM):
    return {"D": acc, "mx": cd.max(acc, axis="n"), "mn": cd.min(acc, axis="m"), "am": cd.amax(acc),
            "s": cd.sum(acc, axis="n"), "t": cd.take(acc, index, axis="n")}


@pytest.mark.parametrize("m, n, empty", [(M, 0, "'mx' is a cd.max over axis 'n'"),
                                         (0, N, "'mn' is a cd.min over axis 'm'")])
def test_max_over_an_empty_axis_is_an_error(fake_kernels, m, n, empty):
    """Like torch.amax: the max/min/amax of no values is undefined; a clear error on both backends."""
    a, b = torch.randn(m, K).bfloat16(), torch.randn(n, K).bfloat16()
    for call in cutlass_and_reference(fake_kernels).values():
        with pytest.raises(OperandError, match=f"{empty}, which is empty here"):
            call(a, b, statistics, index=torch.zeros(m, dtype=torch.long))


@pytest.mark.parametrize("m, n", [(0, N), (M, 0)])
def test_a_whole_amax_of_no_values_is_an_error(fake_kernels, m, n):
    """cd.amax(x, axis=None) of an empty output (no rows, or no columns) is undefined too."""
    @cd.epilogue
    def whole(acc):
        return {"D": acc, "am": cd.amax(acc, axis=None)}

    a, b = torch.randn(m, K).bfloat16(), torch.randn(n, K).bfloat16()
    for call in cutlass_and_reference(fake_kernels).values():
        with pytest.raises(OperandError, match="'am' is a cd.amax over axis None, which is empty here"):
            call(a, b, whole)


def test_empty_axes_that_have_a_value():
    """cd.sum over an empty axis is 0 and cd.take of an empty row gives 0 (every index is outside);
    a max over n of no rows is simply empty."""
    @cd.epilogue
    def row_stats(acc, index: cd.VecM):
        return {"s": cd.sum(acc, axis="n"), "t": cd.take(acc, index, axis="n"), "c": cd.sum(acc, axis="m")}

    res = cd.gemm(torch.randn(M, K), torch.randn(0, K), row_stats, backend="reference",
                  index=torch.zeros(M, dtype=torch.long))
    assert torch.equal(res["s"], torch.zeros(M)) and torch.equal(res["t"], torch.zeros(M)) and res["c"].shape == (0,)
    res = cd.gemm(torch.randn(0, K), torch.randn(N, K), row_stats, backend="reference",
                  index=torch.zeros(0, dtype=torch.long))
    assert res["s"].shape == (0,) and torch.equal(res["c"], torch.zeros(N))


@pytest.mark.parametrize("backend", ["reference", "cutlass"])
def test_outputs_that_alias_each_other_are_refused(fake_kernels, backend):
    """One tensor for two outputs would leave D holding aux's values: refused on every call, warm too; so are
    views of one buffer that interleave, while views that lie apart (its halves) are separate outputs."""
    a, b = ab()
    r = torch.randn(M, N).bfloat16()
    call = cutlass_and_reference(fake_kernels)[backend]
    d, aux = torch.empty(M, N, dtype=torch.bfloat16), torch.empty(M, N, dtype=torch.bfloat16)
    call(a, b, two_outputs, out={"D": d, "aux": aux}, residual=r)  # valid: this layout is now warm
    halves = torch.empty(2, M, N, dtype=torch.bfloat16)
    got = call(a, b, two_outputs, out={"D": halves[0], "aux": halves[1]}, residual=r)
    assert got["D"].data_ptr() == halves[0].data_ptr() and got["aux"].data_ptr() == halves[1].data_ptr()
    if backend == "reference":
        want = cd.gemm(a, b, two_outputs, backend="reference", residual=r)
        assert torch.equal(halves[0], want["D"]) and torch.equal(halves[1], want["aux"])
    columns = torch.empty(M, 2 * N, dtype=torch.bfloat16)
    for out in ({"D": d, "aux": d}, {"D": columns[:, :N], "aux": columns[:, N:]}):
        with pytest.raises(OperandError, match=r"out\['aux'\] shares memory with out\['D'\]"):
            call(a, b, two_outputs, out=out, residual=r)
    if backend == "cutlass":
        op = cd.compile(two_outputs, a, b, residual=r)
        with pytest.raises(OperandError, match="shares memory with out"):
            op(a, b, out={"D": d, "aux": d}, residual=r)


def test_overlap_is_of_memory_ranges():
    """Outputs and inputs are told apart by the bytes they span: a buffer's rows or halves are apart, its
    column slices interleave, a view meets its base; empty and meta tensors (nothing stored) meet nothing."""
    from coda_dsl.runtime.checks import overlaps
    buf = torch.empty(4, 2, 6)
    assert not overlaps(buf[0], buf[1]) and not overlaps(buf[:2], buf[2:]) and overlaps(buf[1], buf[1:3])
    assert overlaps(buf[:, :, :3], buf[:, :, 3:]) and overlaps(buf, buf[3, 1, 5:])
    assert not overlaps(buf[3, 1, 4:5], buf[3, 1, 5:]) and not overlaps(buf, torch.empty(4, 2, 6))
    assert not overlaps(buf[:0], buf) and not overlaps(*(torch.empty(3, device="meta") for _ in range(2)))


@pytest.mark.parametrize("bad_aux", ["shape", "stride0", "grad"])
def test_a_refused_call_writes_no_output(bad_aux):
    """Every output is checked before the reference backend writes the first one."""
    a, b = ab()
    d = torch.zeros(M, N, dtype=torch.bfloat16)
    aux = {"shape": torch.empty(M, N + 1, dtype=torch.bfloat16),
           "stride0": torch.empty(N, dtype=torch.bfloat16).expand(M, N),
           "grad": torch.empty(M, N, dtype=torch.bfloat16, requires_grad=True)}[bad_aux]
    with pytest.raises(OperandError, match=r"out\['aux'\]"):
        cd.gemm(a, b, two_outputs, backend="reference", out={"D": d, "aux": aux}, residual=torch.randn(M, N).bfloat16())
    assert not d.any()


@pytest.mark.parametrize("backend", ["reference", "cutlass"])
def test_bad_arguments_are_operand_errors(fake_kernels, backend):
    """Arguments that used to end in a bare TypeError/RuntimeError (or were ignored) are OperandErrors."""
    a, b = ab()
    r = torch.randn(M, N).bfloat16()
    call = cutlass_and_reference(fake_kernels)[backend]
    good = {"D": torch.empty(M, N, dtype=torch.bfloat16), "aux": torch.empty(M, N, dtype=torch.bfloat16)}
    call(a, b, two_outputs, out=good, residual=r)  # valid: this layout is now warm
    cases = [
        (dict(deterministic=[1]), "deterministic must be True or False"),
        (dict(deterministic=1), "deterministic must be True or False, not 1\n  fix: deterministic=True if that"),
        (dict(accumulate="yes"), "accumulate must be True or False(.|\n)*fix: accumulate=True or accumulate=False"),
        (dict(tune="x"), "tune must be True or False"),
        (dict(config="garbage"), "bad config 'garbage'(.|\n)*at least three parts"),
        (dict(config="128x256x64_c2x1_bogus"), "schedule must be"),
        (dict(out={"D": torch.empty(N, dtype=torch.bfloat16).expand(M, N)}), "stride 0"),
        (dict(out={**good, "D": good["D"].clone().requires_grad_()}), "requires grad"),  # warm layout otherwise
    ]
    for kw, words in cases:
        with pytest.raises(OperandError, match=words):
            call(a, b, two_outputs, residual=r, **kw)
    with pytest.raises(OperandError, match="stride 0"):  # a broadcast batch of two: as bad as one of 77
        call(torch.randn(2, M, K).bfloat16(), torch.randn(2, N, K).bfloat16(), cd.identity,
             out={"D": torch.empty(M, N, dtype=torch.bfloat16).expand(2, M, N)})
    with pytest.raises(OperandError, match="sparse"):
        call(torch.randn(2, M, K).bfloat16().to_sparse(), torch.randn(2, N, K).bfloat16(), two_outputs,
             residual=torch.randn(2, M, N).bfloat16())
    with pytest.raises(OperandError, match=r"sparse(.|\n)*fix: pass residual\.to_dense\(\)"):
        call(a, b, two_outputs, residual=r.to_sparse())
    with pytest.raises(OperandError, match="nested"):  # torch's error was an internal one
        call(a, b, two_outputs, residual=torch.nested.nested_tensor([r[:3], r[3:]]))


def test_compile_refuses_cpu_tensors_at_once(fake_kernels, monkeypatch):
    """cd.compile on CPU tensors gives cd.gemm(backend="cutlass")'s error (its fix: cd.gemm's reference backend,
    not the backend= that cd.compile lacks), not an op whose first call runs a long build and then fails; an
    op called with CPU tensors is refused before any build."""
    monkeypatch.setattr(runtime.checks, "require_cutlass", REQUIRE_CUTLASS)
    a, b = ab()
    r = torch.randn(M, N).bfloat16()
    with pytest.raises(UnsupportedError) as compiled:
        cd.compile(two_outputs, a, b, residual=r)
    with pytest.raises(UnsupportedError) as called:
        cd.gemm(a, b, two_outputs, backend="cutlass", residual=r)
    first = lambda e: str(e.value).splitlines()[0]  # noqa: E731
    assert first(compiled) == first(called) and "needs CUDA tensors" in first(called)
    assert "or pass backend='reference'" in str(called.value) and "backend=" not in str(compiled.value).replace(
        "cd.gemm(A, B, epilogue, ..., backend='reference')", "")
    monkeypatch.setattr(runtime.checks, "require_cutlass", lambda *_: None)
    op = cd.compile(two_outputs, a, b, residual=r)
    monkeypatch.setattr(runtime.checks, "require_cutlass", REQUIRE_CUTLASS)
    with pytest.raises(UnsupportedError, match="needs CUDA tensors"):
        op(a, b, residual=r)
    assert not fake_kernels and op._op is None


def test_empty_outputs_alias_nothing(fake_kernels):
    """With M = 0 every tensor of the call stores nothing (data pointer 0): that is no aliasing."""
    a, b = ab(m=0)
    r = torch.empty(0, N, dtype=torch.bfloat16)
    out = {"D": torch.empty(0, N, dtype=torch.bfloat16), "aux": torch.empty(0, N, dtype=torch.bfloat16)}
    for backend in ("cutlass", "reference"):
        res = cd.gemm(a, b, two_outputs, backend=backend, out=out, residual=r)
        assert res["D"] is out["D"] and res["aux"] is out["aux"]


def test_compiled_op_built_asks_the_cache_without_building(fake_kernels, monkeypatch):
    """CompiledOp.built: whether load() would find the kernel (what the benchmarks check after a prebuild)."""
    from pathlib import Path

    from coda_dsl import build
    op = cd.compile(cd.identity, torch.randn(64, 32).bfloat16(), torch.randn(48, 32).bfloat16())
    asked = []
    monkeypatch.setattr(build, "valid_output", lambda key: asked.append(key))
    assert not op.built and asked == [build.build_key(op.key)]
    monkeypatch.setattr(build, "valid_output", lambda key: Path("kernel.so"))
    assert op.built and not op.loaded
    op.load()
    monkeypatch.setattr(build, "valid_output", lambda key: None)
    assert op.built  # a loaded library is built, whatever the cache now holds


def test_a_dimension_past_32_bits_is_refused_by_the_kernels(fake_kernels):
    """The kernels take M, N, K and L as 32-bit ints: a call past that is refused before any launch (else the
    launcher's int would wrap), and backend="auto" takes the reference backend."""
    a = torch.zeros(1, 64, dtype=torch.bfloat16).expand(2**31, 64)  # no memory: a stride-0 view
    b = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(cd.UnsupportedError, match=r"M, N, K, L = 2147483648, 64, 64, 1: the kernels take each as a "
                                                  r"32-bit int(?s:.*)fix: split the call"):
        cd.gemm(a, b, cd.identity, backend="cutlass")
    assert not fake_kernels
