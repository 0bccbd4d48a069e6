"""RMSNorm moved into GEMM epilogues (the CODA reparameterization).

    y = RMSNorm_gamma(h) @ W2^T,  h = x @ W1^T + residual
      = rstd[m] * ((h * gamma) @ W2^T),   rstd[m] = 1 / sqrt(mean_n(h^2) + eps)

The producer (GEMM 1) writes h (the new residual stream), h * gamma (the next GEMM's input) and
rstd, the per-row statistic finished right after the GEMM; the consumer (GEMM 2) scales its
accumulator by rstd. No pass over [M, N] is left outside the two GEMMs.
"""
from __future__ import annotations

import torch

import coda_dsl as cd  # the library is written against the public API, like user code


@cd.epilogue
def rms_producer(acc, residual: cd.Tensor, gamma: cd.VecN, inv_n: cd.Scalar, eps: cd.Scalar):
    h = acc + residual
    return {
        "D": h,
        "h_gamma": h * gamma,
        "rstd": cd.sum(h * h, axis="n").then(lambda s: cd.rsqrt(s * inv_n + eps)),
    }


@cd.epilogue
def gain_wgrad(acc, gamma: cd.VecN):
    """The weight gradient of a GEMM whose input was x * gamma, from x itself: dW = dY^T @ (x * gamma) =
    (dY^T @ x) * gamma, as cd.gemm(dY.t(), x.t(), gain_wgrad, gamma=gamma): x * gamma need not be kept
    for the backward."""
    return acc * gamma


_ACTIVATIONS = {None: lambda x: x, "relu": cd.relu, "silu": cd.silu, "gelu": cd.gelu,
                "gelu_tanh": lambda x: cd.gelu(x, approximate="tanh")}


@cd.epilogue_factory
def rms_consumer(activation: str | None = None) -> cd.Epilogue:
    """D = activation(rstd[m] * acc)."""
    if activation not in _ACTIVATIONS:
        raise cd.OperandError(f"activation must be one of {list(_ACTIVATIONS)}, not {activation!r}")
    act = _ACTIVATIONS[activation]

    def rms_scaled(acc, rstd: cd.VecM):
        return act(rstd * acc)

    return cd.epilogue(rms_scaled, name=f"rms_scaled_{activation or 'linear'}")


def rmsnorm_linear(x: torch.Tensor, w1: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                   w2: torch.Tensor, eps: float = 1e-6, activation: str | None = None,
                   backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """h = x @ w1^T + residual;  y = activation(RMSNorm_gamma(h) @ w2^T). Returns (h, y) in two GEMMs."""
    p = cd.gemm(x, w1, rms_producer, residual=residual, gamma=gamma, inv_n=1.0 / w1.shape[-2], eps=eps,
             backend=backend)
    y = cd.gemm(p["h_gamma"], w2, rms_consumer(activation), rstd=p["rstd"], backend=backend)["D"]
    return p["D"], y
