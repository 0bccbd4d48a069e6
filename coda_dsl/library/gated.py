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


# SwiGLU's backward, derived from swiglu (passes/autodiff.py), as the epilogue of dY = dOut @ W_down:
# acc = dY (N/2 wide), saved_acc = the forward's accumulator (the interleaved pre-activation, N wide);
# D = d(pre-activation), interleaved like it, and recomputed_D = y again, for W_down's gradient. It
# replaced a hand-written epilogue of the same math, as fast (H200, bench.mlp: 1517 against 1509 µs).
swiglu_backward = cd.backward_epilogue(swiglu, recompute="D")


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """[F, d] gate and up weights -> one [2F, d] weight with rows gate0, up0, gate1, up1, ..."""
    if w_gate.shape != w_up.shape:
        raise cd.OperandError(f"gate {list(w_gate.shape)} and up {list(w_up.shape)} weights must have one shape")
    return torch.stack((w_gate, w_up), dim=1).reshape(-1, w_gate.shape[-1])


def linear_swiglu(x: torch.Tensor, w_interleaved: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(x @ W_gate^T) * (x @ W_up^T) in one GEMM, with w_interleaved = interleave_gate_up(W_gate, W_up)."""
    return cd.gemm(x, w_interleaved, swiglu, backend=backend)["D"]
