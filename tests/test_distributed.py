"""coda_dsl.parallel on CPU: 2 processes (torch.multiprocessing spawn), gloo, the reference backend, each
against the same computation in one process: FSDP2 (with activation checkpointing) on a 2-layer stack,
the tensor-parallel decoder layer, and the vocabulary-parallel cross-entropy. Every check runs inside
the ranks (an assertion there fails the test with the rank's traceback); a hang fails after a timeout."""
from __future__ import annotations

import copy
import datetime
import os
import sys
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402  (the config only: the ranks need not import HF's model code)

import coda_dsl as cd  # noqa: E402
from coda_dsl import nn as cdnn  # noqa: E402
from epilogues import rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch built without torch.distributed / gloo")
WORLD = 2


def llama_config(**kw) -> LlamaConfig:
    """tests/test_nn.py's small config (not imported from there: HF's modeling code would add seconds per rank)."""
    args = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 96, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
    return LlamaConfig(**{**args, **kw})


def random_layer(config, seed: int = 0, layer_idx: int = 0, backend: str = "reference") -> cdnn.LlamaDecoderLayer:
    """Random weights and non-trivial norm gammas (ones would hide gamma mistakes), as test_nn's HF layers."""
    torch.manual_seed(seed)
    layer = cdnn.LlamaDecoderLayer(config, layer_idx, backend=backend)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return layer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, fn, port, backend, device_type, timeout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=timeout))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        torch.set_num_threads(1)  # 2 ranks on a 2-core CI machine
        fn(rank, init_device_mesh(device_type, (WORLD,)))
        dist.barrier()  # neither rank tears gloo down while the other still talks to it (an abort at exit)
    finally:
        dist.destroy_process_group()
    # done and checked: leave without the interpreter's teardown, where a thread of torch's still joinable at
    # exit aborted a rank now and then ("terminate called without an active exception", SIGABRT in CI)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def spawn(fn, timeout: float = 120, backend: str = "gloo", device_type: str = "cpu"):
    """Run fn(rank, mesh) in WORLD fresh processes; a rank's exception fails the test with its traceback,
    and ranks still running after `timeout` seconds are killed and the test fails (no CI hang)."""
    ctx = mp.start_processes(_rank_main, args=(fn, _free_port(), backend, device_type, timeout), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"distributed ranks still running after {timeout} s (a hang in a collective?)")


def assert_close(a, b, what, tol=1e-5):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert rel_err(a, b) < tol, (what, rel_err(a, b))


def _strip(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


# ---------------------------------------------------------------- FSDP2


class Stack(torch.nn.Module):
    """Decoder layers (each layer hands its output's rstd to the next) and an LM head with the fused
    cross-entropy; forward returns the summed token loss."""

    def __init__(self, config, n_layers: int, vocab: int, backend: str = "reference"):
        super().__init__()
        self.backend = backend
        self.layers = torch.nn.ModuleList(random_layer(config, i, i, backend) for i in range(n_layers))
        torch.manual_seed(10)
        self.lm_head = torch.nn.Linear(config.hidden_size, vocab, bias=False)

    def forward(self, x, position_ids, target):
        h, rstd = x, None
        for layer in self.layers:
            h, rstd = layer(h, position_ids=position_ids, input_rstd=rstd, return_rstd=True)
        return cd.linear_cross_entropy(h.flatten(0, 1), self.lm_head.weight, target.flatten(), reduction="sum",
                                       backend=self.backend)


def _batch(lengths, d, vocab):
    """One sequence per rank, of different lengths (a ragged token count per rank)."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(1, n, d, generator=g), torch.arange(n)[None], torch.randint(0, vocab, (1, n), generator=g))
            for n in lengths]


def _fsdp_rank(rank, mesh):
    from torch.distributed.fsdp import FSDPModule

    from coda_dsl.parallel import fully_shard_stack
    config, vocab, lengths = llama_config(), 40, (9, 5)
    model = Stack(config, 2, vocab)
    ref = copy.deepcopy(model)
    batch = _batch(lengths, config.hidden_size, vocab)
    total = sum(lengths)

    # one process, the whole global batch: the mean token loss over both sequences
    ref_loss = sum(ref(*seq) for seq in batch) / total
    ref_loss.backward()

    tied = copy.deepcopy(model)  # gate and up stored interleaved: views FSDP2 cannot shard, said before any wrap
    tied.layers[1].mlp.tie_gate_up()
    with pytest.raises(cd.UnsupportedError, match="layer 1's parameter 'mlp.gate_proj.weight' is not contiguous"):
        fully_shard_stack(tied, tied.layers, mesh, checkpoint=True)
    assert all(type(m) is cdnn.LlamaDecoderLayer for m in tied.layers) and not isinstance(tied, FSDPModule)
    sliced = copy.deepcopy(model)  # a copy of the list: the wrappers went into it, and the root's wrap failed
    with pytest.raises(cd.OperandError, match="layers must be the ModuleList inside root"):
        fully_shard_stack(sliced, sliced.layers[1:], mesh, checkpoint=True)
    assert all(type(m) is cdnn.LlamaDecoderLayer for m in sliced.layers) and not isinstance(sliced, FSDPModule)

    fully_shard_stack(model, model.layers, mesh, checkpoint=True)
    assert isinstance(model.layers[0], FSDPModule) and isinstance(model, FSDPModule)
    w = model.layers[0].self_attn.q_proj.weight
    assert w.placements[0].is_shard(0) and w.to_local().shape[0] == w.shape[0] // WORLD
    calls = []  # checkpointing recomputes each layer's forward in the backward
    model.layers[0]._checkpoint_wrapped_module.register_forward_pre_hook(lambda *_: calls.append(1))
    part = model(*batch[rank]) / total
    # FSDP averages the ranks' gradients: scale by the world size so they sum to the global batch's
    (part * WORLD).backward()
    assert len(calls) == 2
    loss = part.detach().clone()
    dist.all_reduce(loss)
    assert_close(loss, ref_loss.detach(), "loss")
    ref_params = dict(ref.named_parameters())
    names = [_strip(n) for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(ref_params) and len(names) == 19
    for n, p in model.named_parameters():
        assert_close(p.grad.full_tensor(), ref_params[_strip(n)].grad, _strip(n), tol=1e-4)

    # an optimizer step on the sharded parameters, then the next loss: still the one-process run's
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        opt.step()
    with torch.no_grad():
        nxt = model(*batch[rank]) / total
        dist.all_reduce(nxt)
        assert_close(nxt, sum(ref(*seq) for seq in batch) / total, "loss after a step", tol=1e-4)
    full = model.state_dict()  # HF names (checkpoint_wrapper's prefix removed), sharded values
    assert {_strip(k) for k in full} == set(ref.state_dict())

    # the CUDA policy (bf16 parameters, fp32 reduction; the fp32 rstd passed between layers stays fp32)
    # also runs on CPU: the loss and gradients within bf16 error of the fp32 one-process run
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mixed = copy.deepcopy(ref)
    fully_shard_stack(mixed, mixed.layers, mesh, checkpoint=False,
                      mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32, cast_forward_inputs=False))
    ref.zero_grad()
    ref_loss = sum(ref(*seq) for seq in batch) / total
    ref_loss.backward()
    part = mixed(*batch[rank]) / total
    (part * WORLD).backward()
    loss = part.detach().clone()
    dist.all_reduce(loss)
    assert_close(loss, ref_loss.detach(), "bf16 loss", tol=2e-2)
    for n, p in mixed.named_parameters():
        assert p.grad.dtype == torch.float32  # FSDP keeps fp32 sharded gradients
        assert_close(p.grad.full_tensor(), ref_params[n].grad, f"bf16 {n}", tol=5e-2)


def test_fsdp2_stack_matches_one_process():
    """2 ranks with 9 and 5 tokens: the loss, every gathered parameter gradient and the loss after an SGD
    step equal one process running both sequences (fp32 on CPU: mixed precision is for CUDA)."""
    spawn(_fsdp_rank)


# ---------------------------------------------------------------- tensor parallelism


def _tp_rank(rank, mesh):
    from torch.distributed.tensor import DTensor

    from coda_dsl.parallel import TPLlamaDecoderLayer, tensor_parallel
    config = llama_config()  # 4 q heads, 2 kv heads, intermediate 96: 2 / 1 / 48 per rank
    layer = random_layer(config)
    ref = copy.deepcopy(layer)
    torch.manual_seed(5)  # the same input on both ranks (replicated)
    x = torch.randn(2, 11, config.hidden_size)
    pid = torch.cat((torch.arange(6), torch.arange(5)))[None]  # packed: positions restart
    rstd_in = cdnn.input_rms(x.flatten(0, 1), config.rms_norm_eps).view(2, 11)
    dy, dr = torch.randn_like(x), torch.randn(2, 11)

    def run(m, dtype=torch.float32):
        xi = x.to(dtype, copy=True).requires_grad_()
        ri = rstd_in.to(torch.promote_types(dtype, torch.float32), copy=True).requires_grad_()  # fp64 for fp64
        y, r = m(xi, position_ids=pid, input_rstd=ri, return_rstd=True)
        (y.float() * dy).sum().add((r * dr).sum()).backward()  # the output and its rstd both carry gradient
        return y.detach(), r.detach(), xi.grad, ri.grad

    expect = run(ref)
    tp = tensor_parallel(layer, mesh)
    assert isinstance(tp, TPLlamaDecoderLayer)
    q, o, gate = tp.self_attn.q_proj.weight, tp.self_attn.o_proj.weight, tp.mlp.gate_proj.weight
    assert isinstance(q, DTensor) and q.to_local().shape == (32, 64) and o.to_local().shape == (64, 32)
    assert gate.to_local().shape == (48, 64)
    got = run(tp)
    for a, b, what in zip(got, expect, ("out", "rstd", "dx", "d input_rstd")):
        assert_close(a, b, what)
    ref_params = dict(ref.named_parameters())
    assert sorted(n for n, _ in tp.named_parameters()) == sorted(ref_params)
    for n, p in tp.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), n
        assert_close(p.grad.full_tensor(), ref_params[n].grad, n, tol=1e-4)

    # optimizer steps and state dicts work on the DTensor parameters
    for m in (tp, ref):
        torch.optim.AdamW(m.parameters(), lr=1e-2).step()
    sd = tp.state_dict()
    assert set(sd) == set(ref.state_dict())
    for n, t in ref.state_dict().items():
        assert_close(sd[n].full_tensor(), t, n)
    for n, t in tp.to_hf().state_dict().items():  # gathered whole, under HF's names
        assert_close(t, ref.state_dict()[n], f"to_hf {n}")

    # bf16: the tensor-parallel layer's error against fp32 is within twice the unsharded bf16 layer's
    l32 = random_layer(config)
    bf16 = torch.bfloat16
    runs = [run(l32), run(copy.deepcopy(l32).to(bf16), bf16),
            run(tensor_parallel(copy.deepcopy(l32).to(bf16), mesh), bf16)]
    for i, what in enumerate(("out", "rstd", "dx", "d input_rstd")):
        single, sharded = rel_err(runs[1][i], runs[0][i]), rel_err(runs[2][i], runs[0][i])
        assert sharded < 2 * single + 2e-3, (what, sharded, single)

    # a whole (HF) state dict loads into the sharded layer: each rank keeps its shards; checked as the unsharded
    # layer's (an old checkpoint's inv_freq skipped, nothing copied unless every shape fits, missing keys said)
    fresh = tensor_parallel(random_layer(config), mesh)
    before = {n: p.full_tensor().clone() for n, p in fresh.named_parameters()}
    bad = {**ref.state_dict(), "mlp.down_proj.weight": torch.zeros(64, 80)}
    with pytest.raises(cd.OperandError, match="nothing loaded"):
        fresh.load_hf_state_dict(bad)
    for n, p in fresh.named_parameters():
        assert torch.equal(p.full_tensor(), before[n]), n
    partial = {k: v for k, v in ref.state_dict().items() if k != "self_attn.q_proj.weight"}
    assert fresh.load_hf_state_dict(partial, strict=False).missing_keys == ["self_attn.q_proj.weight"]
    fresh.load_hf_state_dict({**ref.state_dict(), "self_attn.rotary_emb.inv_freq": torch.ones(8)})
    for n, p in fresh.named_parameters():
        assert_close(p.full_tensor(), ref.state_dict()[n], f"loaded {n}")

    # frozen norms stay frozen; an fp64 layer computes (and hands the next layer its rstd) in fp64
    frozen = random_layer(config).requires_grad_(False)
    assert not any(p.requires_grad for p in tensor_parallel(frozen, mesh).parameters())
    l64 = random_layer(config).double()
    want64 = run(copy.deepcopy(l64), torch.float64)
    got64 = run(tensor_parallel(l64, mesh), torch.float64)
    assert got64[1].dtype == torch.float64
    for a, b, what in zip(got64, want64, ("out", "rstd", "dx", "d input_rstd")):
        assert rel_err(a, b) < 1e-12, what
    # attention dropout would draw one mask for every rank's heads: refused in training
    dropped = tensor_parallel(random_layer(llama_config(attention_dropout=0.1)), mesh).train()
    with pytest.raises(cd.UnsupportedError, match="same masks for every rank's heads"):
        dropped(x)
    dropped.eval()(x)  # no dropout outside training

    with pytest.raises(cd.UnsupportedError, match="num_key_value_heads = 1 does not split evenly"):
        tensor_parallel(cdnn.LlamaDecoderLayer(llama_config(num_key_value_heads=1)), mesh)
    with pytest.raises(cd.UnsupportedError, match="expected a coda_dsl.nn.LlamaDecoderLayer"):
        tensor_parallel(tp, mesh)


def test_tensor_parallel_layer_matches_unsharded():
    """Output, its rstd, the input and input-rstd gradients and every (gathered) parameter gradient equal
    the unsharded layer's; after an AdamW step the gathered state dict still does."""
    spawn(_tp_rank)


def _vocab_ce_rank(rank, mesh):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from coda_dsl.parallel import vocab_parallel_cross_entropy
    m, d, v = 37, 24, 51  # 51 rows: 26 on rank 0, 25 on rank 1
    g = torch.Generator().manual_seed(7)
    x0, w0 = torch.randn(m, d, generator=g), torch.randn(v, d, generator=g) * 0.5
    target = torch.randint(0, v, (m,), generator=g)
    target[::5] = -100  # ignored rows
    for reduction, smoothing in (("mean", 0.0), ("sum", 0.1), ("none", 0.0)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        ref = cd.linear_cross_entropy(x, w, target, reduction=reduction, label_smoothing=smoothing,
                                      backend="reference")
        dloss = torch.randn(ref.shape, generator=g)
        (ref * dloss).sum().backward()
        xs = x0.clone().requires_grad_()
        ws = torch.nn.Parameter(distribute_tensor(w0.clone(), mesh, [Shard(0)]))
        assert ws.to_local().shape[0] == (26, 25)[rank]
        loss = vocab_parallel_cross_entropy(xs, ws, target, reduction=reduction, label_smoothing=smoothing,
                                            backend="reference")
        (loss * dloss).sum().backward()
        case = f"{reduction}, smoothing {smoothing}"
        assert_close(loss.detach(), ref.detach(), f"loss ({case})")
        assert_close(xs.grad, x.grad, f"grad_x ({case})")
        assert_close(ws.grad.full_tensor(), w.grad, f"grad_W ({case})")
    with pytest.raises(cd.UnsupportedError, match="must be a DTensor sharded by rows"):
        vocab_parallel_cross_entropy(x0, w0, target)
    # shards that are not torch.chunk's split (26 and 25 rows): the rows' offsets would be wrong
    uneven = DTensor.from_local(w0[:25] if rank == 0 else w0[25:], mesh, [Shard(0)], shape=w0.shape,
                                stride=w0.stride())
    with pytest.raises(cd.UnsupportedError, match="torch.chunk's split of 51 over 2 ranks gives it"):
        vocab_parallel_cross_entropy(x0, uneven, target, backend="reference")
    # a one-row head: rank 1 holds none of it (it deadlocked the backward's all-reduce)
    x, w1 = x0.clone().requires_grad_(), w0[:1].clone().requires_grad_()
    t1 = torch.zeros(m, dtype=torch.long)
    cd.linear_cross_entropy(x, w1, t1, backend="reference").backward()
    xs = x0.clone().requires_grad_()
    ws = torch.nn.Parameter(distribute_tensor(w0[:1].clone(), mesh, [Shard(0)]))
    vocab_parallel_cross_entropy(xs, ws, t1, backend="reference").backward()
    assert_close(xs.grad, x.grad, "grad_x (a rank without rows)")
    assert_close(ws.grad.full_tensor(), w1.grad, "grad_W (a rank without rows)")


def test_vocab_parallel_cross_entropy_matches_linear_cross_entropy():
    """An uneven vocabulary split (51 rows over 2 ranks), ignored rows, label smoothing, three reductions:
    the loss, grad_x and the gathered grad_W equal the one-process linear_cross_entropy."""
    spawn(_vocab_ce_rank)
