"""A trainable Llama decoder layer whose forward is four GEMMs with fused epilogues.

`LlamaDecoderLayer` holds exactly the parameters of Hugging Face's `LlamaDecoderLayer` (same names and
shapes, so `load_state_dict(hf_layer.state_dict())` works both ways). Per layer, on [M, D] tokens:

    1. QKV     = rope(rstd1[m] * ((x * gamma1) @ W_qkv^T))          epilogue `rms_rope`
    2. attention through F.scaled_dot_product_attention (causal, GQA)
    3. h       = attn @ W_o^T + x;  h * gamma2;  rstd2 = rsqrt(mean(h^2) + eps)    `rms_producer`
    4. y       = swiglu(rstd2[m] * ((h * gamma2) @ W_gate_up^T))   epilogue `rms_swiglu`
    5. out     = y @ W_down^T + h;  rstd of out for the next layer's norm           `residual_rms`

Design decisions:

- **Gamma on the activation side, nothing folded.** RMSNorm's gamma multiplies the GEMM's input
  (`h * gamma2` is an output of the o-proj epilogue; `x * gamma1` is one fused step at the layer's
  entrance, `input_norm`, since the previous layer does not know this layer's gamma), and rstd scales the
  accumulator per row. Folding gamma into the weights (W * gamma) would cost a pass over every weight
  per forward, or a re-fold after each optimizer step; this way training updates HF's own parameters.
- **Fused weights derived per forward.** W_qkv (q/k rows permuted per head by
  `neox_to_interleaved`, so the interleaved-pair RoPE epilogue gives HF's half-split rotation;
  q·k is unchanged by a common permutation) and the interleaved W_gate_up are concatenations of the
  HF parameters made per forward, so gradients land in q_proj.weight, gate_proj.weight, ... (a copy
  per forward: the price of training HF's parameters directly). `mlp.tie_gate_up()` saves W_gate_up's
  copy by storing gate_proj.weight and up_proj.weight as the halves of one interleaved buffer (still two
  leaf parameters with HF's names and shapes, but strided, which FSDP2 refuses).
- **Norm statistics across layers.** The down epilogue emits rstd of the layer's output (with this
  layer's eps: one config per stack); `forward(..., return_rstd=True)` returns it and the next layer
  takes it as `input_rstd`, so only the first layer computes its input's rstd in torch.
- **Backward.** The MLP is one `torch.autograd.Function` (`_Mlp`): its backward GEMM dY = dOut @ W_down
  carries the SwiGLU and rstd derivative in its epilogue (`rms_swiglu_grad`, derived from `rms_swiglu` by
  passes/autodiff.py: it reads the saved [M, 2F] accumulator and writes the gate and up accumulators'
  gradients, [M, F] each, and rstd's). Each RMSNorm's backward is the epilogue of the GEMM that makes
  d(x * gamma), with the residual's gradient added there (x's whole gradient in one store):
  `input_norm_grad` in the QKV dgrad GEMM (x comes back out of the QKV step as the residual, so its
  gradient arrives there), `post_norm_grad` in gate/up's second dgrad GEMM (the MLP takes h and its
  norm, and the o-proj's h * gamma2 and rstd as made). RoPE's backward is one Triton kernel over q's, k's
  and v's gradients (`triton_kernels.rope_backward`); the rest are named functions of plain torch ops
  (`residual_rms_backward`, ...), fused by torch.compile on CUDA, between cuBLAS GEMMs.
  Only the gradients autograd asks for are computed.
- **Attention mask: causal only**, per row of the batch (SDPA; GQA by `enable_gqa`, torch >= 2.5).
  Packed sequences may restart `position_ids` (RoPE follows them) but attention still spans the
  whole row; a mask other than None is refused.
- RoPE: the default and any rope type whose attention scaling is 1 (the inverse frequencies are taken
  from transformers' rope functions for non-default types). No KV cache (training layer).
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from torch import nn

import coda_dsl as cd
from .errors import OperandError, UnsupportedError
from .library import gain_wgrad, interleave_gate_up, rms_producer
from .library.rope import neox_to_interleaved, rotate
from .ir.ops import dtype_name, math_dtype
from .runtime import checks
from .runtime.reference import evaluate_on
from .triton_kernels import rope_backward


# ---------------------------------------------------------------- forward epilogues

@cd.epilogue
def rms_rope(acc, rstd: cd.VecM, pos: cd.VecM, inv_freq: cd.VecN):
    """QKV projection of a normalized input: rstd scales the row, then RoPE by position (inv_freq 0
    for V's columns, which pass through)."""
    angle = pos * inv_freq
    return rotate(rstd * acc, cd.cos(angle), cd.sin(angle))


@cd.epilogue
def rms_swiglu(acc, rstd: cd.VecM):
    """Gate/up projection (interleaved rows) of a normalized input: rstd scales the row, then SwiGLU."""
    g, u = cd.pairs(rstd * acc)
    return cd.silu(g) * u


# The MLP's two kernels around rms_swiglu. The forward's also stores its [M, 2F] accumulator, which the
# backward reads. The backward's is derived (passes/autodiff.py) and runs in the epilogue of the GEMM
# that produces its incoming gradient, dY = dOut @ W_down: the gate and up accumulators' gradients
# (D_even, D_odd: [M, F] each, so each is a plain GEMM operand of its own weight's gradient) and rstd's.
rms_swiglu_fwd = cd.forward_epilogue(rms_swiglu)
rms_swiglu_grad = cd.backward_epilogue(rms_swiglu, split=True)
rms_swiglu_grad_and_y = cd.backward_epilogue(rms_swiglu, split=True, recompute=("D",))  # y too: LlamaMLP.keep_y


@cd.epilogue
def residual_rms(acc, residual: cd.Tensor, inv_n: cd.Scalar, eps: cd.Scalar):
    """Down projection plus residual; rstd of the result for the next layer's input norm."""
    h = acc + residual
    return {"D": h, "rstd": cd.sum(h * h, axis="n").then(lambda s: cd.rsqrt(s * inv_n + eps))}


# The layer's two RMSNorms differentiated in the epilogue of the GEMM that makes d(x * gamma), with x's
# other use, the residual, added: x's whole gradient in the GEMM's one store.

def _norm_backward(dxg, x, dres, gamma, drstd, rstd, inv_n):
    """x's gradient through xg = x * gamma and through its rstd, which scales the next GEMM's rows
    (rsqrt(mean(x^2) + eps): d rstd/dx = -rstd^3 x / N; inv_n = 0 where rstd did not come from x), plus
    dres, the residual's; gamma's gradient summed over the rows."""
    return {"D": dxg * gamma + dres - drstd * rstd * rstd * rstd * inv_n * x, "dgamma": cd.sum(dxg * x, axis="m")}


@cd.epilogue
def input_norm_grad(acc, x: cd.Tensor, dres: cd.Tensor, gamma: cd.VecN, drstd: cd.VecM, rstd: cd.VecM,
                    inv_n: cd.Scalar):
    """The QKV dgrad GEMM's epilogue: acc = d(x * gamma1) = d acc_qkv @ W_qkv."""
    return _norm_backward(acc, x, dres, gamma, drstd, rstd, inv_n)


@cd.epilogue
def post_norm_grad(acc, prev: cd.Tensor, x: cd.Tensor, dres: cd.Tensor, gamma: cd.VecN, drstd: cd.VecM,
                   rstd: cd.VecM, inv_n: cd.Scalar):
    """The gate/up dgrad's second GEMM's epilogue: acc + prev = d up @ W_up + d gate @ W_gate = d(h * gamma2)."""
    return _norm_backward(acc + prev, x, dres, gamma, drstd, rstd, inv_n)


# ---------------------------------------------------------------- backward steps (torch ops, fused on CUDA)

def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return a.to(dtype) @ b.to(dtype)


def _linear_grads(ctx, dacc, a, w, ia: int, iw: int):
    """acc = a @ w^T: (d a, d w), each only if autograd wants it."""
    da = _mm(dacc, w, a.dtype) if ctx.needs_input_grad[ia] else None
    dw = _mm(dacc.t(), a, w.dtype) if ctx.needs_input_grad[iw] else None
    return da, dw


def _gained_wgrad(dacc, x, gamma, dtype: torch.dtype, backend: str) -> torch.Tensor:
    """d W for acc = (x * gamma) @ W^T from x itself: (dacc^T @ x) * gamma in one GEMM (both operands passed
    transposed), so that x * gamma, [M, D], need not be kept for the backward."""
    return cd.gemm(dacc.t(), x.t(), gain_wgrad, gamma=gamma, backend=backend)["D"].to(dtype)


@cd.on_cuda
def residual_rms_backward(dout, drstd, out, rstd, inv_n: float):
    """out = acc + residual, outputs (out, rstd(out)) -> d acc (= d residual), in out's dtype: dout plus the
    gradient through rstd = rsqrt(mean(out^2) + eps), d rstd/d out = -rstd^3 out / N, in fp32 (as
    _norm_backward's; fp64 for fp64)."""
    f = math_dtype(out.dtype)
    return (dout.to(f) - (drstd * rstd ** 3 * inv_n)[:, None] * out.to(f)).to(out.dtype)


# ---------------------------------------------------------------- one autograd.Function per fused GEMM

class _NormRopeLinear(torch.autograd.Function):
    """The layer's entrance: the input norm's gain (and its rstd, unless the previous layer gave it), then
    rms_rope's GEMM; inv_freq per column pair (qkv_inv_freq: q's and k's heads of head_dim columns, each
    with the same head_dim / 2 frequencies). q, k and v come back as views of the GEMM's output, so that
    their gradients arrive apart and one kernel reads them (rope_backward; autograd would first join
    them into one tensor). x also comes back as it is, for the
    layer's residual: its gradient then arrives here too, and the QKV dgrad GEMM's epilogue
    (input_norm_grad) adds it into x's gradient, where autograd would add the two in a pass of its own.
    x * gamma is not kept: W's gradient is (dacc^T @ x) * gamma (_gained_wgrad)."""

    @staticmethod
    def forward(ctx, x, gamma, rstd_in, w, pos, inv_freq, eps, heads, kv_heads, head_dim, backend):
        xg, rstd = input_norm(x, gamma, eps, rstd_in)
        y = cd.gemm(xg, w, rms_rope, rstd=rstd, pos=pos, inv_freq=inv_freq, backend=backend)["D"]
        ctx.save_for_backward(x, gamma, rstd, w, pos, inv_freq, y)
        ctx.head_dim, ctx.own_rstd, ctx.backend = head_dim, rstd_in is None, backend
        return (*split_qkv(y, heads, kv_heads, head_dim), x)

    @staticmethod
    @cd.first_order("coda_dsl.nn's QKV projection")
    def backward(ctx, dq, dk, dv, dres):
        x, gamma, rstd, w, pos, inv_freq, y = ctx.saved_tensors
        need = ctx.needs_input_grad
        head_freq = inv_freq[: ctx.head_dim // 2]  # the first head's, the same for every rotated head
        dacc, drstd = rope_backward(dq, dk, dv, y, rstd, pos, head_freq)
        dx = dgamma = None
        if need[0] or need[1]:  # through rstd only where it came from x
            g = cd.gemm(dacc, w.t(), input_norm_grad, x=x, dres=dres, gamma=gamma, drstd=drstd, rstd=rstd,
                        inv_n=1.0 / x.shape[1] if ctx.own_rstd else 0.0, backend=ctx.backend)
            dx = g["D"] if need[0] else None
            dgamma = g["dgamma"].to(gamma.dtype) if need[1] else None
        drstd_in = drstd if need[2] and not ctx.own_rstd else None
        dw = _gained_wgrad(dacc, x, gamma, w.dtype, ctx.backend) if need[3] else None
        return dx, dgamma, drstd_in, dw, None, None, None, None, None, None, None


class _RmsProducerLinear(torch.autograd.Function):
    """The o-proj: h = a @ W_o^T + residual, and for the post-attention norm h * gamma and rstd(h), which
    only the MLP reads. Those two are not differentiable here: the MLP's backward differentiates through
    them to h and gamma itself (post_norm_grad, in a GEMM's epilogue) and hands back h's whole gradient."""

    @staticmethod
    def forward(ctx, a, w, residual, gamma, eps, backend):
        r = cd.gemm(a, w, rms_producer, residual=residual, gamma=gamma, inv_n=1.0 / w.shape[0], eps=eps,
                    backend=backend)
        ctx.save_for_backward(a, w)
        ctx.mark_non_differentiable(r["h_gamma"], r["rstd"])
        ctx.set_materialize_grads(False)
        return r["D"], r["h_gamma"], r["rstd"]

    @staticmethod
    @cd.first_order("coda_dsl.nn's output projection")
    def backward(ctx, dh, _dhg, _drstd):
        if dh is None:
            return None, None, None, None, None, None
        a, w = ctx.saved_tensors
        da, dw = _linear_grads(ctx, dh, a, w, 0, 1)
        return da, dw, dh if ctx.needs_input_grad[2] else None, None, None, None


class _Mlp(torch.autograd.Function):
    """The MLP's two GEMMs on the residual stream h after its RMSNorm (gamma): y = swiglu(rstd * (hg @
    W_gate_up^T)), out = y @ W_down^T + h (and its rstd), where hg = h * gamma and rstd = rstd(h) come
    made (the o-proj's epilogue makes them) and are not differentiated as inputs: the backward gives h's
    and gamma's whole gradients. Its dY = dOut @ W_down carries rms_swiglu_grad in its epilogue, so the
    SwiGLU derivative costs no pass of its own over the saved [M, 2F] accumulator, and d(hg)'s second GEMM
    carries the norm's backward and the residual's gradient (post_norm_grad). It uses the gate and up
    weights as they are, never the interleaved one (not kept), and keeps h, not hg (_gained_wgrad).
    keep_y: y is kept for W_down's gradient; else the dY epilogue computes it again
    (rms_swiglu_grad_and_y). The backward frees y and the accumulator (its own intermediates, the
    layer's largest) as soon as it has used them: see _release."""

    @staticmethod
    def forward(ctx, h, gamma, hg, rstd, w_gate, w_up, w_down, eps, backend, keep_y):
        r, o, inv_n = _mlp_gemms(h, hg, rstd, w_gate, w_up, w_down, eps, backend, rms_swiglu_fwd)
        ctx.save_for_backward(h, gamma, rstd, w_gate, w_up, w_down, r["D"] if keep_y else None, r["acc"],
                              o["D"], o["rstd"])
        ctx.inv_n, ctx.backend = inv_n, backend
        ctx.set_materialize_grads(False)  # rstd's gradient is None unless a next layer's norm took it
        return o["D"], o["rstd"]

    @staticmethod
    @cd.first_order("coda_dsl.nn.LlamaMLP")
    def backward(ctx, dout, drstd_out):
        h, gamma, rstd, w_gate, w_up, w_down, y, acc, out, rstd_out = ctx.saved_tensors
        _check_unreleased("LlamaMLP", *(t for t in (y, acc) if t is not None))
        need = ctx.needs_input_grad  # h, gamma, (hg, rstd: made, never differentiable), w_gate, w_up, w_down
        if dout is None:
            dout = torch.zeros_like(out)
        if drstd_out is not None:
            dout = residual_rms_backward(dout, drstd_out, out, rstd_out, ctx.inv_n)
        dacc = dout.to(acc.dtype)  # = d residual
        dw_down = None
        if y is not None:  # kept: W_down's gradient first, and y's memory goes before the dY GEMM's outputs come
            dw_down = _mm(dacc.t(), y, w_down.dtype) if need[6] else None
            _release(y)
        g = None
        if need[0] or need[1] or need[4] or need[5]:
            ep = rms_swiglu_grad if y is not None else rms_swiglu_grad_and_y
            g = cd.gemm(dacc, w_down.t(), ep, saved_acc=acc, rstd=rstd, backend=ctx.backend)
        if y is None and need[6]:  # y from the dY epilogue, or (W_down alone training) from the accumulator
            y = g.pop("recomputed_D") if g is not None else _swiglu_of_acc(acc, rstd)
            dw_down = _mm(dacc.t(), y, w_down.dtype)
            del y
        _release(acc)
        dh = dgamma = dw_gate = dw_up = None
        if g is not None:
            dgate, dup = g["D_even"], g["D_odd"]  # d(hg @ W_gate^T), d(hg @ W_up^T): [M, F]
            if need[0] or need[1]:
                n = cd.gemm(dup, w_up.t(), post_norm_grad, prev=_mm(dgate, w_gate, h.dtype), x=h, dres=dacc,
                            gamma=gamma, drstd=g["rstd"], rstd=rstd, inv_n=1.0 / h.shape[1], backend=ctx.backend)
                dh = n["D"] if need[0] else None
                dgamma = n["dgamma"].to(gamma.dtype) if need[1] else None
            dw_gate = _gained_wgrad(dgate, h, gamma, w_gate.dtype, ctx.backend) if need[4] else None
            del g, dgate  # its memory for dw_up
            dw_up = _gained_wgrad(dup, h, gamma, w_up.dtype, ctx.backend) if need[5] else None
        return dh, dgamma, None, None, dw_gate, dw_up, dw_down, None, None, None


def _mlp_gemms(h, hg, rstd, w_gate, w_up, w_down, eps: float, backend: str, gate_up: cd.Epilogue):
    """The MLP's two GEMMs: `gate_up` (rms_swiglu, y alone, or rms_swiglu_fwd, also its accumulator) on
    hg, then out = y @ W_down^T + h and the next norm's rstd of it. -> (gate/up outputs, down outputs,
    the 1 / D of that rstd)."""
    r = cd.gemm(hg, gate_up_weight(w_gate, w_up), gate_up, rstd=rstd, backend=backend)
    inv_n = 1.0 / w_down.shape[0]
    return r, cd.gemm(r["D"], w_down, residual_rms, residual=h, inv_n=inv_n, eps=eps, backend=backend), inv_n


@cd.on_cuda
def _swiglu_of_acc(acc: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """rms_swiglu's y from its saved accumulator (its reference semantics; one fused kernel on CUDA)."""
    return evaluate_on(rms_swiglu.program, acc.to(math_dtype(acc.dtype)), {"rstd": rstd},  # fp64: its math's
                       {"D": None if acc.dtype == torch.float64 else dtype_name(acc.dtype)})["D"]


def _release(t: torch.Tensor) -> None:
    """Free a saved intermediate's memory now, not when the backward returns (autograd holds saved tensors
    until then): the MLP's y and [M, 2F] accumulator, 672 MiB at 8192 tokens of Llama-3-8B, would
    otherwise still be allocated while the backward's largest gradients are. Only tensors the forward
    made and never handed out; not under torch.compile, whose graph owns its buffers."""
    if not torch.compiler.is_compiling():
        t.untyped_storage().resize_(0)


def _check_unreleased(where: str, *saved: torch.Tensor) -> None:
    """A second backward through the same forward (retain_graph) would read memory _release freed."""
    if not torch.compiler.is_compiling() and any(t.untyped_storage().nbytes() == 0 < t.numel() for t in saved):
        raise UnsupportedError(f"coda_dsl.nn.{where}: backward ran twice through the same forward (retain_graph); "
                               "the first one freed the activations it saved\n  fix: run the forward again for a "
                               "second backward")


def layer_name(layer: nn.Module) -> str:
    """How messages name a layer: by its class, with the class's module (coda_dsl.nn.LlamaDecoderLayer)."""
    return f"{type(layer).__module__}.{type(layer).__qualname__}"


def _check_inputs(where: str, x, hidden_size: int, dtype: torch.dtype, position_ids, input_rstd) -> None:
    """The layer's arguments, with what they should be (shape errors deep in the layer name none)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != hidden_size:
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise OperandError(f"{where}: hidden_states must be [batch, seq, {hidden_size}], got {got}")
    if torch.is_autocast_enabled(x.device.type):  # its GEMMs would meet autocast's casts of some operands only
        raise UnsupportedError(f"{where}: torch.autocast is not supported (no fp32-master / bf16-compute mode)\n  "
                               "fix: run the layer outside autocast, in the dtype to compute in: layer.to(torch.bfloat16)")
    if x.dtype != dtype:
        raise OperandError(f"{where}: hidden_states are {x.dtype} but the layer's weights are {dtype}\n  fix: cast one "
                           f"of them: hidden_states.to({dtype}), or layer.to({x.dtype})")
    b, s = x.shape[:2]
    if position_ids is not None and not isinstance(position_ids, torch.Tensor):
        raise OperandError(f"{where}: position_ids must be a tensor [{b}, {s}] or [1, {s}], got "
                           f"{type(position_ids).__name__}")
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[1] != s
                                     or position_ids.shape[0] not in (1, b)):
        raise OperandError(f"{where}: position_ids must be [{b}, {s}] or [1, {s}], got {list(position_ids.shape)}")
    if position_ids is not None and (position_ids.dtype == torch.bool or position_ids.is_complex()):
        raise OperandError(f"{where}: position_ids are token positions (integers, as HF passes them), not "
                           f"{position_ids.dtype}")
    if input_rstd is None:
        return
    want = math_dtype(dtype)  # what return_rstd=True gives
    if not isinstance(input_rstd, torch.Tensor) or tuple(input_rstd.shape) != (b, s) or input_rstd.dtype != want:
        cast = isinstance(input_rstd, torch.Tensor) and input_rstd.dtype in (torch.bfloat16, torch.float16)
        raise OperandError(f"{where}: input_rstd must be a [{b}, {s}] {want} tensor, as the previous layer returns it "
                           f"with return_rstd=True, got {checks.described(input_rstd)}" + (
                               "\n  fix: pass it on as it came (under FSDP2, a MixedPrecisionPolicy casts forward "
                               "inputs unless cast_forward_inputs=False, as parallel.mixed_precision_policy has it)"
                               if cast else ""))


PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))  # (block, projection)


def _check_weights(layer: nn.Module) -> None:
    """Each projection a plain bias-free nn.Linear without hooks, every parameter in q_proj.weight's dtype: the
    layer reads the weights directly, so a wrapper (a PEFT/LoRA adapter), a bias or a hook would be ignored,
    silently, and a cast parameter meet a GEMM's dtype error that names no parameter."""
    # per forward, so through the modules' dicts (nn.Module.__getattr__ costs ~0.5 us a name); the dtype
    # loop over named_parameters only names the culprit
    blocks = layer._modules
    projections = [blocks[b]._modules[n] for b, n in PROJECTIONS]
    where = layer_name(layer)
    norms = [(None, n) for n in ("input_layernorm", "post_attention_layernorm")]
    for (block, name), p in [*zip(PROJECTIONS, projections), *((key, blocks[key[1]]) for key in norms)]:
        if what := _not_plain_linear(p) if block else _unread(p):
            name = f"{block}.{name}" if block else name
            raise UnsupportedError(f"{where}: {name} {what}, but the layer reads the projections' and norms' weights "
                                   "directly (fused GEMMs), so that would be ignored; only plain bias-free nn.Linear "
                                   "projections without hooks are supported\n  fix: merge adapters into the weights "
                                   "first (PEFT: model.merge_and_unload()), remove the hooks or parametrizations, or "
                                   "use transformers' own layer")
    dtype = projections[0]._parameters["weight"].dtype
    if all(p._parameters["weight"].dtype == dtype for p in projections) and all(
            blocks[n]._parameters["weight"].dtype == dtype for n in ("input_layernorm", "post_attention_layernorm")):
        return
    for name, p in layer.named_parameters():
        if p.dtype != dtype:
            raise OperandError(f"{where}: {name} is {p.dtype}, but the layer computes in {dtype} (its "
                               f"self_attn.q_proj.weight's)\n  fix: layer.to({dtype}) puts every parameter in one dtype")


def _not_plain_linear(p: nn.Module) -> str | None:
    """What keeps a projection from being a plain bias-free nn.Linear without hooks, or None."""
    if type(p) is not nn.Linear:
        return f"is a {type(p).__module__}.{type(p).__name__}"
    if p._parameters.get("bias") is not None:
        return "has a bias"
    return _unread(p)


def _unread(m: nn.Module) -> str | None:
    """What the layer would skip of a module whose weight it reads directly (never calling the module): its
    hooks, a weight that is not its own (a parametrization; FSDP1's flat parameters), or None. A plain tensor
    in its parameters (torch.func.functional_call's) is read like a Parameter."""
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
        return "has hooks"
    return None if isinstance(m._parameters.get("weight"), torch.Tensor) else \
        "has no weight of its own (a parametrization, or FSDP1 with use_orig_params=False)"


def _check_training_call(where: str, config, attention_mask, cache, use_cache, position_ids, position_embeddings,
                         kwargs: dict) -> None:
    """A decoder layer's call as training makes it: causal attention over whole rows, no KV cache, RoPE from
    positions."""
    if position_embeddings is not None and position_ids is None:
        raise UnsupportedError(f"{where}: position_embeddings without position_ids: the layer rotates by "
                               "positions in its QKV epilogue and does not read cos/sin tables\n  fix: pass the "
                               "position_ids they were made from (a transformers model passes both)")
    if getattr(config, "_attn_implementation", None) not in (None, "sdpa", "eager") or any(
            kwargs.get(k) is not None for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")):
        raise UnsupportedError(f"{where}: attention implementations other than 'sdpa' and 'eager' (flash "
                               "attention splits packed sequences by their position_ids or cu_seq_lens; others may "
                               "pass no mask) are not supported: this layer attends causally over whole rows (SDPA)"
                               "\n  fix: attn_implementation='sdpa' (a packed batch is then refused by its mask "
                               "instead of attended across)")
    if attention_mask is not None:
        raise UnsupportedError(f"{where}: attention is causal only; pass attention_mask=None (no padding or "
                               "packed-sequence masks yet). In a transformers model, use attn_implementation='sdpa' "
                               "(its default), which passes None for a causal batch; 'eager' passes the causal mask "
                               "as a tensor, and so does 'sdpa' inside a torch.compile of the whole model (where it "
                               "cannot check for packed sequences): compile each layer instead (for layer in "
                               "model.layers: layer.compile())")
    if collected := _collected_outputs():
        raise UnsupportedError(f"{where}: the transformers model around it collects {' and '.join(collected)} "
                               "(output_hidden_states / output_attentions) with hooks on its own layer classes, "
                               "which this layer is not: they would come back without this layer's\n  fix: call "
                               "the model without them, or collect them with forward hooks on these layers")
    if cache is not None or use_cache or kwargs.get("past_key_values") is not None:
        raise UnsupportedError(f"{where}: no KV cache (a training layer). In a transformers model, call it "
                               "with use_cache=False (or set model.config.use_cache = False); called directly, pass "
                               "no cache")


def _collected_outputs() -> list[str]:
    """What a transformers (>= 5) model around the layer is collecting per layer, through hooks it installed on
    its own layer and attention classes only (transformers.utils.output_capturing). Not asked inside
    torch.compile, which cannot trace the ContextVar it lives in (fullgraph=True failed on it)."""
    if torch.compiler.is_compiling():
        return []
    capturing = sys.modules.get("transformers.utils.output_capturing")  # never imported here
    collector = getattr(capturing, "_active_collector", None)
    wanted = collector.get() if collector is not None else None
    return [k for k in ("hidden_states", "attentions") if wanted and k in wanted]


def flat_inputs(where: str, x: torch.Tensor, position_ids, input_rstd, hidden_size: int, dtype: torch.dtype):
    """[B, S, D] hidden states (of the weights' dtype) -> (x as [B*S, D], fp32 positions [B*S] (default
    0..S-1 per row), input_rstd flattened to [B*S] or None), checked first (messages begin with where)."""
    _check_inputs(where, x, hidden_size, dtype, position_ids, input_rstd)
    b, s, d = x.shape
    if position_ids is None:
        position_ids = torch.arange(s, device=x.device, dtype=torch.float32)[None]  # exact below 2^24
    rstd = None if input_rstd is None else input_rstd.reshape(-1)
    return x.reshape(b * s, d), position_ids.expand(b, s).reshape(-1).float(), rstd


@cd.on_cuda
def input_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float, rstd: torch.Tensor | None = None):
    """The input norm on the activation side: (x * gamma, rstd), rstd computed here unless given (as the
    previous layer's epilogue gives it). One fused pass on CUDA. Differentiable (one fused pass back, as
    the tensor-parallel layer uses it); LlamaDecoderLayer's backward is input_norm_grad instead."""
    return x * gamma, input_rms(x, eps) if rstd is None else rstd


@cd.on_cuda
def input_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rstd = rsqrt(mean(x^2) + eps) per row, in fp32 (fp64 for fp64): what `residual_rms` emits for the next layer."""
    return torch.rsqrt(x.to(math_dtype(x.dtype)).pow(2).mean(-1) + eps)


# ---------------------------------------------------------------- modules (HF parameter names)

class RMSNorm(nn.Module):
    """Holds gamma only (HF's `LlamaRMSNorm.weight`): the norm itself runs in the GEMM epilogues."""

    def __init__(self, hidden_size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.variance_epsilon = eps


def _linear(n_in: int, n_out: int, dtype, device) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False, dtype=dtype, device=device)


def head_dim_of(config) -> int:
    """A Llama config's head dimension (explicit in newer configs, else hidden size over heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_inv_freq(config) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies, as HF's LlamaRotaryEmbedding computes them."""
    # transformers 5 keeps rope_theta and the rope type in rope_parameters; 4.x in rope_theta and rope_scaling
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", "default")
    head_dim = head_dim_of(config)
    if rope_type == "default":
        base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope_type in ("dynamic", "longrope"):  # HF recomputes these frequencies from the sequence length
        raise UnsupportedError(f"coda_dsl.nn: rope_type {rope_type!r} changes its frequencies with the sequence "
                               "length at run time; the layer's are fixed at load (e.g. 'default', 'llama3', "
                               "'linear')")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    if scaling != 1.0:
        raise UnsupportedError(f"coda_dsl.nn: rope_type {rope_type!r} scales cos/sin by {scaling}; only rope types "
                               "with attention scaling 1 are supported (e.g. 'default', 'llama3')")
    return inv_freq.float()


def qkv_inv_freq(inv_freq: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Per column pair of the fused QKV output ([heads + 2 kv_heads] x head_dim): q and k heads rotate by
    the [head_dim / 2] inverse frequencies, V's pairs get 0 (they pass through)."""
    return torch.cat((inv_freq.repeat(heads + kv_heads), torch.zeros(kv_heads * inv_freq.numel())))


def qkv_weight(wq, wk, wv, head_dim: int) -> torch.Tensor:
    """[Nq + 2 Nkv, D]: q and k rows permuted per head for the interleaved RoPE epilogue
    (neox_to_interleaved), v's as they are, in one copy (a strided cat); differentiable, so gradients land
    in the three weights. Not torch.compile'd: compiled, it measured slower both ways at every size tried
    (bench/results/history.md, 2026-12-07)."""
    v = wv.unflatten(0, (-1, head_dim // 2, 2))
    return torch.cat((neox_to_interleaved(wq, head_dim), neox_to_interleaved(wk, head_dim), v)).flatten(0, 2)


def split_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """[M, (heads + 2 kv_heads) head_dim] -> q, k, v ([M, heads head_dim], [M, kv_heads head_dim] twice; views)."""
    return qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, head_dim: int,
                     dropout: float = 0.0) -> torch.Tensor:
    """Rotated q [M, heads head_dim], k and v [M, kv_heads head_dim] -> causal SDPA (GQA) output [M, heads
    head_dim], with dropout on the attention weights (config.attention_dropout, in training as HF applies it)."""
    seq = q.shape[0] // max(batch, 1)  # not -1: a batch of 0 has no rows to infer it from
    q, k, v = (t.unflatten(0, (batch, seq)).unflatten(-1, (-1, head_dim)).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=head_dim ** -0.5,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o.transpose(1, 2).flatten(-2).flatten(0, 1)


class LlamaAttention(nn.Module):
    """q/k/v/o projections (HF names). The QKV GEMM's epilogue applies the input norm's rstd and RoPE. A
    building block of LlamaDecoderLayer, not a drop-in for HF's module: its forward takes the layer's norm."""

    def __init__(self, config, layer_idx: int | None = None, *, dtype=None, device=None):
        super().__init__()
        if getattr(config, "attention_bias", False):
            raise UnsupportedError("coda_dsl.nn.LlamaAttention: attention_bias is not supported; use a config "
                                   "without it (as Llama's)")
        if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
            raise UnsupportedError(f"coda_dsl.nn.LlamaAttention: sliding-window attention (sliding_window = "
                                   f"{config.sliding_window}, Mistral's) is not supported: the layer attends causally "
                                   "over whole rows; use a config without it (as Llama's)")
        self.layer_idx, self.head_dim = layer_idx, head_dim_of(config)
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.attention_dropout = float(getattr(config, "attention_dropout", 0.0))
        d, hd = config.hidden_size, self.head_dim
        self.q_proj = _linear(d, self.num_heads * hd, dtype, device)
        self.k_proj = _linear(d, self.num_kv_heads * hd, dtype, device)
        self.v_proj = _linear(d, self.num_kv_heads * hd, dtype, device)
        self.o_proj = _linear(self.num_heads * hd, d, dtype, device)
        with torch.device("cpu"):  # the fp32 master has values also where the module is made on "meta"
            qkv_inv = qkv_inv_freq(rope_inv_freq(config), self.num_heads, self.num_kv_heads)
        self._qkv_inv_freq_fp32 = qkv_inv
        self.register_buffer("qkv_inv_freq", qkv_inv.to(device or torch.empty(()).device), persistent=False)
        self.register_load_state_dict_post_hook(LlamaAttention._rope_follows_weights)

    @staticmethod
    def _rope_follows_weights(module: "LlamaAttention", incompatible_keys) -> None:
        # load_state_dict(assign=True) into a module made on "meta" moves the weights, not this unsaved buffer
        if not module.q_proj.weight.is_meta:
            module._rope_on(module.q_proj.weight.device)

    def _rope_on(self, device: torch.device) -> None:
        """The RoPE frequencies on `device`, from the fp32 master (never cast with the module's dtype)."""
        self.qkv_inv_freq = self._qkv_inv_freq_fp32.to(device)

    def _apply(self, fn, recurse=True):
        # module.to(torch.bfloat16) casts float buffers too; RoPE angles need the fp32 frequencies
        super()._apply(fn, recurse)
        self._rope_on(self.qkv_inv_freq.device)
        return self

    def forward(self, x, norm: "RMSNorm", rstd, pos, batch: int, backend: str):
        """x [M, D] (the layer's input), its norm (gamma1, eps), its rstd [M] or None (computed here) ->
        (attention output before o_proj [M, Nq], x again: the residual, whose gradient then comes back
        through here; see _NormRopeLinear)."""
        w = qkv_weight(self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.head_dim)
        q, k, v, residual = _NormRopeLinear.apply(x, norm.weight, rstd, w, pos, self.qkv_inv_freq,
                                                  norm.variance_epsilon, self.num_heads, self.num_kv_heads,
                                                  self.head_dim, backend)
        dropout = self.attention_dropout if self.training else 0.0
        return causal_attention(q, k, v, batch, self.head_dim, dropout), residual


class LlamaMLP(nn.Module):
    """gate/up/down projections (HF names): gate/up in one GEMM (rows interleaved) with rstd and SwiGLU in
    its epilogue; down with the residual add and the next norm's rstd in its epilogue.

    The gate/up GEMM reads one [2F, D] weight with the two weights' rows interleaved: a copy of both per
    forward, unless tie_gate_up() has made them the halves of one such buffer.

    keep_y (default True): the forward keeps y = swiglu(...) [M, F] for W_down's gradient. False: it keeps
    [M, F] less per layer for the backward, whose dY GEMM epilogue computes y again (more work there).

    A building block of LlamaDecoderLayer, not a drop-in for HF's module: its forward takes the residual
    stream and the post-attention norm, and returns h + mlp(norm(h)) and the next norm's rstd."""

    def __init__(self, config, *, dtype=None, device=None):
        super().__init__()
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):  # the same function in transformers
            raise UnsupportedError(f"coda_dsl.nn.LlamaMLP: hidden_act {config.hidden_act!r}; only 'silu' is supported")
        if getattr(config, "mlp_bias", False):
            raise UnsupportedError("coda_dsl.nn.LlamaMLP: mlp_bias is not supported; use a config without it "
                                   "(as Llama's)")
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(d, f, dtype, device)
        self.up_proj = _linear(d, f, dtype, device)
        self.down_proj = _linear(f, d, dtype, device)
        self.tied, self.keep_y = False, True

    def tie_gate_up(self) -> LlamaMLP:
        """Store gate_proj.weight and up_proj.weight as the halves of one interleaved [F, 2, D] buffer, so
        the forward passes it to the GEMM as it is instead of copying both weights per call. Same
        Parameter objects and values: an optimizer, load_state_dict and state_dict still see HF's two
        [F, D] weights, updated in place; .to() ties them again. Each is then a strided (non-contiguous)
        tensor: for single-process and DDP training, not FSDP2 (which refuses strided parameters) nor
        optimizers with fused=True (torch's CPU fused kernels ignore strides and would write across the
        two halves; its CUDA ones refuse them). state_dict() holds the two views, as it holds every
        parameter (torch.save keeps the one buffer); safetensors and save_pretrained refuse views of one
        buffer: untie_gate_up() first. Weights assigned anew later are simply copied per forward again,
        as under torch.compile, where the tie cannot be seen."""
        g, u = self.gate_proj.weight, self.up_proj.weight
        if not _tied(g, u):
            both = torch.stack((g.detach(), u.detach()), dim=1)
            g.data, u.data = both[:, 0], both[:, 1]
        _refuse_fused_steps_on(g, u)
        self.tied = True
        return self

    def untie_gate_up(self) -> LlamaMLP:
        """gate_proj.weight and up_proj.weight as two contiguous tensors again (same Parameter objects and
        values), e.g. before saving with safetensors or save_pretrained."""
        g, u = self.gate_proj.weight, self.up_proj.weight
        if _tied(g, u):
            g.data, u.data = g.detach().contiguous(), u.detach().contiguous()
        self.tied = False
        return self

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to() makes each strided weight contiguous on its own
        return self.tie_gate_up() if self.tied else self

    def __setstate__(self, state):  # copy.deepcopy and unpickling: the two weights' copies tied again
        super().__setstate__(state)
        if self.tied:
            self.tie_gate_up()

    def forward(self, h, norm: RMSNorm, eps: float, backend: str, hg=None, rstd=None):
        """The residual stream h [M, D] and its RMSNorm -> (h + mlp(norm(h)), rstd of that with `eps`, for the
        next layer's norm). hg = h * norm.weight and rstd = rstd(h), when given, are taken as made (the
        o-proj's epilogue makes them), else made here."""
        if hg is None or rstd is None:
            with torch.no_grad():
                hg, rstd = input_norm(h, norm.weight, norm.variance_epsilon)
        w_gate, w_up, w_down = self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        inputs = (h, norm.weight, hg, rstd, w_gate, w_up, w_down)
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
            # nothing to differentiate: y alone, without the [M, 2F] accumulator (the GEMM's largest store)
            # that only the backward reads
            o = _mlp_gemms(h, hg, rstd, w_gate, w_up, w_down, eps, backend, rms_swiglu)[1]
            return o["D"], o["rstd"]
        return _Mlp.apply(h, norm.weight, hg, rstd, w_gate, w_up, w_down, eps, backend, self.keep_y)


def _copy_state(src: nn.Module, dst: nn.Module) -> None:
    """What a layer carries beside its weights, from one of HF's and coda_dsl's layers to the other (same
    parameter and norm names): train or eval mode, requires_grad, the norms' eps."""
    dst.train(src.training)
    wanted = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        p.requires_grad_(wanted[name].requires_grad)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        getattr(dst, norm).variance_epsilon = getattr(src, norm).variance_epsilon


def _refuse_fused_steps_on(*params: nn.Parameter) -> None:
    """From now on an optimizer step with fused=True over one of these parameters while it is tied (strided)
    on the CPU raises: torch's CPU fused kernels ignore strides and would write across the two halves (its
    CUDA ones refuse strided parameters themselves)."""
    _guard_fused_steps()
    for p in params:
        p._coda_dsl_tied = True


@functools.cache
def _guard_fused_steps() -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    register_optimizer_step_pre_hook(_refuse_fused_step)


def _refuse_fused_step(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        if group.get("fused") and any(getattr(p, "_coda_dsl_tied", False) and p.device.type == "cpu"
                                      and not p.is_contiguous() for p in group["params"]):
            raise UnsupportedError(f"coda_dsl.nn: {type(optimizer).__name__}(fused=True) over tied gate/up weights "
                                   "(LlamaMLP.tie_gate_up): torch's fused CPU kernels ignore their strides and would "
                                   "corrupt them\n  fix: fused=False (foreach is exact), or mlp.untie_gate_up() first")


def _tied(w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
    """Are the two [F, D] weights the halves of one interleaved [F, 2, D] buffer (LlamaMLP.tie_gate_up)?
    Never under torch.compile, where storages cannot be compared."""
    d = w_gate.shape[-1]
    return (not torch.compiler.is_compiling() and w_up.shape == w_gate.shape
            and w_gate.stride() == w_up.stride() == (2 * d, 1) and w_up.storage_offset() == w_gate.storage_offset() + d
            and w_up.untyped_storage().data_ptr() == w_gate.untyped_storage().data_ptr())


def gate_up_weight(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """The [2F, D] interleaved gate/up weight: a view of tied weights, else a copy (interleave_gate_up)."""
    if _tied(w_gate, w_up):
        return w_gate.detach().as_strided((2 * w_gate.shape[0], w_gate.shape[1]), (w_gate.shape[1], 1))
    return interleave_gate_up(w_gate, w_up)


class LlamaDecoderLayer(nn.Module):
    """Drop-in for transformers' LlamaDecoderLayer in training (same state dict); see the module docstring.

    backend: cd.gemm's backend for the four forward GEMMs ("auto", "cutlass" or "reference")."""

    def __init__(self, config, layer_idx: int = 0, backend: str = "auto", dtype=None, device=None):
        super().__init__()
        checks.backend(layer_name(self), backend)
        self.config, self.layer_idx, self.backend = config, layer_idx, backend
        self.hidden_size = config.hidden_size
        eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_idx, dtype=dtype, device=device)
        self.mlp = LlamaMLP(config, dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)

    @classmethod
    def from_hf(cls, hf_layer, backend: str = "auto") -> "LlamaDecoderLayer":
        """A copy of a transformers LlamaDecoderLayer: its config, dtype, device, weights, norms' eps, train or
        eval mode and which parameters require grad."""
        w = hf_layer.self_attn.q_proj.weight
        layer = cls(hf_layer.self_attn.config, getattr(hf_layer.self_attn, "layer_idx", 0), backend,
                    dtype=w.dtype, device=w.device)
        layer.load_hf_state_dict(hf_layer.state_dict())
        _copy_state(hf_layer, layer)
        return layer

    def load_hf_state_dict(self, state_dict, strict: bool = True):
        """Load a transformers LlamaDecoderLayer's state dict (the names are the same; older transformers'
        rotary_emb.inv_freq buffer is skipped: the layer makes its own). Checked whole before anything is
        copied: a missing or unexpected key (with strict) or a wrong shape leaves the layer as it was."""
        return self.load_state_dict(self._checked_hf_state_dict(state_dict, strict)[0], strict=strict)

    def _checked_hf_state_dict(self, state_dict, strict: bool) -> tuple[dict, list[str], list[str]]:
        """load_hf_state_dict's checks: (the state dict without the skipped buffer, missing keys, unexpected
        keys), or an OperandError."""
        sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        own = self.state_dict()
        missing, unexpected = sorted(own.keys() - sd.keys()), sorted(sd.keys() - own.keys())
        where = f"{layer_name(self)}.load_hf_state_dict"
        if strict and (missing or unexpected):
            prefixes = sorted({k[: -len(o)] for k in unexpected for o in own if k.endswith("." + o)})
            p = prefixes[0] if prefixes and not sd.keys() & own.keys() else None
            if p is None:
                hint = ""
            elif len(prefixes) == 1:
                hint = f"\n  fix: strip the model's prefix {p!r}: {{k.removeprefix({p!r}): v for k, v in sd.items()}}"
            else:  # a whole model's
                hint = (f"\n  fix: this holds {len(prefixes)} layers' weights: take one's, "
                        f"{{k.removeprefix(p): v for k, v in sd.items() if k.startswith(p)}} with p = {p!r}")
            shown = unexpected[:8] + [f"... {len(unexpected) - 8} more"] * (len(unexpected) > 8)
            raise OperandError(f"{where}: missing keys {missing}, unexpected keys {shown}; nothing loaded{hint}")
        wrong = [f"{k}: {list(sd[k].shape)} for {list(own[k].shape)}" for k in sorted(sd.keys() & own.keys())
                 if sd[k].shape != own[k].shape]
        if wrong:
            raise OperandError(f"{where}: shapes differ from this layer's config ({'; '.join(wrong)}); nothing loaded")
        return sd, missing, unexpected

    def to_hf(self):
        """A transformers LlamaDecoderLayer with these weights, made from this layer's config (the same
        object, attention implementation included); a tensor-parallel layer's (DTensor) weights are
        gathered whole."""
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer as HFLayer
        w = self.self_attn.q_proj.weight
        hf = HFLayer(self.config, self.layer_idx).to(dtype=w.dtype, device=w.device)
        hf.load_state_dict({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in self.state_dict().items()})
        _copy_state(self, hf)
        return hf

    def prebuild(self, tokens: int) -> int:
        """Build every kernel a training step of this layer, and a forward under no_grad, launch on `tokens`
        rows, in one parallel ninja run, or find them in the cache (cd.prebuild of a forward and a forward
        and backward on random data, whose GEMMs run on the reference backend meanwhile); else the first
        calls build them one after another. Returns the number of kernels."""
        p = self.self_attn.q_proj.weight
        if self.backend == "reference" or (self.backend == "auto" and not checks.cutlass_runs_on(p.device)):
            return 0  # every GEMM runs on the reference backend: no kernel to build
        x = torch.randn(1, tokens, self.hidden_size, device=p.device, dtype=p.dtype, requires_grad=True)
        wrt = [x, *(q for q in self.parameters() if q.requires_grad)]

        def step():  # gradients returned, not accumulated into .grad; also when called under no_grad
            with torch.no_grad():  # a forward alone runs the MLP's y-only kernel
                self(x)
            with torch.enable_grad():
                out, rstd = self(x, return_rstd=True)
                torch.autograd.grad((out, rstd), wrt, (torch.randn_like(out), torch.randn_like(rstd)))
        return cd.prebuild(step)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                use_cache: bool = False, position_embeddings=None, *, input_rstd: torch.Tensor | None = None,
                return_rstd: bool = False, **kwargs):
        """hidden_states [B, S, D] -> [B, S, D]. position_ids [B, S] or [1, S] (default 0..S-1 per row);
        RoPE is computed from them in the QKV epilogue (position_embeddings, made from them, is not read;
        given without them, it is refused).
        input_rstd [B, S] (fp32): rsqrt(mean(x^2) + eps) of the input, as a previous layer returns it with
        return_rstd=True; computed here when None. return_rstd: also return this output's rstd."""
        _check_training_call(layer_name(self), self.config, attention_mask, cache, use_cache, position_ids,
                             position_embeddings, kwargs)
        step = functools.partial(self._step, position_ids=position_ids, return_rstd=return_rstd)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(step, hidden_states, input_rstd)  # (tensors positional)
        return step(hidden_states, input_rstd)

    # transformers' gradient_checkpointing_enable() sets this, and _gradient_checkpointing_func, on each module
    # that has the attribute: the layer then checkpoints its step, as transformers' own layers do
    gradient_checkpointing = False

    def _step(self, x: torch.Tensor, input_rstd: torch.Tensor | None, position_ids, return_rstd: bool):
        """The layer on checked arguments (forward's)."""
        _check_weights(self)
        xf, pos, rstd = flat_inputs(layer_name(self), x, position_ids, input_rstd, self.hidden_size,
                                    self.self_attn.q_proj.weight.dtype)
        b, s, d = x.shape
        # float() here: under torch.compile(dynamic=True) Dynamo makes the float a graph input, which must enter
        # the graph out here; met first inside an autograd.Function below, it cannot reach the next one
        eps = float(self.input_layernorm.variance_epsilon)
        # gamma1 on the activation side: the previous layer's epilogue does not know this layer's gamma
        attn, xf = self.self_attn(xf, self.input_layernorm, rstd, pos, b, self.backend)
        h, hg, rstd2 = _RmsProducerLinear.apply(attn, self.self_attn.o_proj.weight, xf,
                                                self.post_attention_layernorm.weight,
                                                self.post_attention_layernorm.variance_epsilon, self.backend)
        out, rstd_out = self.mlp(h, self.post_attention_layernorm, eps, self.backend, hg, rstd2)
        out = out.view(b, s, d)
        return (out, rstd_out.view(b, s)) if return_rstd else out
