"""coda_dsl.triton_kernels: each kernel's plain-torch twin against autograd, and the kernel against its twin,
on the CPU through Triton's interpreter (the kernel's index and rotation logic, no GPU needed). On the GPU:
tests/test_gpu_nn.py."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from coda_dsl.triton_kernels import rope_backward_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rope_forward(acc, rstd, pos, freq, hq, hk):
    """y = rope(rstd[m] * acc): q's and k's column pairs of every head rotate by pos * freq (in fp32, as the
    epilogue computes it; in fp64 for fp64, as the reference backend does), v's pass."""
    x = rstd[:, None] * acc
    rotated = (hq + hk) * 2 * freq.numel()
    pairs = x[:, :rotated].unflatten(-1, (-1, freq.numel(), 2))
    f = torch.promote_types(acc.dtype, torch.float32)
    angle = (pos.to(f)[:, None, None] * freq.to(f)[None, None, :]).to(acc.dtype)
    c, s = angle.cos(), angle.sin()
    x0, x1 = pairs[..., 0], pairs[..., 1]
    turned = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(1)
    return torch.cat((turned, x[:, rotated:]), dim=1)


@pytest.mark.parametrize("hq,hk,d", [(4, 2, 8), (3, 1, 10)])
def test_rope_backward_reference_is_autograd_of_the_rotation(hq, hk, d):
    torch.manual_seed(0)
    m, n = 7, (hq + 2 * hk) * d
    acc = torch.randn(m, n, dtype=torch.float64, requires_grad=True)
    rstd = (torch.rand(m, dtype=torch.float64) + 0.5).requires_grad_()
    pos = torch.randint(0, 131072, (m,)).double()
    freq = 1.0 / 500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    y = rope_forward(acc, rstd, pos, freq, hq, hk)
    dy = torch.randn_like(y)
    want_acc, want_rstd = torch.autograd.grad(y, (acc, rstd), dy)
    dq, dk, dv = dy.split((hq * d, hk * d, hk * d), dim=1)
    dacc, drstd = rope_backward_reference(dq, dk, dv, y.detach(), rstd.detach(), pos, freq)
    assert dacc.dtype == dq.dtype and drstd.dtype == torch.float64  # fp64 inputs: fp64 math (fp32 for narrower)
    torch.testing.assert_close(dacc, want_acc, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(drstd.double(), want_rstd, rtol=1e-4, atol=1e-4)


def test_rope_backward_kernel_in_the_interpreter():
    """The Triton kernel, run by Triton's CPU interpreter (TRITON_INTERPRET is read when the kernel is
    defined: a fresh process), through its custom op, eagerly and under torch.compile(fullgraph=True) (the
    op's fake implementation), against its twin: head counts and half head dims that are not powers of two
    (masked blocks), GQA and MHA, bf16, fp16 and fp32, M = 1, gradients with strided rows, a stride-0 one,
    zeros, and one whose columns are not adjacent."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch
        from coda_dsl import triton_kernels as tk
        torch.manual_seed(0)
        op = torch.ops.coda_dsl.rope_backward
        compiled = torch.compile(lambda *t: op(*t), fullgraph=True, backend="aot_eager")
        def grads(m, hq, hk, d, dtype, layout):
            dq, dk, dv = (torch.randn(m, h * d + 6, dtype=dtype)[:, :h * d] for h in (hq, hk, hk))  # strided rows
            if layout == "transposed":  # columns not adjacent: the op copies
                dq = torch.randn(hq * d, m, dtype=dtype).t()
            elif layout == "expanded":  # one row for all (stride 0), and autograd's zeros
                dq, dk = torch.randn(1, hq * d, dtype=dtype).expand(m, -1), torch.zeros(m, hk * d, dtype=dtype)
            return dq, dk, dv

        cases = [(5, 4, 2, 16, torch.bfloat16, "strided"), (3, 3, 1, 10, torch.bfloat16, "strided"),
                 (4, 6, 6, 10, torch.float16, "expanded"), (1, 2, 1, 2, torch.float32, "transposed")]
        for m, hq, hk, d, dtype, layout in cases:
            dq, dk, dv = grads(m, hq, hk, d, dtype, layout)
            y, rstd = torch.randn(m, (hq + 2 * hk) * d, dtype=dtype), torch.rand(m) + 0.5
            pos = torch.randint(0, 131072, (m,)).float()
            freq = 1.0 / 500000.0 ** (torch.arange(0, d, 2).float() / d)
            want_acc, want_rstd = tk.rope_backward_reference(dq, dk, dv, y, rstd, pos, freq)
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # rounding
            for fn in (op, compiled):
                dacc, drstd = fn(dq, dk, dv, y, rstd, pos, freq)
                assert dacc.dtype == dtype and dacc.shape == y.shape and drstd.shape == (m,)
                torch.testing.assert_close(dacc.float(), want_acc.float(), **tol)
                torch.testing.assert_close(drstd, want_rstd, rtol=1e-4, atol=1e-4)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_scale_kernel_in_the_interpreter():
    """triton_kernels.scale_'s kernel in Triton's CPU interpreter: t *= by for sizes that leave a partial
    block and take the grid-stride loop more than once, in bf16, fp16 and fp32; by == 1 leaves t's bytes
    as they were (NaN included). On the GPU: tests/test_gpu.py's cross-entropy tests (their backward runs
    it with the gradient 1 and 0.5)."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch
        from coda_dsl import triton_kernels as tk
        for n in (1, 4095, 3 * tk._SCALE_BLOCK + 5):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                t = torch.randn(n).to(dtype)
                want = t * torch.tensor(0.375)
                tk._launch_scale(t, torch.tensor(0.375), programs=2)
                # the interpreter casts fp32 to bf16 by truncation (the GPU rounds): one ulp apart
                tol = dict(rtol=2 ** -7, atol=0) if dtype == torch.bfloat16 else dict(rtol=0, atol=0)
                torch.testing.assert_close(t, want, **tol)
                t[0] = float("nan")
                before = t.clone()
                tk._launch_scale(t, torch.tensor(1.0), programs=2)
                assert torch.equal(t.view(torch.uint8), before.view(torch.uint8)), (n, dtype)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
