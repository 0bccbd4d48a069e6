"""Hand-written Triton kernels for the layer's steps between GEMMs that torch.compile fuses poorly.

Each is a `torch.library.custom_op` with a fake (shape) implementation, so torch.compile keeps it as
one opaque call and CUDA graphs capture its launch, and has a plain-torch twin that defines its values;
its wrapper (what `coda_dsl.nn` calls) runs the op on CUDA and the twin elsewhere. Imported by
`coda_dsl.nn` only, so `import coda_dsl` does not load Triton.
"""
from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch: the twins run instead
    triton = None


def rope_backward_reference(dq, dk, dv, y, rstd, pos, freq):
    """Backward of y = rope(rstd[m] * acc) for a fused QKV output y = [q | k | v], [M, Nq + 2 Nkv]: q's and
    k's column pairs (2j, 2j+1) of each head rotate by pos[m] * freq[j] (freq: [head_dim / 2], the same for
    every head), v's pass through. From the three parts' gradients: (d acc in dq's dtype, d rstd in fp32).
    The rotation is orthogonal, so d rstd = sum_n dy * y / rstd."""
    dy = torch.cat((dq, dk, dv), dim=1).float()
    rotated = dq.shape[1] + dk.shape[1]
    angle = pos.float()[:, None] * freq.float()[None, :]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # the same for every head
    pairs = dy[:, :rotated].unflatten(-1, (-1, freq.numel(), 2))
    d0, d1 = pairs[..., 0], pairs[..., 1]
    back = torch.stack((d0 * cos + d1 * sin, d1 * cos - d0 * sin), dim=-1).flatten(1)
    dacc = (torch.cat((back, dy[:, rotated:]), dim=1) * rstd.float()[:, None]).to(dq.dtype)
    return dacc, (dy * y.float()).sum(-1) / rstd.float()


if triton is not None:
    @triton.jit
    def _rope_part(d_ptr, y_ptr, o_ptr, cos, sin, r, HEADS: tl.constexpr, HALF: tl.constexpr,
                   BH: tl.constexpr, BF: tl.constexpr, ROTATE: tl.constexpr):
        """One row's part of HEADS heads of 2 HALF columns: stores rotate_back(d) * r, returns sum(d * y)."""
        h = tl.arange(0, BH)[:, None, None]
        j = tl.arange(0, BF)[None, :, None]
        e = tl.arange(0, 2)[None, None, :]
        offs = h * (2 * HALF) + 2 * j + e
        mask = (h < HEADS) & (j < HALF) & (e < 2)
        d = tl.load(d_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dot = tl.sum(d * y)
        if ROTATE:
            d0, d1 = tl.split(d)
            c, s = cos[None, :], sin[None, :]
            d = tl.join(d0 * c + d1 * s, d1 * c - d0 * s)
        tl.store(o_ptr + offs, (d * r).to(o_ptr.dtype.element_ty), mask=mask)
        return dot

    @triton.jit
    def _rope_backward_kernel(dq, dk, dv, y, rstd, pos, freq, dacc, drstd, s_q, s_k, s_v, s_y, s_o,
                              HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                              BQ: tl.constexpr, BK: tl.constexpr, BF: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        r = tl.load(rstd + m)
        j = tl.arange(0, BF)
        angle = tl.load(pos + m) * tl.load(freq + j, mask=j < HALF, other=0.0)  # once per frequency
        cos, sin = tl.cos(angle), tl.sin(angle)
        nq, nk = HQ * 2 * HALF, HK * 2 * HALF
        yr, o = y + m * s_y, dacc + m * s_o
        dot = _rope_part(dq + m * s_q, yr, o, cos, sin, r, HQ, HALF, BQ, BF, True)
        dot += _rope_part(dk + m * s_k, yr + nq, o + nq, cos, sin, r, HK, HALF, BK, BF, True)
        dot += _rope_part(dv + m * s_v, yr + nq + nk, o + nq + nk, cos, sin, r, HK, HALF, BK, BF, False)
        tl.store(drstd + m, dot / r)

    @torch.library.custom_op("coda_dsl::rope_backward", mutates_args=())
    def _rope_backward_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, y: torch.Tensor,
                          rstd: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dq, dk, dv, y = (t if t.stride(1) == 1 else t.contiguous() for t in (dq, dk, dv, y))  # adjacent columns
        rstd, pos, freq = (t.float().contiguous() for t in (rstd, pos, freq))
        dacc, drstd = _rope_backward_fake(dq, dk, dv, y, rstd, pos, freq)
        half = freq.shape[0]
        hq, hk = dq.shape[1] // (2 * half), dk.shape[1] // (2 * half)
        p2 = triton.next_power_of_2
        with torch.cuda.device(y.device) if y.is_cuda else contextlib.nullcontext():
            _rope_backward_kernel[(y.shape[0],)](
                dq, dk, dv, y, rstd, pos, freq, dacc, drstd,
                dq.stride(0), dk.stride(0), dv.stride(0), y.stride(0), dacc.stride(0),
                HQ=hq, HK=hk, HALF=half, BQ=p2(hq), BK=p2(hk), BF=p2(half), num_warps=8)
        return dacc, drstd

    @_rope_backward_op.register_fake
    def _rope_backward_fake(dq, dk, dv, y, rstd, pos, freq):
        return torch.empty(y.shape, dtype=dq.dtype, device=y.device), y.new_empty(y.shape[0], dtype=torch.float32)


def rope_backward(dq, dk, dv, y, rstd, pos, freq):
    """rope_backward_reference's values: on CUDA one Triton kernel, one pass over the three gradients and y
    (cos/sin once per row and frequency), else (and for M = 0) the reference. dq [M, Hq d], dk and dv [M, Hk d],
    y [M, (Hq + 2 Hk) d], any strides (a layout whose columns are not adjacent is copied first); rstd and pos
    [M], freq [d / 2]."""
    if triton is None or not y.is_cuda or y.shape[0] == 0:
        return rope_backward_reference(dq, dk, dv, y, rstd, pos, freq)
    return torch.ops.coda_dsl.rope_backward(dq, dk, dv, y, rstd, pos, freq)
