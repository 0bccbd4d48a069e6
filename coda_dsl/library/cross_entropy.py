"""Cross-entropy fused into the LM head: the logits [M, V] are never stored whole, nor in fp32.

    loss_m = lse_m - (1 - eps) z[m, t_m] - eps * mean_n z[m, n]     (z: softcapped logits)
    dloss_m/dz[m, n] = softmax_mn - (1 - eps) [n == t_m] - eps / V   (times dz/dacc = 1 - (z/cap)^2)

Three paths, chosen per call:

- No gradient wanted (torch.no_grad, or neither x nor W requires grad): one GEMM per chunk of rows
  whose epilogue keeps per row only the online log-sum-exp, the target logit (and, with label
  smoothing, the sum of logits); no D. Extra memory O(M).
- Gradients wanted, reduction "mean" or "sum": three GEMMs in all, all in the forward, per chunk of
  rows: (a) the chunk's logits GEMM stores z into a [chunk, V] buffer reused across chunks, with the
  per-row statistics in the same epilogue; (b) one fused elementwise pass turns z into the logits'
  gradient g in place; (c) grad_x[chunk] = g @ W and grad_W += g^T @ x[chunk]. The backward only
  scales the saved gradients by the incoming (scalar) gradient.
- Gradients wanted, reduction "none" (the incoming gradient is per row, known only in the backward):
  the statistics-only forward, and a backward that recomputes the logits per chunk (a fourth GEMM)
  with P = (softmax - eps/V) * scale formed in its epilogue.

The buffer holds z in fp16 for bf16 and fp16 inputs: bf16 logits lose up to |z| * 2^-9, which gave
2-4 % gradient error vs fp32 autograd on a confident model (logits up to 20-40, p(target) ~ 0.5);
fp16 gave 0.3-0.5 %, fp32 0.01-0.03 % (CPU measurement, V = 32000). g is then written over z in the
inputs' dtype (same bytes per element), so the buffer is all the chunk needs. (fp16 holds logits
up to 65504 in magnitude; a softcap bounds them.) The target's column is formed from the statistics'
fp32 target logit instead: on a confident row 1 - p is below the buffer's rounding of z.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Sequence

import torch

import coda_dsl as cd  # the library is written against the public API, like user code

# The [chunk, V] logits buffer, by default: 4096 rows at V = 128256. Measured on the H200 at M = 8192,
# d = 4096 (bench.cross_entropy --chunk-rows --profile): forward+backward 52.8 ms with 1536-row chunks
# (peak 1466 MiB), 42.1 ms with 2048, 41.6 ms with 4096 (2132 MiB, 0.18x eager's); with 1536 rows the
# six chunks' logits GEMMs took 19.3 ms against 12.6 for two, and grad_W's accumulation 13.4 against 11.5.
BUFFER_BYTES = 1 << 30
# Chunk rows: a multiple of the tile's M times the cluster's, 256 for CONFIG and the cooperative 256x128
# 1x2 (CUTLASS's scheduler rounds 13 tiles of rows up to 14: a tile row past the chunk), and of 8 (16-byte
# aligned row vectors).
_ROW_ALIGN = 256
# The kernels' configuration unless linear_cross_entropy(config=) names another, per GPU model (default_config),
# at M = 8192, d = 4096, V = 128256 (bench.cross_entropy --configs --profile). H200 (and GPUs not measured):
# pingpong 128x128 overlaps one tile's exp-heavy epilogue with the other's mainloop: forward 13.68 ms against
# 14.57 for the cooperative 128x256 tile and 15.28 for pingpong 128x192; the chunks' logits GEMMs 12.46 ms
# against 15.04.
CONFIG = cd.Config((128, 128, 64), (2, 1), "pingpong")
# H100: the cooperative 256x128 1x2 tile, whose mainloop runs at cuBLAS's speed there (pingpong 128x128's at
# 1.27-1.30x): two runs on 2026-12-06 (at 0e4a44d and 6905cf2), forward 13.59 / 13.47 ms against 14.48 / 15.00,
# forward+backward 40.33 / 40.56 against 41.13 / 43.26 (torch.compile 38.82 / 38.71).
H100_CONFIG = cd.Config((256, 128, 64), (1, 2), "cooperative")


def default_config(device: torch.device) -> cd.Config:
    """The kernels' configuration on `device`: H100_CONFIG on an H100, else CONFIG."""
    return H100_CONFIG if cd.is_gpu("H100", device) else CONFIG


def _softcapped(acc, cap):
    return cap * cd.tanh(acc * (1.0 / cap)) if cap else acc


@cd.epilogue_factory
def _forward_epilogue(smoothing: bool, cap: float | None, logits: bool | torch.dtype = False) -> cd.Epilogue:
    """Per row: lse, the target logit (and the sum of logits); with `logits`, D = z too: True in the inputs'
    dtype, a dtype in that one (the chunk buffer's, logits_buffer_dtype: fp16 for bf16 inputs; declared
    here, not taken from the buffer, so that the op torch.compile traces makes the same D)."""
    def ce_forward(acc, target: cd.VecM):
        z = _softcapped(acc, cap)
        out = {"D": z if logits is True else cd.cast(z, logits)} if logits is not False else {}
        out.update(lse=cd.logsumexp(z, axis="n"), z_target=cd.take(z, target, axis="n"))
        if smoothing:
            out["z_sum"] = cd.sum(z, axis="n")
        return out
    stored = "" if logits is False else "_logits" if logits is True else f"_logits_{str(logits).removeprefix('torch.')}"
    name = f"ce_forward{stored}{'_smooth' if smoothing else ''}{'_cap' if cap else ''}"
    return cd.epilogue(ce_forward, name=name)


@cd.epilogue
def ce_backward(acc, lse: cd.VecM, scale: cd.VecM, target: cd.VecM, uniform: cd.Scalar, hot: cd.Scalar):
    """The logits' gradient, (softmax - eps/V - (1 - eps) one-hot) * scale, in fp32 and rounded once: on a
    confident row the target's 1 - p stays whole (subtracting 1 from D's rounded p would not keep it)."""
    return (cd.exp(acc - lse) - uniform - hot * cd.onehot(target)) * scale


@cd.epilogue_factory
def _backward_softcap_epilogue(cap: float) -> cd.Epilogue:
    def ce_backward_softcap(acc, lse: cd.VecM, scale: cd.VecM, target: cd.VecM, uniform: cd.Scalar, hot: cd.Scalar):
        t = cd.tanh(acc * (1.0 / cap))
        dz = 1.0 - t * t  # d softcap(acc) / d acc
        return (cd.exp(cap * t - lse) - uniform - hot * cd.onehot(target)) * scale * dz
    return cd.epilogue(ce_backward_softcap)


def logits_buffer_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the chunk's logits are stored in (see the module docstring)."""
    return torch.float16 if dtype in (torch.bfloat16, torch.float16) else dtype


def stored_logits(dtype: torch.dtype) -> bool | torch.dtype:
    """_forward_epilogue's `logits` for inputs of `dtype`: the buffer's dtype where it is another."""
    return True if logits_buffer_dtype(dtype) == dtype else logits_buffer_dtype(dtype)


def default_chunk_rows(m: int, v: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> int:
    """Rows per chunk for inputs of `dtype`: the [rows, V] buffer (logits_buffer_dtype's: 2 bytes a logit for
    bf16 and fp16, 4 for fp32, 8 for fp64) within BUFFER_BYTES (and a quarter of the free memory on CUDA),
    balanced over the chunks M needs, rounded up to a multiple of _ROW_ALIGN."""
    budget = BUFFER_BYTES
    if torch.device(device).type == "cuda" and not torch.compiler.is_compiling():
        budget = min(budget, torch.cuda.mem_get_info(device)[0] // 4)
    per_row = v * logits_buffer_dtype(dtype).itemsize
    most = max(_ROW_ALIGN, budget // per_row // _ROW_ALIGN * _ROW_ALIGN)
    chunks = max(1, -(-m // most))
    return max(1, -(-(-(-m // chunks)) // _ROW_ALIGN)) * _ROW_ALIGN  # M = 0 too: a step for range()


def _logit_grad(z: torch.Tensor, lse, scale, target, z_target, uniform: float, hot: float, cap: float | None):
    """The logits' gradient in fp32 (fp64 for fp64), from the (softcapped) logits z [c, V']:
    g = (exp(z - lse) - uniform - hot * [n == target]) * scale * (1 - (z/cap)^2 with a softcap).
    At the target's column z is the statistics' own z_target: the buffer's rounding of z (up to |z| 2^-11
    in fp16) would stay whole in exp(z - lse) - 1, whose true value 1 - p is small on a confident row."""
    cols = torch.arange(z.shape[1], device=z.device)
    at_target = cols == target[:, None]
    zf = torch.where(at_target, z_target[:, None], z.to(torch.promote_types(z.dtype, torch.float32)))
    g = torch.exp(zf - lse[:, None]) - uniform
    g = torch.where(at_target, g - hot, g) * scale[:, None]  # ignored rows: scale 0
    return g * (1.0 - (zf * (1.0 / cap)) ** 2) if cap else g


@cd.on_cuda
def _logit_grad_(z: torch.Tensor, lse, scale, target, z_target, uniform: float, hot: float, cap: float | None,
                 dtype: torch.dtype) -> None:
    """In place: the logits z [c, V] become their gradient (_logit_grad), in `dtype` over the same bytes.

    Passes over the buffer: 1 on CUDA, compiled (one fused kernel reads z and stores g into z's
    storage; checked on CPU's inductor: no temporary), with static sizes: with every size symbolic
    (dynamic=True) that kernel ran at a third of the H200's bandwidth (1.99 ms per 4096-row chunk at
    V = 128256); eagerly (CPU), ~6 passes with fp32 temporaries."""
    z.view(dtype).copy_(_logit_grad(z, lse, scale, target, z_target, uniform, hot, cap))


def _scale_(gx: torch.Tensor | None, gw: torch.Tensor | None, by: torch.Tensor, alpha: float) -> None:
    """In place: gx times by, gw times by / alpha (the factors _factored left out; no second grad_W). On
    CUDA a Triton kernel that leaves them alone where the factor is 1 (triton_kernels.scale_; eagerly, a
    multiply by a 0-dim CUDA tensor takes the unvectorized broadcast path: 2.36 ms for grad_W at
    V = 128256 on the H200, a third of the bandwidth)."""
    for t, factor in ((gx, by), (gw, by * (1.0 / alpha))):
        if t is None:
            continue
        if t.is_cuda:
            from ..triton_kernels import scale_
            scale_(t, factor)
        else:
            t.mul_(factor)


def _chunk_buffer(rows: int, v: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """[rows, V], its rows padded to 16 bytes (V = 50257 too): TMA stores need aligned row strides.
    The padding is zeroed: CPU BLAS reads it when g is a GEMM operand (garbage NaN gave NaN grad_x).
    None inside torch.compile: there each chunk's GEMM makes its own D (the op cannot write into a given
    tensor: it would make D and copy it in, a pass of its own)."""
    if torch.compiler.is_compiling():
        return None
    per16 = 16 // torch.empty((), dtype=dtype).element_size()
    buf = torch.empty(rows, -(-v // per16) * per16, device=like.device, dtype=dtype)
    buf[:, v:].zero_()
    return buf[:, :v]


def _stats(x, w, safe, smoothing, cap, backend, config, logits: torch.Tensor | bool = False) -> dict:
    """One GEMM: lse, z_target (0 where safe is out of range), z_sum with smoothing; with `logits`, D too
    (in logits_buffer_dtype): into that tensor, or (True) a new one."""
    out = {"D": logits} if isinstance(logits, torch.Tensor) else None
    ep = _forward_epilogue(smoothing > 0, cap, logits is not False and stored_logits(x.dtype))
    return cd.gemm(x, w, ep, target=safe, out=out, backend=backend, config=config)


def _chunked_stats(x, w, safe, smoothing, cap, backend, config, chunk: int) -> dict:
    """_stats (no D) one chunk of rows at a time, as the gradient path's GEMMs run. Why, a hypothesis not
    yet timed chunked: a chunk's x tiles stay in L2 while W streams past them, where one GEMM over all rows
    reads them from memory again and again. At M = 8192, d = 4096, V = 128256 on an H100 the forward (one
    GEMM) took 16.86 ms, while the gradient path's two 4096-row GEMMs, which also store the logits, took
    13.3 ms of GPU time under the profiler (README, "Library": linear_cross_entropy). The chunk is the gradient
    path's (sized by its logits buffer, not by L2): at V = 32000 a single one up to 16640 rows."""
    if x.shape[0] <= chunk:
        return _stats(x, w, safe, smoothing, cap, backend, config)
    parts = [_stats(x[s:s + chunk], w, safe[s:s + chunk], smoothing, cap, backend, config)
             for s in range(0, x.shape[0], chunk)]
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def _grad_buffers(x, w, need_x: bool, need_w: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """grad_x and grad_W to be written by _accumulate, in the inputs' dtypes (each GEMM sums in fp32); without
    rows no GEMM writes grad_W: zeros then."""
    gw = (torch.zeros_like(w) if x.shape[0] == 0 else torch.empty_like(w)) if need_w else None
    return (torch.empty_like(x) if need_x else None), gw


def _accumulate(gx, gw, g, gt, w, xs, s: int, alpha: float) -> None:
    """One chunk's share of the gradients (gx or gw None: not wanted), from the logits' gradient g over
    the kernels' columns and gt over the last V % 8 (None if V % 8 == 0): gx[s:s+rows] = g @ W, and
    gw += alpha g^T @ xs, gw = at the first chunk (s = 0: the uninitialized output is not read)."""
    vk, rows, beta = g.shape[1], slice(s, s + g.shape[0]), 1 if s else 0
    if gx is not None:
        gx[rows].addmm_(g, w[:vk], beta=0)
        if gt is not None:
            gx[rows].addmm_(gt, w[vk:])
    if gw is not None:
        gw[:vk].addmm_(g.t(), xs, beta=beta, alpha=alpha)
        if gt is not None:
            gw[vk:].addmm_(gt.t(), xs, beta=beta, alpha=alpha)


def _split(v: int) -> int:
    """Columns the kernels compute: a multiple of 8, since they store [rows, V] logits with TMA (16-byte
    rows). The last V % 8 (at most 7: V = 50257) are computed in fp32 by _tail, per chunk."""
    return v - v % 8


def _tail(xs, w_tail, cap) -> torch.Tensor:
    """The softcapped fp32 (fp64 for fp64) logits of the last V % 8 columns: [rows, V % 8]."""
    dt = torch.promote_types(xs.dtype, torch.float32)
    z = xs.to(dt) @ w_tail.to(dt).t()
    return cap * torch.tanh(z / cap) if cap else z


def _tail_target(zt: torch.Tensor, t_tail: torch.Tensor) -> torch.Tensor:
    """Per row, the tail's logit at the target's column (t_tail: the target less V - V % 8), 0 where that
    column is not in the tail."""
    picked = zt.gather(1, t_tail.clamp(0, zt.shape[1] - 1)[:, None])[:, 0]
    return torch.where((t_tail >= 0) & (t_tail < zt.shape[1]), picked, torch.zeros_like(picked))


def _merge_tail(st: dict, zt: torch.Tensor, t_tail: torch.Tensor) -> dict:
    """Statistics over all V columns from the kernel's (the first V - V % 8) and the tail's logits."""
    out = {"lse": torch.logaddexp(st["lse"], torch.logsumexp(zt, 1)),
           "z_target": st["z_target"] + _tail_target(zt, t_tail)}
    if "z_sum" in st:
        out["z_sum"] = st["z_sum"] + zt.sum(1)
    return out


def _row_loss(st: dict, v: int, smoothing: float) -> torch.Tensor:
    loss = st["lse"] - (1 - smoothing) * st["z_target"]
    return loss - smoothing * st["z_sum"] / v if smoothing else loss


def _out_of_range(target: torch.Tensor, v: int, ignore_index: int) -> torch.Tensor:
    """Rows whose target is neither ignore_index nor in [0, V): their loss is NaN (F.cross_entropy raises;
    so does this on CPU, where the check costs no GPU synchronization)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= v))
    if not target.is_cuda and not torch.compiler.is_compiling() and bool(bad.any()):
        raise cd.OperandError(f"target {int(target[bad][0])} is out of range: targets are class indices in "
                              f"[0, {v}) or ignore_index ({ignore_index})")
    return bad


def _rows(target: torch.Tensor, ignore_index: int, v: int) -> tuple[torch.Tensor, ...]:
    """Per row: valid (not ignored), bad (_out_of_range), safe (the target, -1 where ignored) and the count of
    valid rows (a 0-dim tensor: no synchronization)."""
    valid = target != ignore_index
    return valid, _out_of_range(target, v, ignore_index), torch.where(valid, target, -1), valid.sum()


def _factored(scale: torch.Tensor, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, float, torch.Tensor]:
    """The rows' gradient scale as unit * peak, for gradients in `dtype`. fp16: |unit| <= 1 goes into the
    logits' gradient g (fp16's g kept out of subnormals: with a scale like 1/M most of it was). The GEMMs
    then scale in fp32 before rounding: grad_x by 1 (a row's own sum), grad_W by alpha =
    2^-round(log2(M) / 2), its sum over M rows kept within fp16's range both ways: a class many rows share
    reaches M |x| (past 65504 at M = 4096, |x| = 30), a class one row has (1 - p) |x| / M (subnormal under
    a plain mean). peak (a 0-dim tensor: no synchronization) and 1 / alpha (exact: a power of 2) multiply
    afterwards (_scale_). bf16 and fp32 have fp32's exponent range: the whole scale goes into g (peak 1,
    alpha 1), so that the backward's factor is the incoming gradient alone, most often 1 (no pass at all);
    only per-row gradients near fp32's subnormals (reduction="none", below ~1e-35) lose precision there."""
    if dtype != torch.float16:
        return scale.contiguous(), 1.0, scale.new_ones(())
    peak = scale.nan_to_num().abs().amax().clamp_min(1e-30) if scale.numel() else scale.new_ones(())
    return (scale / peak).contiguous(), 2.0 ** -round(math.log2(max(m, 1)) / 2), peak


def _poisoned(t: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """t (per row: the loss, or the gradient's scale), NaN where the target is out of range: the loss and the
    gradients are NaN there (where no error can be raised: on CUDA, inside torch.compile)."""
    return torch.where(bad, torch.full_like(t, float("nan")), t)


def _reduce(loss, valid, count, reduction, bad):
    loss = _poisoned(torch.where(valid, loss, torch.zeros_like(loss)), bad)
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / count.clamp_min(1) if reduction == "mean" else total


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    @cd.as_written
    def forward(ctx, x, w, target, ignore_index, reduction, smoothing, cap, backend, config, chunk, need_x, need_w):
        m, v = x.shape[0], w.shape[0]
        chunk = -(-(chunk or default_chunk_rows(m, v, x.device, x.dtype)) // 8) * 8  # 16-byte aligned row slices
        ctx.cfg = (reduction, smoothing, cap, backend, config, chunk)
        # The GEMMs are queued before the rows' bookkeeping (_rows, _factored: a dozen small kernels, each
        # of which the GPU would otherwise wait for the host to launch before the first GEMM: most of 1.1 ms
        # of idle GPU at M = 8192 on an H100), so they take the targets as given: one outside their columns takes
        # nothing (z_target 0), and an ignored row's statistics are masked out (loss by valid, gradient by
        # a zero scale and safe's -1).
        if reduction == "none" or not (need_x or need_w):
            st = _chunked_stats(x, w, target, smoothing, cap, backend, config, chunk)
            valid, bad, safe, count = _rows(target, ignore_index, v)
            ctx.save_for_backward(x, w, safe, valid, bad, st["lse"], count)
            return _reduce(_row_loss(st, v, smoothing), valid, count, reduction, bad)
        # gradients now, chunk by chunk: the backward then only scales them
        vk = _split(v)
        wk, wt = w[:vk], w[vk:]
        buf = _chunk_buffer(min(chunk, m), vk, x, logits_buffer_dtype(x.dtype))
        spans = [(s, min(m, s + chunk)) for s in range(0, m, chunk)]

        def logits_gemm(s: int, e: int) -> dict:
            return _stats(x[s:e], wk, target[s:e], smoothing, cap, backend, config,
                          logits=buf[: e - s] if buf is not None else True)
        first = logits_gemm(*spans[0]) if spans else None
        valid, bad, safe, count = _rows(target, ignore_index, v)
        loss = torch.empty(m, device=x.device, dtype=torch.promote_types(x.dtype, torch.float32))
        scale, alpha, peak = _factored(
            _poisoned(valid.to(loss.dtype) / (count.clamp_min(1) if reduction == "mean" else 1), bad), m, x.dtype)
        gx, gw = _grad_buffers(x, w, need_x, need_w)
        for s, e in spans:
            st = first if s == 0 else logits_gemm(s, e)
            xs, ts, z = x[s:e], safe[s:e], st["D"]
            if vk < v:
                zt = _tail(xs, wt, cap)
                st = _merge_tail(st, zt, ts - vk)
            loss[s:e] = _row_loss(st, v, smoothing)
            _logit_grad_(z, st["lse"], scale[s:e], ts, st["z_target"], smoothing / v, 1.0 - smoothing, cap, x.dtype)
            gt = None if vk == v else _logit_grad(zt, st["lse"], scale[s:e], ts - vk, st["z_target"], smoothing / v,
                                                  1.0 - smoothing, cap).to(x.dtype)
            _accumulate(gx, gw, z.view(x.dtype), gt, w, xs, s, alpha)
        ctx.grads = (gx, gw, peak, alpha)
        return _reduce(loss, valid, count, reduction, bad)

    @staticmethod
    @cd.as_written
    @cd.first_order("linear_cross_entropy")
    def backward(ctx, grad):
        if hasattr(ctx, "grads"):
            if ctx.grads is None:
                raise cd.UnsupportedError("linear_cross_entropy: backward ran twice through the same forward "
                                          "(retain_graph); its gradients were computed in the forward and handed out "
                                          "by the first backward\n  fix: call linear_cross_entropy again for a "
                                          "second backward")
            gx, gw, peak, alpha = ctx.grads
            ctx.grads = None  # the only reference left is ours: autograd takes the tensors without a copy
            _scale_(gx, gw, grad * peak, alpha)
            return gx, gw, *[None] * 10
        x, w, safe, valid, bad, lse, count = ctx.saved_tensors
        reduction, smoothing, cap, backend, config, chunk = ctx.cfg
        m, v = x.shape[0], w.shape[0]
        scale = grad.to(torch.promote_types(x.dtype, torch.float32))
        if reduction != "none":
            scale = scale.expand(m) / (count.clamp_min(1) if reduction == "mean" else 1)
        scale = _poisoned(torch.where(valid, scale, torch.zeros_like(scale)), bad)
        need_x, need_w = ctx.needs_input_grad[:2]  # a frozen LM head needs no grad_w GEMMs
        grad_x, grad_w = recomputed_grads(x, w, lse, scale, safe, smoothing / v, 1.0 - smoothing, cap, backend, config,
                                          chunk, need_x, need_w)
        return grad_x, grad_w, *[None] * 10


def recomputed_grads(x, w, lse, scale, target, uniform: float, hot: float, cap: float | None, backend, config,
                     chunk: int, need_x: bool = True, need_w: bool = True):
    """grad_x and grad_W of the loss over w's vocabulary rows, the logits recomputed: per chunk of rows, a
    GEMM forms (softmax - uniform - hot * one-hot(target)) * scale in its epilogue (lse: the rows'
    log-sum-exp over the whole vocabulary; a target of -1 or out of range has no one-hot column here: the
    row is ignored or its target is on another shard), then grad_x = g @ W and grad_W = g^T @ x, with the
    rows' scale factored as _factored says. scale: per row, 0 on ignored rows. linear_cross_entropy's
    reduction="none" backward, and each vocabulary shard's in coda_dsl.parallel."""
    m, v = x.shape[0], w.shape[0]
    scale, alpha, peak = _factored(scale, m, x.dtype)
    grad_x, grad_w = _grad_buffers(x, w, need_x, need_w)
    vk = _split(v)
    wk, wt = w[:vk], w[vk:]
    buf = _chunk_buffer(min(chunk, m), vk, x, x.dtype)
    for s in range(0, m, chunk):
        e = min(m, s + chunk)
        xs, ts, sc, lse_s = x[s:e], target[s:e], scale[s:e], lse[s:e].contiguous()
        tk = torch.where(ts < vk, ts, -1)
        out = cd.gemm(xs, wk, _backward_softcap_epilogue(cap) if cap else ce_backward, lse=lse_s, scale=sc,
                      target=tk, uniform=uniform, hot=hot, backend=backend,
                      out=None if buf is None else {"D": buf[: e - s]}, config=config)
        p = out["D"]  # [chunk, V - V % 8]: the logits' gradient
        gt = None
        if vk < v:  # the last V % 8 columns, in fp32 (_tail)
            zt = _tail(xs, wt, cap)
            gt = _logit_grad(zt, lse_s, sc, ts - vk, _tail_target(zt, ts - vk), uniform, hot, cap).to(x.dtype)
        _accumulate(grad_x, grad_w, p, gt, w, xs, s, alpha)
    if x.dtype == torch.float16:  # else the rows' whole scale is in g (_factored)
        _scale_(grad_x, grad_w, peak, alpha)
    return grad_x, grad_w


def _is_int(x) -> bool:
    """An int, numpy's, or a 0-d integer tensor (what has __index__), not a bool."""
    try:
        operator.index(x)
    except TypeError:
        return False
    return not isinstance(x, bool)


def _check_options(reduction, label_smoothing, ignore_index):
    if not _is_int(ignore_index):
        raise cd.OperandError(f"ignore_index must be an int (a target value whose rows are left out), "
                              f"not {ignore_index!r}")
    if reduction not in ("mean", "sum", "none"):
        raise cd.OperandError(f"reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
    eps = label_smoothing.item() if isinstance(label_smoothing, torch.Tensor) and label_smoothing.dim() == 0 \
        else label_smoothing  # (a 0-d tensor, e.g. a config value, as softcap)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 <= eps <= 1.0:
        raise cd.OperandError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")


def _cap(softcap) -> float | None:
    """softcap as the kernels take it: None (no cap) or a positive finite float."""
    if softcap is None:
        return None
    if isinstance(softcap, torch.Tensor) and softcap.dim() == 0:  # e.g. a config value kept as a tensor
        if softcap.requires_grad:
            raise cd.OperandError("softcap is a constant of the kernels, not a learnable value: it gets no gradient"
                                  "\n  fix: pass float(softcap), or softcap.detach()")
        softcap = softcap.item()
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 < softcap < math.inf:
        raise cd.OperandError("softcap must be a positive finite number (logits become softcap * tanh(logits / "
                              f"softcap)), or None for no cap; got {softcap!r}")
    return float(softcap)


def _check_target(target, m: int) -> None:
    if not isinstance(target, torch.Tensor) or target.dtype != torch.int64 or target.shape != (m,):
        got = f"{target.dtype} {list(target.shape)}" if isinstance(target, torch.Tensor) else type(target).__name__
        raise cd.OperandError(f"target must be an int64 tensor of shape [{m}] (class indices), got {got}")


def check_args(x, w, target, reduction, label_smoothing, ignore_index):
    _check_options(reduction, label_smoothing, ignore_index)
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise cd.OperandError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise cd.OperandError(f"x must be [M, d] (flatten a batch: x.flatten(0, -2), target.flatten()), got "
                              f"{list(x.shape)}")
    if w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise cd.OperandError(f"w must be the head's weight [V, {x.shape[1]}] (V rows of x's width d), "
                              f"got {list(w.shape)}")
    if w.dtype != x.dtype:
        raise cd.OperandError(f"x is {x.dtype} but w is {w.dtype}: the head's GEMM takes both in one dtype\n"
                              "  fix: w.to(x.dtype), or x.to(w.dtype)")
    _check_target(target, x.shape[0])
    if target.device != x.device:
        raise cd.OperandError(f"target is on {target.device}, x on {x.device}: put them on one device")


def linear_cross_entropy(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0, softcap: float | None = None,
                         backend: str = "auto", chunk_rows: int | None = None,
                         config: cd.Config | str | None = None) -> torch.Tensor:
    """F.cross_entropy(x @ w.T, target) without materializing the logits; differentiable in x and w.

    x: [M, d], w: [V, d] (the LM head weight), target: [M] int64. Without gradients: O(M) extra
    memory. With gradients ("mean"/"sum"): they are computed in the forward (three GEMMs), with one
    [chunk_rows, V] logits buffer (default: default_chunk_rows, within BUFFER_BYTES) plus grad_x and
    grad_w; smaller chunks trade time for memory (M = 8192, V = 128256 on an H100: 4096 rows 2100 MiB,
    1536 rows 1454 MiB for 6 % more time: each chunk re-reads grad_w); a second backward through the
    same forward (retain_graph) raises. With "none": the
    backward recomputes the logits per chunk. Only the gradients autograd asks for are computed.
    (The reference backend forms fp32 logits per chunk.) config: the kernels' tile configuration
    (a cd.Config or its text; default: default_config, per GPU model).
    """
    check_args(x, w, target, reduction, label_smoothing, ignore_index)
    if w.shape[0] == 0:
        raise cd.OperandError("w has no rows: the vocabulary is empty (a shard of a vocabulary-parallel head may be; "
                              "see vocab_shard_stats)")
    if backend not in cd.BACKENDS:
        raise cd.OperandError(f"backend must be {', '.join(map(repr, cd.BACKENDS[:-1]))} or {cd.BACKENDS[-1]!r}, "
                              f"not {backend!r}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not (isinstance(chunk_rows, numbers.Integral)
                                                                       and chunk_rows > 0)):
        raise cd.OperandError(f"chunk_rows must be a positive int (rounded up to a multiple of 8), got {chunk_rows!r}")
    grad = torch.is_grad_enabled()  # Function.forward runs without grad mode: decide here
    return _LinearCrossEntropy.apply(x, w, target, operator.index(ignore_index), reduction, float(label_smoothing),
                                     _cap(softcap), backend, config or default_config(x.device),
                                     int(chunk_rows) if chunk_rows else None,
                                     grad and x.requires_grad, grad and w.requires_grad)


@cd.as_written
def vocab_shard_stats(x: torch.Tensor, w_shard: torch.Tensor, target: torch.Tensor, vocab_start: int,
                      ignore_index: int = -100, label_smoothing: float = 0.0, softcap: float | None = None,
                      backend: str = "auto") -> dict[str, torch.Tensor]:
    """Per-row partials of one vocabulary shard (rows vocab_start .. vocab_start + V_shard of the LM
    head, as a tensor-parallel head holds them), fp32 [M] each, forward only, no logits stored:
    "lse" over the shard's columns, "z_target" (0 where the target is in another shard or ignored)
    and, with label smoothing, "z_sum". Combine the shards' with combine_vocab_shards, or across
    GPUs with all-reduces: m = lse, all_reduce(m, MAX); s = exp(lse - m), all_reduce(s, SUM);
    lse = m + log(s); all_reduce(z_target, SUM) (and z_sum); then the loss as combine_vocab_shards."""
    check_args(x, w_shard, target, "mean", label_smoothing, ignore_index)
    if not _is_int(vocab_start):
        raise cd.OperandError(f"vocab_start must be an int (the shard's first vocabulary row), not {vocab_start!r}")
    local = target - operator.index(vocab_start)
    inside = (target != ignore_index) & (local >= 0) & (local < w_shard.shape[0])
    with torch.no_grad():
        return _stats(x, w_shard, torch.where(inside, local, -1), label_smoothing, _cap(softcap), backend,
                      default_config(x.device))


def combine_vocab_shards(stats: Sequence[dict[str, torch.Tensor]], target: torch.Tensor, vocab_size: int,
                         ignore_index: int = -100, label_smoothing: float = 0.0,
                         reduction: str = "mean") -> torch.Tensor:
    """The loss from every shard's vocab_shard_stats, as linear_cross_entropy over the whole
    vocabulary (vocab_size columns) would give it; the same max / sum-exp steps as the all-reduces."""
    _check_options(reduction, label_smoothing, ignore_index)
    if not stats:
        raise cd.OperandError("stats: one vocab_shard_stats result per shard, got none")
    _check_target(target, stats[0]["lse"].shape[0])
    if shapes := {tuple(s["lse"].shape) for s in stats} - {tuple(target.shape)}:
        raise cd.OperandError(f"every shard's stats must be of target's {target.shape[0]} rows, got rows "
                              f"{sorted(s[0] for s in shapes)}")
    if label_smoothing and any("z_sum" not in s for s in stats):
        raise cd.OperandError(f"label_smoothing={label_smoothing}: every shard's stats need 'z_sum'; pass the same "
                              "label_smoothing to vocab_shard_stats")
    lse = torch.stack([s["lse"] for s in stats])
    top = lse.amax(0)
    total = {"lse": top + torch.log(torch.exp(lse - top).sum(0)),
             "z_target": torch.stack([s["z_target"] for s in stats]).sum(0)}
    if label_smoothing:
        total["z_sum"] = torch.stack([s["z_sum"] for s in stats]).sum(0)
    valid = target != ignore_index
    return _reduce(_row_loss(total, vocab_size, label_smoothing), valid, valid.sum(), reduction,
                   _out_of_range(target, vocab_size, ignore_index))
