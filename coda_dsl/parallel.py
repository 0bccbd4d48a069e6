"""coda_dsl.nn layers in PyTorch's own distributed engines: FSDP2, tensor parallelism, a vocab-parallel LM head.

Everything here takes a torch DeviceMesh and works on any device type the mesh has (CPU + gloo with the
reference backend in the test suite; CUDA + NCCL with the cutlass backend on GPUs).

- **FSDP2** (`fully_shard_stack`): `torch.distributed.fsdp.fully_shard` on each decoder layer and on the
  root, optionally with activation checkpointing (checkpoint_wrapper, non-reentrant) under it. FSDP2
  all-gathers a layer's parameters before its forward, so the fused GEMMs see whole weights; gradients are
  reduce-scattered. `mixed_precision_policy(device_type)`: bf16 parameters with fp32 gradient reduction on
  CUDA; on CPU fp32 throughout (None), since the CPU runs are exactness tests against one process.
- **Tensor parallelism** (`tensor_parallel(layer, mesh)`): shards one `coda_dsl.nn.LlamaDecoderLayer`
  over a 1-D mesh in place (Megatron-style, parameters become DTensors with the same HF names, so
  optimizers and state dicts work; `full_tensor()` gives HF's layout). QKV and gate/up are
  column-parallel and keep their fused epilogues (rstd + RoPE, rstd + SwiGLU) since those are
  row-local: each rank holds whole q and kv heads, and the same rows of gate_proj and up_proj, which it
  interleaves locally. o_proj and down_proj are row-parallel: their partial sums are all-reduced (in
  fp32) BEFORE the residual add and the next RMSNorm's statistics, which therefore run in torch on this
  path (the single-GPU layer fuses them into the GEMM epilogue, where the sum is whole).
- **Vocabulary-parallel cross-entropy** (`vocab_parallel_cross_entropy`): each rank holds rows of the LM
  head, computes its shard's (lse, target logit) partials with `library.cross_entropy.vocab_shard_stats` (no logits
  stored), and the partials are combined by all-reduces (max, then sum of exp); the backward recomputes
  the shard's logits per chunk with the `ce_backward` epilogue and all-reduces grad_x.

GPU check (2 sm_90 GPUs, NCCL, cutlass backend):
    torchrun --nproc-per-node 2 -m pytest tests/test_gpu_distributed.py -q -x -p no:cacheprovider
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import coda_dsl as cd
from .errors import OperandError, UnsupportedError
from .ir.ops import math_dtype
from .library import interleave_gate_up
from .library.cross_entropy import (check_args, combine_vocab_shards, default_chunk_rows, recomputed_grads,
                                    vocab_shard_stats)
from .nn import (PROJECTIONS, LlamaDecoderLayer, causal_attention, flat_inputs, input_norm, input_rms, layer_name,
                 qkv_inv_freq, qkv_weight, rms_rope, rms_swiglu, rope_inv_freq, split_qkv)


# ---------------------------------------------------------------- FSDP2

def mixed_precision_policy(device_type: str):
    """bf16 parameters, fp32 gradient reduction on CUDA; None (fp32 throughout) elsewhere. Layer inputs are
    not cast (cast_forward_inputs=False), so the fp32 rstd a layer hands the next one stays fp32; the
    root's policy casts the stack's input."""
    if device_type != "cuda":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def fully_shard_stack(root: torch.nn.Module, layers: torch.nn.ModuleList, mesh: DeviceMesh,
                      checkpoint: bool = True, mp_policy="auto") -> torch.nn.Module:
    """FSDP2 on every module of `layers` (a ModuleList inside root), then on root. checkpoint: activation
    checkpointing of each layer (recomputed in the backward, parameters re-gathered by FSDP).
    mp_policy: a MixedPrecisionPolicy, None, or "auto" (mixed_precision_policy of the mesh's device)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if not isinstance(layers, torch.nn.ModuleList) or not any(m is layers for m in root.modules()):
        raise OperandError("coda_dsl.parallel.fully_shard_stack: layers must be the ModuleList inside root (e.g. "
                           f"model.layers), not a {type(layers).__name__} apart from it: checkpointing puts its "
                           "wrappers in the list's places (a slice or a list is a copy, and root would keep the "
                           "unwrapped layers); nothing was wrapped\n  fix: pass model.layers")
    for i, layer in enumerate(layers):  # before anything is wrapped: FSDP2 would fail halfway through the stack
        if strided := [n for n, p in layer.named_parameters() if not p.is_contiguous()]:
            raise UnsupportedError(f"coda_dsl.parallel.fully_shard_stack: layer {i}'s parameter '{strided[0]}' is not "
                                   "contiguous (a view into memory it shares), which FSDP2 cannot shard; nothing was "
                                   "wrapped\n  fix: untie it first (coda_dsl.nn layers: layer.mlp.untie_gate_up())")
    if mp_policy == "auto":
        mp_policy = mixed_precision_policy(mesh.device_type)
    kw = {"mp_policy": mp_policy} if mp_policy is not None else {}
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i in range(len(layers)):
            layers[i] = checkpoint_wrapper(layers[i])  # non-reentrant; state-dict names stay unprefixed
    for layer in layers:
        fully_shard(layer, mesh=mesh, **kw)
    root_kw = {"mp_policy": MixedPrecisionPolicy(mp_policy.param_dtype, mp_policy.reduce_dtype)} if kw else {}
    return fully_shard(root, mesh=mesh, **root_kw)


# ---------------------------------------------------------------- tensor-parallel collectives

class _CopyToTP(torch.autograd.Function):
    """Identity forward (the input is replicated); the backward all-reduces the ranks' partial gradients."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        return xs

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for g in grads:
            if g is not None:
                g = g.contiguous()
                dist.all_reduce(g, group=ctx.group)
            out.append(g)
        return (None, *out)


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) of the row-parallel partials forward; identity backward (the gradient is replicated)."""

    @staticmethod
    def forward(ctx, group, x):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return None, g


@cd.epilogue
def fp32_partial(acc):
    """A row-parallel GEMM's partial sum, kept in fp32 for the all-reduce (no bf16 rounding per rank)."""
    return cd.cast(acc, torch.float32)


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's block of a DTensor parameter (differentiable: the gradient lands in the DTensor)."""
    return p.to_local() if isinstance(p, DTensor) else p


# ---------------------------------------------------------------- tensor-parallel Llama layer

class TPLlamaDecoderLayer(LlamaDecoderLayer):
    """A LlamaDecoderLayer after tensor_parallel(): same parameter names (DTensors), same call signature;
    the input and output hidden states are replicated over the mesh (plain tensors)."""

    tp_mesh: DeviceMesh
    _tp_inv_freq: torch.Tensor

    def _step(self, x: torch.Tensor, input_rstd: torch.Tensor | None, position_ids, return_rstd: bool):
        """LlamaDecoderLayer's step, its GEMMs split over the mesh (forward, checks and checkpointing, as there)."""
        group, backend = self.tp_mesh.get_group(), self.backend
        attn, mlp = self.self_attn, self.mlp
        xf, pos, rstd = flat_inputs(layer_name(self), x, position_ids, input_rstd, self.hidden_size,
                                    attn.q_proj.weight.dtype)
        b, s, d = x.shape
        eps = self.input_layernorm.variance_epsilon
        xg, rstd = _CopyToTP.apply(group, *input_norm(xf, _local(self.input_layernorm.weight), eps, rstd))
        # column-parallel QKV: this rank's whole heads, rstd + RoPE fused in the epilogue
        hd, nh, nkv = attn.head_dim, self._tp_heads, self._tp_kv_heads
        w_qkv = qkv_weight(*(_local(p.weight) for p in (attn.q_proj, attn.k_proj, attn.v_proj)), hd)
        inv_freq = self._tp_inv_freq.to(x.device)
        qkv = cd.linear(xg, w_qkv, rms_rope, rstd=rstd, pos=pos, inv_freq=inv_freq, backend=backend)["D"]
        dropout = attn.attention_dropout if attn.training else 0.0
        if dropout:
            raise UnsupportedError("coda_dsl.parallel: attention dropout in a tensor-parallel layer would draw the "
                                   "same masks for every rank's heads (each rank's generator, seeded alike)\n  fix: "
                                   "attention_dropout=0.0 (Llama's), or the unsharded layer")
        o = causal_attention(*split_qkv(qkv, nh, nkv, hd), b, hd, dropout)
        # row-parallel o_proj: reduce, then the residual add and the post-attention norm's statistics, from
        # the fp32 sum as the fused epilogue (rms_producer) takes them
        h32 = self._row_parallel(o, attn.o_proj.weight, group, xf)
        h, norm2 = h32.to(x.dtype), self.post_attention_layernorm
        rstd2 = input_rms(h32, norm2.variance_epsilon)
        hg, rstd2 = _CopyToTP.apply(group, (h32 * _local(norm2.weight)).to(x.dtype), rstd2)
        # column-parallel gate/up (the same rows of both, interleaved here), rstd + SwiGLU fused
        w_gu = interleave_gate_up(_local(mlp.gate_proj.weight), _local(mlp.up_proj.weight))
        y = cd.linear(hg, w_gu, rms_swiglu, rstd=rstd2, backend=backend)["D"]
        out32 = self._row_parallel(y, mlp.down_proj.weight, group, h)
        out = out32.to(x.dtype).view(b, s, d)
        return (out, input_rms(out32, eps).view(b, s)) if return_rstd else out

    def load_hf_state_dict(self, state_dict, strict: bool = True):
        """A whole (unsharded) transformers layer's state dict, the same on every rank: each rank keeps its
        shards (plain load_state_dict cannot copy whole tensors into DTensors). Checked as the unsharded
        layer's: nothing is copied unless every key and shape fits."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.nn.modules.module import _IncompatibleKeys
        sd, missing, unexpected = self._checked_hf_state_dict(state_dict, strict)
        set_model_state_dict(self, {k: v for k, v in sd.items() if k not in unexpected},
                             options=StateDictOptions(full_state_dict=True, strict=False))
        return _IncompatibleKeys(missing, unexpected)

    def _row_parallel(self, a: torch.Tensor, w: torch.Tensor, group, residual: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a @ w_local^T, plus the residual, in fp32 (fp64 for fp64)."""
        ep = cd.identity if a.dtype == torch.float64 else fp32_partial
        total = _ReduceFromTP.apply(group, cd.linear(a, _local(w), ep, backend=self.backend)["D"])
        return total + residual.to(total.dtype)


def tensor_parallel(layer: LlamaDecoderLayer, mesh: DeviceMesh) -> TPLlamaDecoderLayer:
    """Shard `layer` in place over the 1-D `mesh` (every rank passes a layer with the same weights) and
    return it as a TPLlamaDecoderLayer. Column-parallel q/k/v/gate/up (rows), row-parallel o/down
    (columns), norms replicated; all parameters become DTensors."""
    if type(layer) is not LlamaDecoderLayer:
        raise UnsupportedError(f"coda_dsl.parallel.tensor_parallel: expected a coda_dsl.nn.LlamaDecoderLayer, "
                               f"got {type(layer).__name__} (apply it once, before fully_shard)")
    if mesh.ndim != 1:
        raise UnsupportedError(f"coda_dsl.parallel.tensor_parallel: needs a 1-D mesh, got {mesh.ndim}-D; "
                               "pass the tensor-parallel sub-mesh, e.g. mesh['tp']")
    world = mesh.size()
    attn, cfg = layer.self_attn, layer.config
    for what, n in (("num_attention_heads", attn.num_heads), ("num_key_value_heads", attn.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % world:
            raise UnsupportedError(f"coda_dsl.parallel.tensor_parallel: {what} = {n} does not split evenly over "
                                   f"{world} ranks (each rank must hold whole heads and equal shares); use a "
                                   f"tensor-parallel size that divides it")
    layer.mlp.tied = False  # the tensor-parallel step interleaves its shards of gate and up itself
    col, row = ColwiseParallel(), RowwiseParallel()  # a block's output projection by rows, the others by columns
    parallelize_module(layer, mesh, {f"{block}.{name}": row if name in ("o_proj", "down_proj") else col
                                     for block, name in PROJECTIONS})
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight = torch.nn.Parameter(distribute_tensor(norm.weight.data, mesh, [Replicate()]),
                                         requires_grad=norm.weight.requires_grad)
    layer.__class__ = TPLlamaDecoderLayer
    layer.tp_mesh = mesh
    layer._tp_heads, layer._tp_kv_heads = attn.num_heads // world, attn.num_kv_heads // world
    # this rank's QKV column pairs: its q and k heads rotate, its V pairs get 0 (as LlamaAttention's buffer)
    layer._tp_inv_freq = qkv_inv_freq(rope_inv_freq(cfg), layer._tp_heads, layer._tp_kv_heads)
    return layer


# ---------------------------------------------------------------- vocabulary-parallel cross-entropy

class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, target, vocab_start, vocab_size, group, ignore_index, reduction, smoothing, backend):
        st = vocab_shard_stats(x, w, target, vocab_start, ignore_index, smoothing, None, backend)
        top = st["lse"].clone()
        dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
        # one all-reduce for the sums: exp(lse - max), the target logit (0 off this shard), the logit sum
        sums = [torch.exp(st["lse"] - top), st["z_target"]] + ([st["z_sum"]] if smoothing else [])
        sums = torch.stack(sums)
        dist.all_reduce(sums, group=group)
        total = {"lse": top + torch.log(sums[0]), "z_target": sums[1]}
        if smoothing:
            total["z_sum"] = sums[2]
        ctx.save_for_backward(x, w, target, total["lse"])
        ctx.cfg = (vocab_start, vocab_size, group, ignore_index, reduction, smoothing, backend)
        return combine_vocab_shards([total], target, vocab_size, ignore_index, smoothing, reduction)

    @staticmethod
    @cd.first_order("coda_dsl.parallel.vocab_parallel_cross_entropy")
    def backward(ctx, grad):
        x, w, target, lse = ctx.saved_tensors
        vocab_start, vocab_size, group, ignore_index, reduction, smoothing, backend = ctx.cfg
        m, v = x.shape[0], w.shape[0]
        valid = target != ignore_index
        scale = grad.to(math_dtype(x.dtype))
        scale = scale if reduction == "none" else scale.expand(m)
        if reduction == "mean":
            scale = scale / valid.sum().clamp_min(1)
        scale = torch.where(valid, scale, torch.zeros_like(scale))
        local = target - vocab_start
        local = torch.where(valid & (local >= 0) & (local < v), local, -1)  # -1: the target is on another shard
        # this shard's part of grad_x (all-reduced below) and its rows of grad_W
        grad_x, grad_w = recomputed_grads(x, w, lse, scale, local, smoothing / vocab_size, 1.0 - smoothing, None,
                                          backend, None, default_chunk_rows(m, max(v, 1), x.device, x.dtype),
                                          need_w=ctx.needs_input_grad[1])
        dist.all_reduce(grad_x, group=group)
        return grad_x, grad_w, *[None] * 8


def vocab_parallel_cross_entropy(x: torch.Tensor, lm_head_weight: DTensor, target: torch.Tensor,
                                 ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                                 backend: str = "auto") -> torch.Tensor:
    """linear_cross_entropy(x, W, target) with W [V, d] a DTensor sharded by rows (Shard(0), torch.chunk
    split) over a 1-D mesh; x [M, d] and target [M] replicated over it. Returns the same (replicated)
    loss; grad_x is whole on every rank, W's gradient is a Shard(0) DTensor. No softcap yet. A shard of any
    row count runs on the cutlass backend (its last rows % 8 columns in fp32, as linear_cross_entropy's)."""
    if not isinstance(lm_head_weight, DTensor) or lm_head_weight.device_mesh.ndim != 1 \
            or lm_head_weight.placements[0] != torch.distributed.tensor.Shard(0):
        raise UnsupportedError("coda_dsl.parallel.vocab_parallel_cross_entropy: lm_head_weight must be a DTensor "
                               "sharded by rows over a 1-D mesh: distribute_tensor(w, mesh, [Shard(0)]) or "
                               "ColwiseParallel on the LM head")
    if isinstance(x, DTensor) or isinstance(target, DTensor):
        raise UnsupportedError("coda_dsl.parallel.vocab_parallel_cross_entropy: x and target are plain tensors, "
                               "the same on every rank (x.to_local() of a replicated DTensor, or use_local_output="
                               "True on the layer that makes it)")
    mesh = lm_head_weight.device_mesh
    vocab_size = lm_head_weight.shape[0]
    w = lm_head_weight.to_local()
    check_args(x, w, target, reduction, label_smoothing, ignore_index)
    per_rank = -(-vocab_size // mesh.size())  # torch.chunk's split, which the rows' offsets assume
    vocab_start = min(mesh.get_local_rank() * per_rank, vocab_size)
    if w.shape[0] != min(per_rank, vocab_size - vocab_start):
        raise UnsupportedError(f"coda_dsl.parallel.vocab_parallel_cross_entropy: this rank holds {w.shape[0]} "
                               f"vocabulary rows, torch.chunk's split of {vocab_size} over {mesh.size()} ranks gives "
                               f"it {min(per_rank, vocab_size - vocab_start)}: shard with distribute_tensor(w, mesh, "
                               "[Shard(0)]) (uneven DTensor.from_local shards are not supported)")
    return _VocabParallelCE.apply(x, w, target, vocab_start, vocab_size, mesh.get_group(), ignore_index, reduction,
                                  float(label_smoothing), backend)
