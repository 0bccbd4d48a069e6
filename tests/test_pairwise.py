"""Pairwise transforms on the reference backend vs plain PyTorch: SwiGLU/GeGLU/ReGLU with interleaved
weights, RoPE (tables, positions, NeoX permutation), the SwiGLU backward vs autograd, width errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import coda_dsl as cd
from coda_dsl.library import (geglu, interleave_gate_up, linear_swiglu, neox_to_interleaved, neox_to_interleaved_rows,
                              reglu, rope_frequencies, rope_positions, rope_tables, swiglu_backward,
                              swiglu_keep_preactivation)
from epilogues import check_gqa_rope_against_torch, half_split_rope, rel_err as _rel

M, D, FF = 29, 48, 40  # ragged rows; N = 2F interleaved columns


def _w(*s):
    return (torch.randn(*s) / s[-1] ** 0.5).bfloat16()


@pytest.mark.parametrize("ep,act", [(None, F.silu), (geglu, lambda g: F.gelu(g, approximate="tanh")),
                                    (reglu, F.relu)], ids=["swiglu", "geglu", "reglu"])
def test_gated_activations_match_separate_projections(ep, act):
    x, wg, wu = _w(M, D), _w(FF, D), _w(FF, D)
    w = interleave_gate_up(wg, wu)
    assert w.shape == (2 * FF, D) and torch.equal(w[0::2], wg) and torch.equal(w[1::2], wu)
    got = linear_swiglu(x, w, backend="reference") if ep is None else \
        cd.gemm(x, w, ep, backend="reference")["D"]
    ref = act(x.float() @ wg.float().t()) * (x.float() @ wu.float().t())
    assert got.shape == (M, FF) and _rel(got, ref) < 1e-2


def test_full_and_half_width_outputs_together():
    x, w = _w(M, D), _w(2 * FF, D)
    out = cd.gemm(x, w, swiglu_keep_preactivation, backend="reference")
    pre = x.float() @ w.float().t()
    assert out["pre"].shape == (M, 2 * FF) and out["D"].shape == (M, FF)
    assert _rel(out["D"], F.silu(pre[:, 0::2]) * pre[:, 1::2]) < 1e-2


def test_swiglu_backward_matches_autograd():
    w_down = _w(D, FF)
    pre = (3 * torch.randn(M, 2 * FF)).bfloat16().float().requires_grad_()  # |pre| ~ 3: silu far from linear
    y = F.silu(pre[:, 0::2]) * pre[:, 1::2]
    d_out = torch.randn(M, D)
    (y @ w_down.float().t()).backward(d_out)
    d_out16 = d_out.bfloat16()
    # dY = dOut @ W_down (the GEMM whose epilogue this is): A = dOut [M, D], B = W_down^T as [FF, D]
    got = cd.gemm(d_out16, w_down.t(), swiglu_backward, saved_acc=pre.detach().bfloat16(), backend="reference")
    assert got["D"].shape == (M, 2 * FF) and got["recomputed_D"].shape == (M, FF)
    assert _rel(got["D"], pre.grad) < 2e-2
    assert _rel(got["recomputed_D"], y.detach()) < 1e-2


def _rope_ref(x, angle):  # interleaved (GPT-J) rotation of column pairs
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = torch.cos(angle), torch.sin(angle)
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2)


def test_rope_tables_and_positions_agree_with_a_standard_rope():
    n_heads, hd = 3, 16
    n = n_heads * hd
    x, w = _w(M, D), _w(n, D)
    pos = torch.arange(M).float() + 5
    inv = rope_frequencies(n, hd)
    angle = pos[:, None] * inv[None, :]
    ref = _rope_ref(x.float() @ w.float().t(), angle)
    by_tables = cd.gemm(x, w, rope_tables, cos=torch.cos(angle), sin=torch.sin(angle), backend="reference")["D"]
    by_positions = cd.gemm(x, w, rope_positions, pos=pos, inv_freq=inv, backend="reference")["D"]
    assert _rel(by_tables, ref) < 1e-2 and _rel(by_positions, ref) < 1e-2


def test_uniform_values_meet_every_width():
    """A value the same in every column (of constants, scalars, VecM operands) fits any width, also when one
    such value is shared by math of two widths; alone as an output it is N wide (found by a fuzzer)."""
    x, w, r = _w(M, D), _w(16, D), torch.randn(M)

    @cd.epilogue
    def shared(acc, c: cd.Const):
        return {"D": cd.abs(c) + cd.pairs(acc)[0], "y": cd.abs(c) + acc}

    @cd.epilogue
    def row_value(acc, r: cd.VecM):
        return {"D": cd.abs(r), "y": cd.interleave(acc, acc) + cd.abs(r), "z": cd.pairs(cd.tanh(r))[0]}
    acc = x.float() @ w.float().t()
    got = cd.gemm(x, w, shared, c=-0.3, backend="reference")
    assert _rel(got["D"], 0.3 + acc[:, 0::2]) < 1e-2 and _rel(got["y"], 0.3 + acc) < 1e-2
    got = cd.gemm(x, w, row_value, r=r, backend="reference")
    assert got["D"].shape == (M, 16) and torch.allclose(got["D"].float(), r.abs()[:, None].expand(M, 16), rtol=1e-2)
    assert _rel(got["y"], torch.stack([acc, acc], -1).flatten(-2) + r.abs()[:, None]) < 1e-2
    assert torch.allclose(got["z"].float(), torch.tanh(r)[:, None].expand(M, 16), atol=1e-2)


def test_a_cast_interleave_is_the_interleave_of_casts():
    """cd.cast(cd.interleave(a, b)) rounds each half: it specializes to the same kernel as the stored form
    cd.interleave(cd.cast(a), cd.cast(b)) (it was refused as 2N-wide math)."""
    from coda_dsl import cli

    @cd.epilogue
    def outer(acc):
        return {"D": acc, "w": cd.cast(cd.interleave(acc, acc * 2.0), cd.bfloat16)}

    @cd.epilogue
    def inner(acc):
        return {"D": acc, "w": cd.interleave(cd.cast(acc, cd.bfloat16), cd.cast(acc * 2.0, cd.bfloat16))}
    keys = [cli.specialization_from_options(ep, "bf16").key for ep in (outer, inner)]
    assert keys[0] == keys[1]


def test_rope_helpers_refuse_odd_heads_and_partial_heads():
    with pytest.raises(cd.OperandError, match="even"):
        neox_to_interleaved(torch.zeros(24, 4), 5)
    with pytest.raises(cd.OperandError, match="whole number of heads"):
        neox_to_interleaved(torch.zeros(24, 4), 16)
    with pytest.raises(cd.OperandError, match="even"):
        neox_to_interleaved_rows(3, 7)
    with pytest.raises(cd.OperandError, match="even"):
        rope_frequencies(24, 7)
    with pytest.raises(cd.OperandError, match="n_cols = 23 is odd"):
        rope_frequencies(23, 8)
    with pytest.raises(cd.OperandError, match="rotate_cols = 129 is odd"):  # it was rounded down to 128
        rope_frequencies(256, 64, rotate_cols=129)
    assert rope_frequencies(24, np.int64(8)).shape == (12,)  # NumPy integers are integers


def test_rope_passes_v_through_and_neox_permutation_keeps_scores():
    n_heads, hd = 2, 8
    qk = 2 * n_heads * hd  # Q and K rotate, V passes through
    n = qk + n_heads * hd
    x, w = _w(M, D), _w(n, D)
    pos = torch.arange(M).float()
    inv = rope_frequencies(n, hd, rotate_cols=qk)
    out = cd.gemm(x, w, rope_positions, pos=pos, inv_freq=inv, backend="reference")["D"].float()
    plain = x.float() @ w.float().t()
    assert _rel(out[:, qk:], plain[:, qk:]) < 1e-2  # V untouched
    # NeoX/Llama: rotate (i, i + d/2); permuting Q and K rows alike gives the same attention scores
    wq, wk = _w(n_heads * hd, D), _w(n_heads * hd, D)
    perm = neox_to_interleaved_rows(n_heads, hd)
    inv_h = rope_frequencies(n_heads * hd, hd)
    q = cd.gemm(x, wq[perm], rope_positions, pos=pos, inv_freq=inv_h, backend="reference")["D"].float()
    k = cd.gemm(x, wk[perm], rope_positions, pos=pos, inv_freq=inv_h, backend="reference")["D"].float()

    def neox(t):  # standard half-split rotation
        angle = pos[:, None, None] * (1.0 / 10000 ** (2 * torch.arange(hd // 2) / hd))
        return half_split_rope(t.view(M, n_heads, hd), angle)

    qn, kn = neox(x.float() @ wq.float().t()), neox(x.float() @ wk.float().t())
    scores = torch.einsum("mhd,nhd->hmn", q.view(M, n_heads, hd), k.view(M, n_heads, hd))
    assert _rel(scores, torch.einsum("mhd,nhd->hmn", qn, kn)) < 2e-2


def test_width_errors_and_odd_n():
    with pytest.raises(cd.EpilogueError, match="wide"):  # at definition, as the DSL's other errors
        @cd.epilogue
        def mixed(acc):
            g, u = cd.pairs(acc)
            return g + acc
    with pytest.raises(cd.EpilogueError, match="a value N wide meets one N/2 wide"):
        @cd.epilogue
        def uniform_pattern_beside_a_half(acc, r: cd.VecM):  # the kernel's interleave parts are N's even and
            g, u = cd.pairs(acc)                            # odd columns: it stored g * u + r in every column
            return g * u + cd.interleave(r, 0.0)
    with pytest.raises(cd.OperandError, match="a multiple of 2"):
        cd.gemm(_w(8, 16), _w(7, 16), reglu, backend="reference")
    with pytest.raises(cd.OperandError, match=r"expected \[8, 4\](.|\n)*fix: .*shape \[M, N/2\]"):  # [M, N/2]
        cd.gemm(_w(8, 16), _w(8, 16), rope_tables, cos=torch.ones(8, 8), sin=torch.ones(8, 8),
                backend="reference")
    from coda_dsl.passes import lower, specialize
    from coda_dsl.passes.plan import Signature

    @cd.epilogue
    def doubled_then_scaled(acc):
        return cd.interleave(acc, acc) * 2.0

    @cd.epilogue
    def wide_operand_unsplit(acc, pre: cd.Tensor):
        return {"D": acc, "y": pre + cd.interleave(acc, acc)}

    for ep, operands in ((doubled_then_scaled, ()), (wide_operand_unsplit, (("pre", "bf16"),))):
        # math on a 2N-wide value: the reference backend only
        with pytest.raises(cd.UnsupportedError, match=r"2N-wide value must be a cd.Tensor operand split"):
            lower(specialize(ep.program, {}), Signature("bf16", "nk", operands,
                                                        tuple((o, "bf16") for o in ep.output_names)))


def test_pairs_of_a_half_runs_on_the_reference_backend_only(make_plan):
    """cd.pairs of a half (N/4 wide): the kernels have no node for it (its column index was lost, giving
    g1 + g1): refused when lowering; the reference backend computes it, on an N a multiple of 4."""
    @cd.epilogue
    def quarters(acc):
        g, _ = cd.pairs(acc)
        g1, g2 = cd.pairs(g)
        return g1 + g2

    with pytest.raises(cd.UnsupportedError, match="cd.pairs of a half"):
        make_plan(quarters)
    a, w = torch.randn(8, 16), torch.randn(12, 16)
    h = a @ w.t()
    torch.testing.assert_close(cd.gemm(a, w, quarters, backend="reference")["D"], h[:, 0::4] + h[:, 2::4])
    with pytest.raises(cd.OperandError, match="a multiple of 4"):
        cd.gemm(a, torch.randn(6, 16), quarters, backend="reference")


def test_a_statistic_as_d_is_stored_like_any_statistic(make_plan):
    """D = cd.sum(acc, axis="n"): an [M] fp32 output, as the reference backend gives it, not a D store."""
    @cd.epilogue
    def row_sums(acc):
        return cd.sum(acc, axis="n")

    plan = make_plan(row_sums)
    assert plan.d_dtype is None and [(name, kind) for name, _, kind in plan.outputs] == [("D", "m")]
    a, w = torch.randn(8, 16), torch.randn(12, 16)
    torch.testing.assert_close(cd.gemm(a, w, row_sums, backend="reference")["D"], (a @ w.t()).sum(1))


def test_pairwise_lowering():
    """Half-width D stored per pair, N/2-wide tables widened, pair-loop functors."""
    from coda_dsl.codegen import render
    from coda_dsl.library import swiglu_keep_preactivation
    from coda_dsl.passes import lower, specialize
    from coda_dsl.passes.plan import PairStore, Signature

    plan = lower(specialize(swiglu_keep_preactivation.program, {}),
                 Signature("bf16", "nk", (), (("D", "bf16"), ("pre", "bf16"))))
    assert plan.d_dtype is None and ("D", "bf16", "mh") in plan.outputs
    assert any(isinstance(n, PairStore) for n in plan.nodes)
    src = render(plan, "0" * 24)
    assert "coda::PairStore<EpilogueDescriptor, cutlass::bfloat16_t>" in src and "for (int q = 0; q < N / 2; ++q)" in src
    tables = lower(specialize(rope_tables.program, {}),
                   Signature("bf16", "nk", (("cos", "bf16"), ("sin", "bf16")), (("D", "bf16"),)))
    assert tables.widened == [] and tables.d_dtype == "bf16"  # [M, N/2] tables are read per pair
    assert "coda::PairLoad<cutlass::bfloat16_t>" in render(tables, "0" * 24)
    positions = lower(specialize(rope_positions.program, {}),
                      Signature("bf16", "nk", (("inv_freq", "fp32"), ("pos", "fp32")), (("D", "bf16"),)))
    assert positions.widened == ["inv_freq"]  # an N/2 VecN is widened on the host


def test_double_width_lowering():
    """A backward's shapes: cd.pairs of a [M, 2N] operand -> one WideLoad of 32-bit words and an Unpack per
    half (columns 2n, 2n + 1), a cd.interleave output -> a Pack of its two N-wide halves into words and
    a WideStore of them, [M, 2N]; no pairwise functor. fp32 [M, 2N] tensors are refused (no 16-bit halves)."""
    from coda_dsl.codegen import render
    from coda_dsl.passes import lower, specialize
    from coda_dsl.passes.plan import Pack, Signature, Unpack, WideLoad, WideStore

    plan = lower(specialize(swiglu_backward.program, {}),
                 Signature("bf16", "nk", (("saved_acc", "bf16"),), (("D", "bf16"), ("recomputed_D", "bf16"))))
    assert plan.d_dtype is None and ("D", "bf16", "mw") in plan.outputs
    assert ("recomputed_D", "bf16", "mn") in plan.outputs
    (load,) = [i for i, n in enumerate(plan.nodes) if isinstance(n, WideLoad)]
    halves = [n for n in plan.nodes if isinstance(n, Unpack)]
    assert sorted(n.part for n in halves) == [0, 1] and all(n.children == (load,) for n in halves)
    assert plan.inputs == ["saved_acc"]
    (store,) = [n for n in plan.nodes if isinstance(n, WideStore)]
    (pack,) = store.children
    assert isinstance(plan.nodes[pack], Pack) and len(plan.nodes[pack].children) == 2
    assert not any(f.pairwise for f in plan.functors)
    src = render(plan, "0" * 24)
    for spelled in ("coda::WideLoad<EpilogueDescriptor>", "coda::Unpack<cutlass::bfloat16_t, 0>",
                    "coda::Unpack<cutlass::bfloat16_t, 1>", "coda::Pack<cutlass::bfloat16_t>",
                    "coda::WideStore<EpilogueDescriptor>"):
        assert spelled in src
    with pytest.raises(cd.UnsupportedError, match="32-bit words of two 16-bit values"):
        lower(specialize(swiglu_backward.program, {}),
              Signature("bf16", "nk", (("saved_acc", "fp32"),), (("D", "bf16"), ("recomputed_D", "bf16"))))


@cd.epilogue
def pairs_of_a_constant(acc, c: cd.Const):
    g, u = cd.pairs(2.0)
    h, k = cd.pairs(c)
    return acc * g + u - h * k + cd.interleave(1.5, 1.5)


@cd.epilogue
def interleave_of_two_consts(acc, a: cd.Const, b: cd.Const):
    return acc + cd.interleave(a, b)


def test_pairs_of_a_constant_is_the_constant(make_plan):
    """A constant's columns are all equal: either half is the constant (it used to be a KeyError in
    constant folding); it folds away, so the plan is plain elementwise math."""
    a, b = _w(M, D), _w(2 * FF, D)
    got = cd.gemm(a, b, pairs_of_a_constant, c=3.0, backend="reference")["D"]
    ref = a.float() @ b.float().t() * 2.0 + 2.0 - 9.0 + 1.5
    assert _rel(got, ref) < 1e-2
    plan = make_plan(pairs_of_a_constant, consts={"c": 3.0})
    assert not any(f.pairwise for f in plan.functors)


def test_interleave_of_two_different_constants_is_a_clear_error():
    """Two numbers: refused where the epilogue is defined; two cd.Consts: at the call that binds them."""
    with pytest.raises(cd.EpilogueError, match=r"test_pairwise.py:\d+: cd.interleave\(1.0, 2.0\) "
                                               r"interleaves two different numbers(.|\n)*fix:"):
        @cd.epilogue
        def interleave_of_two_numbers(acc):
            return acc + cd.interleave(1.0, 2.0)
    with pytest.raises(cd.EpilogueError, match=r"test_pairwise.py:\d+\): cd.interleave\(1.0, 2.0\) "
                                               r"interleaves two different constants(.|\n)*fix:"):
        cd.gemm(_w(M, D), _w(2 * FF, D), interleave_of_two_consts, backend="reference", a=1.0, b=2.0)


def test_odd_n_is_fine_without_half_width_values():
    """cd.pairs of a [M, 2N] operand and an interleaved [M, 2N] output need no column pairs of the
    accumulator: N may be odd (only N/2-wide values need an even N)."""
    from epilogues import wide_only
    a, b, pre = _w(M, D), _w(7, D), torch.randn(M, 14)
    got = cd.gemm(a, b, wide_only, pre=pre, backend="reference")["D"]
    acc = a.float() @ b.float().t()
    assert got.shape == (M, 14) and _rel(got[:, 0::2], acc * pre[:, 0::2]) < 1e-2
    with pytest.raises(cd.OperandError, match="a multiple of 2"):
        cd.gemm(a, b, swiglu_keep_preactivation, backend="reference")


def test_gqa_rope_both_conventions_match_torch():
    """issue 12's case on the reference backend (the GPU suite runs it on the kernel): GQA, packed positions up
    to 131071, the interleaved and HF's half-split conventions against plain torch."""
    check_gqa_rope_against_torch("cpu", "reference", k=64)
