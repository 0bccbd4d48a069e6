"""coda_dsl.parallel on 2 Hopper GPUs: NCCL, the cutlass backend, bf16. Skipped without 2 sm_90 GPUs.

    torchrun --nproc-per-node 2 -m pytest tests/test_gpu_distributed.py -q -x -p no:cacheprovider

(each rank runs the tests; plain `pytest tests/test_gpu_distributed.py` spawns the 2 ranks itself).
The same bodies as tests/test_distributed.py's CPU checks, at GPU sizes (every N and K a multiple of 8),
compared in bf16 with the errors of one GPU: the sharded run's error against an fp32 reference-backend
run on one GPU is within twice the unsharded cutlass bf16 run's (plus 2e-3). The first run builds the
kernels (both ranks share the cache, under its file locks)."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
from test_distributed import WORLD, Stack, _batch, llama_config, random_layer, spawn  # noqa: E402

import coda_dsl as cd  # noqa: E402
from epilogues import rel_err  # noqa: E402

HOPPERS = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD and all(
    torch.cuda.get_device_capability(i) == (9, 0) for i in range(WORLD))
pytestmark = pytest.mark.skipif(not HOPPERS or not dist.is_nccl_available(),
                                reason=f"needs {WORLD} sm_90 (Hopper) GPUs and NCCL")
BF16 = torch.bfloat16


def gpu_config():
    # hidden 512, 8 heads of 64, 4 KV heads, intermediate 1408: per rank QKV N = 512, gate/up 2 * 704
    return llama_config(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                        intermediate_size=1408)


@pytest.fixture(scope="module")
def torchrun_mesh():
    """The mesh over torchrun's ranks, or None when pytest runs alone (then each test spawns its ranks)."""
    if "RANK" not in os.environ:
        yield None
        return
    from torch.distributed.device_mesh import init_device_mesh
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    yield init_device_mesh("cuda", (dist.get_world_size(),))
    dist.destroy_process_group()


def run_ranks(fn, mesh):
    if mesh is not None:
        fn(dist.get_rank(), mesh)
    else:
        spawn(fn, timeout=1800, backend="nccl", device_type="cuda")  # the first run builds kernels


def within_bf16(sharded, single, ref, what):
    """Sharded about as close to fp32 as unsharded, and that within bf16's error (not only relative to it)."""
    e_sharded, e_single = rel_err(sharded, ref), rel_err(single, ref)
    assert e_single < 2e-2 and e_sharded < 2 * e_single + 2e-3, (what, e_sharded, e_single)


def _tp_rank(rank, mesh):
    from coda_dsl.parallel import tensor_parallel
    config = gpu_config()
    fp32 = random_layer(config, backend="reference").cuda()
    single = copy.deepcopy(fp32).to(BF16)
    single.backend = "cutlass"
    torch.manual_seed(5)
    x = torch.randn(2, 300, config.hidden_size, device="cuda")  # M = 600: ragged against the tiles
    dy = torch.randn_like(x)

    def run(m, dtype):
        xi = x.to(dtype, copy=True).requires_grad_()
        y = m(xi)
        (y.float() * dy).sum().backward()
        return y.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}

    ref, one = run(fp32, torch.float32), run(single, BF16)
    tp = tensor_parallel(copy.deepcopy(single), mesh)
    got = run(tp, BF16)
    within_bf16(got[0], one[0], ref[0], "out")
    within_bf16(got[1], one[1], ref[1], "dx")
    for n, g in got[2].items():
        within_bf16(g.full_tensor(), one[2][n], ref[2][n], n)


def test_tensor_parallel_layer_cutlass_bf16(torchrun_mesh):
    run_ranks(_tp_rank, torchrun_mesh)


def _fsdp_rank(rank, mesh):
    from coda_dsl.parallel import fully_shard_stack
    config, vocab, lengths = gpu_config(), 4096, (300, 212)
    fp32 = Stack(config, 2, vocab, backend="reference").cuda()
    single = copy.deepcopy(fp32).to(BF16)
    for m in (single, *single.layers):
        m.backend = "cutlass"
    model = copy.deepcopy(single).float()  # FSDP keeps fp32 parameters; its policy gathers them in bf16
    batch = [tuple(t.cuda() for t in seq) for seq in _batch(lengths, config.hidden_size, vocab)]
    total = sum(lengths)
    losses = {}
    for name, m, dtype in (("ref", fp32, torch.float32), ("single", single, BF16)):
        loss = sum(m(x.to(dtype), p, t) for x, p, t in batch) / total
        loss.backward()
        losses[name] = loss.detach().float()
    fully_shard_stack(model, model.layers, mesh, checkpoint=True)  # the CUDA policy: bf16 params, fp32 reduce
    part = model(*batch[rank]) / total
    (part * WORLD).backward()  # FSDP averages over ranks; the global batch's gradient is their sum
    loss = part.detach().float()
    dist.all_reduce(loss)
    within_bf16(loss, losses["single"], losses["ref"], "loss")
    ref_g = {n: p.grad for n, p in fp32.named_parameters()}
    one_g = {n: p.grad for n, p in single.named_parameters()}
    for n, p in model.named_parameters():
        n = n.replace("_checkpoint_wrapped_module.", "")
        within_bf16(p.grad.full_tensor(), one_g[n], ref_g[n], n)


def test_fsdp2_stack_cutlass_bf16(torchrun_mesh):
    run_ranks(_fsdp_rank, torchrun_mesh)


def _vocab_ce_rank(rank, mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    from coda_dsl.parallel import vocab_parallel_cross_entropy
    m, d, v = 600, 512, 4096
    g = torch.Generator(device="cuda").manual_seed(7)
    x0 = torch.randn(m, d, device="cuda", generator=g)
    w0 = torch.randn(v, d, device="cuda", generator=g) * 0.05
    target = torch.randint(0, v, (m,), device="cuda", generator=g)
    target[::7] = -100
    runs = []
    for dtype, backend in ((torch.float32, "reference"), (BF16, "cutlass")):
        x, w = x0.to(dtype, copy=True).requires_grad_(), w0.to(dtype, copy=True).requires_grad_()
        loss = cd.linear_cross_entropy(x, w, target, label_smoothing=0.1, backend=backend)
        loss.backward()
        runs.append((loss.detach().float(), x.grad, w.grad))
    x = x0.to(BF16, copy=True).requires_grad_()
    w = torch.nn.Parameter(distribute_tensor(w0.to(BF16), mesh, [Shard(0)]))
    loss = vocab_parallel_cross_entropy(x, w, target, label_smoothing=0.1, backend="cutlass")
    loss.backward()
    got = (loss.detach().float(), x.grad, w.grad.full_tensor())
    for i, what in enumerate(("loss", "grad_x", "grad_W")):
        within_bf16(got[i], runs[1][i], runs[0][i], what)


def test_vocab_parallel_cross_entropy_cutlass_bf16(torchrun_mesh):
    run_ranks(_vocab_ce_rank, torchrun_mesh)
