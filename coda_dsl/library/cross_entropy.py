"""Cross-entropy fused into the LM head: the logits [M, V] are never stored in fp32.

Forward, one GEMM whose epilogue keeps per row only the online log-sum-exp, the target logit (and,
with label smoothing, the sum of logits); no D. Backward, per chunk of rows: one GEMM whose
epilogue forms P = (softmax - eps/V) * scale in bf16 (at most one chunk of logits exists at a
time); the one-hot term, one value per row, is scattered into P, so the epilogue never needs
column indices; then grad_x = P @ W and grad_W += P^T @ x.

    loss_m = lse_m - (1 - eps) z[m, t_m] - eps * mean_n z[m, n]     (z: softcapped logits)
"""
from __future__ import annotations

import functools

import torch

import coda_dsl as cd  # the library is written against the public API, like user code


def _softcapped(acc, cap):
    return cap * cd.tanh(acc * (1.0 / cap)) if cap else acc


@functools.cache
def _forward_epilogue(smoothing: bool, cap: float | None) -> cd.Epilogue:
    def ce_forward(acc, target: cd.VecM):
        z = _softcapped(acc, cap)
        out = {"lse": cd.logsumexp(z, axis="n"), "z_target": cd.take(z, target, axis="n")}
        if smoothing:
            out["z_sum"] = cd.sum(z, axis="n")
        return out
    return cd.epilogue(ce_forward, name=f"ce_forward{'_smooth' if smoothing else ''}{'_cap' if cap else ''}")


@cd.epilogue
def ce_backward(acc, lse: cd.VecM, scale: cd.VecM, uniform: cd.Scalar):
    """The logits' gradient but for the one-hot term: (softmax - eps/V) * scale."""
    return (cd.exp(acc - lse) - uniform) * scale


@functools.cache
def _backward_softcap_epilogue(cap: float) -> cd.Epilogue:
    def ce_backward_softcap(acc, lse: cd.VecM, scale: cd.VecM, target: cd.VecM, uniform: cd.Scalar):
        t = cd.tanh(acc * (1.0 / cap))
        dz = 1.0 - t * t  # d softcap(acc) / d acc
        g = (cd.exp(cap * t - lse) - uniform) * scale
        return {"D": g * dz, "dz_target": cd.take(dz, target, axis="n")}
    return cd.epilogue(ce_backward_softcap)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, target, ignore_index, reduction, smoothing, cap, backend, chunk):
        valid = target != ignore_index
        safe = torch.where(valid, target, -1)  # out of range: take gives 0, the row is masked anyway
        st = cd.gemm(x, w, _forward_epilogue(smoothing > 0, cap), target=safe, backend=backend)
        v = w.shape[0]
        loss = st["lse"] - (1 - smoothing) * st["z_target"]
        if smoothing:
            loss = loss - smoothing * st["z_sum"] / v
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        count = valid.sum()
        ctx.save_for_backward(x, w, safe, valid, st["lse"], count)
        ctx.cfg = (reduction, smoothing, cap, backend, chunk)
        if reduction == "none":
            return loss
        total = loss.sum()
        return total / count.clamp_min(1) if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad):
        x, w, safe, valid, lse, count = ctx.saved_tensors
        reduction, smoothing, cap, backend, chunk = ctx.cfg
        m, v = x.shape[0], w.shape[0]
        if reduction == "none":
            scale = grad.float()
        else:
            scale = grad.float().expand(m) / (count.clamp_min(1) if reduction == "mean" else 1)
        scale = torch.where(valid, scale, torch.zeros_like(scale)).contiguous()
        need_x, need_w = ctx.needs_input_grad[:2]  # a frozen LM head needs no grad_w GEMMs
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros_like(w) if need_w else None  # in w's dtype: each chunk's GEMM sums in fp32
        chunk = -(-chunk // 8) * 8  # whole 16-byte groups of the per-row vectors: aligned slices
        for s in range(0, m, chunk):
            e = min(m, s + chunk)
            xs, ts, sc = x[s:e], safe[s:e], scale[s:e]
            common = dict(lse=lse[s:e].contiguous(), scale=sc, uniform=smoothing / v, backend=backend)
            out = cd.gemm(xs, w, _backward_softcap_epilogue(cap), target=ts, **common) if cap else \
                cd.gemm(xs, w, ce_backward, **common)
            p = out["D"]  # [chunk, V]: the logits' gradient, but for the one-hot term
            hot = (1 - smoothing) * sc * (out["dz_target"] if cap else 1.0)  # 0 on ignored rows
            rows = torch.arange(e - s, device=p.device)
            p.index_put_((rows, ts.clamp_min(0)), -hot.to(p.dtype), accumulate=True)  # now all of it
            if need_x:
                grad_x[s:e] = p @ w
            if need_w:
                grad_w.addmm_(p.t(), xs)
        return grad_x, grad_w, None, None, None, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0, softcap: float | None = None,
                         backend: str = "auto", chunk_rows: int = 4096) -> torch.Tensor:
    """F.cross_entropy(x @ w.T, target) without materializing fp32 logits; differentiable in x and w.

    x: [M, d], w: [V, d] (the LM head weight), target: [M] int64. Peak extra memory on the CUTLASS
    backend: O(M) in the forward; in the backward one [chunk_rows, V] block of logit gradients and
    grad_w, both in w's dtype. (The reference backend forms fp32 logits.)
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if target.dtype != torch.int64 or target.shape != x.shape[:1]:
        raise ValueError(f"target must be int64 of shape [{x.shape[0]}], got {target.dtype} {list(target.shape)}")
    return _LinearCrossEntropy.apply(x, w, target, ignore_index, reduction, float(label_smoothing),
                                     float(softcap) if softcap else None, backend, int(chunk_rows))
