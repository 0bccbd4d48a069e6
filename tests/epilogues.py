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


def half_split_rope(t: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """HF Llama's (NeoX) RoPE in plain torch: t [..., heads, d] turned by angle [..., 1, d / 2], pairs (i, i + d/2):
    t cos + rotate_half(t) sin with emb = cat(angle, angle)."""
    d, emb = t.shape[-1], torch.cat((angle, angle), -1)
    return t * emb.cos() + torch.cat((-t[..., d // 2:], t[..., :d // 2]), -1) * emb.sin()


def check_gqa_rope_against_torch(device: str, backend: str, k: int) -> None:
    """A Llama-3 QKV projection (32 Q and 8 KV heads of 128) with RoPE in its epilogue, on packed sequences
    (positions restart; the second reaches 131071, base 500000) of 777 tokens, against plain torch in fp32:
    the interleaved (GPT-J) rotation on the weights as they are; HF's half-split `rotate_half` on
    `qkv_weight`'s permuted copy, head by head once un-permuted; and causal GQA attention on the fused output
    as it comes equal to attention on HF's q, k, v. V passes through both."""
    from coda_dsl.library import rope_positions
    from coda_dsl.nn import qkv_inv_freq, qkv_weight
    hq, hk, d, m = 32, 8, 128, 777
    nq, nk = hq * d, hk * d
    x = torch.randn(m, k, device=device).bfloat16()
    wq, wk, wv = (torch.randn(n, k, device=device).mul(k ** -0.5).bfloat16() for n in (nq, nk, nk))
    pos = torch.cat((torch.arange(300), torch.arange(131072 - (m - 300), 131072))).float()
    inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2).float() / d)  # HF's inv_freq: [d / 2]
    operands = dict(pos=pos.to(device), inv_freq=qkv_inv_freq(inv, hq, hk).to(device), backend=backend)
    pos, inv = pos.to(device), inv.to(device)
    angle = pos[:, None, None] * inv  # [m, 1, d / 2], fp32 as the kernel forms it
    q, kk, v = (x.float() @ w.float().t() for w in (wq, wk, wv))

    def per_head(got, want, heads):  # every head within bf16 rounding of its reference
        got, want = got.float().reshape(m, heads, d).transpose(0, 1), want.reshape(m, heads, d).transpose(0, 1)
        err = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)
        assert err.max() <= 5e-3, err.max()

    def gptj(t, heads):
        t0, t1 = t.view(m, heads, d // 2, 2).unbind(-1)
        return torch.stack((t0 * angle.cos() - t1 * angle.sin(), t0 * angle.sin() + t1 * angle.cos()), -1)

    y = cd.gemm(x, torch.cat((wq, wk, wv)), rope_positions, **operands)["D"]
    per_head(y[:, :nq], gptj(q, hq), hq)
    per_head(y[:, nq:nq + nk], gptj(kk, hk), hk)
    per_head(y[:, nq + nk:], v, hk)

    def hf(t, heads):
        return half_split_rope(t.view(m, heads, d), angle)

    y = cd.gemm(x, qkv_weight(wq, wk, wv, d), rope_positions, **operands)["D"]
    half_split = lambda t, heads: t.float().view(m, heads, d // 2, 2).transpose(-1, -2)  # noqa: E731
    per_head(half_split(y[:, :nq], hq), hf(q, hq), hq)
    per_head(half_split(y[:, nq:nq + nk], hk), hf(kk, hk), hk)
    per_head(y[:, nq + nk:], v, hk)

    def attention(q_, k_, v_):  # [m, heads * d] each -> [hq, m, d]
        q_, k_, v_ = (t.float().reshape(m, -1, d).transpose(0, 1) for t in (q_, k_, v_))
        k_, v_ = (t.repeat_interleave(hq // hk, 0) for t in (k_, v_))
        return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=True)

    fused = attention(y[:, :nq], y[:, nq:nq + nk], y[:, nq + nk:])
    assert rel_err(fused, attention(hf(q, hq), hf(kk, hk), v)) <= 1e-2
