"""GPU tests: every op and operand kind through the CUTLASS backend vs the reference backend.

Fresh random inputs per test, ragged shapes, outputs poisoned with NaN before the launch.
Skipped (with the reason) where no sm_90 GPU is present. All kernels are built in parallel once,
before the first test (see `kernels`).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.library import (interleave_gate_up, linear_swiglu, rms_consumer, rms_producer, rmsnorm_linear,
                              rope_frequencies, rope_positions, rope_tables, swiglu, swiglu_backward,
                              swiglu_keep_preactivation)
from coda_dsl.library.cross_entropy import (BUFFER_BYTES, _backward_softcap_epilogue, _forward_epilogue, ce_backward,
                                           combine_vocab_shards, default_chunk_rows, default_config, logits_buffer_dtype,
                                           recomputed_grads, stored_logits, vocab_shard_stats)
from coda_dsl.runtime import op as runtime
from coda_dsl.runtime.autograd import derived_backward
from build_helpers import warm_path_or_skip
from epilogues import (bias_gelu, check_gqa_rope_against_torch, double_width, pairs_with_full_width_operands,
                       residual_rms, statistics_of_a_half, wide_only)

swiglu_derived_backward = cd.backward_epilogue(swiglu)  # swiglu_backward without recomputing y
residual_rms_backward = cd.backward_epilogue(residual_rms)  # reads h back from the forward's D (saved_D)

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU; none visible to torch")

RAGGED = (777, 4104, 1000)  # M, N, K: none a multiple of the 128x256x64 tile
SHAPES = [RAGGED, (128, 256, 64), (8, 16, 8), (300, 4112, 256)]


# ---- epilogues under test --------------------------------------------------------------------
@cd.epilogue
def all_kinds(acc, res: cd.Tensor, scale_m: cd.VecM, bias_n: cd.VecN, alpha: cd.Scalar, c: cd.Const):
    h = alpha * acc * scale_m + bias_n
    return {"D": h + res * c, "h32": cd.cast(h, cd.float32), "h16": cd.cast(cd.relu(h) - res, cd.float16)}


@cd.epilogue
def transcendental(acc):
    x = acc * 0.25
    return {
        "D": cd.tanh(x) + cd.exp(-cd.abs(x)),
        "a": cd.cast(cd.log(cd.abs(x) + 1.0) * cd.sqrt(cd.abs(x)), cd.float32),
        "b": cd.cast(cd.rsqrt(x * x + 1.0) + cd.sigmoid(x) - x / (x * x + 2.0), cd.float32),
    }


@cd.epilogue
def activations(acc, t: cd.Scalar):
    x = acc * 0.5
    picked = cd.where(x > t, cd.silu(x), cd.gelu(x, approximate="tanh"))
    return {
        "D": picked + cd.maximum(x, -x * 0.5) - cd.minimum(x, 1.0),
        # bf16 tolerance: a value within rounding of a threshold may compare differently with another acc order
        "c": (x <= t) + (x >= 0) * 2.0 + (x == 0) * 4.0 + (x != 1.0) * 8.0 + (x < -t) * 16.0,
        "r": cd.relu(-x) + cd.cast(x, cd.bfloat16) ** 2,  # bf16: a rounding boundary may flip with acc order
    }


@cd.epilogue
def row_stats(acc, residual: cd.Tensor):
    h = acc + residual
    return {"D": h, "sumsq": cd.sum(h * h, axis="n"), "rowmax": cd.max(h, axis="n"),
            "rowmin": cd.min(h, axis="n"), "rowamax": cd.amax(h, axis="n")}


@cd.epilogue
def col_and_total_stats(acc, scale: cd.Scalar):
    x = acc * scale
    return {"D": x, "colsum": cd.sum(x, axis="m"), "colmax": cd.max(x, axis="m"), "colmin": cd.min(x, axis="m"),
            "colamax": cd.amax(x, axis="m"), "total": cd.sum(x, axis=None), "tmax": cd.max(x, axis=None),
            "tmin": cd.min(x, axis=None), "tamax": cd.amax(x, axis=None)}


@cd.epilogue
def column_mix(acc, x: cd.Tensor, scale: cd.Scalar):
    """Every column statistic, one finished by .then and one of an fp16 operand, beside two row statistics."""
    h = acc * scale
    return {"D": h, "colsum": cd.sum(h, axis="m"), "colmax": cd.max(h, axis="m"), "colmin": cd.min(h, axis="m"),
            "colamax": cd.amax(h, axis="m"), "colrsqrt": cd.sum(h * h, axis="m").then(lambda s: cd.rsqrt(s + 1.0)),
            "xamax": cd.amax(x, axis="m"), "rowmax": cd.max(h, axis="n"), "lse": cd.logsumexp(h)}


@cd.epilogue
def no_d(acc, bias: cd.VecN):
    y = cd.silu(acc + bias)
    return {"y": y, "ysum": cd.sum(y, axis="n")}


@cd.epilogue
def scaled_bias(acc, bias: cd.VecN, alpha: cd.Scalar):
    return alpha * acc + bias


@cd.epilogue
def scaled_residual(acc, residual: cd.Tensor, alpha: cd.Scalar):
    return alpha * acc + residual


@cd.epilogue
def lse_and_take(acc, target: cd.VecM, shift: cd.Scalar):
    z = acc * 8.0 + shift  # shift -1000: every exp underflows unless taken relative to the running max
    masked = cd.where(acc < -1.0, float("-inf"), z)  # -inf logits
    return {"lse": cd.logsumexp(z), "lse_masked": cd.logsumexp(masked), "zt": cd.take(z, target),
            "rstd_like": cd.logsumexp(acc).then(lambda s: cd.exp(-0.01 * s))}  # no underflow at K=1000


@cd.epilogue
def ce_like(acc, target: cd.VecM):
    z = acc * 0.01  # logits of about unit size at the suite's K: exp(z - lse) neither overflows nor all underflows
    return {"lse": cd.logsumexp(z), "zt": cd.take(z, target)}


ce_derived_backward = derived_backward(ce_like)  # the logits' gradient in the GEMM that recomputes them (one-hot)


@cd.epilogue
def sin_cos(acc, pos: cd.VecM, inv_freq: cd.VecN):
    """RoPE's rotation angles, the sines and cosines stored in fp32 (their accuracy is tested alone)."""
    angle = pos * inv_freq
    return {"D": acc, "s": cd.cast(cd.sin(angle), cd.float32), "c": cd.cast(cd.cos(angle), cd.float32)}


def _targets(m, n, lead=()):
    t = torch.randint(0, n, (*lead, m), device="cuda")
    t[..., ::5] = n - 1  # the last column: in the partial last tile when N is ragged
    t[..., 1::7] = -100  # ignore_index: outside [0, N), take gives 0
    t[..., 2::11] = n  # just past the end
    return t


def _rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda").to(dtype)


def _operands(ep, m, n, dtype, batch=None):
    lead = (batch,) if batch else ()
    make = {
        bias_gelu: lambda: dict(bias=_rand(n, dtype=dtype)),
        residual_rms: lambda: dict(residual=_rand(*lead, m, n, dtype=dtype), gamma=_rand(n, dtype=dtype)),
        all_kinds: lambda: dict(res=_rand(*lead, m, n, dtype=torch.float32), scale_m=_rand(*lead, m, dtype=torch.float32),
                                bias_n=_rand(n, dtype=dtype), alpha=0.37, c=1.5),
        transcendental: lambda: {},
        activations: lambda: dict(t=0.3),
        cd.identity: lambda: {},
        row_stats: lambda: dict(residual=_rand(*lead, m, n, dtype=dtype)),
        col_and_total_stats: lambda: dict(scale=0.5),
        column_mix: lambda: dict(x=_rand(*lead, m, n, dtype=torch.float16), scale=0.5),
        no_d: lambda: dict(bias=_rand(n, dtype=dtype)),
        scaled_bias: lambda: dict(bias=_rand(n, dtype=dtype), alpha=0.5),
        scaled_residual: lambda: dict(residual=_rand(*lead, m, n, dtype=dtype), alpha=0.5),
        rms_producer: lambda: dict(residual=_rand(*lead, m, n, dtype=dtype), gamma=_rand(n, dtype=dtype),
                                   inv_n=1.0 / n, eps=1e-6),
        rms_consumer(None): lambda: dict(rstd=_rand(*lead, m, dtype=torch.float32).abs() + 0.5),
        residual_rms_backward: lambda: dict(saved_D=_rand(*lead, m, n, dtype=dtype), residual=_rand(*lead, m, n, dtype=dtype),
                                            gamma=_rand(n, dtype=dtype), grad_h_gamma=_rand(*lead, m, n, dtype=dtype)),
        swiglu: lambda: {},
        swiglu_keep_preactivation: lambda: {},
        rope_tables: lambda: dict(cos=_rand(*lead, m, n // 2, dtype=dtype), sin=_rand(*lead, m, n // 2, dtype=dtype)),
        rope_positions: lambda: dict(pos=torch.arange(m, device="cuda", dtype=torch.float32),
                                     inv_freq=rope_frequencies(n, 128).cuda()),
        lse_and_take: lambda: dict(target=_targets(m, n, lead), shift=-1000.0),
        ce_derived_backward: lambda: dict(target=_targets(m, n, lead), grad_lse=_rand(*lead, m, dtype=torch.float32),
                                          grad_zt=_rand(*lead, m, dtype=torch.float32),
                                          saved_lse=math.log(n) + 0.1 * _rand(*lead, m, dtype=torch.float32)),
        sin_cos: lambda: dict(pos=torch.randint(0, 131072, (*lead, m), device="cuda").float(),
                              inv_freq=rope_frequencies(2 * n, 128, base=500000.0).cuda()),  # [N]: no pairs
        pairs_with_full_width_operands: lambda: dict(bias=_rand(n, dtype=dtype), rs=_rand(*lead, m, dtype=dtype),
                                                     s=0.7),
        swiglu_backward: lambda: dict(saved_acc=3 * _rand(*lead, m, 2 * n, dtype=dtype)),
        swiglu_derived_backward: lambda: dict(saved_acc=3 * _rand(*lead, m, 2 * n, dtype=dtype)),
        double_width: lambda: dict(pre=_rand(*lead, m, 2 * n, dtype=dtype), rs=_rand(*lead, m, dtype=torch.float32)),
    }
    return make[ep]()


# (epilogue, A/B dtype, layout) of every kernel the suite needs; layout: B's ("nk" or "kn"), or
# "km/<B's>" for A passed as X.t() ([K, M] storage, as a weight gradient's GEMM reads dY^T)
CASES = [
    (cd.identity, torch.bfloat16, "nk"),
    (cd.identity, torch.bfloat16, "kn"),
    (cd.identity, torch.bfloat16, "km/nk"),
    (residual_rms, torch.bfloat16, "km/kn"),
    (cd.identity, torch.float16, "nk"),
    (bias_gelu, torch.bfloat16, "nk"),
    (residual_rms, torch.bfloat16, "nk"),
    (residual_rms, torch.float16, "kn"),
    (all_kinds, torch.bfloat16, "nk"),
    (transcendental, torch.bfloat16, "nk"),
    (activations, torch.bfloat16, "nk"),
    (row_stats, torch.bfloat16, "nk"),
    (col_and_total_stats, torch.bfloat16, "nk"),
    (no_d, torch.bfloat16, "nk"),
    (rms_producer, torch.bfloat16, "nk"),
    (rms_consumer(None), torch.bfloat16, "nk"),
]
CASES += [(ep, torch.bfloat16, "nk") for ep in (swiglu, swiglu_keep_preactivation, rope_tables, rope_positions,
                                                 lse_and_take, pairs_with_full_width_operands, sin_cos,
                                                 swiglu_backward, swiglu_derived_backward, residual_rms_backward,
                                                 double_width, ce_derived_backward)]
# the row nodes under other thread layouts: one warp group per 64-row tile; the cooperative tile, whose
# epilogue no mainloop hides (the cross-entropy's cost there)
LSE_CONFIGS = ("64x256x64_c1x1_pingpong", "256x128x64_c1x2_cooperative")
# two epilogue subtiles per tile: C (D itself, accumulating) has one stage more than AuxLoad nodes would have
# had from a descriptor without C
NARROW = "128x64x64_c1x1_cooperative"
# further specializations: (case, compile options)
VARIANTS = [
    ((row_stats, torch.bfloat16, "nk"), dict(deterministic=True)),
    ((col_and_total_stats, torch.bfloat16, "nk"), dict(deterministic=True)),
    ((rms_producer, torch.bfloat16, "nk"), dict(deterministic=True)),
    ((scaled_bias, torch.bfloat16, "nk"), dict(accumulate=True, out_dtype=torch.float32)),
    ((scaled_bias, torch.bfloat16, "nk"), dict(accumulate=True, out_dtype=torch.bfloat16)),
    ((scaled_residual, torch.bfloat16, "nk"), dict(accumulate=True, out_dtype=torch.bfloat16, config=NARROW)),
    *(((lse_and_take, torch.bfloat16, "nk"), dict(config=c)) for c in LSE_CONFIGS),
    ((double_width, torch.bfloat16, "nk"), dict(config=runtime.tuning.PINGPONG.text)),
]
# tile-scheduler options and other tiles: each with reductions + a full-size load, and with pair stores;
# every candidate tune=True may pick (the default one is CASES'), then other rasters, swizzles and clusters;
# PINGPONG and its _rm_s4 are one GEMM type, told apart at run time only: two libraries in one process
# (once, the second's launch failed: they shared the record of devices set up)
SCHEDULER_CONFIGS = [c.text for c in runtime.tuning.CANDIDATES if c != runtime.tuning.DEFAULT] + \
    ["128x256x64_c2x1_cooperative_rm_s4_streamk", "256x128x64_c1x2_cooperative_rn_s2",
     runtime.tuning.PINGPONG.text + "_rm_s4"]
VARIANTS += [((ep, torch.bfloat16, "nk"), dict(config=c)) for c in SCHEDULER_CONFIGS
             for ep in (row_stats, col_and_total_stats, swiglu)]
# coda::ColumnReduction on narrow tiles (128x48, 64x16, 128x80), on a 64x48 epilogue subtile, whose 12 columns
# per thread halve to 6, then 3 over the 8 lanes along m (the exchange's odd branch), and on the H200 rule's tile
COLUMN_CONFIGS = ["128x48x64_c1x1_cooperative", "64x16x64_c1x1_pingpong", "128x80x64_c2x1_pingpong",
                  "128x96x64_c1x1_pingpong_e64x48", runtime.tuning.PINGPONG.text]
VARIANTS += [((column_mix, torch.bfloat16, "nk"), dict(config=c)) for c in COLUMN_CONFIGS]
VARIANTS += [((column_mix, torch.bfloat16, "nk"), dict(config=runtime.tuning.PINGPONG.text, deterministic=True))]
# the cross-entropy library's kernels, with their A/B dtype: forward variants (smoothing, softcap),
# statistics only or also storing the logits chunk (fp16 D, as cross_entropy._stats asks: stored_logits),
# and the recompute backward ones
CE_KERNELS = [(_forward_epilogue(s, c, logits), dtype) for dtype in (torch.bfloat16, torch.float16)
              for s in (False, True) for c in (None, 30.0) for logits in (False, stored_logits(dtype))] + \
    [(ep, dtype) for dtype in (torch.bfloat16, torch.float16) for ep in (ce_backward, _backward_softcap_epilogue(30.0))]


def _ab(m, n, k, dtype, layout, batch=None):
    lead = (batch,) if batch else ()
    a_layout, layout = layout.split("/") if "/" in layout else ("mk", layout)
    if a_layout == "mk":
        a = _rand(*lead, m, k, dtype=dtype)
    else:  # [K, M] storage, rows padded to 16 bytes (ragged M), passed transposed
        a = _rand(*lead, k, -(-m // 8) * 8, dtype=dtype)[..., :m].transpose(-1, -2)
    b = _rand(*lead, n, k, dtype=dtype) if layout == "nk" else _rand(*lead, k, n, dtype=dtype).transpose(-1, -2)
    return a, b


@pytest.fixture(scope="session")
def kernels():
    return build_kernels()


def build_kernels() -> list:
    """Build every kernel of the suite in one parallel ninja run."""
    ops = []
    only = os.environ.get("CODA_PREBUILD")  # name prefixes, e.g. "rope,ce_": build just these up front
    wanted = lambda ep: not only or ep.name.startswith(tuple(only.split(",")))  # noqa: E731
    for (ep, dtype, layout), opts in [(c, {}) for c in CASES] + VARIANTS:
        if not wanted(ep):
            continue
        a, b = _ab(64, 64, 64, dtype, layout)
        opts = dict(opts)
        if "out_dtype" in opts:
            opts["out"] = {"D": torch.empty(64, 64, device="cuda", dtype=opts.pop("out_dtype"))}
        ops.append(cd.compile(ep, a, b, **opts, **_operands(ep, 64, 64, dtype)))
    t, vec = torch.zeros(64, dtype=torch.int64, device="cuda"), torch.zeros(64, device="cuda")
    for ep, dtype in CE_KERNELS:
        if not wanted(ep):
            continue
        x, names = _rand(64, 64, dtype=dtype), {p.name for p in ep.params}
        out = {"D": torch.empty(64, 64, device="cuda", dtype=logits_buffer_dtype(dtype))} if "_logits" in ep.name \
            else None
        ops.append(cd.compile(ep, x, x, out=out, config=default_config(x.device), **{k: v for k, v in dict(
            target=t, lse=vec, scale=vec, uniform=0.0, hot=1.0).items() if k in names}))  # the config its calls use
    try:
        runtime.prebuild(ops)
    except cd.CodaError as e:  # tests of the kernels that did build still run; the others fail on their own
        print(f"prebuild: {e}")
    return ops


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _tol(t: torch.Tensor) -> float:
    return 1e-5 if t.dtype == torch.float32 else 1e-2  # fp32: reductions and fp32 outputs of fp32 math


# Sums that cancel: their rounding error scales with the sum of magnitudes, not with the sum itself
# (an fp32 sum of 128 values of size ~1 that cancels to ~0.2 differs by ~1e-6 between two orders).
MAGNITUDE = {("col_and_total_stats", "colsum"): lambda ref: ref["D"].float().abs().sum(-2),
             ("column_mix", "colsum"): lambda ref: ref["D"].float().abs().sum(-2),
             ("col_and_total_stats", "total"): lambda ref: ref["D"].float().abs().sum()}


# A sum of all M*N values in fp32, in two different orders (atomics vs torch): ~sqrt(M*N) * 2^-24 apart
# even when nothing cancels (777 x 4104 values of one sign: 1.3e-5 on the H200).
WHOLE_SUMS = {("col_and_total_stats", "total"): 1e-4, ("statistics_of_a_half", "total"): 1e-4}


def _check(ep, a, b, operands, batch=None, **opts):
    """The fused call against the reference: into out= tensors poisoned with NaN (an element left unwritten
    stays NaN), and into the outputs the call allocates itself (their dtypes, shapes and padded rows)."""
    ref = cd.gemm(a, b, ep, backend="reference", **operands)
    out = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
    into = cd.gemm(a, b, ep, backend="cutlass", out=out, **opts, **operands)
    assert all(into[name].data_ptr() == out[name].data_ptr() for name in ref), "out= tensor not used"
    for got in (into, cd.gemm(a, b, ep, backend="cutlass", **opts, **operands)):
        assert got.keys() == ref.keys()
        for name, r in ref.items():
            g = got[name]
            assert g.dtype == r.dtype and g.shape == r.shape, f"{ep.name}.{name}: {g.dtype} {list(g.shape)}"
            assert not torch.isnan(g).any(), f"{ep.name}.{name}: NaN left (unwritten elements?)"
            err = _rel(g, r)
            if (ep.name, name) in MAGNITUDE:
                err *= r.double().norm().item() / max(MAGNITUDE[ep.name, name](ref).double().norm().item(), 1e-30)
            assert err <= WHOLE_SUMS.get((ep.name, name), _tol(r)), f"{ep.name}.{name}: rel err {err:.2e}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{str(c[1])[6:]}-{c[2]}")
def test_matches_reference(kernels, case, shape):
    ep, dtype, layout = case
    m, n, k = shape
    a, b = _ab(m, n, k, dtype, layout)
    if layout.startswith("km") and m % 8:  # A = X.t() is read along M in 16-byte groups
        with pytest.raises(cd.UnsupportedError, match=f"M = {m} must be a multiple of 8"):
            cd.gemm(a, b, ep, backend="cutlass", **_operands(ep, m, n, dtype))
        return
    _check(ep, a, b, _operands(ep, m, n, dtype))


@pytest.mark.parametrize("ep", [cd.identity, residual_rms, all_kinds, double_width, ce_derived_backward],
                         ids=lambda e: e.name)
def test_batched(kernels, ep):
    m, n, k, l = 200, 264, 96, 3
    a, b = _ab(m, n, k, torch.bfloat16, "nk", batch=l)  # [L, M, K] x [L, N, K]
    _check(ep, a, b, _operands(ep, m, n, torch.bfloat16, batch=l), batch=l)


def test_double_width_other_config_and_unaligned_rows(kernels):
    """[M, 2N] operands and outputs under pingpong tiles; with N = 1001 (odd: no column pairs of the
    accumulator here) the output's rows (2002 bf16) are not whole 16-byte groups, so the interleaved
    output goes straight from registers (no TMA)."""
    m, n, k = 777, 4104, 1000
    a, b = _ab(m, n, k, torch.bfloat16, "nk")
    _check(double_width, a, b, _operands(double_width, m, n, torch.bfloat16), config=runtime.tuning.PINGPONG.text)
    a, b = _ab(300, 1001, 64, torch.bfloat16, "nk")
    _check(wide_only, a, b, dict(pre=_rand(300, 2002)))


def test_batched_a_shared_weight(kernels):
    a = _rand(3, 100, 64)
    b = _rand(136, 64)  # one weight for every batch: folded into M
    ops = _operands(residual_rms, 100, 136, torch.bfloat16, batch=3)
    _check(residual_rms, a, b, ops)


@pytest.mark.parametrize("sign", [-1.0, 1.0], ids=["all-negative", "all-positive"])
def test_reductions_extreme_inputs(kernels, sign):
    """All-negative values (max must not report the 0 of a wrong identity), large magnitudes for sums."""
    m, n, k = 777, 4104, 1000
    a = (torch.rand(m, k, device="cuda") + 0.1).bfloat16()
    b = (torch.rand(n, k, device="cuda") * sign + 0.1 * sign).bfloat16()  # acc has one sign everywhere
    residual = sign * _rand(m, n).abs() * 1e3  # so has h = acc + residual, in every row
    for deterministic in (False, True):
        _check(row_stats, a, b, dict(residual=residual), deterministic=deterministic)
        _check(col_and_total_stats, a, b, dict(scale=1e3), deterministic=deterministic)


def test_extrema_keep_nan_as_torch(kernels):
    """A NaN in row 7 of A makes that row of the accumulator NaN: cd.max/min/amax over it are NaN, as
    torch.amax/amin give (fmaxf would drop it: an fp8 scale computed from such an amax hides an overflow);
    the other rows' statistics are unaffected."""
    m, n, k = 300, 264, 64
    a, b = _ab(m, n, k, torch.bfloat16, "nk")
    a[7, 3] = float("nan")
    for ep, operands in ((row_stats, dict(residual=_rand(m, n))), (col_and_total_stats, dict(scale=0.5))):
        ref = cd.gemm(a, b, ep, backend="reference", **operands)
        for opts in (dict(deterministic=False), dict(deterministic=True), dict(config=runtime.tuning.PINGPONG.text)):
            got = cd.gemm(a, b, ep, backend="cutlass", **opts, **operands)
            for name in ref:
                nan = torch.isnan(ref[name])
                assert torch.equal(torch.isnan(got[name]), nan), (ep.name, name, opts)
                assert _rel(got[name][~nan], ref[name][~nan]) <= _tol(ref[name]), (ep.name, name, opts)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_statistics_of_a_half_width_value(kernels, deterministic):
    """Row and whole statistics of SwiGLU's [M, N/2] output, over interleave(g(y), g(y)) in the kernel."""
    a, b = _ab(777, 4104, 1000, torch.bfloat16, "nk")
    _check(statistics_of_a_half, a, b, {}, deterministic=deterministic)


def test_reductions_batched(kernels):
    m, n, k, l = 300, 264, 128, 3
    a, b = _ab(m, n, k, torch.bfloat16, "nk", batch=l)
    _check(row_stats, a, b, dict(residual=_rand(l, m, n)))
    _check(col_and_total_stats, a, b, dict(scale=0.25))
    a2d = _rand(l, m, k)  # 3-D A with a shared 2-D B: per-row statistics fold, per-column ones are refused
    _check(row_stats, a2d, b[0], dict(residual=_rand(l, m, n)))
    with pytest.raises(cd.UnsupportedError, match="reductions over m"):
        cd.gemm(a2d, b[0], col_and_total_stats, scale=1.0, backend="cutlass")


@pytest.mark.parametrize("ep", [row_stats, col_and_total_stats, rms_producer], ids=lambda e: e.name)
def test_deterministic_reductions(kernels, ep):
    """Per-tile partials combined in a fixed order: matches the reference and is bit-identical run to run."""
    m, n, k = RAGGED
    a, b = _ab(m, n, k, torch.bfloat16, "nk")
    ops = _operands(ep, m, n, torch.bfloat16)
    _check(ep, a, b, ops, deterministic=True)
    runs = [cd.gemm(a, b, ep, deterministic=True, **ops) for _ in range(5)]
    for name in runs[0]:
        for r in runs[1:]:
            assert torch.equal(r[name], runs[0][name]), f"{ep.name}.{name} differs between runs"


def test_deterministic_column_statistics_on_pingpong(kernels):
    """Deterministic column statistics on the H200 rule's tile, where each warp of a tile's one warp group
    stores a row of partials (the cooperative tile's two share it: test_deterministic_reductions): as the
    reference, batched too, and bit-identical run to run."""
    config = runtime.tuning.PINGPONG.text
    for m, n, k, l in ((777, 4104, 256, None), (300, 264, 64, 3)):
        a, b = _ab(m, n, k, torch.bfloat16, "nk", batch=l)
        ops = _operands(column_mix, m, n, torch.bfloat16, batch=l)
        _check(column_mix, a, b, ops, config=config, deterministic=True)
        runs = [cd.gemm(a, b, column_mix, config=config, deterministic=True, **ops) for _ in range(3)]
        assert all(torch.equal(r[name], runs[0][name]) for r in runs[1:] for name in runs[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_accumulate_in_place(kernels, dtype):
    m, n, k = RAGGED
    a, b = _ab(m, n, k, torch.bfloat16, "nk")
    ops = _operands(scaled_bias, m, n, torch.bfloat16)
    target = torch.randn(m, n, device="cuda").to(dtype)
    expected = target.clone()
    cd.gemm(a, b, scaled_bias, out={"D": expected}, accumulate=True, backend="reference", **ops)
    before = target.data_ptr()
    got = cd.gemm(a, b, scaled_bias, out={"D": target}, accumulate=True, **ops)["D"]
    assert got.data_ptr() == before
    assert _rel(target, expected) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_accumulate_with_a_full_size_operand_on_a_narrow_tile(kernels):
    """D += alpha acc + residual at NARROW: D comes through C, the residual through an AuxLoad that must use C's
    stage count (three here)."""
    m, n, k = RAGGED
    a, b = _ab(m, n, k, torch.bfloat16, "nk")
    ops = _operands(scaled_residual, m, n, torch.bfloat16)
    target = _rand(m, n)
    expected = target.clone()
    cd.gemm(a, b, scaled_residual, out={"D": expected}, accumulate=True, backend="reference", **ops)
    cd.gemm(a, b, scaled_residual, out={"D": target}, accumulate=True, config=NARROW, **ops)
    assert _rel(target, expected) <= 1e-2


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_rmsnorm_reparameterization_end_to_end(kernels, deterministic):
    """x -> GEMM1 + residual -> RMSNorm(gamma) -> GEMM2 as two fused GEMMs, vs F.rms_norm in fp32."""
    m, d, f = 777, 1024, 2056
    x, r = _rand(m, d), _rand(m, d)
    w1, w2 = (_rand(d, d) * d ** -0.5).bfloat16(), (_rand(f, d) * d ** -0.5).bfloat16()
    gamma = (torch.rand(d, device="cuda") + 0.5).bfloat16()
    if deterministic:  # the producer's statistic through the deterministic path, then the consumer
        p = cd.gemm(x, w1, rms_producer, residual=r, gamma=gamma, inv_n=1.0 / d, eps=1e-6, deterministic=True)
        h, y = p["D"], cd.gemm(p["h_gamma"], w2, rms_consumer(None), rstd=p["rstd"])["D"]
    else:
        h, y = rmsnorm_linear(x, w1, r, gamma, w2, eps=1e-6)
    h_ref = x.float() @ w1.float().t() + r.float()
    y_ref = F.rms_norm(h_ref, (d,), gamma.float(), 1e-6) @ w2.float().t()
    assert _rel(h, h_ref) <= 1e-2 and _rel(y, y_ref) <= 1e-2


def _rms_chain(x, r, ws, gamma, n, first=0, backend="cutlass"):
    """n steps of the layer's pattern: a GEMM with the residual add and its rstd (fill and finishing kernels
    around it), then a GEMM reading that rstd (a VecM) and its normalized output."""
    steps, d = [], x.shape[1]
    for i in range(first, first + n):
        p = cd.gemm(x, ws[i % 3], rms_producer, residual=r, gamma=gamma, inv_n=1.0 / d, eps=1e-6, backend=backend)
        y = cd.gemm(p["h_gamma"], ws[(i + 1) % 3], rms_consumer(None), rstd=p["rstd"], backend=backend)["D"]
        steps.append(((x, r), p, y))
        x, r = y, p["D"]
    return steps


def test_chained_calls_read_what_the_call_before_wrote(kernels):
    """Calls queued with no host wait, each reading what the one before it wrote: the layer's pattern 24 steps
    eagerly and 8 replayed from a CUDA graph on new inputs, and GEMM after GEMM over several waves of tiles in
    both schedules; every step against the reference on the inputs it had. (This caught programmatic
    dependent launch, since removed: its eager chain was wrong.)"""
    m, d = 777, 1024
    ws = [_rand(d, d) * d ** -0.5 for _ in range(3)]
    gamma = (torch.rand(d, device="cuda") + 0.5).bfloat16()

    def worst(steps):
        err = 0.0
        for i, ((x, r), p, y) in enumerate(steps):
            (_, q, z), = _rms_chain(x, r, ws, gamma, 1, i, backend="reference")
            err = max(err, *(_rel(got, ref) for got, ref in [(p["D"], q["D"]), (p["rstd"], q["rstd"]), (y, z)]))
        return err

    x0, r0 = _rand(m, d), _rand(m, d)
    assert worst(_rms_chain(x0, r0, ws, gamma, 24)) <= 1e-2
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g):
        captured = _rms_chain(x0, r0, ws, gamma, 8)
    torch.cuda.current_stream().wait_stream(s)
    x0.copy_(_rand(m, d))
    r0.copy_(_rand(m, d))
    g.replay()
    torch.cuda.synchronize()
    assert worst(captured) <= 1e-2
    big = 4096
    w = _rand(big, big) * big ** -0.5
    for config in ("128x256x64_c2x1_cooperative", "128x128x64_c2x1_pingpong"):
        xs = [_rand(big, big)]
        for _ in range(12):
            xs.append(cd.gemm(xs[-1], w, backend="cutlass", config=config)["D"])
        for x, y in zip(xs, xs[1:]):
            assert _rel(y, cd.gemm(x, w, backend="reference")["D"]) <= 1e-2, config


def test_linear_swiglu_matches_separate_projections(kernels):
    m, d, f = 777, 1024, 2056
    x, wg, wu = _rand(m, d), _rand(f, d) * d ** -0.5, _rand(f, d) * d ** -0.5
    out = torch.full((m, f), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = cd.gemm(x, interleave_gate_up(wg, wu), swiglu, out={"D": out}, backend="cutlass")["D"]
    ref = F.silu(x.float() @ wg.float().t()) * (x.float() @ wu.float().t())
    assert not torch.isnan(got).any() and _rel(got, ref) <= 1e-2
    assert _rel(linear_swiglu(x, interleave_gate_up(wg, wu)), ref) <= 1e-2


def test_scalar_change_does_not_rebuild(kernels, monkeypatch):
    """New cd.Scalar values launch the very kernel the first call launched."""
    a, b = _ab(256, 256, 128, torch.bfloat16, "nk")
    ops = _operands(all_kinds, 256, 256, torch.bfloat16)
    launched = []
    launch = runtime.CompiledOp.launch
    monkeypatch.setattr(runtime.CompiledOp, "launch", lambda self, *args, **kw: launched.append(self.key) or
                        launch(self, *args, **kw))
    for alpha in (0.37, 0.1, -2.0, 7.5):
        _check(all_kinds, a, b, {**ops, "alpha": alpha})
    # each value's results checked; those through the Python path (the C++ warm path passes no CompiledOp)
    # launched one kernel
    assert launched and len(set(launched)) == 1


def test_compiled_op_reuse(kernels):
    a, b = _ab(300, 512, 256, torch.bfloat16, "nk")
    bias = _rand(512)
    op = cd.compile(bias_gelu, a, b, bias=bias)
    for _ in range(2):
        a2, bias2 = _rand(300, 256), _rand(512)
        got = op(a2, b, bias=bias2)["D"]
        ref = cd.gemm(a2, b, bias_gelu, bias=bias2, backend="reference")["D"]
        assert _rel(got, ref) <= 1e-2


def test_current_stream(kernels):
    """The kernel runs on the caller's current stream: on a side stream, after a long sleep and a copy of new
    data into A, it must see the new A (a launch on another stream would overtake the sleep and read the old A)."""
    a, b = _ab(512, 512, 256, torch.bfloat16, "nk")
    a2 = _rand(512, 256)
    cd.gemm(a, b, cd.identity)  # warm: build/load outside the timed window
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time on s
        a.copy_(a2)
        got = cd.gemm(a, b, cd.identity)["D"]
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert _rel(got, cd.gemm(a2, b, backend="reference")["D"]) <= 1e-2


def test_warm_path_launches_as_the_python_path(kernels):
    """A kept op's and cd.gemm's later calls of a layout launch from C++ (runtime/warm.py): same results as
    the first call, which took the Python path, for fresh inputs and scalars each call."""
    warm_path_or_skip()
    m, n, k = RAGGED
    a, b = _ab(m, n, k, torch.bfloat16, "nk")
    op = cd.compile(all_kinds, a, b, **_operands(all_kinds, m, n, torch.bfloat16))
    for run in (lambda a, b, **o: op(a, b, **o), lambda a, b, **o: cd.gemm(a, b, all_kinds, **o)):
        for i in range(3):
            a, b = _ab(m, n, k, torch.bfloat16, "nk")
            ops = {**_operands(all_kinds, m, n, torch.bfloat16), "alpha": 0.37 + i}
            got = run(a, b, **ops)
            ref = cd.gemm(a, b, all_kinds, backend="reference", **ops)
            assert list(got) == list(ref)
            for name in ref:
                assert _rel(got[name], ref[name]) <= _tol(ref[name]), name
    assert op._table and op._table.size() == 1  # its layout, launched from C++ after the first call


def test_cuda_graph_capture_and_replay(kernels):
    a, b = _ab(384, 520, 128, torch.bfloat16, "nk")
    residual, gamma = _rand(384, 520), _rand(520)
    cd.gemm(a, b, residual_rms, residual=residual, gamma=gamma)  # warm: build/load outside capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g):
        out = cd.gemm(a, b, residual_rms, residual=residual, gamma=gamma)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):  # new data in the captured buffers, replay, compare
        a.copy_(_rand(384, 128)); residual.copy_(_rand(384, 520))
        g.replay()
        torch.cuda.synchronize()
        ref = cd.gemm(a, b, residual_rms, residual=residual, gamma=gamma, backend="reference")
        for name in ref:
            assert _rel(out[name], ref[name]) <= 1e-2


@pytest.mark.parametrize("config", [None, "128x256x64_c2x1_cooperative_rm_s4_streamk"], ids=["deterministic", "streamk"])
def test_cuda_graph_capture_with_a_workspace(kernels, config):
    """Kernels whose calls need a workspace from torch's caching allocator (deterministic partials; stream-K's
    flags, zeroed per launch) and fill outputs before the GEMM (atomic reductions, with stream-K): captured and
    replayed."""
    opts = dict(deterministic=True) if config is None else dict(config=config)
    a, b = _ab(384, 520, 128, torch.bfloat16, "nk")
    residual = _rand(384, 520)
    cd.gemm(a, b, row_stats, residual=residual, **opts)  # warm: build/load and the workspace size, outside capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g):
        out = cd.gemm(a, b, row_stats, residual=residual, **opts)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):
        a.copy_(_rand(384, 128)); residual.copy_(_rand(384, 520))
        g.replay()
        torch.cuda.synchronize()
        ref = cd.gemm(a, b, row_stats, residual=residual, backend="reference")
        for name in ref:
            assert _rel(out[name], ref[name]) <= _tol(ref[name]), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_call_on_a_device_that_is_not_current(kernels):
    """The launcher makes A's device current for its launches and restores the caller's."""
    with torch.cuda.device(0):
        a, b = (t.to("cuda:1") for t in _ab(256, 264, 128, torch.bfloat16, "nk"))
        residual = _rand(256, 264).to("cuda:1")
        got = cd.gemm(a, b, row_stats, residual=residual)
        assert torch.cuda.current_device() == 0
    ref = cd.gemm(a, b, row_stats, residual=residual, backend="reference")
    for name in ref:
        assert got[name].device == a.device and _rel(got[name], ref[name]) <= _tol(ref[name]), name


def test_torch_compile_fullgraph(kernels):
    a, b = _ab(256, 264, 128, torch.bfloat16, "nk")
    residual, gamma = _rand(256, 264), _rand(264)

    def block(x, w, r, g, backend="cutlass"):
        o = cd.gemm(x, w, residual_rms, residual=r, gamma=g, backend=backend)
        return torch.relu(o["D"]) + o["h_gamma"]

    compiled = torch.compile(block, fullgraph=True)
    got = compiled(a, b, residual, gamma)
    assert _rel(got, block(a, b, residual, gamma, backend="reference")) <= 1e-2


@pytest.mark.parametrize("config", SCHEDULER_CONFIGS)
@pytest.mark.parametrize("ep", [row_stats, col_and_total_stats, swiglu], ids=lambda e: e.name)
def test_scheduler_configs(kernels, ep, config):
    """Swizzled and stream-K tile orders, other tiles and clusters: ragged, tiny and batched problems. The
    column statistics' lanes exchange their registers differently per tile (coda::ColumnReduction)."""
    for m, n, k in (RAGGED, (8, 16, 8), (1000, 8200, 4104)):
        a, b = _ab(m, n, k, torch.bfloat16, "nk")
        _check(ep, a, b, _operands(ep, m, n, torch.bfloat16), config=config)
    a, b = _ab(300, 264, 520, torch.bfloat16, "nk", batch=3)
    _check(ep, a, b, _operands(ep, 300, 264, torch.bfloat16, batch=3), config=config)


@pytest.mark.parametrize("config", COLUMN_CONFIGS)
def test_column_statistics_on_other_tiles(kernels, config):
    """Column statistics beside row ones: ragged, tiny, batched and narrower than a tile. Then a NaN in row 5
    of B, so column 5 of the accumulator is NaN: exactly column 5 of each column statistic is NaN (a lane
    exchange that mixed columns would spread it), the others as the reference."""
    for m, n, k, l in ((777, 4104, 256, None), (8, 16, 8, None), (300, 264, 64, 3), (2048, 48, 64, None)):
        a, b = _ab(m, n, k, torch.bfloat16, "nk", batch=l)
        _check(column_mix, a, b, _operands(column_mix, m, n, torch.bfloat16, batch=l), config=config)
    a, b = _ab(777, 4104, 256, torch.bfloat16, "nk")
    b[5, 3] = float("nan")
    operands = _operands(column_mix, 777, 4104, torch.bfloat16)
    ref = cd.gemm(a, b, column_mix, backend="reference", **operands)
    got = cd.gemm(a, b, column_mix, backend="cutlass", config=config, **operands)
    for name in ("colsum", "colmax", "colmin", "colamax", "colrsqrt"):
        assert torch.isnan(got[name]).nonzero().flatten().tolist() == [5], name
        keep = torch.arange(4104, device="cuda") != 5
        assert _rel(got[name][keep], ref[name][keep]) <= 1e-4, name


def test_rope_angle_accuracy(kernels):
    """sin/cos reduce the angle to [-pi, pi] and use the hardware units. Against fp64 sin/cos of the
    same fp32 angle: 5.04e-7 on H100s (the inputs are fixed). Against the exact angle (positions up to
    131040, base 500000): the fp32 rounding of pos * inv_freq itself (up to ulp(131072) / 2 = 0.0039 rad)
    dominates, as in any fp32 RoPE."""
    m, n, k = 4096, 128, 64
    pos = (torch.arange(m, device="cuda") * 32).float()  # 0 .. 131040
    inv_freq = rope_frequencies(2 * n, 128, base=500000.0).cuda()  # [N]: sin_cos works on whole columns
    a, b = _ab(m, n, k, torch.bfloat16, "nk")
    got = cd.gemm(a, b, sin_cos, pos=pos, inv_freq=inv_freq, backend="cutlass")
    angle32 = (pos[:, None] * inv_freq[None, :]).double()  # the fp32 product the kernel forms
    exact = pos.double()[:, None] * inv_freq.double()[None, :]
    fp32_angle_err = max((got["s"].double() - angle32.sin()).abs().max().item(),
                         (got["c"].double() - angle32.cos()).abs().max().item())
    exact_err = max((got["s"].double() - exact.sin()).abs().max().item(),
                    (got["c"].double() - exact.cos()).abs().max().item())
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "rope_accuracy.txt"), "w") as f:
            f.write(f"max abs error vs fp64 sin/cos of the fp32 angle: {fp32_angle_err:.3g}\n"
                    f"max abs error vs fp64 sin/cos of the exact angle: {exact_err:.3g}\n")
    assert fp32_angle_err <= 1e-6 and exact_err <= 8e-3


def test_gqa_rope_both_conventions_match_torch(kernels):
    """issue 12's RoPE as models apply it, on the kernel: ragged M and K, packed positions up to 131071."""
    check_gqa_rope_against_torch("cuda", "cutlass", k=1000)


@pytest.mark.parametrize("config", LSE_CONFIGS)
def test_lse_and_take_other_config(kernels, config):
    m, n, k = RAGGED
    a, b = _ab(m, n, k, torch.bfloat16, "nk")
    _check(lse_and_take, a, b, _operands(lse_and_take, m, n, torch.bfloat16), config=config)


@pytest.mark.parametrize("config", [None, LSE_CONFIGS[1]])
def test_lse_and_take_special_values(kernels, config):
    """+inf, NaN and all -inf rows, inside tiles and in the partial ones (rows 768+, column n - 1), and take
    indices outside [0, N) that int32 would wrap onto a column: as the reference, batched too."""
    m, n, k = 777, 4104, 64
    a, b = _ab(m, n, k, torch.bfloat16, "nk")
    b[:, :3] = 0
    b[:, 1] = 1
    b[7, 0] = b[n - 1, 0] = b[n - 1, 2] = 1
    a[5, 0] = a[770, 0] = 1e38  # z = 8 acc overflows: +inf at columns 7 and n - 1
    a[6] = a[775] = float("nan")
    for r in (3, 4, 776):  # lse_masked over -inf alone (padded columns too) ...
        a[r] = 0
        a[r, 1] = -100
    a[3, 2] = 200  # ... but for row 3's column n - 1 (z = -200)
    t = _targets(m, n)
    t[5], t[770], t[6] = 7, n - 1, 0
    t[8], t[9], t[10], t[11] = -1, 2**31, 2**32 + 3, -(2**40)  # all take 0
    for lead in ((), (2,)):
        a_, b_, t_ = (x.expand(*lead, *x.shape).contiguous() for x in (a, b, t))
        want = cd.gemm(a_, b_, lse_and_take, backend="reference", target=t_, shift=-1000.0)
        got = cd.gemm(a_, b_, lse_and_take, backend="cutlass", config=config, target=t_, shift=-1000.0)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=2e-5, atol=1e-4, equal_nan=True, msg=name)
        assert got["lse"][..., 5].isposinf().all() and got["lse_masked"][..., 4].isneginf().all()


def test_lse_and_take_batched(kernels):
    m, n, k, l = 200, 264, 96, 3
    a, b = _ab(m, n, k, torch.bfloat16, "nk", batch=l)
    _check(lse_and_take, a, b, _operands(lse_and_take, m, n, torch.bfloat16, batch=l))


def _ce_reference(x, w, t, smoothing=0.0, cap=None, reduction="mean"):
    z = x.float() @ w.float().t()
    z = cap * torch.tanh(z / cap) if cap else z
    return F.cross_entropy(z, t, ignore_index=-100, label_smoothing=smoothing, reduction=reduction)


def _ce_problem(m, d, v, dtype=torch.bfloat16):
    x = _rand(m, d, dtype=dtype).requires_grad_()
    w = (_rand(v, d) * d ** -0.5).to(dtype).requires_grad_()
    t = _targets(m, v)
    t[t >= v] = 0
    return x, w, t


def _ce_check(x, w, t, reduction="mean", grad=1.0, smoothing=0.0, cap=None, **opts):
    """Loss within 1e-3 and gradients within 1e-2 of F.cross_entropy on fp32 logits (the issue's 1 %)."""
    loss = cd.linear_cross_entropy(x, w, t, label_smoothing=smoothing, softcap=cap, reduction=reduction,
                                   backend="cutlass", **opts)
    g = torch.full_like(loss, grad) if reduction != "none" else torch.randn_like(loss)
    loss.backward(g)
    xr, wr = x.detach().clone().requires_grad_(x.requires_grad), w.detach().clone().requires_grad_(w.requires_grad)
    ref = _ce_reference(xr, wr, t, smoothing, cap, reduction)
    ref.backward(g)
    assert _rel(loss.detach(), ref.detach()) <= 1e-3
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad)):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.dtype == x.dtype and _rel(got, want) <= 1e-2


@pytest.mark.parametrize("smoothing,cap", [(0.0, None), (0.1, None), (0.0, 30.0), (0.1, 30.0)])
@pytest.mark.parametrize("m,d,v", [(300, 256, 5000), (256, 512, 128256), (264, 256, 50257)],
                         ids=["v5000", "v128256", "v50257"])
@pytest.mark.parametrize("reduction,grad", [("mean", 1.0), ("sum", 0.5), ("none", None)])
def test_linear_cross_entropy_matches_torch(kernels, smoothing, cap, m, d, v, reduction, grad):
    """Vocabularies that are not a multiple of the tile, ignored rows, two row chunks. mean/sum: the
    gradients computed in the forward, scaled by the incoming one; none: the recompute backward."""
    x, w, t = _ce_problem(m, d, v)
    _ce_check(x, w, t, reduction, grad, smoothing, cap, chunk_rows=m // 2 + 8)


@pytest.mark.parametrize("smoothing,cap", [(0.0, None), (0.1, None), (0.0, 30.0), (0.1, 30.0)])
@pytest.mark.parametrize("reduction,grad", [("mean", 1.0), ("none", None)])
def test_linear_cross_entropy_fp16_options(kernels, smoothing, cap, reduction, grad):
    """fp16 inputs under every option: the gradients made in the forward (mean) and recomputed (none)."""
    m, d, v = 264, 256, 50257
    _ce_check(*_ce_problem(m, d, v, torch.float16), reduction, grad, smoothing, cap, chunk_rows=m // 2 + 8)


def test_linear_cross_entropy_default_chunks_fp16_and_frozen_head(kernels):
    """fp16 inputs; the default chunk size; a frozen head (no grad_W) and a frozen input (no grad_x)."""
    _ce_check(*_ce_problem(1000, 256, 50257, torch.float16))
    x, w, t = _ce_problem(1000, 256, 32000)
    _ce_check(x, w.detach(), t, smoothing=0.1)
    _ce_check(x.detach(), w, t, cap=30.0, reduction="sum")


@pytest.mark.parametrize("dtype,reduction,cap", [(torch.bfloat16, "mean", None), (torch.bfloat16, "mean", 30.0),
                                               (torch.bfloat16, "none", None), (torch.bfloat16, "none", 30.0),
                                               (torch.float16, "mean", None)])
def test_linear_cross_entropy_confident_rows(kernels, dtype, reduction, cap):
    """p(target) 0.96-0.999 with logits ~ 20-36: 1 - p is below the rounding of the stored logits (fp16
    buffer) and of the backward's D, so the target's column must come from fp32 (z_target; the epilogue's
    g_target), and in fp16 neither g nor the GEMMs' results may carry 1/M (subnormal). grad_x and grad_W
    within 1 % of fp64 autograd on the same (rounded) inputs (the reference backend: 0.3 %; before the
    fixes 3-1500 %), with a loss scale as AMP uses (the gradients of a confident fp16 model are subnormal
    without one); V = 2003 has a tail."""
    m, d, v = 256, 64, 2003
    x, w = torch.randn(m, d, device="cuda", dtype=torch.float64), _rand(v, d, dtype=torch.float64) * d ** -0.5
    t = torch.randperm(v, device="cuda")[:m]  # one row per class: each row is confident
    x[:, 0], w[:, 0] = (10.0 if cap else 20.0), 1.0  # every logit + 20 (+ 10 under the softcap)
    w[t, 1:] = x[:, 1:] * 16 / x[:, 1:].square().sum(-1, keepdim=True)  # the target's: + 16 more
    x, w = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    loss = cd.linear_cross_entropy(x, w, t, reduction=reduction, softcap=cap, backend="cutlass")
    ((loss.mean() if reduction == "none" else loss) * 4096).backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = x64 @ w64.t()
    (F.cross_entropy(cap * torch.tanh(z / cap) if cap else z, t) * 4096).backward()
    assert _rel(x.grad, x64.grad) < 1e-2 and _rel(w.grad, w64.grad) < 1e-2


@pytest.mark.parametrize("reduction,grad", [("mean", 1.0), ("sum", 0.5)])
def test_linear_cross_entropy_under_torch_compile(kernels, reduction, grad):
    """torch.compile(fullgraph=True) of the loss, forward and backward (the backward's scaling a custom op
    that mutates the gradients): the eager call's loss and gradients."""
    x, w, t = _ce_problem(264, 256, 50257)
    f = torch.compile(lambda x, w: cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="cutlass"),
                      fullgraph=True)
    got = torch.autograd.grad(f(x, w), (x, w), torch.tensor(grad, device="cuda"))
    want = torch.autograd.grad(cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="cutlass"), (x, w),
                               torch.tensor(grad, device="cuda"))
    for a, b in zip(got, want):
        assert _rel(a, b) <= 1e-3


def test_linear_cross_entropy_all_ignored(kernels):
    for reduction in ("mean", "sum", "none"):
        x, w = _rand(64, 256).requires_grad_(), (_rand(1000, 256) * 0.06).to(torch.bfloat16).requires_grad_()
        t = torch.full((64,), -100, device="cuda")
        loss = cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="cutlass")
        loss.sum().backward()
        assert not loss.any() and not torch.isnan(loss).any() and not x.grad.any() and not w.grad.any()


def _peak_extra(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def test_linear_cross_entropy_memory(kernels):
    """No grad: O(M) extra memory (per-row statistics and per-tile partials), no logits. With grads:
    grad_x + grad_W + one [chunk, V] buffer and nothing of that size more (the fused gradient step
    works in place: one compiled kernel, no temporary)."""
    m, d, v = 2048, 512, 128256
    x, w, t = _ce_problem(m, d, v)
    with torch.no_grad():
        loss, extra = _peak_extra(lambda: cd.linear_cross_entropy(x, w, t, backend="cutlass"))
    assert extra <= 24 << 20, f"{extra / 2**20:.0f} MiB"  # bf16 logits alone would be 501 MiB
    assert _rel(loss, _ce_reference(x, w, t)) <= 1e-3
    m = BUFFER_BYTES // (2 * v) + 300  # more rows than one chunk buffer holds: two chunks at least
    x, w, t = _ce_problem(m, d, v)
    cd.linear_cross_entropy(x, w, t, backend="cutlass")  # compiles the fused step outside the measurement
    rows = default_chunk_rows(m, v, "cuda")
    assert rows < m
    assert rows * v * 2 <= BUFFER_BYTES
    def loss_and_grads():
        return torch.autograd.grad(cd.linear_cross_entropy(x, w, t, backend="cutlass"), (x, w))
    grads, extra = _peak_extra(loss_and_grads)
    expected = rows * v * 2 + x.numel() * 2 + w.numel() * 2
    assert extra <= expected + (32 << 20), f"{extra / 2**20:.0f} MiB vs {expected / 2**20:.0f} MiB"


def test_linear_cross_entropy_two_vocabulary_shards(kernels):
    """The partials of two halves of W (as two tensor-parallel ranks would hold them) combine to the loss
    over the whole vocabulary."""
    x, w, t = _ce_problem(300, 256, 50257)
    t[:2] = torch.tensor([25000, 25001])  # one target at each side of the split
    parts = [vocab_shard_stats(x.detach(), ws, t, start, label_smoothing=0.1, softcap=30.0, backend="cutlass")
             for start, ws in ((0, w.detach()[:25000]), (25000, w.detach()[25000:]))]
    for reduction in ("mean", "none"):
        got = combine_vocab_shards(parts, t, 50257, label_smoothing=0.1, reduction=reduction)
        assert _rel(got, _ce_reference(x, w, t, 0.1, 30.0, reduction)) <= 1e-3


def test_vocabulary_shard_backward_of_rows_not_a_multiple_of_8(kernels):
    """A vocabulary shard's backward as vocab_parallel_cross_entropy runs it on each rank (recomputed_grads) on
    a shard of 25257 rows: its last V % 8 columns in fp32 beside the kernel's, as for linear_cross_entropy at
    V = 50257; against the reference backend."""
    x, w, t = _ce_problem(300, 256, 50257)
    t[:3] = torch.tensor([25000, 50256, 50250])  # the shard's first column, and two in its last V % 8
    x, ws = x.detach(), w.detach()[25000:]
    lse = torch.logsumexp(x.float() @ w.detach().float().t(), 1)
    local = t - 25000
    local = torch.where((local >= 0) & (local < ws.shape[0]), local, -1)
    scale = torch.full((300,), 1 / 300, device=x.device)
    got, want = (recomputed_grads(x, ws, lse, scale, local, 0.1 / 50257, 0.9, None, backend, None, 256)
                 for backend in ("cutlass", "reference"))
    assert _rel(got[0], want[0]) <= 2e-2 and _rel(got[1], want[1]) <= 2e-2


@pytest.mark.parametrize("ep, make", [(bias_gelu, lambda m, n: dict(bias=_rand(n))),
                                      (residual_rms, lambda m, n: dict(residual=_rand(m, n), gamma=_rand(n)))],
                         ids=["bias_gelu", "residual_rms"])
def test_linear_derived_backward_matches_reference(kernels, ep, make):
    """cd.linear on the cutlass backend against the reference backend's gradients. The fused forward saves
    what the derivative reads: bias_gelu's accumulator (in bf16); residual_rms's D (h = acc + residual),
    read back instead of an accumulator and the residual."""
    m, n, k = 777, 4104, 1000
    grads = {}
    for backend in ("reference", "cutlass"):
        torch.manual_seed(1)
        x = _rand(m, k).requires_grad_()
        w = (_rand(n, k) * k ** -0.5).to(torch.bfloat16).requires_grad_()
        operands = {name: t.requires_grad_() for name, t in make(m, n).items()}
        outs = cd.linear(x, w, ep, backend=backend, **operands)
        sum(o.float().square().sum() for o in outs.values()).backward()
        grads[backend] = (x.grad, w.grad, *(t.grad for t in operands.values()))
    for got, want in zip(grads["cutlass"], grads["reference"]):
        assert _rel(got, want) <= 2e-2


def test_linear_fp16_keeps_its_accumulator_in_fp32(kernels):
    """fp16 ends at 65504, the accumulator here near 2e5: the fused forward keeps it for sin's derivative in
    fp32 (kept in fp16 it was inf, and the gradients NaN)."""
    @cd.epilogue
    def scaled_sin(acc):
        return cd.sin(acc * 1e-5)

    m, n, k = 300, 264, 128
    x = (torch.rand(m, k, device="cuda") * 40 + 20).half().requires_grad_()
    w = (torch.rand(n, k, device="cuda") * 40 + 20).half().requires_grad_()
    y = cd.linear(x, w, scaled_sin, backend="cutlass")["D"]
    y.float().square().sum().backward()
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    torch.sin((xd @ wd.t()) * 1e-5).square().sum().backward()
    assert x.grad.isfinite().all() and w.grad.isfinite().all()
    assert _rel(x.grad, xd.grad) <= 1e-2 and _rel(w.grad, wd.grad) <= 1e-2


def test_backward_epilogue_reading_an_output_back(kernels):
    """residual_rms's derived backward in the GEMM that produces D's gradient reads h back from the forward's
    D (saved_D), not its accumulator and residual, and stores dacc once (the residual's gradient is the same
    tensor): the kernel against the reference backend, ragged shape."""
    m, n, k = RAGGED
    bw = residual_rms_backward
    assert "saved_acc" not in {p.name for p in bw.params}
    g, v = _rand(m, k), _rand(n, k) * k ** -0.5
    operands = _operands(bw, m, n, torch.bfloat16)
    got, want = cd.gemm(g, v, bw, **operands), cd.gemm(g, v, bw, backend="reference", **operands)
    assert set(got) == set(want) == {"D", "residual", "gamma"}
    assert got["residual"] is got["D"]  # dacc, stored once
    for name in want:
        assert _rel(got[name], want[name]) <= 2e-2, name
