"""Cross-entropy in the LM-head epilogue, on the reference backend, vs F.cross_entropy on fp32 logits:
loss and gradients, ignore_index, label smoothing, softcap, reductions; cd.logsumexp and cd.take."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.library.cross_entropy import vocab_shard_stats
from epilogues import rel_err as _rel


def _problem(m=37, d=32, v=301, dtype=torch.bfloat16):
    x = torch.randn(m, d).to(dtype).requires_grad_()
    w = (torch.randn(v, d) / d ** 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (m,))
    t[[1, m // 2]] = -100  # ignored rows
    return x, w, t


def _torch_loss(x, w, t, smoothing=0.0, cap=None, reduction="mean"):
    """F.cross_entropy on fp32 logits of fp32 copies of x and w (returned, with grads after backward)."""
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    z = xf @ wf.t()
    z = cap * torch.tanh(z / cap) if cap else z
    return F.cross_entropy(z, t, ignore_index=-100, label_smoothing=smoothing, reduction=reduction), xf, wf


def _incoming(loss: torch.Tensor) -> torch.Tensor:
    """The loss's incoming gradient: for mean/sum a scalar that is not 1 (the backward's scaling), |g| in
    [0.5, 1.5) with either sign (randn's near 0 made fp16 gradients subnormal: CI-scale flakes)."""
    return (torch.rand_like(loss) + 0.5) * torch.randn_like(loss).sign()


@pytest.mark.parametrize("v", [301, 1007], ids=["v301", "v1007"])  # neither a multiple of the tile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("smoothing,cap,reduction", [(0.0, None, "mean"), (0.1, None, "sum"), (0.0, 30.0, "mean"),
                                                     (0.2, 15.0, "none"), (0.1, 10.0, "sum")])
def test_loss_and_grads_match_f_cross_entropy(seed, smoothing, cap, reduction, dtype, v):
    x, w, t = _problem(v=v, dtype=dtype)
    loss = cd.linear_cross_entropy(x, w, t, label_smoothing=smoothing, softcap=cap, reduction=reduction,
                                   backend="reference", chunk_rows=16)  # several chunks, the last one short
    g = _incoming(loss)
    loss.backward(g)
    ref, xf, wf = _torch_loss(x, w, t, smoothing, cap, reduction)
    ref.backward(g)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert _rel(loss.detach(), ref.detach()) < 1e-3
    assert x.grad.dtype == dtype and w.grad.dtype == dtype
    assert _rel(x.grad, xf.grad) < 1e-2 and _rel(w.grad, wf.grad) < 1e-2


@pytest.mark.parametrize("ignore", [0, 150, 299])  # V = 301: columns the kernels compute, and the fp32 tail's
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_ignore_index_that_is_a_class(seed, ignore, grad):
    """An ignore_index inside [0, V), whose column the GEMMs take for those rows (they get the targets as
    given): the rows are still left out; loss and gradients match F.cross_entropy's."""
    x, w, t = _problem()
    t[[1, x.shape[0] // 2]] = 3
    t[[0, 5, 9]] = ignore
    with torch.set_grad_enabled(grad):
        loss = cd.linear_cross_entropy(x, w, t, ignore_index=ignore, backend="reference", chunk_rows=16)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.cross_entropy(xf @ wf.t(), t, ignore_index=ignore)
    assert _rel(loss.detach(), ref.detach()) < 1e-3
    if grad:
        loss.backward()
        ref.backward()
        assert _rel(x.grad, xf.grad) < 1e-2 and _rel(w.grad, wf.grad) < 1e-2


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_vocabulary_a_multiple_of_8_has_no_tail(monkeypatch, reduction):
    """V % 8 == 0: the kernels cover every column, no fp32 tail is computed; loss and gradients still
    match F.cross_entropy."""
    from coda_dsl.library import cross_entropy as ce
    monkeypatch.setattr(ce, "_tail", lambda *a: pytest.fail("a tail computed for V % 8 == 0"))
    x, w, t = _problem(v=304)
    loss = cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="reference", chunk_rows=16)
    ref, xf, wf = _torch_loss(x, w, t, reduction=reduction)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    assert _rel(x.grad, xf.grad) < 2e-2 and _rel(w.grad, wf.grad) < 2e-2


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_grads_match_finite_differences(seed, reduction):
    """In fp64 (the reference backend keeps it), on a tiny case with every option: the gradients computed
    in the forward ("mean", "sum") and by the recomputing backward ("none", through torch.autograd.gradcheck)
    against central differences of the function's own loss, independent of F.cross_entropy. (gradcheck
    runs a backward twice, which "mean" and "sum" refuse: they hand out gradients made in the forward.)"""
    x, w, t = _problem(m=6, d=5, v=13, dtype=torch.float64)
    t[1] = -100
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    opts = dict(label_smoothing=0.1, softcap=3.0, backend="reference", chunk_rows=4, reduction=reduction)
    f = lambda x_, w_: cd.linear_cross_entropy(x_, w_, t, **opts)  # noqa: E731
    if reduction == "none":
        assert torch.autograd.gradcheck(f, (x, w))
        return
    f(x, w).backward()
    h = 1e-6
    for p, other in ((x, w), (w, x)):
        fd = torch.zeros_like(p)
        for i in range(p.numel()):
            e = torch.zeros_like(p).view(-1)
            e[i] = h
            e = e.view(p.shape)
            with torch.no_grad():
                plus, minus = (f(p + e, other), f(p - e, other)) if p is x else (f(other, p + e), f(other, p - e))
            fd.view(-1)[i] = (plus - minus) / (2 * h)
        torch.testing.assert_close(p.grad, fd, rtol=1e-5, atol=1e-7)


def _count_gemms(monkeypatch):
    """Records (epilogue, whether D is stored into a given buffer) per cd.gemm call; a given D must pass
    the cutlass backend's TMA layout check (V = 301: rows padded to 16 bytes)."""
    from coda_dsl.runtime import checks
    calls = []
    gemm = cd.gemm

    def counting(a, b, ep, **kw):
        d = (kw.get("out") or {}).get("D")
        if d is not None:
            checks.tma_layout("test", "D", d)
        calls.append((ep.name, d is not None))
        return gemm(a, b, ep, **kw)
    monkeypatch.setattr(cd, "gemm", counting)
    return calls


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradients_in_the_forward_backward_launches_no_gemm(monkeypatch, reduction):
    """With gradients wanted, each chunk's logits GEMM stores z (D) with its statistics; the backward
    computes nothing but the scaling: three GEMMs in all, not four."""
    x, w, t = _problem(m=40)
    calls = _count_gemms(monkeypatch)
    loss = cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="reference", chunk_rows=16)
    assert calls == [("ce_forward_logits_float16", True)] * 3  # 40 rows: chunks of 16, 16, 8 (bf16: z in fp16)
    loss.backward()
    assert len(calls) == 3 and x.grad is not None and w.grad is not None


def test_per_row_loss_recomputes_in_the_backward(monkeypatch):
    """reduction="none": the incoming gradient is per row, so the forward keeps statistics only and
    the backward recomputes the logits per chunk."""
    x, w, t = _problem(m=40)
    calls = _count_gemms(monkeypatch)
    loss = cd.linear_cross_entropy(x, w, t, reduction="none", backend="reference", chunk_rows=16)
    assert calls == [("ce_forward", False)] * 3
    loss.sum().backward()
    assert calls[3:] == [("ce_backward", True)] * 3


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_config_reaches_every_kernel(monkeypatch, reduction):
    """config= names the tile configuration of every GEMM of the loss (CONFIG by default); a bad one is
    an error on any backend."""
    x, w, t = _problem(m=40)
    seen = []
    gemm = cd.gemm
    monkeypatch.setattr(cd, "gemm", lambda a, b, ep, **kw: seen.append(kw["config"]) or gemm(a, b, ep, **kw))
    want = _torch_loss(x, w, t, reduction=reduction)[0]
    loss = cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="reference", chunk_rows=16,
                                   config="128x128x64_c1x1_pingpong")
    loss.sum().backward()
    assert seen and set(seen) == {"128x128x64_c1x1_pingpong"}
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
    seen.clear()
    cd.linear_cross_entropy(x, w, t, backend="reference")
    assert seen == [cd.library.cross_entropy.CONFIG]
    with pytest.raises(cd.CodaError, match="config"):
        cd.linear_cross_entropy(x, w, t, backend="reference", config="128x128_bogus")


def test_default_config_per_gpu_model(monkeypatch):
    """The kernels' default configuration follows the GPU model (cd.is_gpu; measured on H100s and the H200,
    others take the H200's), inside torch.compile too; no GPU: CONFIG, what the reference backend ignores."""
    from coda_dsl.library import cross_entropy as ce
    from coda_dsl.runtime import tune
    for name, want in (("NVIDIA H100 80GB HBM3", ce.H100_CONFIG), ("NVIDIA H200", ce.CONFIG),
                       ("NVIDIA GH200 480GB", ce.CONFIG), ("", ce.CONFIG)):
        monkeypatch.setattr(tune, "gpu_name", lambda device, name=name: name)
        assert ce.default_config(torch.device("cuda")) == want, name
    pick = torch.compile(lambda x: x * (2.0 if ce.default_config(x.device) is ce.CONFIG else 3.0), fullgraph=True,
                         backend="eager")  # the model is a constant of a traced graph (cd.is_gpu), no graph break
    assert torch.equal(pick(torch.ones(2)), torch.full((2,), 2.0))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_no_gradient_wanted_stores_no_logits(monkeypatch, smoothing):
    """Under no_grad, or when neither x nor W requires grad: a statistics-only GEMM per chunk of rows
    (40 rows in chunks of 16: three), no D; the same loss as one GEMM over all rows."""
    x, w, t = _problem(m=40)
    calls = _count_gemms(monkeypatch)
    with torch.no_grad():
        a = cd.linear_cross_entropy(x, w, t, backend="reference", chunk_rows=16, label_smoothing=smoothing)
    b = cd.linear_cross_entropy(x.detach(), w.detach(), t, backend="reference", chunk_rows=16, label_smoothing=smoothing)
    name = "ce_forward_smooth" if smoothing else "ce_forward"
    assert calls == [(name, False)] * 6 and not a.requires_grad and not b.requires_grad
    whole = cd.linear_cross_entropy(x.detach(), w.detach(), t, backend="reference", chunk_rows=40,
                                    label_smoothing=smoothing, reduction="none")
    assert calls[6:] == [(name, False)] and torch.equal(a, b)
    torch.testing.assert_close(a, whole[t != -100].mean(), rtol=1e-6, atol=1e-6)
    ref, _, _ = _torch_loss(x, w, t, smoothing)
    assert _rel(a, ref) < 1e-4


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_uninitialized_buffers_do_not_leak_into_grads(monkeypatch, reduction):
    """Fresh memory full of NaN: the chunk buffer's row padding (V = 301 -> 304) must not reach grad_x
    (CPU BLAS reads it when the strided chunk is a GEMM operand)."""
    x, w, t = _problem(m=40)
    empty = torch.empty

    def nan_empty(*args, **kw):
        out = empty(*args, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out
    monkeypatch.setattr(torch, "empty", nan_empty)
    loss = cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="reference", chunk_rows=40)  # one chunk:
    loss.sum().backward()  # from about 32 rows on, CPU BLAS reads the padding of a strided operand
    monkeypatch.undo()
    ref, xf, wf = _torch_loss(x, w, t, reduction=reduction)
    ref.sum().backward()
    assert _rel(x.grad, xf.grad) < 1e-2 and _rel(w.grad, wf.grad) < 1e-2


def test_frozen_weight_or_input():
    """Only the gradients autograd asks for are computed; each equals the one computed with both."""
    x, w, t = _problem()
    cd.linear_cross_entropy(x, w, t, backend="reference", chunk_rows=16).backward()
    for frozen in ("x", "w"):
        xf, wf = x.detach().requires_grad_(frozen != "x"), w.detach().requires_grad_(frozen != "w")
        cd.linear_cross_entropy(xf, wf, t, backend="reference", chunk_rows=16).backward()
        assert (xf.grad is None) == (frozen == "x") and (wf.grad is None) == (frozen == "w")
        live, ref = (wf.grad, w.grad) if frozen == "x" else (xf.grad, x.grad)
        assert torch.equal(live, ref)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_only_ignored_rows_give_zero_loss_and_grads(reduction):
    x, w, t = _problem(m=8)
    t[:] = -100
    loss = cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="reference")
    loss.sum().backward()
    assert not loss.any() and not torch.isnan(loss).any()
    assert torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_second_backward_through_one_forward_raises():
    """The gradients were computed in the forward and handed to autograd (no copy): a second backward
    would scale them twice, so it raises instead."""
    x, w, t = _problem()
    loss = cd.linear_cross_entropy(x, w, t, backend="reference")
    loss.backward(retain_graph=True)
    with pytest.raises(cd.UnsupportedError, match="backward ran twice"):
        loss.backward()


def test_confident_model_gradients_within_one_percent(seed, monkeypatch):
    """Logits up to ~30 with p(target) near 1 on half the rows: the gradient within 1 % of fp32 autograd
    with the logits buffer in fp16; a bf16 buffer gives several percent (checked: the test then fails)."""
    from coda_dsl.library import cross_entropy as ce
    m, d, v = 64, 64, 1007
    x = torch.randn(m, d).bfloat16().requires_grad_()
    w = (torch.randn(v, d) * 2 / d ** 0.5).bfloat16()
    t = torch.randint(0, v, (m,))
    w[t[: m // 2]] = (x[: m // 2].detach().float() * 1.6 / d ** 0.5).bfloat16()  # confident rows
    w.requires_grad_()
    cd.linear_cross_entropy(x, w, t, backend="reference").backward()
    ref, xf, wf = _torch_loss(x, w, t)
    ref.backward()
    assert ce.logits_buffer_dtype(torch.bfloat16) == torch.float16
    assert _rel(x.grad, xf.grad) < 1e-2 and _rel(w.grad, wf.grad) < 1e-2


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_very_confident_rows_keep_their_gradient(reduction, dtype):
    """p(target) 0.998-0.9997 on every row, logits ~ 20-36, one row per class: the gradient 1 - p is smaller than
    the logits' rounding in the buffer (fp16: |z| 2^-11) or the backward's D. The target's column comes from
    fp32 values, and in fp16 neither g nor the GEMMs' results may be subnormal (with 1/M in g: 36 % error in
    grad_x; with 1/M as the GEMMs' alpha: 3.5 % in grad_x, 1 % in grad_W). Both gradients within 1 % of
    fp64 autograd (in bf16 it was 320 %; F.cross_entropy on fp32 logits: 0.16 % and 0.9 %)."""
    g = torch.Generator().manual_seed(7)
    m, d, v = 256, 64, 2003
    x = torch.randn(m, d, dtype=torch.float64, generator=g)
    w = torch.randn(v, d, dtype=torch.float64, generator=g) / d ** 0.5
    t = torch.randperm(v, generator=g)[:m]
    x[:, 0], w[:, 0] = 20.0, 1.0  # every logit + 20
    w[t, 1:] = x[:, 1:] * 16 / x[:, 1:].square().sum(-1, keepdim=True)  # the target's: + 16 more
    x, w = x.to(dtype), w.to(dtype)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    (F.cross_entropy(x64 @ w64.t(), t) * 4096).backward()  # a loss scale, as AMP uses: the true fp16
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()  # gradients are subnormal without one
    loss = cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="reference")
    ((loss.mean() if reduction == "none" else loss) * 4096).backward()
    assert _rel(x.grad, x64.grad) < 1e-2 and _rel(w.grad, w64.grad) < 1e-2


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp16_grad_w_sums_many_rows_without_overflow(reduction):
    """4096 rows with one target and |x| = 30: grad_W's sum over the rows (1.2e5) is beyond fp16; as a mean
    (the GEMMs' alpha = 1/M) it is -28.1, as torch gives it. (Summed first and scaled after, it was -inf.)"""
    m, d, v = 4096, 16, 16
    x = torch.full((m, d), 30.0, dtype=torch.float16, requires_grad=True)
    w = torch.zeros(v, d, dtype=torch.float16, requires_grad=True)
    t = torch.zeros(m, dtype=torch.long)
    loss = cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="reference")
    (loss.mean() if reduction == "none" else loss).backward()
    wr = w.detach().float().requires_grad_()
    F.cross_entropy(x.detach().float() @ wr.t(), t).backward()
    assert w.grad.isfinite().all() and _rel(w.grad, wr.grad) < 1e-3


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp64_inputs_give_fp64_accuracy(reduction):
    """fp64 (the reference backend's gradcheck precision): loss and gradients to ~1e-15, the fp32 tail's
    columns (V % 8) included."""
    x, w = torch.randn(64, 32, dtype=torch.float64, requires_grad=True), torch.randn(1003, 32, dtype=torch.float64,
                                                                                     requires_grad=True)
    t = torch.randint(0, 1003, (64,))
    loss = cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="reference", chunk_rows=16)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(xr @ wr.t(), t, reduction=reduction)
    loss.sum().backward()
    ref.sum().backward()
    assert _rel(loss.detach(), ref.detach()) < 1e-13
    assert _rel(x.grad, xr.grad) < 1e-13 and _rel(w.grad, wr.grad) < 1e-13


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_second_derivative_raises(reduction):
    """create_graph=True gives gradients whose own derivative raises (not torch's silent zeros)."""
    x, w, t = _problem(dtype=torch.float32)
    gx, = torch.autograd.grad(cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="reference").sum(), x,
                              create_graph=True)
    assert gx.requires_grad
    with pytest.raises(cd.UnsupportedError, match="linear_cross_entropy has no second derivative"):
        gx.pow(2).sum().backward()


def test_label_smoothing_one():
    """label_smoothing=1.0, which F.cross_entropy accepts: the uniform target alone."""
    x, w, t = _problem(dtype=torch.float32)
    loss = cd.linear_cross_entropy(x, w, t, label_smoothing=1.0, backend="reference")
    ref, xf, wf = _torch_loss(x, w, t, smoothing=1.0)
    loss.backward()
    ref.backward()
    assert _rel(loss.detach(), ref.detach()) < 1e-5 and _rel(x.grad, xf.grad) < 1e-5


def test_compiled_gradient_step_matches_eager():
    """The fused step as torch.compile runs it on CUDA (one kernel writing g over z's bytes), here
    through inductor's CPU backend, equals the eager step, on the padded chunk buffer."""
    from coda_dsl.library import cross_entropy as ce
    c, v = 24, 1007
    z = ce._chunk_buffer(c, v, torch.empty(0), torch.float16)  # rows padded to 1008: a strided view
    z.copy_(torch.randn(c, v) * 5)
    lse = torch.logsumexp(z.float(), -1)
    scale, t = torch.rand(c), torch.randint(-1, v, (c,))
    z_target = z.float().gather(1, t.clamp_min(0)[:, None])[:, 0] + 1e-3  # the statistics' fp32 value
    eager = z.clone()
    ce._logit_grad_.eager(eager, lse, scale, t, z_target, 0.01, 0.9, 30.0, torch.bfloat16)
    torch.compile(ce._logit_grad_.eager)(z, lse, scale, t, z_target, 0.01, 0.9, 30.0, torch.bfloat16)
    assert _rel(z.view(torch.bfloat16), eager.view(torch.bfloat16)) < 1e-6


def test_scaling_in_place():
    """The backward's scaling (on the CPU the plain multiply; on CUDA triton_kernels.scale_, checked in
    tests/test_triton_kernels.py): in place, grad_W also by 1 / alpha (its GEMMs' factor), grad_x absent
    (a frozen input) too."""
    from coda_dsl.library import cross_entropy as ce
    gx, gw = torch.randn(8, 16).bfloat16(), torch.randn(32, 16).bfloat16()
    want_x, want_w = gx * 0.5, gw * 2
    ce._scale_(gx, gw, torch.tensor(0.5), 0.25)
    assert torch.equal(gx, want_x) and torch.equal(gw, want_w)
    ce._scale_(None, gw, torch.tensor(2.0), 1.0)
    assert torch.equal(gw, want_w * 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_factoring_leaves_the_incoming_gradient_alone_unless_fp16(dtype):
    """bf16 and fp32 gradients take the rows' whole scale in g (the backward's factor is then the incoming
    gradient, most often 1: no pass over grad_W); fp16's keep |g| <= 1 and grad_W's GEMM a power-of-2 alpha."""
    from coda_dsl.library import cross_entropy as ce
    scale = torch.full((4096,), 1 / 4000.0)
    unit, alpha, peak = ce._factored(scale, 4096, dtype)
    torch.testing.assert_close(unit * peak, scale)
    if dtype == torch.float16:
        assert unit.abs().max() == 1 and alpha == 2.0 ** -6
    else:
        assert alpha == 1.0 and peak.item() == 1.0


def test_default_chunk_rows():
    """The [rows, V] buffer within BUFFER_BYTES, rows a multiple of 256, as few chunks as that allows,
    balanced; at Llama-3's vocabulary and M = 8192 tokens, 2 chunks of 4096 rows (1 GiB)."""
    from coda_dsl.library.cross_entropy import BUFFER_BYTES, default_chunk_rows
    assert default_chunk_rows(8192, 128256) == 4096 and default_chunk_rows(0, 1000) == 256
    for m, v in [(8192, 128256), (16384, 128256), (8192, 32000), (8192, 256000), (37, 301), (1, 10**7)]:
        rows = default_chunk_rows(m, v)
        chunks = -(-m // rows)
        assert rows % 256 == 0 and (rows * v * 2 <= BUFFER_BYTES or rows == 256)
        assert chunks == max(1, -(-m // max(256, BUFFER_BYTES // (2 * v) // 256 * 256)))
        assert rows - 256 < -(-m // chunks)  # balanced: no chunk is much shorter than the others
    # the buffer holds fp32 logits for fp32 inputs, fp64 for fp64: fewer rows in the same bytes (it was 2x and 4x)
    assert default_chunk_rows(8192, 128256, dtype=torch.float32) == 2048
    assert default_chunk_rows(8192, 128256, dtype=torch.float64) == 1024
    assert default_chunk_rows(8192, 128256, dtype=torch.float16) == 4096


def test_default_chunk_rows_within_a_quarter_of_free_cuda_memory(monkeypatch):
    """On CUDA the buffer also stays within a quarter of the free memory: 1 GiB free at Llama-3's
    vocabulary gives chunks of 1024 rows (a 250.5 MiB buffer in a 256 MiB budget); with plenty free,
    BUFFER_BYTES rules as on the CPU."""
    from coda_dsl.library.cross_entropy import default_chunk_rows
    free = {"bytes": 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * 2**30))
    assert default_chunk_rows(8192, 128256, "cuda") == 1024
    free["bytes"] = 64 * 2**30
    assert default_chunk_rows(8192, 128256, "cuda") == default_chunk_rows(8192, 128256) == 4096


@pytest.mark.parametrize("smoothing,cap", [(0.0, None), (0.1, 20.0)])
def test_vocabulary_shards_combine_to_the_full_loss(seed, smoothing, cap):
    """Two shards of W, as a tensor-parallel LM head holds them: their (lse, target logit, sum)
    partials, combined by max / sum-exp, give the loss over the whole vocabulary."""
    from coda_dsl.library.cross_entropy import combine_vocab_shards, vocab_shard_stats
    x, w, t = _problem(m=40, v=1007)
    t[:4] = torch.tensor([0, 499, 500, 1006])  # targets at both shards' edges
    shards = [(0, w[:500]), (500, w[500:])]
    parts = [vocab_shard_stats(x, ws, t, start, label_smoothing=smoothing, softcap=cap, backend="reference")
             for start, ws in shards]
    first, second = (p["z_target"][:4] != 0 for p in parts)  # each shard holds the targets in its range
    assert first.tolist() == [True, True, False, False] and second.tolist() == [False, False, True, True]
    for reduction in ("mean", "none"):
        got = combine_vocab_shards(parts, t, 1007, label_smoothing=smoothing, reduction=reduction)
        ref, _, _ = _torch_loss(x, w, t, smoothing, cap, reduction)
        assert _rel(got, ref) < 1e-4
        whole = cd.linear_cross_entropy(x.detach(), w.detach(), t, label_smoothing=smoothing, softcap=cap,
                                        reduction=reduction, backend="reference")
        assert _rel(got, whole) < 1e-5


def test_combining_shards_checks_its_arguments():
    from coda_dsl.library.cross_entropy import combine_vocab_shards, vocab_shard_stats
    x, w, t = _problem(m=8, v=20)
    parts = [vocab_shard_stats(x, w[:10], t, 0, backend="reference"), vocab_shard_stats(x, w[10:], t, 10,
                                                                                       backend="reference")]
    for kwargs, match in (({"reduction": "avg"}, "reduction"), ({"label_smoothing": 0.1}, "z_sum"),
                          ({"label_smoothing": 1.5}, "label_smoothing"), ({"ignore_index": None}, "ignore_index")):
        with pytest.raises(cd.OperandError, match=match):
            combine_vocab_shards(parts, t, 20, **kwargs)
    with pytest.raises(cd.OperandError, match="got none"):
        combine_vocab_shards([], t, 20)
    for bad in (t.float(), t.int(), t[:5], t.tolist()):  # were taken, or a bare RuntimeError
        with pytest.raises(cd.OperandError, match=r"target must be an int64 tensor of shape \[8\]"):
            combine_vocab_shards(parts, bad, 20)
    with pytest.raises(cd.OperandError, match=r"every shard's stats must be of target's 8 rows, got rows \[5\]"):
        combine_vocab_shards([parts[0], {k: v[:5] for k, v in parts[1].items()}], t, 20)
    for bad in (1.5, "0"):  # 1.5 blamed the target's dtype; "0" was a bare TypeError
        with pytest.raises(cd.OperandError, match="vocab_start must be an int"):
            vocab_shard_stats(x, w[:10], t, bad, backend="reference")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_targets_out_of_range_raise_on_cpu_and_give_nan_rows(reduction):
    """A target neither ignore_index nor in [0, V) is an error (F.cross_entropy raises); on CUDA, where
    checking would synchronize, its row's loss is NaN instead of a wrong number."""
    from coda_dsl.library import cross_entropy as ce
    x, w, t = _problem(m=8, v=16)
    for bad in (16, -5):
        t[3] = bad
        with pytest.raises(cd.OperandError, match=f"target {bad} is out of range"):
            cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="reference")
    bad = torch.arange(8) == 3  # what _out_of_range returns on CUDA, where it does not raise
    loss = ce._reduce(torch.ones(8), torch.ones(8, dtype=torch.bool), torch.tensor(8), reduction, bad)
    assert loss.isnan().tolist() == ([False] * 3 + [True] + [False] * 4 if reduction == "none" else True)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_targets_out_of_range_inside_torch_compile_poison_the_gradients(reduction):
    """Inside torch.compile nothing can raise (as on CUDA): the bad row's loss is NaN, and so are the
    gradients it reaches (its grad_x row, all of grad_w), not a step's worth of finite numbers."""
    x, w, t = _problem(m=8, v=50, dtype=torch.float32)
    t[3] = 57
    torch._dynamo.reset()
    f = torch.compile(lambda a, b, c: cd.linear_cross_entropy(a, b, c, reduction=reduction, backend="reference"),
                      fullgraph=True, backend="aot_eager")
    loss = f(x, w, t)
    loss.sum().backward()
    assert loss.isnan().any() and x.grad[3].isnan().all() and w.grad.isnan().all()
    assert x.grad[torch.arange(8) != 3].isfinite().all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocabulary_under_8_columns(reduction):
    """V < 8: every column is the fp32 tail's, the kernels' share is empty; all three paths still match."""
    x, w, t = _problem(m=6, v=5)
    loss = cd.linear_cross_entropy(x, w, t, reduction=reduction, backend="reference")
    ref, xf, wf = _torch_loss(x, w, t, reduction=reduction)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    assert _rel(x.grad, xf.grad) < 2e-2 and _rel(w.grad, wf.grad) < 2e-2


def test_bad_arguments():
    x, w, t = _problem(m=4)
    with pytest.raises(cd.OperandError, match="reduction"):
        cd.linear_cross_entropy(x, w, t, reduction="avg", backend="reference")
    with pytest.raises(cd.OperandError, match="int64"):
        cd.linear_cross_entropy(x, w, t.int(), backend="reference")
    with pytest.raises(cd.OperandError, match=r"x must be \[M, d\] \(flatten a batch"):
        cd.linear_cross_entropy(x[None], w, t[None], backend="reference")
    for bad in (w[0], w[:, :-1]):  # a vector, or rows of another width than x's
        with pytest.raises(cd.OperandError, match=r"w must be the head's weight \[V, %d\]" % x.shape[1]):
            cd.linear_cross_entropy(x, bad, t, backend="reference")
    with pytest.raises(cd.OperandError, match=rf"x is {x.dtype} but w is torch.float64(.|\n)*fix: w.to\(x.dtype\)"):
        cd.linear_cross_entropy(x, w.double(), t, backend="reference")  # named as the caller names them
    for rows in (-8, 2.5, True):
        with pytest.raises(cd.OperandError, match="chunk_rows must be a positive int"):
            cd.linear_cross_entropy(x, w, t, chunk_rows=rows, backend="reference")
    with pytest.raises(cd.OperandError, match="backend must be 'auto', 'cutlass' or 'reference', not 'cuda'"):
        cd.linear_cross_entropy(x, w, t, backend="cuda")
    with pytest.raises(cd.OperandError, match="w has no rows"):
        cd.linear_cross_entropy(x, w[:0], t, backend="reference")
    for bad in (None, -100.0, True):  # F.cross_entropy refuses them too
        with pytest.raises(cd.OperandError, match="ignore_index must be an int"):
            cd.linear_cross_entropy(x, w, t, ignore_index=bad, backend="reference")
    for same in (np.int64(-100), torch.tensor(-100)):  # integers all the same
        assert torch.equal(cd.linear_cross_entropy(x, w, t, ignore_index=same, backend="reference"),
                           cd.linear_cross_entropy(x, w, t, backend="reference"))
    with pytest.raises(cd.OperandError, match="target is on meta, x on cpu"):
        cd.linear_cross_entropy(x, w, t.to("meta"), backend="reference")
    # not tensors, or options of the wrong type: OperandErrors, not bare TypeErrors (a numpy target's message
    # read "must be int64 ..., got int64")
    for args, match in (((x.tolist(), w, t), "x must be a torch.Tensor, got list"),
                        ((x, w.detach().float().numpy(), t), "w must be a torch.Tensor, got ndarray"),
                        ((x, w, t.numpy()), r"target must be an int64 tensor of shape \[4\].*got ndarray")):
        with pytest.raises(cd.OperandError, match=match):
            cd.linear_cross_entropy(*args, backend="reference")
    for bad in (None, "0.1", 1.5):
        with pytest.raises(cd.OperandError, match="label_smoothing must be a number in"):
            cd.linear_cross_entropy(x, w, t, label_smoothing=bad, backend="reference")
    with pytest.raises(cd.OperandError, match="softcap is a constant of the kernels"):
        cd.linear_cross_entropy(x, w, t, softcap=torch.tensor(5.0, requires_grad=True), backend="reference")
    for cap in (0.0, -10.0, float("inf"), float("nan"), True, "30", torch.tensor(-1.0)):  # 0 is no "off": None is
        with pytest.raises(cd.OperandError, match="softcap must be a positive finite number"):
            cd.linear_cross_entropy(x, w, t, softcap=cap, backend="reference")
        with pytest.raises(cd.OperandError, match="softcap must be a positive finite number"):
            vocab_shard_stats(x, w, t, 0, softcap=cap, backend="reference")


def test_logsumexp_and_take_semantics():
    @cd.epilogue
    def stats(acc, target: cd.VecM):
        z = cd.where(acc > 1.0, float("-inf"), acc)  # some -inf logits, as masking would give
        return {"lse": cd.logsumexp(z), "zt": cd.take(z, target)}

    a, b = torch.randn(9, 16), torch.randn(20, 16)
    target = torch.tensor([0, 5, 19, -100, 20, 7, 3, 3, 1])
    got = cd.gemm(a, b, stats, target=target, backend="reference")
    z = a @ b.t()
    z = torch.where(z > 1.0, float("-inf"), z)
    assert torch.allclose(got["lse"], torch.logsumexp(z, -1))
    inside = (target >= 0) & (target < 20)
    expect = torch.where(inside, z.gather(1, target.clamp(0, 19)[:, None])[:, 0], torch.zeros(9))
    assert torch.equal(got["zt"], expect)  # out-of-range indices read 0


def test_take_needs_an_int64_vecm():
    with pytest.raises(cd.EpilogueError, match="cd.VecM"):
        @cd.epilogue
        def bad(acc, t: cd.VecN):
            return {"D": acc, "zt": cd.take(acc, t)}

    @cd.epilogue
    def ok(acc, t: cd.VecM):
        return {"D": acc, "zt": cd.take(acc, t)}

    with pytest.raises(cd.OperandError, match="int64"):
        cd.gemm(torch.randn(4, 8), torch.randn(8, 8), ok, t=torch.zeros(4), backend="reference")


def test_forward_epilogue_lowers_to_row_nodes():
    """logsumexp and take become coda::RowLogSumExp / RowTake taps: no D, no logits, no atomics."""
    from coda_dsl.codegen import render
    from coda_dsl.library.cross_entropy import _forward_epilogue
    from coda_dsl.passes import lower, specialize
    from coda_dsl.passes.plan import LogSumExp, Signature, Take

    ep = _forward_epilogue(True, 30.0)
    plan = lower(specialize(ep.program, {}), Signature("bf16", "nk", (("target", "i64"),), ()))
    assert plan.d_dtype is None and plan.inputs == ["target"]
    assert [type(n) for n in plan.nodes if isinstance(n, (LogSumExp, Take))] == [LogSumExp, Take]
    assert [o[2] for o in plan.outputs] == ["m", "m", "m"]  # lse, z_target, z_sum: one value per row
    src = render(plan, "0" * 24)
    for text in ("coda::RowLogSumExp<TileShape>", "coda::RowTake", "coda::finish_logsumexp<",
                 "coda::take_args<Take_z_target>(inputs[0], outputs[1])", "coda::Fill{outputs[1], 0.f}"):
        assert text in src, text


def test_forward_with_logits_lowers_for_cutlass(make_plan):
    """The forward that also stores the logits chunk: D (fp16, into the buffer) with the row nodes in
    one kernel, softcap and smoothing included."""
    from coda_dsl.codegen import render
    from coda_dsl.library.cross_entropy import _forward_epilogue
    from coda_dsl.passes.plan import LogSumExp, Take

    plan = make_plan(_forward_epilogue(True, 30.0, torch.float16), operand_dtypes={"target": "i64"})
    assert plan.d_dtype == "fp16" and plan.inputs == ["target"]
    assert [type(n) for n in plan.nodes if isinstance(n, (LogSumExp, Take))] == [LogSumExp, Take]
    assert [o[0] for o in plan.outputs] == ["lse", "z_target", "z_sum"]
    assert "coda::RowLogSumExp<TileShape>" in render(plan, "0" * 24)


def test_logsumexp_is_per_row_only_and_stable():
    for axis in ("m", None):
        with pytest.raises(cd.EpilogueError):
            @cd.epilogue
            def per_column(acc):
                return {"lse": cd.logsumexp(acc, axis=axis)}

    @cd.epilogue
    def huge(acc):
        return {"lse": cd.logsumexp(acc * 100.0 + 1000.0)}

    a, b = torch.randn(9, 16), torch.randn(20, 16)
    lse = cd.gemm(a, b, huge, backend="reference")["lse"]
    assert torch.isfinite(lse).all() and torch.allclose(lse, torch.logsumexp((a @ b.t()) * 100 + 1000, -1))


def test_label_smoothing_spreads_over_all_v_classes():
    """With equal logits the smoothed loss is log V whatever the logit value (eps/V per class, as torch)."""
    x = torch.randn(5, 32).bfloat16()
    w = torch.randn(1, 32).bfloat16().expand(4, 32).contiguous() * 3  # all 4 logits of a row equal
    t = torch.tensor([0, 1, 2, 3, 1])
    loss = cd.linear_cross_entropy(x, w, t, label_smoothing=0.1, backend="reference")
    ref = F.cross_entropy(x.float() @ w.float().t(), t, label_smoothing=0.1)
    assert abs(loss.item() - ref.item()) < 1e-5


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing,cap", [(0.0, None), (0.1, 30.0)])
def test_targets_in_the_last_columns(reduction, smoothing, cap):
    """V = 301: the kernels compute the first 296 columns (whole 16-byte rows), the last 5 are added in
    fp32 per chunk; targets there, and at the edge of the split, get the full loss and gradient."""
    x, w, t = _problem(m=48)
    t[::3] = torch.tensor([295, 296, 300])[torch.arange(16) % 3]
    loss = cd.linear_cross_entropy(x, w, t, reduction=reduction, label_smoothing=smoothing, softcap=cap,
                                   backend="reference", chunk_rows=24)
    g = _incoming(loss)
    loss.backward(g)
    ref, xf, wf = _torch_loss(x, w, t, smoothing, cap, reduction)
    ref.backward(g)
    assert _rel(loss, ref) < 1e-3
    assert _rel(x.grad, xf.grad) < 1e-2 and _rel(w.grad, wf.grad) < 1e-2
    assert _rel(w.grad[296:], wf.grad[296:]) < 1e-2  # the tail's own weight rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_under_torch_compile(dtype):
    """bf16 and fp16 inputs inside torch.compile(fullgraph=True): the logits chunk's D is declared fp16 in
    the epilogue (for bf16 inputs it was taken from the buffer, which the traced op cannot see: refused),
    loss and gradients as eager, with an incoming gradient of 1 and of 0.5."""
    x, w, t = _problem(m=40, dtype=dtype)
    f = lambda x, w: cd.linear_cross_entropy(x, w, t, backend="reference", chunk_rows=16)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for g in (1.0, 0.5):
        got, want = compiled(x, w), f(x, w)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        grads = [torch.autograd.grad(loss, (x, w), torch.tensor(g)) for loss in (got, want)]
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dynamic", [None, True], ids=["default_dynamic", "dynamic"])
@pytest.mark.parametrize("smoothing,cap,reduction", [(0.0, None, "mean"), (0.1, 30.0, "sum"), (0.0, 15.0, "none")])
def test_under_torch_compile_fullgraph(seed, smoothing, cap, reduction, dynamic):
    """Inside torch.compile(fullgraph=True) (aot_eager: no C++ compiler), over changing token counts: loss and
    both gradients as eager. The kernels' epilogues come from cd.epilogue_factory functions, which Dynamo
    calls instead of tracing the DSL."""
    w = (torch.randn(301, 32) / 32 ** 0.5).requires_grad_()

    def loss(x, t):
        return cd.linear_cross_entropy(x, w, t, label_smoothing=smoothing, softcap=cap, reduction=reduction,
                                       backend="reference", chunk_rows=16)

    torch._dynamo.reset()  # each case's constants recompile the same code object: the limit counts per process
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for m in (37, 45):  # the second length recompiles with a symbolic one (default dynamic shapes)
        x, t = torch.randn(m, 32, requires_grad=True), torch.randint(0, 301, (m,))
        t[1] = -100
        got, want = compiled(x, t), loss(x, t)
        g = torch.randn_like(want)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.autograd.grad(got, (x, w), g), torch.autograd.grad(want, (x, w), g)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_rows_gives_zero_gradients(monkeypatch, reduction):
    """M = 0 (an empty micro-batch): as with every target ignored, a mean of 0 (F.cross_entropy: NaN), a sum of
    0, an empty vector, and zero gradients; grad_W is written by no GEMM, so it must be zeroed, never left
    uninitialized (fresh memory full of NaN here)."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: (lambda t: t.fill_(float("nan")) if t.is_floating_point()
                                                          else t)(empty(*a, **kw)))
    x = torch.randn(0, 32, requires_grad=True)
    w = torch.randn(301, 32, requires_grad=True)
    loss = cd.linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.int64), reduction=reduction, backend="reference")
    ref = F.cross_entropy(torch.zeros(0, 301), torch.zeros(0, dtype=torch.int64), reduction=reduction)
    torch.testing.assert_close(loss, ref.nan_to_num())
    loss.sum().backward()
    assert x.grad.shape == (0, 32) and torch.equal(w.grad, torch.zeros_like(w))
