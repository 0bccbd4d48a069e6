"""The catalogue of test epilogues used by more than one test file, and the helpers that check them:
`signature_for` (the Signature cd.gemm builds, for lowering without a GPU) and `rel_err`.

A plain module, imported by name (`from epilogues import bias_gelu`); tests/conftest.py holds only
fixtures and hooks. An epilogue used by one file stays in that file.
"""
import dataclasses

import torch

import coda_dsl as cd
from coda_dsl.passes import Signature
from coda_dsl.runtime import op as runtime


# ---- epilogues ----------------------------------------------------------------------------------
@cd.epilogue
def bias_gelu(acc, bias: cd.VecN):
    """The erf GELU (coda_dsl.examples.bias_gelu is the tanh one)."""
    return cd.gelu(acc + bias)


@cd.epilogue
def extrema(acc, scale: cd.Scalar):
    """fp8 scaling statistics: max |x| of the tensor, max per row, min per column (NaN kept, as torch.amax)."""
    y = acc * scale
    return {"D": y, "amax": cd.amax(y, axis=None), "row_max": cd.max(y, axis="n"), "col_min": cd.min(y, axis="m")}


@cd.epilogue
def statistics_of_a_half(acc):
    """Row and whole statistics of SwiGLU's N/2-wide output: taken over interleave(g(y), g(y)) (lower.py)."""
    g, u = cd.pairs(acc)
    y = cd.silu(g) * u
    return {"D": y, "amax": cd.amax(y, axis=None), "rmax": cd.max(y, axis="n"), "rmin": cd.min(y, axis="n"),
            "rsum": cd.sum(cd.abs(y), axis="n"), "lse": cd.logsumexp(y, axis="n"),  # sums that do not cancel
            "rstd": cd.sum(y * y, axis="n").then(lambda s: cd.rsqrt(s * 0.25 + 1e-5)),
            "total": cd.sum(cd.abs(y), axis=None)}


@cd.epilogue
def residual_rms(acc, residual: cd.Tensor, gamma: cd.VecN):
    h = acc + residual
    return {"D": h, "h_gamma": h * gamma}


@cd.epilogue
def rich_operands(acc, residual: cd.Tensor, bias: cd.VecN, rstd: cd.VecM, alpha: cd.Scalar, beta: cd.Scalar,
                  c: cd.Const):
    """Every operand kind, two aux outputs of different dtypes, a value (h) shared by three uses."""
    h = (acc * rstd + bias) * alpha + residual * c
    g = cd.gelu(h, approximate="tanh")
    return {"D": g * beta, "h32": cd.cast(h, cd.float32), "g16": cd.cast(cd.where(h > 0, g, float("-inf")),
                                                                          cd.float16)}


@cd.epilogue
def rich_operands_and_ops(acc, residual: cd.Tensor, bias: cd.VecN, rstd: cd.VecM, alpha: cd.Scalar,
                          beta: cd.Scalar, c: cd.Const):
    """rich_operands plus every elementwise op and comparison, for the one full compile."""
    h = (acc * rstd + bias) * alpha + residual * c  # shared: D and both aux outputs read it
    g = cd.gelu(h, approximate="tanh")
    e = (cd.exp(-cd.abs(h)) + cd.log(1 + h * h) + cd.sqrt(cd.relu(h)) + cd.rsqrt(1 + h ** 2) + cd.tanh(h)
         + cd.sigmoid(h) + cd.gelu(h) + cd.silu(h) + cd.maximum(h, beta) - cd.minimum(h, 0.5) / 3
         + (h < 1) + (h <= 1) + (h >= 2) + (h == 0) + (h != 0) + cd.cast(h, cd.bfloat16))
    e = cd.where(e != e, 0.0, e)
    return {"D": g * beta + e, "h32": cd.cast(h, cd.float32),
            "g16": cd.cast(cd.where(h > 0, g, float("-inf")), cd.float16)}


@cd.epilogue
def pairs_with_full_width_operands(acc, bias: cd.VecN, rs: cd.VecM, s: cd.Scalar):
    """Inside one pair functor: a full-width VecN (read per slot), a VecM and a scalar (one per row)."""
    even, odd = cd.pairs(acc)
    y = cd.interleave(even * rs - odd, odd * s + 1.0)
    return {"D": y * 2.0 + bias, "h": cd.cast(odd - even * s, cd.float32)}


@cd.epilogue
def double_width(acc, pre: cd.Tensor, rs: cd.VecM):
    """A backward's shapes beside other nodes: a [M, 2N] operand split by cd.pairs, an interleaved [M, 2N]
    output, a per-row sum and an N-wide output of the same halves."""
    g, u = cd.pairs(pre)
    dg = acc * cd.sigmoid(g) * rs
    return {"D": cd.interleave(dg, acc * u), "s": cd.sum(dg * u, axis="n"), "h": g - u}


@cd.epilogue
def wide_only(acc, pre: cd.Tensor):
    """Only double-width values (no N/2-wide one): N may be odd."""
    g, u = cd.pairs(pre)
    return cd.interleave(acc * g, acc - u)


# ---- helpers ------------------------------------------------------------------------------------
def signature_for(ep, ab="bf16", b_layout="nk", operand_dtype="bf16", operand_dtypes=None, output_dtypes=None,
                  consts=None, config=None, deterministic=False, accumulate=False) -> Signature:
    """The Signature cd.gemm would build for `ep` (runtime.op.signature, the product's one): every load
    operand `operand_dtype` unless given in `operand_dtypes`; outputs as a call gets them, except those
    in `output_dtypes` (forced, even over a traced dtype, to reach codegen cases a call cannot)."""
    loads = {p.name: (operand_dtypes or {}).get(p.name, operand_dtype) for p in ep.params
             if p.kind in ("tensor", "vec_n", "vec_m")}
    sig = runtime.signature(ep, ab, b_layout, loads, consts or {}, config, deterministic, accumulate)
    if output_dtypes:
        sig = dataclasses.replace(sig, output_dtypes=tuple((name, output_dtypes.get(name, dtype))
                                                           for name, dtype in sig.output_dtypes))
    return sig


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖, computed in fp64 (a zero reference divides by 1e-30, not 0)."""
    out, ref = out.detach().double(), ref.detach().double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
