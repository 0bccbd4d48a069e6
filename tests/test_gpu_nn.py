"""coda_dsl.nn.LlamaDecoderLayer on the cutlass backend (sm_90): against the reference backend and HF in bf16,
under torch.compile(fullgraph=True), activation checkpointing and CUDA graphs. Skipped without a Hopper GPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from test_nn import grads, hf_forward, llama_config, random_hf_layer, rel_err  # noqa: E402

from coda_dsl import nn as cdnn  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU; none visible to torch")

B, S = 2, 300  # M = 600: ragged against every tile size


def build_kernels():
    """The layer's kernels in one parallel build (LlamaDecoderLayer.prebuild), as tests/test_gpu.py
    builds its own; one it misses only costs a build on first use."""
    cdnn.LlamaDecoderLayer(gpu_config(), dtype=torch.bfloat16, device="cuda").prebuild(B * S)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    build_kernels()


def gpu_config():
    # hidden 512, 8 heads of 64, 4 KV heads: QKV N = 1024, gate/up N = 2 * 1408; every N and K a multiple of 8
    return llama_config(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                        intermediate_size=1408)


def layers(config):
    hf = random_hf_layer(config).to("cuda", torch.bfloat16)
    return hf, {b: cdnn.LlamaDecoderLayer.from_hf(hf, backend=b) for b in ("cutlass", "reference")}


def run(layer, x, dy, fn=None):
    """fn(x) (default: layer(x)) -> (output, dx, {parameter name: grad}) with the layer's parameter names."""
    x = x.detach().clone().requires_grad_()
    y = (layer if fn is None else fn)(x)
    dx, g = grads(layer, x, y, dy)
    return y.detach(), dx, {n: t.clone() for n, t in g.items()}


@pytest.mark.parametrize("tied", [False, True])
def test_cutlass_matches_reference_bf16(tied):
    """tied: gate/up weights as halves of one interleaved buffer (tie_gate_up), so the backward's GEMMs
    read W_up with a row stride of 2 D (post_norm_grad's B operand among them)."""
    config = gpu_config()
    _, ours = layers(config)
    if tied:
        for layer in ours.values():
            layer.mlp.tie_gate_up()
    torch.manual_seed(1)
    x = torch.randn(B, S, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    y_c, dx_c, g_c = run(ours["cutlass"], x, dy)
    y_r, dx_r, g_r = run(ours["reference"], x, dy)
    assert y_c.dtype == torch.bfloat16
    assert rel_err(y_c, y_r) < 2e-2
    with torch.no_grad():  # the MLP's y-only kernel (no accumulator stored): the training forward's values
        assert rel_err(ours["cutlass"](x), y_c) < 1e-3
    assert rel_err(dx_c, dx_r) < 3e-2
    for n in g_r:
        assert rel_err(g_c[n], g_r[n]) < 3e-2, n


def test_cutlass_within_hf_bf16_error():
    """Against HF in fp32: the cutlass layer's error is within twice HF's own bf16 error."""
    config = gpu_config()
    hf16, ours = layers(config)
    hf32 = random_hf_layer(config).to("cuda")
    torch.manual_seed(1)
    x = torch.randn(B, S, config.hidden_size, device="cuda")
    dy = torch.randn_like(x) / x.numel() ** 0.5
    pid = torch.arange(S, device="cuda")[None].expand(B, S)
    out = {}
    for name, layer, dtype in (("ref", hf32, torch.float32), ("hf", hf16, torch.bfloat16),
                               ("ours", ours["cutlass"], torch.bfloat16)):
        xi = x.detach().to(dtype).requires_grad_()
        y = hf_forward(layer, config, xi, pid) if name != "ours" else layer(xi, position_ids=pid)
        out[name] = (y.detach(), *grads(layer, xi, y, dy.to(dtype)))
    for i in (0, 1):
        assert rel_err(out["ours"][i], out["ref"][i]) < 2 * rel_err(out["hf"][i], out["ref"][i]) + 2e-3
    for n in out["ref"][2]:
        ours_err, hf_err = rel_err(out["ours"][2][n], out["ref"][2][n]), rel_err(out["hf"][2][n], out["ref"][2][n])
        assert ours_err < 2 * hf_err + 2e-3, (n, ours_err, hf_err)


def test_torch_compile_fullgraph_and_checkpointing():
    from torch.utils.checkpoint import checkpoint
    config = gpu_config()
    _, ours = layers(config)
    layer = ours["cutlass"]
    torch.manual_seed(1)
    x = torch.randn(B, S, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    y, dx, g = run(layer, x, dy)
    compiled = torch.compile(layer, fullgraph=True)
    for _ in range(2):  # the second call reuses the compiled graph
        y_c, dx_c, g_c = run(layer, x, dy, compiled)
    assert rel_err(y_c, y) < 1e-2 and rel_err(dx_c, dx) < 1e-2
    for n in g:
        assert rel_err(g_c[n], g[n]) < 1e-2, n
    y_k, dx_k, g_k = run(layer, x, dy, lambda t: checkpoint(layer, t, use_reentrant=False))
    assert rel_err(y_k, y) < 1e-2 and rel_err(dx_k, dx) < 1e-2
    for n in g:
        assert rel_err(g_k[n], g[n]) < 1e-2, n


def test_cuda_graphs_forward_and_backward():
    config = gpu_config()
    _, ours = layers(config)
    layer = ours["cutlass"]
    torch.manual_seed(1)
    x = torch.randn(B, S, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    run(layer, x, dy)  # builds every kernel before capture
    graphed = torch.cuda.make_graphed_callables(layer, (x,))
    for _ in range(2):  # replays on new inputs (a graph reading its capture's data would still match those)
        x, dy = torch.randn_like(x).requires_grad_(), torch.randn_like(dy)
        y, dx, g = run(layer, x, dy)
        y_g, dx_g, g_g = run(graphed, x, dy)
        assert rel_err(y_g, y) < 1e-2 and rel_err(dx_g, dx) < 1e-2
        for n in g:
            assert rel_err(g_g[n], g[n]) < 1e-2, n


@pytest.mark.parametrize("m,hq,hk,d", [(777, 32, 8, 128), (600, 6, 2, 80)])
def test_rope_backward_kernel_matches_its_reference(m, hq, hk, d):
    """The layer's RoPE backward (one Triton kernel) against its torch twin: Llama-3-8B's heads and a ragged
    config (head counts and half head dim not powers of two), positions up to 131072, q's gradient strided."""
    from coda_dsl.triton_kernels import rope_backward, rope_backward_reference
    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    n = (hq + 2 * hk) * d
    dq = torch.randn(m, n + 64, **bf)[:, : hq * d]
    dk, dv, y = torch.randn(m, hk * d, **bf), torch.randn(m, hk * d, **bf), torch.randn(m, n, **bf)
    rstd = torch.rand(m, device="cuda") + 0.5
    pos = torch.randint(0, 131072, (m,), device="cuda").float()
    freq = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d)
    dacc, drstd = rope_backward(dq, dk, dv, y, rstd, pos, freq)
    want_acc, want_rstd = rope_backward_reference(dq, dk, dv, y, rstd, pos, freq)
    assert dacc.dtype == torch.bfloat16 and dacc.shape == (m, n) and drstd.shape == (m,)
    torch.testing.assert_close(dacc.float(), want_acc.float(), rtol=1e-2, atol=1e-2)  # bf16 rounding
    torch.testing.assert_close(drstd, want_rstd, rtol=1e-4, atol=1e-3)
