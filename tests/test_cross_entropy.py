"""Cross-entropy in the LM-head epilogue, on the reference backend, vs F.cross_entropy on fp32 logits:
loss and gradients, ignore_index, label smoothing, softcap, reductions; cd.logsumexp and cd.take."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import coda_dsl as cd
from conftest import rel_err as _rel


def _problem(m=37, d=32, v=301):
    x = torch.randn(m, d).bfloat16().requires_grad_()
    w = (torch.randn(v, d) / d ** 0.5).bfloat16().requires_grad_()
    t = torch.randint(0, v, (m,))
    t[[1, m // 2]] = -100  # ignored rows
    return x, w, t


@pytest.mark.parametrize("smoothing,cap,reduction", [(0.0, None, "mean"), (0.1, None, "sum"), (0.0, 30.0, "mean"),
                                                     (0.2, 15.0, "none")])
def test_loss_and_grads_match_f_cross_entropy(smoothing, cap, reduction):
    x, w, t = _problem()
    loss = cd.linear_cross_entropy(x, w, t, label_smoothing=smoothing, softcap=cap, reduction=reduction,
                                   backend="reference", chunk_rows=16)  # several backward chunks
    g = torch.randn_like(loss) if reduction == "none" else torch.tensor(1.0)
    loss.backward(g)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    z = xf @ wf.t()
    z = cap * torch.tanh(z / cap) if cap else z
    ref = F.cross_entropy(z, t, ignore_index=-100, label_smoothing=smoothing, reduction=reduction)
    ref.backward(g)
    assert _rel(loss.detach(), ref.detach()) < 1e-3
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


def test_only_ignored_rows_give_zero_loss_and_grads():
    x, w, t = _problem(m=8)
    t[:] = -100
    loss = cd.linear_cross_entropy(x, w, t, backend="reference")
    loss.backward()
    assert loss.item() == 0.0 and not torch.isnan(loss)
    assert torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_bad_arguments():
    x, w, t = _problem(m=4)
    with pytest.raises(ValueError, match="reduction"):
        cd.linear_cross_entropy(x, w, t, reduction="avg", backend="reference")
    with pytest.raises(ValueError, match="int64"):
        cd.linear_cross_entropy(x, w, t.int(), backend="reference")


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
                 "coda::take_args<Take_z_target>(inputs[0], outputs[1])", "outputs[1].zero_();"):
        assert text in src, text


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
