"""Hand-written Triton kernels for steps between GEMMs that torch.compile does poorly.

rope_backward is a `torch.library.custom_op` with a fake (shape) implementation, so torch.compile keeps it
as one opaque call and CUDA graphs capture its launch, and has a plain-torch twin that defines its values;
its wrapper runs the op inside torch.compile, the op's function itself eagerly on CUDA (the op's dispatch
cost 28 µs a call on an H100, a third of the call), and the twin elsewhere. scale_ is a plain launch
(inside torch.compile it is a plain multiply). Imported by `coda_dsl.nn` and, on CUDA, by the
cross-entropy's backward only, so `import coda_dsl` does not load Triton.
"""
from __future__ import annotations

import contextlib

import torch

from .ir.ops import math_dtype

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch: the twins run instead
    triton = None


def rope_backward_reference(dq, dk, dv, y, rstd, pos, freq):
    """Backward of y = rope(rstd[m] * acc) for a fused QKV output y = [q | k | v], [M, Nq + 2 Nkv]: q's and
    k's column pairs (2j, 2j+1) of each head rotate by pos[m] * freq[j] (freq: [head_dim / 2], the same for
    every head), v's pass through. From the three parts' gradients: (d acc in dq's dtype, d rstd in the math's);
    the math in fp32 (fp64 for fp64, as the reference backend's forward). The rotation is orthogonal, so
    d rstd = sum_n dy * y / rstd."""
    f = math_dtype(dq.dtype)
    dy = torch.cat((dq, dk, dv), dim=1).to(f)
    rotated = dq.shape[1] + dk.shape[1]
    angle = pos.to(f)[:, None] * freq.to(f)[None, :]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # the same for every head
    pairs = dy[:, :rotated].unflatten(-1, (-1, freq.numel(), 2))
    d0, d1 = pairs[..., 0], pairs[..., 1]
    back = torch.stack((d0 * cos + d1 * sin, d1 * cos - d0 * sin), dim=-1).flatten(1)
    dacc = (torch.cat((back, dy[:, rotated:]), dim=1) * rstd.to(f)[:, None]).to(dq.dtype)
    return dacc, (dy * y.to(f)).sum(-1) / rstd.to(f)


# rope_backward's rows and heads per program, and warps: at Llama-3-8B's 8192 tokens on an H100 (ncu), 0.120 ms
# (72 % of DRAM bandwidth) against 0.167 for 16 rows and 0.33-0.47 for 32-64 rows (166-255 registers a thread)
_TILE, _WARPS = (8, 8), 4

if triton is not None:
    @triton.jit
    def _rope_backward_kernel(dq, dk, dv, y, rstd, pos, freq, dacc, drstd, s_q, s_k, s_v, s_y, s_o, M,
                              HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                              GROUP: tl.constexpr, BM: tl.constexpr):
        """BM rows x GROUP heads: cos and sin once per row and column of a head, then each head's [BM, D]
        tile in its columns' order (a column's pair partner is column ^ 1: a second load of the same lines),
        so every load and store is a row's contiguous run. d rstd's partial sums go to drstd atomically (their
        order varies: d rstd is not bit-reproducible, like cd.gemm's reductions with deterministic=False)."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        c = tl.arange(0, BD)
        rmask, cmask = rows < M, c < D
        r = tl.load(rstd + rows, mask=rmask, other=1.0)
        angle = tl.load(pos + rows, mask=rmask, other=0.0)[:, None] * tl.load(freq + c // 2, mask=cmask)[None, :]
        cos, sin = tl.cos(angle), tl.sin(angle)
        sin = tl.where((c % 2 == 0)[None, :], sin, -sin)  # even: d0 cos + d1 sin; odd: d1 cos - d0 sin
        row = rows.to(tl.int64)[:, None]
        mask = rmask[:, None] & cmask[None, :]
        dot = tl.zeros([BM], dtype=tl.float32)
        for i in tl.static_range(GROUP):
            h = tl.program_id(1) * GROUP + i  # q's heads, then k's, then v's
            if h < HQ:
                src = dq + row * s_q + h * D
            elif h < HQ + HK:
                src = dk + row * s_k + (h - HQ) * D
            else:
                src = dv + row * s_v + (h - HQ - HK) * D
            m = mask & (h < HQ + 2 * HK)
            d = tl.load(src + c[None, :], mask=m, other=0.0).to(tl.float32)
            dot += tl.sum(d * tl.load(y + row * s_y + h * D + c[None, :], mask=m, other=0.0).to(tl.float32), 1)
            if h < HQ + HK:
                d = d * cos + tl.load(src + (c ^ 1)[None, :], mask=m, other=0.0).to(tl.float32) * sin
            tl.store(dacc + row * s_o + h * D + c[None, :], (d * r[:, None]).to(dacc.dtype.element_ty), mask=m)
        tl.atomic_add(drstd + rows, dot / r, mask=rmask)

    def _rope_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, y: torch.Tensor,
                       rstd: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dq, dk, dv, y = (t if t.stride(1) == 1 else t.contiguous() for t in (dq, dk, dv, y))  # adjacent columns
        rstd, pos, freq = (t.float().contiguous() for t in (rstd, pos, freq))
        dacc = torch.empty(y.shape, dtype=dq.dtype, device=y.device)
        drstd = torch.zeros(y.shape[0], dtype=torch.float32, device=y.device)
        m, d = y.shape[0], 2 * freq.shape[0]
        hq, hk = dq.shape[1] // d, dk.shape[1] // d
        bm, group = _TILE
        with torch.cuda.device(y.device) if y.is_cuda else contextlib.nullcontext():  # the interpreter: CPU
            _rope_backward_kernel[(triton.cdiv(m, bm), triton.cdiv(hq + 2 * hk, group))](
                dq, dk, dv, y, rstd, pos, freq, dacc, drstd,
                dq.stride(0), dk.stride(0), dv.stride(0), y.stride(0), dacc.stride(0), m,
                HQ=hq, HK=hk, D=d, BD=triton.next_power_of_2(d), GROUP=group, BM=bm, num_warps=_WARPS)
        return dacc, drstd

    _rope_backward_op = torch.library.custom_op("coda_dsl::rope_backward", _rope_backward, mutates_args=())

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
    op = torch.ops.coda_dsl.rope_backward if torch.compiler.is_compiling() else _rope_backward
    return op(dq, dk, dv, y, rstd, pos, freq)


# scale_'s elements per program and step, and programs per SM (a grid-stride loop: when the factor is 1,
# each program reads it and returns, so the launch costs a few microseconds, not a wave per block)
_SCALE_BLOCK, _SCALE_PROGRAMS_PER_SM = 4096, 4

if triton is not None:
    @triton.jit
    def _scale_kernel(t, n, by, BLOCK: tl.constexpr):
        f = tl.load(by)
        if f != 1.0:
            step = tl.num_programs(0).to(tl.int64) * BLOCK
            for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, step):
                i = start + tl.arange(0, BLOCK)
                m = i < n
                x = tl.load(t + i, mask=m)
                tl.store(t + i, (x.to(tl.float32) * f).to(t.dtype.element_ty), mask=m)


def _launch_scale(t: torch.Tensor, by: torch.Tensor, programs: int) -> None:
    """The kernel over a contiguous bf16, fp16 or fp32 t (on CUDA, or on the CPU in Triton's interpreter)."""
    if t.numel():
        with torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext():
            _scale_kernel[(min(triton.cdiv(t.numel(), _SCALE_BLOCK), programs),)](
                t, t.numel(), by.float().reshape(1), BLOCK=_SCALE_BLOCK)


def scale_(t: torch.Tensor, by: torch.Tensor) -> None:
    """t *= by in place, by a 0-dim tensor on t's device (no synchronization to read it). Eagerly on CUDA,
    for a contiguous bf16, fp16 or fp32 t, one Triton kernel that reads by first and leaves t alone where
    it is 1 (a loss's backward is most often called with the gradient 1: the cross-entropy then skips a
    pass over grad_W, 1 GB at Llama-3's vocabulary). Otherwise t.mul_(by): on the CPU, for other layouts
    and dtypes (fp64: the kernel's fp32 factor would round), and inside torch.compile, which fuses the
    multiply in place (an op that mutates a tensor the graph saved would have it cloned first)."""
    if (triton is None or not t.is_cuda or not t.is_contiguous() or torch.compiler.is_compiling()
            or t.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        t.mul_(by)
    else:
        _launch_scale(t, by, torch.cuda.get_device_properties(t.device).multi_processor_count * _SCALE_PROGRAMS_PER_SM)
