"""Gated activations with gate and up projections interleaved in one weight (rows 2j: gate, 2j+1: up),
so one GEMM produces both and the epilogue pairs adjacent columns: D has N/2 columns."""
from __future__ import annotations

import torch

import coda_dsl as cd  # the library is written against the public API, like user code


def _glu(act, name: str) -> cd.Epilogue:
    def glu(acc):
        g, u = cd.pairs(acc)
        return act(g) * u
    return cd.epilogue(glu, name=name)


swiglu = _glu(cd.silu, "swiglu")
geglu = _glu(lambda g: cd.gelu(g, approximate="tanh"), "geglu")
reglu = _glu(cd.relu, "reglu")


@cd.epilogue
def swiglu_keep_preactivation(acc):
    """SwiGLU that also stores the full-width pre-activation, the input of its backward."""
    g, u = cd.pairs(acc)
    return {"D": cd.silu(g) * u, "pre": acc}


def swiglu_grad(dy, g, u):
    """(d g, d u, silu(g)) of y = silu(g) * u for an incoming dy: DSL values, for backward epilogues."""
    sig = cd.sigmoid(g)
    silu = g * sig
    return dy * u * sig * (1.0 + g * (1.0 - sig)), dy * silu, silu


@cd.epilogue
def swiglu_backward(acc, pre: cd.Tensor):
    """acc = dY (= dOut @ W_down, N/2 wide); pre = saved pre-activation (N wide, interleaved).
    D = d(pre-activation), interleaved like pre; "y" recomputes the activation for the weight gradient."""
    g, u = cd.pairs(pre)
    dg, du, silu = swiglu_grad(acc, g, u)
    return {"D": cd.interleave(dg, du), "y": silu * u}


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """[F, d] gate and up weights -> one [2F, d] weight with rows gate0, up0, gate1, up1, ..."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate {list(w_gate.shape)} and up {list(w_up.shape)} weights must have one shape")
    return torch.stack((w_gate, w_up), dim=1).reshape(-1, w_gate.shape[-1])


def linear_swiglu(x: torch.Tensor, w_interleaved: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(x @ W_gate^T) * (x @ W_up^T) in one GEMM, with w_interleaved = interleave_gate_up(W_gate, W_up)."""
    return cd.gemm(x, w_interleaved, swiglu, backend=backend)["D"]
