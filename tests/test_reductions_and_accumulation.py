"""CPU tests (reference backend and lowering) of reductions with finishing steps, deterministic mode,
epilogues without D, in-place accumulation and the RMSNorm library."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.codegen import render
from coda_dsl.codegen.evt import node as cpp
from coda_dsl.library import rms_consumer, rmsnorm_linear
from coda_dsl.passes import accumulate_into_d, specialize
from coda_dsl.passes.plan import Reduce, SrcFetch
from epilogues import rel_err as _rel


def _ab(m=37, n=56, k=24):
    return torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()


@cd.epilogue
def stats(acc, eps: cd.Scalar, inv_n: cd.Scalar):
    return {"D": acc, "rstd": cd.sum(acc * acc, axis="n").then(lambda s: cd.rsqrt(s * inv_n + eps)),
            "colmax": cd.max(acc, axis="m").then(lambda v: v * 2.0)}


def test_finishing_expression_matches_torch():
    a, b = _ab()
    r = cd.gemm(a, b, stats, eps=1e-5, inv_n=1 / 56, backend="reference")
    acc = a.float() @ b.float().t()
    assert r["rstd"].shape == (37,) and r["rstd"].dtype == torch.float32
    assert _rel(r["rstd"], torch.rsqrt(acc.pow(2).mean(-1) + 1e-5)) < 1e-6
    assert _rel(r["colmax"], acc.amax(0) * 2) < 1e-6


def test_finishing_expression_rejects_tile_values():
    with pytest.raises(cd.EpilogueError, match="finishing expression sees only"):
        @cd.epilogue
        def bad(acc, bias: cd.VecN):
            return {"D": acc, "s": cd.sum(acc).then(lambda s: s + bias)}
    with pytest.raises(cd.EpilogueError, match="already applied"):
        @cd.epilogue
        def twice(acc):
            return {"D": acc, "s": cd.sum(acc).then(lambda s: s * 2).then(lambda s: s)}
    for again in (lambda s: cd.sum(s), lambda s: cd.exp(cd.amax(s, axis="n"))):  # not "use .then()", its fix
        with pytest.raises(cd.EpilogueError, match=r"inside \.then\(\): .* cannot reduce again"):
            cd.epilogue(lambda acc: {"s": cd.sum(acc, axis="n").then(again)})


def test_deterministic_lowering_uses_partials_and_a_finishing_kernel(make_plan):
    atomic, det = make_plan(stats), make_plan(stats, deterministic=True)
    assert atomic.canonical != det.canonical
    for plan, expect_atomic in ((atomic, True), (det, False)):
        reds = [n for n in plan.nodes if isinstance(n, Reduce)]
        assert len(reds) == 2 and all(r.finish is not None for r in reds)
        for r in reds:
            assert ("atomic" in cpp(r).type) == expect_atomic
            assert ("coda::Fill{" in cpp(r).fill) == expect_atomic  # atomics need the identity, partials don't
            assert ("ws.floats(" in cpp(r).init) != expect_atomic  # partials live in the workspace
            assert "coda::finish<" in cpp(r).finish


def test_epilogue_without_d_on_reference_and_in_code(make_plan):
    @cd.epilogue
    def only_stats(acc, bias: cd.VecN):
        y = cd.silu(acc + bias)
        return {"y": y, "total": cd.sum(y, axis=None)}

    a, b = _ab()
    bias = torch.randn(56).bfloat16()
    r = cd.gemm(a, b, only_stats, bias=bias, backend="reference")
    y = F.silu(a.float() @ b.float().t() + bias.float())
    assert set(r) == {"y", "total"} and r["total"].shape == ()
    assert _rel(r["total"], y.sum()) < 1e-5
    plan = make_plan(only_stats)  # no D: ElementD = void, and an EVT exposing ElementAux for CUTLASS
    assert plan.d_dtype is None
    text = render(plan, "0" * 24)
    assert "using ElementD = void;" in text and "using ElementAux = float;" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_reference(dtype):
    @cd.epilogue
    def scaled(acc, alpha: cd.Scalar):
        return acc * alpha

    a, b = _ab()
    t = torch.randn(37, 56).to(dtype)
    t0 = t.clone()
    got = cd.gemm(a, b, scaled, alpha=0.25, out={"D": t}, accumulate=True, backend="reference")["D"]
    assert got.data_ptr() == t.data_ptr()
    assert _rel(t, t0.float() + 0.25 * (a.float() @ b.float().t())) < (1e-6 if dtype == torch.float32 else 1e-2)
    with pytest.raises(cd.OperandError, match="out=\\{'D'"):
        cd.gemm(a, b, scaled, alpha=1.0, accumulate=True, backend="reference")


def test_accumulate_into_a_half_width_d_is_refused():
    """A pairwise D (SwiGLU's, N/2 wide) is stored by the pair store, not as CUTLASS's D, which accumulate
    reads: the kernel had no prior D to add (C was null). Refused on every backend, with the fix."""
    @cd.epilogue
    def swiglu_d(acc):
        g, u = cd.pairs(acc)
        return cd.silu(g) * u

    a, b = torch.randn(8, 16).bfloat16(), torch.randn(32, 16).bfloat16()
    with pytest.raises(cd.UnsupportedError, match=r"accumulate=True needs an N-wide D; this D is N/2 wide"):
        cd.gemm(a, b, swiglu_d, out={"D": torch.zeros(8, 16, dtype=torch.bfloat16)}, accumulate=True)


def test_accumulate_without_a_d_output_says_so():
    """An epilogue with outputs but no D: out={'D': ...} would be refused as unknown, so the fix is another."""
    @cd.epilogue
    def stats_only(acc):
        return {"s": cd.sum(acc, axis="n")}
    a, b = _ab()
    with pytest.raises(cd.OperandError, match="this epilogue has no D output.*\n  fix: return a D"):
        cd.gemm(a, b, stats_only, accumulate=True, backend="reference")


@pytest.mark.parametrize("d, words", [
    (torch.zeros(37, 57), r"out\['D'\] is torch.float32 \[37, 57\], expected torch.float32 \[37, 56\]"),
    (torch.zeros(2, 37, 56), r"out\['D'\] is torch.float32 \[2, 37, 56\], expected torch.float32 \[37, 56\]"),
    (torch.zeros(37, 56, device="meta"), r"out\['D'\] is on meta, A on cpu"),
    ([[0.0] * 56] * 37, r"out\['D'\] is list: accumulate=True adds into a tensor.*\n  fix:"),
])
def test_accumulate_into_a_bad_d_is_refused_before_it_is_read(d, words):
    """The reference backend reads D before it computes: its shape, device and type are checked first (torch's
    own broadcasting errors came instead, or a broadcast D was added into)."""
    a, b = _ab()
    with pytest.raises(cd.OperandError, match=words):
        cd.gemm(a, b, out={"D": d}, accumulate=True, backend="reference")


def test_accumulate_into_a_reduction_as_d_is_refused():
    @cd.epilogue
    def row_sum(acc):
        return cd.sum(acc, axis="n")
    a, b = _ab()
    t = torch.ones(37)
    with pytest.raises(cd.OperandError, match="D is a reduction.*\n  fix:"):  # a call's misuse, as without a D
        cd.gemm(a, b, row_sum, out={"D": t}, accumulate=True, backend="reference")
    assert torch.equal(t, torch.ones(37))  # refused before anything was written


def test_accumulate_lowers_to_a_source_fetch(make_plan):
    @cd.epilogue
    def plain(acc):
        return acc * 2.0

    plan = make_plan(plain, accumulate=True)
    assert plan.reads_d and any(isinstance(n, SrcFetch) for n in plan.nodes)
    src = render(plan, "0" * 24)
    assert "Sm90SrcFetch<ElementC>" in src and "using ElementC = ElementD;" in src
    assert make_plan(plain).canonical != plan.canonical


@pytest.mark.parametrize("eps", [1e-6, 1.0])  # 1.0: eps inside the mean, not scaled with it
@pytest.mark.parametrize("activation", [None, "silu"])
def test_rmsnorm_linear_matches_f_rms_norm(activation, eps):
    m, d_in, d, f = 45, 48, 64, 72  # W1 not square: the norm is over d, GEMM 1's N
    x, r = torch.randn(m, d_in).bfloat16(), torch.randn(m, d).bfloat16()
    w1, w2 = (torch.randn(d, d_in) / 8).bfloat16(), (torch.randn(f, d) / 8).bfloat16()
    gamma = (torch.rand(d) + 0.5).bfloat16()
    h, y = rmsnorm_linear(x, w1, r, gamma, w2, eps=eps, activation=activation, backend="reference")
    h_ref = x.float() @ w1.float().t() + r.float()
    y_ref = F.rms_norm(h_ref, (d,), gamma.float(), eps) @ w2.float().t()
    y_ref = F.silu(y_ref) if activation else y_ref
    assert _rel(h, h_ref) < 1e-2 and _rel(y, y_ref) < 1e-2
    with pytest.raises(ValueError, match="activation"):
        rms_consumer("swish")


@cd.epilogue
def extremes(acc):
    return {"D": acc, "mx": cd.max(acc, axis="n"), "mn": cd.min(acc, axis="m"), "s": cd.sum(acc, axis="n")}


def test_reduction_identities_atomics_and_strides(make_plan):
    """Atomic mode: each output is filled with its kind's identity, combined with its kind's atomic, and
    addressed per row ([M], axis n) or per column ([N], axis m)."""
    red = {n.kind: n for n in make_plan(extremes).nodes if isinstance(n, Reduce)}
    assert cpp(red["max"]).fill.endswith(", -INFINITY}") and cpp(red["min"]).fill.endswith(", INFINITY}")
    assert "coda::atomic_maximum" in cpp(red["max"]).type and "coda::atomic_minimum" in cpp(red["min"]).type
    assert "{cute::_1{}, cute::_0{}, int64_t(M)}" in cpp(red["sum"]).args
    assert cpp(red["min"]).args == "{outputs[1].data_ptr<float>(), INFINITY, int64_t(N), 0}"  # [L, N]: batch stride N
    src = render(make_plan(extremes), "0" * 24)  # the three outputs filled by one launch, before the GEMM's
    assert src.count("coda::fill(") == 1 and src.count("coda::Fill{outputs[") == 3
    assert src.index("coda::fill(") < src.index("coda::launch<GemmKernel>")


def test_deterministic_partials_and_combines(make_plan):
    src = render(make_plan(extremes, deterministic=True), "0" * 24)
    assert "partial_0_shape = coda::row_partials<TileShape>(M, N)" in src  # mx: one partial per row
    # mn: one per column, per tile row and warp: coda's node stores each warp's totals (no atomics)
    assert "partial_1_shape = coda::column_partials<TileShape>(M, N, coda::kTileWarps<KernelSchedule>)" in src
    assert "coda::finish<coda::Max" in src and "coda::finish<coda::Min" in src
    assert ("coda::ColumnReduction<coda::minimum_nan, coda::minimum_nan, coda::store_value, "
            "coda::kTileWarps<KernelSchedule>>") in src and "Sm90RowReduction" not in src


def test_accumulate_adds_before_the_one_rounding():
    """D += cast(x): the sum is rounded once, to D's dtype, not x first and then the sum."""
    @cd.epilogue
    def third(acc):
        return cd.cast(acc * (1.0 / 3.0), cd.bfloat16)

    d = accumulate_into_d(specialize(third.program, {})).output("D").node
    assert d.op == "add" and all(i.op != "cast" for i in d.inputs)


def test_consts_inside_then_are_folded(make_plan):
    @cd.epilogue
    def scaled_sum(acc, c: cd.Const):
        return {"D": acc, "s": cd.sum(acc, axis="n").then(lambda s: s * (c * 2.0))}

    [r] = [n for n in make_plan(scaled_sum, consts={"c": 1.5}).nodes if isinstance(n, Reduce)]
    assert "3.0f" in r.finish.canonical()
    a, b = _ab()
    s = cd.gemm(a, b, scaled_sum, c=1.5, backend="reference")["s"]
    assert _rel(s, 3.0 * (a.double() @ b.double().t()).sum(-1)) < 1e-5
