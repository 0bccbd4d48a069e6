"""coda_dsl.nn.LlamaDecoderLayer against Hugging Face's LlamaDecoderLayer (eager attention), on CPU with the
reference backend: outputs, input gradients and every parameter gradient, and a short training run."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer as HFLayer  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

import coda_dsl as cd  # noqa: E402
from coda_dsl import nn as cdnn  # noqa: E402


def llama_config(**kw) -> LlamaConfig:
    args = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                rope_theta=500000.0, rms_norm_eps=1e-5, attn_implementation="eager")
    return LlamaConfig(**{**args, **kw})


def random_hf_layer(config, seed=0, layer_idx=0) -> HFLayer:
    """HF layer with random weights and non-trivial norm gammas (ones would hide gamma mistakes)."""
    torch.manual_seed(seed)
    layer = HFLayer(config, layer_idx)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return layer


def hf_forward(layer, config, x, position_ids):
    """HF's layer as its model calls it: RoPE tables from LlamaRotaryEmbedding, an explicit causal mask."""
    s = x.shape[1]
    cos_sin = LlamaRotaryEmbedding(config)(x, position_ids)
    mask = torch.full((s, s), float("-inf"), dtype=x.dtype, device=x.device).triu(1)[None, None]
    return layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin)


def grads(layer, x, y, dy):
    layer.zero_grad()
    x.grad = None
    y.backward(dy)
    return x.grad, {n: p.grad for n, p in layer.named_parameters()}


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def positions(b, s, packed):
    if not packed:
        return torch.arange(s)[None].expand(b, s)
    cut = s // 2 + 1  # two packed sequences per row: positions restart at `cut`
    p = torch.cat((torch.arange(cut), torch.arange(s - cut)))
    return p[None].expand(b, s)


@pytest.mark.parametrize("s, packed", [(7, False), (13, False), (13, True)])
def test_layer_matches_hf_fp32(s, packed):
    config = llama_config()
    hf = random_hf_layer(config)
    ours = cdnn.LlamaDecoderLayer.from_hf(hf, backend="reference")
    torch.manual_seed(1)
    x = torch.randn(2, s, config.hidden_size, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    pid = positions(2, s, packed)
    y_hf, y = hf_forward(hf, config, x, pid), ours(x2, position_ids=pid)
    assert rel_err(y, y_hf) < 1e-5
    dy = torch.randn_like(y)
    dx_hf, g_hf = grads(hf, x, y_hf, dy)
    dx, g = grads(ours, x2, y, dy)
    assert rel_err(dx, dx_hf) < 1e-5
    assert g.keys() == g_hf.keys() and len(g) == 9
    for name in g_hf:
        assert rel_err(g[name], g_hf[name]) < 1e-4, name


def test_default_positions_are_arange():
    config = llama_config()
    ours = cdnn.LlamaDecoderLayer.from_hf(random_hf_layer(config), backend="reference")
    x = torch.randn(2, 5, config.hidden_size)
    torch.testing.assert_close(ours(x), ours(x, position_ids=torch.arange(5)[None]), rtol=0, atol=0)
    restart = torch.tensor([[0, 1, 2, 0, 1]])  # a shift alone would not show: RoPE scores are relative
    assert rel_err(ours(x), ours(x, position_ids=restart)) > 1e-3


def test_layer_bf16_within_hf_bf16_error():
    """bf16: our error against the fp32 reference is within twice HF's own bf16 error (measured: 0.3-1.5 % for both)."""
    config = llama_config(hidden_size=128, head_dim=32, intermediate_size=176)
    hf32 = random_hf_layer(config)
    hf16 = random_hf_layer(config).to(torch.bfloat16)
    ours = cdnn.LlamaDecoderLayer.from_hf(hf16, backend="reference")
    assert ours.self_attn.q_proj.weight.dtype == torch.bfloat16
    torch.manual_seed(1)
    x32 = torch.randn(2, 13, config.hidden_size)
    pid = positions(2, 13, False)
    runs = {}
    for name, layer, dtype in (("ref", hf32, torch.float32), ("hf", hf16, torch.bfloat16),
                               ("ours", ours, torch.bfloat16)):
        x = x32.detach().to(dtype).requires_grad_()
        y = hf_forward(layer, config, x, pid) if name != "ours" else layer(x, position_ids=pid)
        assert y.dtype == dtype
        dx, g = grads(layer, x, y, torch.ones_like(y) / y.numel() ** 0.5)
        runs[name] = (y, dx, g)
    ref_y, ref_dx, ref_g = runs["ref"]
    for i, (ref, name) in enumerate(((ref_y, "out"), (ref_dx, "dx"))):
        hf_err, our_err = rel_err(runs["hf"][i], ref), rel_err(runs["ours"][i], ref)
        assert our_err < 2 * hf_err + 2e-3, (name, our_err, hf_err)
    for name in ref_g:
        hf_err, our_err = rel_err(runs["hf"][2][name], ref_g[name]), rel_err(runs["ours"][2][name], ref_g[name])
        assert our_err < 2 * hf_err + 2e-3, (name, our_err, hf_err)


@pytest.mark.parametrize("made", [True, False])
def test_mlp_differentiates_through_its_norm(made):
    """LlamaMLP(h, norm): out = h + down(silu(gate(n)) * up(n)), n = RMSNorm(h), and the next norm's rstd;
    h's, gamma's and the weights' gradients as torch's autograd gives them, whether hg and rstd come made
    (as the o-proj's epilogue makes them; not differentiated as inputs) or are made inside."""
    torch.manual_seed(0)
    config = llama_config()
    mlp, norm = cdnn.LlamaMLP(config), cdnn.RMSNorm(config.hidden_size, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    h = torch.randn(9, config.hidden_size, requires_grad=True)
    dout, drstd = torch.randn(9, config.hidden_size), torch.randn(9)
    params = [h, norm.weight, *mlp.parameters()]

    def torch_mlp():
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
        out = h + mlp.down_proj(F.silu(mlp.gate_proj(n)) * mlp.up_proj(n))
        return out, torch.rsqrt(out.pow(2).mean(-1) + 1e-6)

    def ours():
        made_args = cdnn.input_norm(h.detach(), norm.weight.detach(), 1e-5) if made else ()
        return mlp(h, norm, 1e-6, "reference", *made_args)
    results = []
    for fn in (torch_mlp, ours):
        out, rstd = fn()
        results.append((out, rstd, torch.autograd.grad((out, rstd), params, (dout, drstd))))
    (o1, r1, g1), (o2, r2, g2) = results
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r2, r1, rtol=1e-5, atol=1e-5)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_frozen_inputs_get_no_gradient_work(monkeypatch):
    """With the weights frozen, each GEMM's backward does only its input's matmuls: the o-proj's plain, the
    down projection's the fused dY GEMM (rms_swiglu_grad), gate/up's a plain one and the fused
    post_norm_grad, the QKV's the fused input_norm_grad; only W_down training needs none of those."""
    config = llama_config()
    ours = cdnn.LlamaDecoderLayer.from_hf(random_hf_layer(config), backend="reference").requires_grad_(False)
    calls, fused = [], []
    real_mm, real_gemm = cdnn._mm, cdnn.cd.gemm
    backward_eps = (cdnn.rms_swiglu_grad, cdnn.input_norm_grad, cdnn.post_norm_grad)
    monkeypatch.setattr(cdnn, "_mm", lambda *a: calls.append(1) or real_mm(*a))
    monkeypatch.setattr(cdnn.cd, "gemm", lambda a, b, ep, **k: (ep in backward_eps and fused.append(ep.name))
                        or real_gemm(a, b, ep, **k))
    x = torch.randn(2, 7, config.hidden_size, requires_grad=True)
    ours(x).sum().backward()
    assert len(calls) == 2 and x.grad is not None
    assert sorted(fused) == ["input_norm_grad", "post_norm_grad", "rms_swiglu_backward_fused"]
    assert all(p.grad is None for p in ours.parameters())
    calls.clear(), fused.clear()
    ours.mlp.down_proj.requires_grad_(True)
    ours(x.detach()).sum().backward()  # only W_down trains: one matmul in all
    assert len(calls) == 1 and not fused and ours.mlp.down_proj.weight.grad is not None


def test_mlp_backward_frees_its_activations_once(monkeypatch):
    """The MLP's backward frees y and the saved accumulator as soon as it has used them (they dominate its
    peak memory); a second backward through the same forward then says so instead of reading freed memory."""
    config = llama_config()
    ours = cdnn.LlamaDecoderLayer.from_hf(random_hf_layer(config), backend="reference")
    saved, real_gemm = [], cdnn.cd.gemm

    def gemm(a, b, ep, **k):
        out = real_gemm(a, b, ep, **k)
        if ep is cdnn.rms_swiglu_fwd:
            saved.extend((out["D"], out["acc"]))
        return out
    monkeypatch.setattr(cdnn.cd, "gemm", gemm)
    y = ours(torch.randn(2, 7, config.hidden_size, requires_grad=True))
    assert all(t.untyped_storage().nbytes() > 0 for t in saved)
    y.sum().backward(retain_graph=True)
    assert all(t.untyped_storage().nbytes() == 0 for t in saved)
    with pytest.raises(cd.UnsupportedError, match="LlamaMLP: backward ran twice through the same forward"):
        y.sum().backward()


def test_mlp_without_y_gives_the_same_gradients(monkeypatch):
    """mlp.keep_y = False: the forward keeps no y (the dY epilogue computes it again); every gradient is
    the same as with y kept, and with only W_down training no dY GEMM runs (y comes from the accumulator)."""
    config = llama_config()
    hf = random_hf_layer(config)
    kept, recomputed = (cdnn.LlamaDecoderLayer.from_hf(hf, backend="reference") for _ in range(2))
    recomputed.mlp.keep_y = False
    x, dy = torch.randn(2, 7, config.hidden_size), torch.randn(2, 7, config.hidden_size)
    runs = []
    for layer in (kept, recomputed):
        xi = x.clone().requires_grad_()
        runs.append(grads(layer, xi, layer(xi), dy))
    torch.testing.assert_close(runs[1][0], runs[0][0])
    for n in runs[0][1]:
        torch.testing.assert_close(runs[1][1][n], runs[0][1][n])
    fused, real_gemm = [], cdnn.cd.gemm
    monkeypatch.setattr(cdnn.cd, "gemm", lambda a, b, ep, **k: (ep is cdnn.rms_swiglu_grad_and_y and fused.append(1))
                        or real_gemm(a, b, ep, **k))
    for layer in (kept, recomputed):
        layer.zero_grad()
        layer.requires_grad_(False).mlp.down_proj.requires_grad_(True)
        layer(x).backward(dy)
    assert not fused
    torch.testing.assert_close(recomputed.mlp.down_proj.weight.grad, kept.mlp.down_proj.weight.grad)
    for layer in (kept, recomputed):  # in fp64 too (y from the accumulator in the reference's fp64 math)
        layer.double().zero_grad()
        layer(x.double()).backward(dy.double())
    assert recomputed.mlp.down_proj.weight.grad.dtype == torch.float64
    torch.testing.assert_close(recomputed.mlp.down_proj.weight.grad, kept.mlp.down_proj.weight.grad)


def test_stack_trains_like_hf():
    """Two layers, 20 SGD steps on a regression target: the same losses as two HF layers. The second layer
    takes the first's rstd from its down-projection epilogue (input_rstd)."""
    config = llama_config()
    hf = torch.nn.ModuleList(random_hf_layer(config, seed=i, layer_idx=i) for i in range(2))
    ours = torch.nn.ModuleList(cdnn.LlamaDecoderLayer.from_hf(l, backend="reference") for l in hf)
    torch.manual_seed(2)
    x = torch.randn(2, 9, config.hidden_size)
    target = torch.randn(2, 9, config.hidden_size)
    pid = positions(2, 9, False)

    def run_hf():
        h = x
        for layer in hf:
            h = hf_forward(layer, config, h, pid)
        return h

    def run_ours():
        h, rstd = ours[0](x, position_ids=pid, return_rstd=True)
        return ours[1](h, position_ids=pid, input_rstd=rstd)

    losses = {}
    for name, model, fwd in (("hf", hf, run_hf), ("ours", ours, run_ours)):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[name] = []
        for _ in range(20):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(fwd(), target)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["ours"][-1] < 0.95 * losses["ours"][0]  # it does train
    for a, b in zip(losses["ours"], losses["hf"]):
        assert abs(a - b) <= 1e-4 * abs(b)
    for (n, p), (n2, q) in zip(hf.named_parameters(), ours.named_parameters()):
        assert n == n2 and rel_err(q, p) < 1e-4, n  # the same (HF) parameters were updated


def test_state_dict_round_trip():
    config = llama_config()
    hf = random_hf_layer(config)
    ours = cdnn.LlamaDecoderLayer(config, backend="reference")
    ours.load_hf_state_dict(hf.state_dict())
    assert set(ours.state_dict()) == set(hf.state_dict())
    back = ours.to_hf()
    for name, t in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def test_load_hf_state_dict_checks_everything_before_copying():
    """A wrong shape, a missing or an unexpected key: an error that loads nothing (torch's load_state_dict
    had copied the keys before the bad one); a model's prefix is named; an old checkpoint's RoPE buffer is
    skipped."""
    config = llama_config()
    hf = random_hf_layer(config)
    ours = cdnn.LlamaDecoderLayer(config, backend="reference")
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    sd = hf.state_dict()
    for bad, what in (({**sd, "mlp.down_proj.weight": torch.zeros(64, 95)}, r"mlp.down_proj.weight: \[64, 95\]"),
                      ({k: v for k, v in sd.items() if k != "mlp.up_proj.weight"}, "missing keys.*mlp.up_proj"),
                      ({f"model.layers.0.{k}": v for k, v in sd.items()}, "prefix.*'model.layers.0.'"),
                      ({f"model.layers.{i}.{k}": v for i in range(3) for k, v in sd.items()},  # a whole model's
                       r"'\.\.\. 19 more'\]; nothing loaded\n  fix: this holds 3 layers' weights: take one's")):
        with pytest.raises(cd.OperandError, match=what):
            ours.load_hf_state_dict(bad)
        assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())
    ours.load_hf_state_dict({**sd, "self_attn.rotary_emb.inv_freq": torch.ones(8)})
    assert all(torch.equal(v, sd[k]) for k, v in ours.state_dict().items())


def test_from_hf_and_to_hf_keep_mode_frozen_parameters_and_eps():
    config = llama_config()
    hf = random_hf_layer(config).eval()
    hf.input_layernorm.weight.requires_grad_(False)
    hf.post_attention_layernorm.variance_epsilon = 1e-2
    ours = cdnn.LlamaDecoderLayer.from_hf(hf, backend="reference")
    assert not ours.training and not ours.input_layernorm.weight.requires_grad and ours.mlp.down_proj.weight.requires_grad
    assert ours.post_attention_layernorm.variance_epsilon == 1e-2
    back = ours.to_hf()
    assert not back.training and not back.input_layernorm.weight.requires_grad
    assert back.post_attention_layernorm.variance_epsilon == 1e-2


def test_the_output_can_be_changed_in_place():
    """As HF's layer's: the output is no view of a custom Function's (torch forbids changing those in place)."""
    layer = cdnn.LlamaDecoderLayer(llama_config(), backend="reference")
    y = layer(torch.randn(1, 4, 64, requires_grad=True))
    y.add_(1)
    F.dropout(layer(torch.randn(1, 4, 64)), 0.1, inplace=True)


def test_fused_optimizer_steps_over_tied_cpu_weights_are_refused():
    """torch's fused CPU optimizers ignore strides: over tied gate/up weights they would corrupt both halves
    (measured: 3 AdamW steps away from HF's by 0.3 in loss); foreach is exact, untied fused too."""
    layer = cdnn.LlamaDecoderLayer.from_hf(random_hf_layer(llama_config()), backend="reference")
    layer.mlp.tie_gate_up()
    layer(torch.randn(1, 4, 64)).sum().backward()
    with pytest.raises(cd.UnsupportedError, match=r"fused=True\) over tied gate/up weights"):
        torch.optim.AdamW(layer.parameters(), lr=1e-3, fused=True).step()
    torch.optim.AdamW(layer.parameters(), lr=1e-3, foreach=True).step()
    layer.mlp.untie_gate_up()
    torch.optim.AdamW(layer.parameters(), lr=1e-3, fused=True).step()


def test_gate_up_weights_are_halves_of_one_buffer():
    """After tie_gate_up, gate_proj.weight and up_proj.weight share one interleaved buffer (the gate/up
    GEMM's weight, no copy per forward) and stay so through casts and optimizer steps (the same Parameter
    objects); the untied layer (the default) gives the same results through the copy."""
    from coda_dsl.library import interleave_gate_up
    config = llama_config()
    hf = random_hf_layer(config)
    ours = cdnn.LlamaDecoderLayer.from_hf(hf, backend="reference")
    mlp = ours.mlp
    g, u = mlp.gate_proj.weight, mlp.up_proj.weight
    assert cdnn.gate_up_weight(g, u).data_ptr() != g.data_ptr() and g.is_contiguous()  # untied by default
    assert mlp.tie_gate_up() is mlp and mlp.gate_proj.weight is g
    view = cdnn.gate_up_weight(g, u)
    assert view.data_ptr() == g.data_ptr()  # no copy
    assert torch.equal(view, interleave_gate_up(g, u)) and torch.equal(g, hf.mlp.gate_proj.weight)
    ours.to(torch.float16).to(torch.float32)  # a cast and back: each makes the halves contiguous apart
    assert mlp.gate_proj.weight is g and g.dtype == torch.float32 and cdnn.gate_up_weight(g, u).data_ptr() == g.data_ptr()
    copied = copy.deepcopy(mlp)  # a copy's two weights are tied again, to each other
    cg, cu = copied.gate_proj.weight, copied.up_proj.weight
    assert cdnn._tied(cg, cu) and cg.data_ptr() != g.data_ptr() and torch.equal(cg, g) and torch.equal(cu, u)

    untied = cdnn.LlamaDecoderLayer.from_hf(hf, backend="reference").to(torch.float16).to(torch.float32)
    assert untied.mlp.gate_proj.weight.is_contiguous()
    x = torch.randn(2, 5, config.hidden_size)
    for layer in (ours, untied):
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        layer(x).square().sum().backward()
        opt.step()
    assert cdnn.gate_up_weight(g, u).data_ptr() == g.data_ptr()  # the step updated them in place, tied
    for (name, a), b in zip(ours.named_parameters(), untied.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(ours(x), untied(x), rtol=1e-5, atol=1e-5)


def test_untied_weights_save_with_safetensors(tmp_path):
    """state_dict() of a tied MLP holds the two views (aliases, as for every parameter); untie_gate_up()
    makes them contiguous tensors again (same Parameters, same values), which safetensors saves; the file
    loads into another layer with the same values, and into a tied one in place."""
    from safetensors.torch import load_file, save_file
    hf = random_hf_layer(llama_config())
    ours = cdnn.LlamaDecoderLayer.from_hf(hf, backend="reference")
    ours.mlp.tie_gate_up()
    g = ours.mlp.gate_proj.weight
    assert ours.state_dict()["mlp.gate_proj.weight"].data_ptr() == g.data_ptr()  # an alias, not a copy
    assert ours.mlp.untie_gate_up() is ours.mlp and ours.mlp.gate_proj.weight is g and not ours.mlp.tied
    assert g.is_contiguous() and not cdnn._tied(g, ours.mlp.up_proj.weight)
    save_file(ours.state_dict(), tmp_path / "layer.safetensors")
    fresh = cdnn.LlamaDecoderLayer.from_hf(random_hf_layer(llama_config()), backend="reference")
    fresh.mlp.tie_gate_up()
    fresh.load_state_dict(load_file(tmp_path / "layer.safetensors"))  # into the tied buffer, in place
    assert cdnn._tied(fresh.mlp.gate_proj.weight, fresh.mlp.up_proj.weight)
    for name, t in hf.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name


def test_bad_backend_is_refused_when_the_layer_is_made():
    with pytest.raises(cd.OperandError, match="backend must be one of"):
        cdnn.LlamaDecoderLayer(llama_config(), backend="Reference")


def test_dtype_cast_keeps_rope_frequencies_fp32():
    """layer.to(torch.bfloat16) casts float buffers too; the RoPE frequencies must stay exact fp32."""
    config = llama_config()
    hf = random_hf_layer(config)
    ours = cdnn.LlamaDecoderLayer.from_hf(hf, backend="reference")
    exact = ours.self_attn.qkv_inv_freq.clone()
    ours.to(torch.bfloat16)
    assert ours.self_attn.q_proj.weight.dtype == torch.bfloat16
    assert ours.self_attn.qkv_inv_freq.dtype == torch.float32
    assert torch.equal(ours.self_attn.qkv_inv_freq, exact)


def test_llama3_rope_scaling_matches_hf():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    config = llama_config(rope_parameters=rope, max_position_embeddings=128)
    hf = random_hf_layer(config)
    ours = cdnn.LlamaDecoderLayer.from_hf(hf, backend="reference")
    x = torch.randn(1, 40, config.hidden_size)
    pid = torch.arange(40)[None]
    assert rel_err(ours(x, position_ids=pid), hf_forward(hf, config, x, pid)) < 1e-5


def test_in_a_transformers_model():
    """Swapped into HF's LlamaModel: equal outputs with use_cache=False; the default (a KV cache) is refused
    with that fix, not computed wrongly."""
    from transformers import LlamaModel
    config = llama_config(attn_implementation="sdpa", num_hidden_layers=2, vocab_size=50)
    torch.manual_seed(0)
    hf = LlamaModel(config)
    ours = LlamaModel(config)
    ours.load_state_dict(hf.state_dict())
    for i, layer in enumerate(ours.layers):
        ours.layers[i] = cdnn.LlamaDecoderLayer.from_hf(layer, backend="reference")
    ids = torch.randint(0, 50, (2, 7))
    assert rel_err(ours(ids, use_cache=False).last_hidden_state, hf(ids, use_cache=False).last_hidden_state) < 1e-5
    with pytest.raises(cd.UnsupportedError, match="use_cache=False"):
        ours(ids)


def test_empty_batch_and_position_ids_not_a_tensor():
    layer = cdnn.LlamaDecoderLayer(llama_config(), backend="reference")
    x = torch.randn(0, 7, 64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == x.grad.shape == (0, 7, 64)
    with pytest.raises(cd.OperandError, match="position_ids must be a tensor"):
        layer(torch.randn(1, 3, 64), position_ids=[[0, 1, 2]])
    with pytest.raises(cd.OperandError, match="position_ids are token positions .* not torch.bool"):
        layer(torch.randn(1, 3, 64), position_ids=torch.ones(1, 3, dtype=torch.bool))


def test_refusals():
    for rope_type in ("dynamic",):  # frequencies that follow the sequence length: not fixed at load
        with pytest.raises(cd.UnsupportedError, match="changes its frequencies"):
            cdnn.LlamaDecoderLayer(llama_config(rope_parameters={"rope_type": rope_type, "factor": 2.0,
                                                                 "rope_theta": 1e4}))
    config = llama_config()
    ours = cdnn.LlamaDecoderLayer(config, backend="reference")
    x = torch.randn(1, 4, config.hidden_size)
    with pytest.raises(cd.UnsupportedError, match="causal only"):
        ours(x, attention_mask=torch.zeros(1, 1, 4, 4))
    with pytest.raises(cd.UnsupportedError, match="no KV cache"):
        ours(x, use_cache=True)
    with pytest.raises(cd.UnsupportedError, match="attention_bias"):
        cdnn.LlamaDecoderLayer(llama_config(attention_bias=True))
    from transformers import MistralConfig  # from_hf of a Mistral layer ignored its window (full causal attention)
    with pytest.raises(cd.UnsupportedError, match="sliding-window attention"):
        cdnn.LlamaDecoderLayer(MistralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                             num_key_value_heads=2, sliding_window=4))
    with pytest.raises(cd.UnsupportedError, match="hidden_act"):
        cdnn.LlamaDecoderLayer(llama_config(hidden_act="gelu"))
    d = config.hidden_size
    for bad, what in (((4, d), r"hidden_states must be \[batch, seq, %d\], got \[4, %d\]" % (d, d)),
                      ((1, 4, d + 1), "hidden_states must be"),
                      ((1, 4, d), r"position_ids must be \[1, 4\] or \[1, 4\], got \[1, 5\]"),
                      ((1, 4, d), r"input_rstd must be a \[1, 4\] torch.float32 tensor.*got torch.float32 \[4\]")):
        kw = {"position_ids": torch.arange(5)[None]} if "position_ids" in what else \
            {"input_rstd": torch.ones(4)} if "input_rstd" in what else {}
        with pytest.raises(cd.OperandError, match=what):
            ours(torch.randn(*bad), **kw)


def test_input_rstd_of_another_dtype_or_kind_is_refused():
    """input_rstd in the dtype return_rstd gives (fp32; fp64 for an fp64 layer): a bf16 one would round the
    norm silently, a list fail deep inside."""
    layer = cdnn.LlamaDecoderLayer(llama_config(), backend="reference")
    x = torch.randn(1, 4, 64)
    _, rstd = layer(x, return_rstd=True)
    assert rstd.dtype == torch.float32 and layer.double()(x.double(), return_rstd=True)[1].dtype == torch.float64
    layer.float()
    layer(x, input_rstd=rstd)
    for bad, got in ((rstd.bfloat16(), r"got torch.bfloat16 \[1, 4\]\n  fix: .*cast_forward_inputs=False"),
                     (rstd.tolist(), "got list")):
        with pytest.raises(cd.OperandError, match=r"input_rstd must be a \[1, 4\] torch.float32 tensor.*" + got):
            layer(x, input_rstd=bad)


def test_what_the_layer_would_ignore_is_refused():
    """The layer reads the projections' weights directly: an adapter wrapping a projection (PEFT's LoRA), a
    bias, a forward hook, or a parameter of another dtype is refused with the fix, not silently ignored."""
    class Adapter(torch.nn.Module):  # a LoRA-style wrapper: the base layer plus a low-rank update
        def __init__(self, base):
            super().__init__()
            self.base, self.a = base, torch.nn.Linear(base.in_features, 2, bias=False)
            self.weight = base.weight

        def forward(self, x):
            return self.base(x) + self.a(x).sum(-1, keepdim=True)

    config = llama_config()
    x = torch.randn(1, 4, 64)

    def layer():
        return cdnn.LlamaDecoderLayer.from_hf(random_hf_layer(config), backend="reference")
    wrapped = layer()
    wrapped.self_attn.q_proj = Adapter(wrapped.self_attn.q_proj)
    biased = layer()
    biased.mlp.down_proj = torch.nn.Linear(96, 64)
    hooked = layer()
    hooked.self_attn.o_proj.register_forward_hook(lambda m, i, o: o * 2)
    # hooks on a norm and backward hooks were skipped silently (the layer calls neither module)
    norm_hooked, grad_hooked, parametrized = layer(), layer(), layer()
    norm_hooked.input_layernorm.register_forward_pre_hook(lambda m, i: None)
    grad_hooked.mlp.up_proj.register_full_backward_hook(lambda m, gi, go: None)
    torch.nn.utils.parametrize.register_parametrization(parametrized.post_attention_layernorm, "weight",
                                                        torch.nn.Identity())
    for ours, what in ((wrapped, "(?s)self_attn.q_proj is a .*Adapter.*merge_and_unload"), (biased, "mlp.down_proj has a bias"),
                       (hooked, "self_attn.o_proj has hooks"), (norm_hooked, "input_layernorm has hooks"),
                       (grad_hooked, "mlp.up_proj has hooks"),
                       (parametrized, "post_attention_layernorm has no weight of its own")):
        with pytest.raises(cd.UnsupportedError, match=what):
            ours(x)
    mixed = layer()
    mixed.mlp.down_proj.double()
    with pytest.raises(cd.OperandError, match=r"mlp.down_proj.weight is torch.float64, but the layer computes in torch.float32"):
        mixed(x)


def test_functional_call_with_plain_tensors():
    """torch.func.functional_call puts plain tensors where the parameters were: the layer reads those (it was
    refused as if they were a parametrization), and their gradients are the layer's own."""
    ours = cdnn.LlamaDecoderLayer.from_hf(random_hf_layer(llama_config()), backend="reference")
    x = torch.randn(2, 5, 64)
    params = {k: (v.detach() * 1.5).requires_grad_() for k, v in ours.named_parameters()}
    y = torch.func.functional_call(ours, params, (x,))
    with torch.no_grad():
        for k, v in ours.named_parameters():
            v.mul_(1.5)
    want = ours(x)
    torch.testing.assert_close(y, want)
    y.square().sum().backward()
    want.square().sum().backward()
    for k, v in ours.named_parameters():
        torch.testing.assert_close(params[k].grad, v.grad, msg=k)


def test_hidden_states_a_transformers_model_collects_are_refused():
    """transformers >= 5 collects output_hidden_states with hooks on its own layer class: a model of coda_dsl
    layers would return none of them, so the call is refused (older transformers collect them in the model's
    loop: they come back whole)."""
    from transformers import LlamaModel
    config = llama_config(attn_implementation="sdpa", num_hidden_layers=2, vocab_size=50)
    torch.manual_seed(0)
    model = LlamaModel(config)
    for i, layer in enumerate(model.layers):
        model.layers[i] = cdnn.LlamaDecoderLayer.from_hf(layer, backend="reference")
    ids = torch.randint(0, 50, (2, 7))
    try:
        import transformers.utils.output_capturing  # noqa: F401
    except ImportError:
        assert len(model(ids, use_cache=False, output_hidden_states=True).hidden_states) == 3
        return
    with pytest.raises(cd.UnsupportedError, match="collects hidden_states"):
        model(ids, use_cache=False, output_hidden_states=True)
    assert model(ids, use_cache=False).last_hidden_state.shape == (2, 7, 64)  # nothing left behind


def test_calls_that_would_be_silently_wrong_are_refused():
    """cos/sin tables without their positions (the layer rotates by positions, and would use 0..S-1), and
    attention implementations but sdpa/eager (flash attention splits packed sequences by position_ids or
    cu_seq_lens, others may pass no mask; this layer attends over whole rows)."""
    config = llama_config()
    ours = cdnn.LlamaDecoderLayer(config, backend="reference")
    x, pid = torch.randn(1, 7, config.hidden_size), positions(1, 7, packed=True)
    with pytest.raises(cd.UnsupportedError, match="position_embeddings without position_ids"):
        ours(x, position_embeddings=LlamaRotaryEmbedding(config)(x, pid))
    with pytest.raises(cd.UnsupportedError, match="other than 'sdpa' and 'eager'"):
        ours(x, position_ids=pid, cu_seq_lens_q=torch.tensor([0, 4, 7], dtype=torch.int32))
    for impl in ("flash_attention_2", "kernels-community/flash-attn"):  # a hub kernel's name too
        config = llama_config()
        config._attn_implementation = impl
        with pytest.raises(cd.UnsupportedError, match="other than 'sdpa' and 'eager'"):
            cdnn.LlamaDecoderLayer(config, backend="reference")(x)


def test_building_blocks_take_hf_constructor_arguments():
    """LlamaAttention(config, layer_idx) and LlamaMLP(config) as HF's; each refuses its own bias config;
    hidden_act 'swish' is SiLU (transformers' ACT2FN maps both to it)."""
    config = llama_config(hidden_act="swish")
    assert cdnn.LlamaAttention(config, 3).layer_idx == 3 and cdnn.LlamaMLP(config).down_proj.weight.shape == (64, 96)
    with pytest.raises(cd.UnsupportedError, match="attention_bias"):
        cdnn.LlamaAttention(llama_config(attention_bias=True), 0)
    with pytest.raises(cd.UnsupportedError, match="mlp_bias"):
        cdnn.LlamaMLP(llama_config(mlp_bias=True))


def test_made_on_the_meta_device_then_loaded():
    """The accelerate pattern: made under `with torch.device("meta")`, then to_empty() and a state dict. The
    RoPE frequencies (not in the state dict) are made on the CPU, so they survive; the layer equals HF's."""
    config = llama_config()
    hf = random_hf_layer(config)
    with torch.device("meta"):
        ours = cdnn.LlamaDecoderLayer(config, backend="reference")
    ours.to_empty(device="cpu").load_hf_state_dict(hf.state_dict())
    x, pid = torch.randn(2, 9, config.hidden_size), positions(2, 9, packed=False)
    assert rel_err(ours(x, position_ids=pid), hf_forward(hf, config, x, pid)) < 1e-5
    with torch.device("meta"):  # or load_state_dict(assign=True): the frequencies stayed on meta
        assigned = cdnn.LlamaDecoderLayer(config, backend="reference")
    assigned.load_state_dict(hf.state_dict(), assign=True)
    assert rel_err(assigned(x, position_ids=pid), hf_forward(hf, config, x, pid)) < 1e-5


def test_transformers_gradient_checkpointing_enable_checkpoints_the_layer(monkeypatch):
    """model.activation_checkpointing_enable() (gradient_checkpointing_enable() before transformers 5.x) on a
    transformers model whose layers are coda_dsl's: each layer's
    step runs again in the backward (as HF's own layers), with the same gradients."""
    from transformers import LlamaModel
    config = llama_config(attn_implementation="sdpa", num_hidden_layers=1, vocab_size=50)
    torch.manual_seed(0)
    model = LlamaModel(config)
    model.layers[0] = cdnn.LlamaDecoderLayer.from_hf(model.layers[0], backend="reference")
    ids = torch.randint(0, 50, (2, 9))
    steps = []
    layer = model.layers[0]
    monkeypatch.setattr(layer, "_step", lambda *a, _f=layer._step, **k: steps.append(1) or _f(*a, **k))

    def step_grads():
        model.zero_grad()
        model(ids, use_cache=False).last_hidden_state.square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = step_grads()
    assert len(steps) == 1
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    checkpointed = step_grads()
    assert len(steps) == 3  # the forward's step, and again in the backward
    for a, b in zip(checkpointed, plain):
        torch.testing.assert_close(a, b)


def test_attention_dropout_in_training_as_hf_applies_it():
    config = llama_config(attention_dropout=0.5, attn_implementation="sdpa")  # HF's SDPA: the same dropout RNG use
    hf = random_hf_layer(config)
    ours = cdnn.LlamaDecoderLayer.from_hf(hf, backend="reference")
    x, pos = torch.randn(2, 9, config.hidden_size), positions(2, 9, False)
    for train in (True, False):
        hf.train(train), ours.train(train)
        torch.manual_seed(1)
        want = hf(x, position_ids=pos, position_embeddings=LlamaRotaryEmbedding(config)(x, pos))
        want = want[0] if isinstance(want, tuple) else want
        torch.manual_seed(1)
        got = ours(x, position_ids=pos)
        assert rel_err(got, want) < 1e-5
        torch.manual_seed(2)
        assert (ours(x, position_ids=pos) != got).any() == train  # a new mask per call in training only


def test_inputs_of_another_dtype_and_autocast_are_refused():
    ours = cdnn.LlamaDecoderLayer(llama_config(), backend="reference")  # fp32 weights
    x = torch.randn(1, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(cd.OperandError, match=r"(?s)hidden_states are torch.bfloat16 but the layer's weights are "
                                              r"torch.float32.*layer.to\(torch.bfloat16\)"):
        ours(x)  # its backward would mix them (HF's promotes to fp32)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(cd.UnsupportedError, match="autocast"):
        ours(x.float())


def _eager_and_wrapped_grads(wrap):
    """(dx, grads) of the layer called eagerly, and called through wrap(layer)(x)."""
    config = llama_config()
    ours = cdnn.LlamaDecoderLayer.from_hf(random_hf_layer(config), backend="reference")
    x = torch.randn(2, 7, config.hidden_size, requires_grad=True)
    dy = torch.randn_like(x)
    dx, g = grads(ours, x, ours(x), dy)
    dx, g = dx.clone(), {n: t.clone() for n, t in g.items()}
    return (dx, g), grads(ours, x, wrap(ours)(x), dy)


def test_activation_checkpointing_same_gradients():
    from torch.utils.checkpoint import checkpoint
    (dx, g), (dx_c, g_c) = _eager_and_wrapped_grads(lambda m: lambda x: checkpoint(m, x, use_reentrant=False))
    torch.testing.assert_close(dx_c, dx, rtol=0, atol=0)
    for n in g:
        torch.testing.assert_close(g_c[n], g[n], rtol=0, atol=0)


def test_torch_compile_fullgraph_cpu():
    """fullgraph=True traces the four autograd.Functions and cd.gemm (a custom op) without a graph break
    (aot_eager: no C++ compiler needed)."""
    (dx, g), (dx_c, g_c) = _eager_and_wrapped_grads(lambda m: torch.compile(m, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(dx_c, dx, rtol=1e-5, atol=1e-6)
    for n in g:
        torch.testing.assert_close(g_c[n], g[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dynamic", [None, True])
def test_torch_compile_fullgraph_as_sequence_lengths_change(dynamic):
    """torch.compile's default dynamic shapes (the second length recompiles with a symbolic token count, and
    later lengths reuse that graph), and dynamic=True (every size, and the norms' eps, symbolic from the
    start): outputs and gradients stay the eager ones."""
    config = llama_config()
    ours = cdnn.LlamaDecoderLayer.from_hf(random_hf_layer(config), backend="reference")
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for s in (7, 9, 12):
        x = torch.randn(2, s, config.hidden_size, requires_grad=True)
        dy = torch.randn_like(x)
        dx, g = grads(ours, x, ours(x), dy)
        dx, g = dx.clone(), {n: t.clone() for n, t in g.items()}
        dx_c, g_c = grads(ours, x, compiled(x), dy)
        torch.testing.assert_close(dx_c, dx, rtol=1e-5, atol=1e-6)
        for n in g:
            torch.testing.assert_close(g_c[n], g[n], rtol=1e-5, atol=1e-6)


def test_backward_steps_compile_to_the_same_values():
    """On CUDA the layer's torch backward steps run through torch.compile (runtime/torch_compile.py); compiled here
    on the CPU they give what they give eagerly (None arguments included)."""
    torch.manual_seed(0)
    m, n = 9, 16
    f32 = lambda *s: torch.randn(*s)  # noqa: E731
    rstd = torch.rand(m) + 0.5
    cases = [(cdnn.residual_rms_backward, (f32(m, n), f32(m), f32(m, n), rstd, 1.0 / n)),
             (cdnn._swiglu_of_acc, (f32(m, 2 * n), rstd))]
    for step, args in cases:
        want = step(*args)
        got = torch.compile(step.eager, dynamic=True)(*args)
        for g, w in zip(got, want) if isinstance(want, tuple) else [(got, want)]:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_forward_steps_compile_to_the_same_values_and_gradients():
    """input_norm is differentiated through torch.compile on CUDA (its autograd: one fused backward), and
    qkv_weight is inside a compiled layer; compiled here on the CPU, their outputs and input gradients are
    the eager ones."""
    torch.manual_seed(0)
    m, n = 9, 16
    rstd = (torch.rand(m) + 0.5).requires_grad_()
    norm = cdnn.input_norm.eager  # the function itself: cdnn.input_norm compiles it on CUDA
    cases = [(norm, lambda: (torch.randn(m, n), torch.randn(n)), (1e-5, None)),
             (norm, lambda: (torch.randn(m, n), torch.randn(n), rstd), (1e-5,)),
             (cdnn.qkv_weight, lambda: (torch.randn(8, n), torch.randn(4, n), torch.randn(4, n)), (4,))]
    for step, make, rest in cases:
        results = []
        for fn in (step, torch.compile(step, dynamic=True)):
            torch.manual_seed(1)
            tensors = [t if t.requires_grad else t.requires_grad_() for t in make()]
            args = (*tensors[:2], *rest, *tensors[2:]) if step is norm else (*tensors, *rest)
            outs = fn(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs)
            results.append((outs, torch.autograd.grad(loss, tensors)))
        (outs_e, grads_e), (outs_c, grads_c) = results
        for got, want in zip((*outs_c, *grads_c), (*outs_e, *grads_e)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_forward_without_gradients_stores_no_accumulator(monkeypatch):
    """Under no_grad (or with nothing requiring grad) the MLP's gate/up GEMM writes y alone (rms_swiglu),
    not the [M, 2F] accumulator only a backward reads; the output is the training forward's."""
    layer = cdnn.LlamaDecoderLayer(llama_config(), backend="reference")
    x = torch.randn(2, 16, layer.hidden_size)
    used, gemm = [], cd.gemm
    monkeypatch.setattr(cd, "gemm", lambda a, b, ep, **kw: (used.append(ep), gemm(a, b, ep, **kw))[1])
    with torch.no_grad():
        y_inference = layer(x)
    inference, used[:] = list(used), []
    y_training = layer(x)
    assert cdnn.rms_swiglu in inference and cdnn.rms_swiglu_fwd not in inference
    assert cdnn.rms_swiglu_fwd in used and cdnn.rms_swiglu not in used
    torch.testing.assert_close(y_inference, y_training.detach(), rtol=1e-6, atol=1e-6)
    for p in layer.parameters():
        p.requires_grad_(False)
    used[:] = []
    torch.testing.assert_close(layer(x), y_inference, rtol=1e-6, atol=1e-6)  # frozen: no grad anywhere
    assert cdnn.rms_swiglu in used


def test_prebuild_builds_the_kernels_of_a_training_step(fake_kernels, monkeypatch):
    """LlamaDecoderLayer.prebuild: one forward and backward (GEMMs on the reference backend meanwhile) notes
    every kernel the layer launches; they are built in one run, and no gradient is left in .grad."""
    from coda_dsl.runtime import op as runtime
    builds = []
    monkeypatch.setattr(runtime.build, "build_units", lambda units, jobs=None: builds.append(units))
    layer = cdnn.LlamaDecoderLayer(llama_config(), backend="cutlass", dtype=torch.bfloat16)
    with torch.no_grad():  # as a caller might: prebuild still runs the backward
        n = layer.prebuild(64)
    names = {op.epilogue.name for op in runtime._ops.values()}
    assert len(builds) == 1 and n == len(builds[0]) == len(runtime._ops) and fake_kernels == []
    assert {"rms_rope", "rms_producer", "rms_swiglu", "residual_rms", "input_norm_grad", "post_norm_grad",
            "gain_wgrad"} <= names  # rms_swiglu: the MLP's forward under no_grad
    # one kernel per epilogue at this size (the default config everywhere); rms_swiglu twice: y alone under
    # no_grad, y and the accumulator for training
    assert len(names) == 8 and n == 9, names
    assert all(p.grad is None for p in layer.parameters())
    assert cdnn.LlamaDecoderLayer(llama_config(), backend="reference").prebuild(64) == 0 and len(builds) == 1
