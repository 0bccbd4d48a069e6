"""The reference backend on CPU against PyTorch formulas written out here, independently of
coda_dsl's own evaluator. Fresh random data each run; ragged shapes; ‖out−ref‖/‖ref‖ ≤ 1e-2 for
bf16 outputs, ≤ 1e-5 for fp32 results."""
import math

import pytest
import torch

import coda_dsl as cd
from coda_dsl.ir.graph import walk
from coda_dsl.ir.ops import OPS
from epilogues import bias_gelu

M, N, K = 77, 104, 40  # ragged: no multiple of any tile
BF16_TOL, FP32_TOL = 1e-2, 1e-5


def gemm(*args, **kw):
    return cd.gemm(*args, backend="reference", **kw)


def acc64(a, b):
    """A @ B^T in fp64 (b: [N, K] or [L, N, K])."""
    return a.double() @ b.double().transpose(-1, -2)


def gelu_erf(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def sigmoid(x):
    return 1 / (1 + torch.exp(-x))


# ---------------------------------------------------------------------------------------------
def test_bias_gelu(seed, rel):
    a, w = torch.randn(M, K).bfloat16(), torch.randn(N, K).bfloat16()
    bias = torch.randn(N).bfloat16()
    out = gemm(a, w, bias_gelu, bias=bias)
    assert list(out) == ["D"]
    d = out["D"]
    assert d.dtype == torch.bfloat16 and d.shape == (M, N)
    assert rel(d, gelu_erf(acc64(a, w) + bias.double())) <= BF16_TOL


@cd.epilogue
def residual_scaled(acc, residual: cd.Tensor, scale: cd.VecM, alpha: cd.Scalar):
    return {"D": acc * scale + alpha * residual, "h": cd.cast(acc * scale, cd.float32)}


def test_residual_vec_m_scale_and_scalar(seed, rel):
    a, w = torch.randn(M, K).bfloat16(), torch.randn(N, K).bfloat16()
    r, s = torch.randn(M, N).bfloat16(), torch.rand(M) + 0.5  # fp32 per-row scale
    out = gemm(a, w, residual_scaled, residual=r, scale=s, alpha=-0.75)
    h = acc64(a, w) * s.double()[:, None]
    assert out["D"].dtype == torch.bfloat16 and out["h"].dtype == torch.float32
    assert rel(out["D"], h - 0.75 * r.double()) <= BF16_TOL
    assert rel(out["h"], h) <= FP32_TOL


# ---------------------------------------------------------------------------------------------
# every elementwise op, fp32 in and out (1e-5)
# ---------------------------------------------------------------------------------------------
def _pos(x):
    return x.abs() + 0.5


# op -> (DSL over (acc, y), torch formula over (acc, y) in fp64, data: "real" | "int")
ELEMENTWISE = {
    "add": (lambda a, y: a + y, lambda a, y: a + y, "real"),
    "sub": (lambda a, y: a - y, lambda a, y: a - y, "real"),
    "mul": (lambda a, y: a * y, lambda a, y: a * y, "real"),
    "div": (lambda a, y: a / y, lambda a, y: a / y, "real"),
    "neg": (lambda a, y: -a, lambda a, y: -a, "real"),
    "maximum": (lambda a, y: cd.maximum(a, y), lambda a, y: torch.where(a > y, a, y), "real"),
    "minimum": (lambda a, y: cd.minimum(a, y), lambda a, y: torch.where(a < y, a, y), "real"),
    "lt": (lambda a, y: (a < y) + 2, lambda a, y: (a < y).double() + 2, "int"),
    "le": (lambda a, y: (a <= y) + 2, lambda a, y: (a <= y).double() + 2, "int"),
    "gt": (lambda a, y: (a > y) + 2, lambda a, y: (a > y).double() + 2, "int"),
    "ge": (lambda a, y: (a >= y) + 2, lambda a, y: (a >= y).double() + 2, "int"),
    "eq": (lambda a, y: (a == y) + 2, lambda a, y: (a == y).double() + 2, "int"),
    "ne": (lambda a, y: (a != y) + 2, lambda a, y: (a != y).double() + 2, "int"),
    # where tests `!= 0`: the condition acc - y is an integer, zero somewhere, negative elsewhere
    "where": (lambda a, y: cd.where(a - y, a, y * 10), lambda a, y: torch.where(a - y != 0, a, y * 10), "int"),
    "exp": (lambda a, y: cd.exp(a * 0.1), lambda a, y: torch.exp(a * 0.1), "real"),
    "log": (lambda a, y: cd.log(cd.abs(a) + 0.5), lambda a, y: torch.log(_pos(a)), "real"),
    "sqrt": (lambda a, y: cd.sqrt(cd.abs(a) + 0.5), lambda a, y: _pos(a) ** 0.5, "real"),
    "rsqrt": (lambda a, y: cd.rsqrt(cd.abs(a) + 0.5), lambda a, y: 1 / _pos(a) ** 0.5, "real"),
    "tanh": (lambda a, y: cd.tanh(a * 0.3), lambda a, y: torch.tanh(a * 0.3), "real"),
    "sin": (lambda a, y: cd.sin(a * 0.3), lambda a, y: torch.sin(a * 0.3), "real"),
    "cos": (lambda a, y: cd.cos(a * 0.3), lambda a, y: torch.cos(a * 0.3), "real"),
    "sigmoid": (lambda a, y: cd.sigmoid(a), lambda a, y: sigmoid(a), "real"),
    "abs": (lambda a, y: cd.abs(a), lambda a, y: torch.where(a < 0, -a, a), "real"),
    "relu": (lambda a, y: cd.relu(a), lambda a, y: torch.where(a > 0, a, 0 * a), "real"),
    "gelu": (lambda a, y: cd.gelu(a), lambda a, y: gelu_erf(a), "real"),
    "gelu_tanh": (lambda a, y: cd.gelu(a, approximate="tanh"), lambda a, y: gelu_tanh(a), "real"),
    "silu": (lambda a, y: cd.silu(a), lambda a, y: a * sigmoid(a), "real"),
    "square": (lambda a, y: a ** 2, lambda a, y: a * a, "real"),
    "erf": (lambda a, y: cd.erf(a * 0.5), lambda a, y: torch.erf(a * 0.5), "real"),
    # integer data halved: exact halves, so ties (round to even) are exercised and nothing is near a step
    "round": (lambda a, y: cd.round(a * 0.5), lambda a, y: torch.round(a * 0.5), "int"),
    "floor": (lambda a, y: cd.floor(a * 0.5), lambda a, y: torch.floor(a * 0.5), "int"),
    "ceil": (lambda a, y: cd.ceil(a * 0.5), lambda a, y: torch.ceil(a * 0.5), "int"),
}


def test_outputs_are_new_tensors_even_when_an_operand_is_returned():
    """As the kernel's outputs are: writing into one must not change the caller's operand."""
    @cd.epilogue
    def passthrough(acc, r: cd.Tensor):
        return {"D": acc, "r_out": r}
    a, b, r = torch.randn(4, 8), torch.randn(6, 8), torch.randn(4, 6)
    out = cd.gemm(a, b, passthrough, r=r, backend="reference")
    assert torch.equal(out["r_out"], r)
    out["r_out"].zero_()
    assert r.abs().sum() > 0


def test_elementwise_table_covers_every_op():
    assert set(ELEMENTWISE) == set(OPS)


def _data(kind):
    if kind == "int":  # small integers: the accumulator is exact, so comparisons cannot flip
        a = torch.randint(-3, 4, (M, K)).float()
        w = torch.randint(-3, 4, (N, K)).float()
        y = torch.randint(-6, 7, (M, N)).float()
    else:
        a, w = torch.randn(M, K), torch.randn(N, K)
        y = torch.randn(M, N)
        y = torch.where(y.abs() < 0.2, y.sign() * 0.2 + y, y)  # away from 0 (a divisor)
    return a, w, y


@pytest.mark.parametrize("op", sorted(ELEMENTWISE))
def test_elementwise_op(seed, rel, op):
    dsl, formula, kind = ELEMENTWISE[op]

    def fn(acc, y: cd.Tensor):
        return dsl(acc, y)

    ep = cd.epilogue(fn)
    assert op in {n.op for n in walk(ep.program)}
    a, w, y = _data(kind)
    d = gemm(a, w, ep, y=y)["D"]
    assert d.dtype == torch.float32  # fp32 A: D defaults to fp32
    ref = formula(acc64(a, w), y.double())
    if kind == "int":
        assert torch.equal(d.double(), ref)
        if op in ("eq", "where"):
            assert (acc64(a, w) == y.double()).any(), "data should hit equality somewhere"
    else:
        assert rel(d, ref) <= FP32_TOL


def test_elementwise_in_bf16(seed, rel):
    """A mix of ops with bf16 inputs and a bf16 output."""
    @cd.epilogue
    def mix(acc, b: cd.VecN, s: cd.Scalar):
        x = acc * 0.2 + b
        return cd.silu(x) * cd.sigmoid(-x) + cd.tanh(x) / (1 + x ** 2) - cd.minimum(cd.relu(x), s)

    a, w, b = torch.randn(M, K).bfloat16(), torch.randn(N, K).bfloat16(), torch.randn(N).bfloat16()
    x = acc64(a, w) * 0.2 + b.double()
    ref = x * sigmoid(x) * sigmoid(-x) + torch.tanh(x) / (1 + x * x) - torch.clamp(x, min=0).clamp(max=0.3)
    d = gemm(a, w, mix, b=b, s=0.3)["D"]
    assert d.dtype == torch.bfloat16 and rel(d, ref) <= BF16_TOL


# ---------------------------------------------------------------------------------------------
# casts and output dtypes
# ---------------------------------------------------------------------------------------------
@cd.epilogue
def rounding(acc):
    return {"D": acc, "r": cd.cast(cd.cast(acc, cd.bfloat16), cd.float32),
            "r16": cd.cast(cd.cast(acc, cd.float16), cd.float32), "twice": cd.cast(acc, cd.bfloat16) * 2}


def test_gelu_is_the_kernels_formula_at_every_size():
    """F.gelu's vectorized CPU path gave NaN at inf and inf at 3.4e38 (where one value alone, and a folded
    constant, did not); the reference is the kernels' 0.5 x (1 + erf(x / sqrt 2)) at any size."""
    @cd.epilogue
    def g(acc, x: cd.Tensor):
        return cd.gelu(x)

    @cd.epilogue
    def folded(acc):
        return cd.gelu(float("inf")) + acc * 0.0

    x = torch.tensor([[float("inf"), 3.4e38, 1.0, -3.0]])
    got = cd.gemm(torch.zeros(1, 8), torch.zeros(4, 8), g, x=x, backend="reference")["D"]
    want = 0.5 * x.double() * (1 + torch.erf(x.double() / math.sqrt(2)))
    assert got[0, 0] == math.inf and got[0, 1] == 3.4e38 and torch.allclose(got[0, 2:].double(), want[0, 2:], rtol=2e-4)
    alone = cd.gemm(torch.zeros(1, 8), torch.zeros(1, 8), g, x=x[:, :1], backend="reference")["D"]
    assert alone.item() == math.inf == cd.gemm(torch.zeros(1, 8), torch.zeros(2, 8), folded, backend="reference")["D"][0, 0]


def test_cast_rounds(seed):
    a, w = torch.randn(M, K), torch.randn(N, K)
    out = gemm(a, w, rounding)
    acc = out["D"]
    assert acc.dtype == out["r"].dtype == out["r16"].dtype == out["twice"].dtype == torch.float32
    # exact: bf16 round-to-nearest-even of the fp32 accumulator, then back to fp32
    assert torch.equal(out["r"], acc.to(torch.bfloat16).to(torch.float32))
    assert torch.equal(out["r16"], acc.to(torch.float16).to(torch.float32))
    assert torch.equal(out["twice"], acc.to(torch.bfloat16).to(torch.float32) * 2)
    assert (out["r"] != acc).float().mean() > 0.9  # rounding really happened
    assert not torch.equal(out["r"], out["r16"])


def test_cast_saturates_like_storage(seed):
    ep = cd.epilogue(lambda acc: {"D": acc, "h": cd.cast(cd.cast(acc * 1e4, cd.float16), cd.float32)})
    a, w = torch.randn(M, K), torch.randn(N, K)
    out = gemm(a, w, ep)
    big = (out["D"] * 1e4).abs() >= 65520  # fp32 product, as the epilogue computes it; fp16 max is 65504
    assert big.any()
    assert torch.isinf(out["h"][big]).all() and torch.isfinite(out["h"][~big]).all()


@cd.epilogue
def aux_dtypes(acc, bias: cd.VecN):
    h = acc + bias
    return {"D": h, "h16": cd.cast(h, cd.float16), "h32": cd.cast(h, cd.float32),
            "gbf": cd.cast(cd.gelu(h), cd.bfloat16)}


@pytest.mark.parametrize("ab", [torch.bfloat16, torch.float16])
def test_aux_outputs_dtypes(seed, rel, ab):
    a, w, bias = torch.randn(M, K).to(ab), torch.randn(N, K).to(ab), torch.randn(N).to(ab)
    out = gemm(a, w, aux_dtypes, bias=bias)
    assert {k: v.dtype for k, v in out.items()} == {"D": ab, "h16": torch.float16, "h32": torch.float32,
                                                      "gbf": torch.bfloat16}
    h = acc64(a, w) + bias.double()
    assert rel(out["D"], h) <= BF16_TOL
    assert rel(out["h16"], h) <= BF16_TOL
    assert rel(out["h32"], h) <= FP32_TOL
    assert rel(out["gbf"], gelu_erf(h)) <= BF16_TOL
    assert all(v.shape == (M, N) and v.is_contiguous() for v in out.values())


def test_constant_output_is_broadcast(seed):
    @cd.epilogue
    def consts(acc, s: cd.Scalar):
        return {"D": acc, "k": acc * 0 + 2.5, "s": cd.cast(s * 1, cd.float32)}

    a, w = torch.randn(M, K), torch.randn(N, K)
    out = gemm(a, w, consts, s=-4)
    assert torch.equal(out["k"], torch.full((M, N), 2.5))
    assert torch.equal(out["s"], torch.full((M, N), -4.0))


# ---------------------------------------------------------------------------------------------
# batching, layouts, out=
# ---------------------------------------------------------------------------------------------
@cd.epilogue
def batched_ep(acc, r: cd.Tensor, sm: cd.VecM, bn: cd.VecN):
    return acc * sm + bn + r


L = 3


def test_batched_a_and_b(seed, rel):
    a, w = torch.randn(L, M, K).bfloat16(), torch.randn(L, N, K).bfloat16()
    r, sm, bn = torch.randn(L, M, N).bfloat16(), torch.randn(L, M), torch.randn(L, N).bfloat16()
    d = gemm(a, w, batched_ep, r=r, sm=sm, bn=bn)["D"]
    ref = torch.einsum("lmk,lnk->lmn", a.double(), w.double()) * sm.double()[:, :, None] \
        + bn.double()[:, None, :] + r.double()
    assert d.shape == (L, M, N) and rel(d, ref) <= BF16_TOL


def test_batched_operands_broadcast_over_l(seed, rel):
    a, w = torch.randn(L, M, K).bfloat16(), torch.randn(L, N, K).bfloat16()
    r, sm, bn = torch.randn(M, N).bfloat16(), torch.randn(M), torch.randn(N).bfloat16()
    d = gemm(a, w, batched_ep, r=r, sm=sm, bn=bn)["D"]
    ref = torch.einsum("lmk,lnk->lmn", a.double(), w.double()) * sm.double()[:, None] + bn.double() + r.double()
    assert d.shape == (L, M, N) and rel(d, ref) <= BF16_TOL


def test_batched_a_with_shared_b(seed, rel):
    a, w = torch.randn(L, M, K).bfloat16(), torch.randn(N, K).bfloat16()
    r, sm, bn = torch.randn(L, M, N).bfloat16(), torch.randn(L, M), torch.randn(N).bfloat16()
    out = gemm(a, w, batched_ep, r=r, sm=sm, bn=bn)
    ref = torch.einsum("lmk,nk->lmn", a.double(), w.double()) * sm.double()[:, :, None] + bn.double() + r.double()
    assert out["D"].shape == (L, M, N) and rel(out["D"], ref) <= BF16_TOL


@pytest.mark.parametrize("shapes", [
    dict(r=(M, N), sm=(L, M), bn=(N,)),
    dict(r=(L, M, N), sm=(M,), bn=(N,)),
    dict(r=(L, M, N), sm=(L, M), bn=(L, N)),
], ids=["tensor_MN", "vecm_M", "vecn_LN"])
def test_batched_a_shared_b_accepts_what_batched_b_accepts(seed, rel, shapes):
    a, w = torch.randn(L, M, K).bfloat16(), torch.randn(N, K).bfloat16()
    ops = {k: torch.randn(*s).bfloat16() for k, s in shapes.items()}
    expanded = gemm(a, w.expand(L, N, K), batched_ep, **ops)["D"]  # accepted with a 3-D B
    shared = gemm(a, w, batched_ep, **ops)["D"]
    assert shared.shape == (L, M, N) and rel(shared, expanded) <= 1e-6


@pytest.mark.parametrize("axis, shape", [("n", (L, M)), ("m", (L, N)), (None, (L,))])
def test_batched_a_shared_b_reductions(seed, rel, axis, shape):
    ep = cd.epilogue(lambda acc: {"D": acc, "s": cd.sum(acc, axis=axis)})
    a, w = torch.randn(L, M, K), torch.randn(N, K)
    s = gemm(a, w, ep)["s"]
    dims = {"n": (-1,), "m": (-2,), None: (-2, -1)}[axis]
    assert s.shape == shape and rel(s, acc64(a, w).sum(dim=dims)) <= FP32_TOL


def test_b_as_transposed_kn_weight(seed, rel):
    a, wkn = torch.randn(M, K).bfloat16(), torch.randn(K, N).bfloat16()
    bias = torch.randn(N).bfloat16()
    d = gemm(a, wkn.t(), bias_gelu, bias=bias)["D"]  # [K, N] storage passed as a [N, K] view
    assert rel(d, gelu_erf(a.double() @ wkn.double() + bias.double())) <= BF16_TOL


def test_out_preallocated_every_element_written(seed, rel):
    a, w, bias = torch.randn(M, K).bfloat16(), torch.randn(N, K).bfloat16(), torch.randn(N).bfloat16()
    out = {"D": torch.full((M, N), float("nan"), dtype=torch.bfloat16),
           "h32": torch.full((M, N), float("nan"), dtype=torch.float32),
           "gbf": torch.full((M, N), float("nan"), dtype=torch.bfloat16)}
    res = gemm(a, w, aux_dtypes, bias=bias, out=out)
    for name in out:
        assert res[name] is out[name]
        assert not torch.isnan(out[name]).any(), name
    assert res["h16"].dtype == torch.float16  # not preallocated: allocated as usual
    h = acc64(a, w) + bias.double()
    assert rel(out["h32"], h) <= FP32_TOL and rel(out["D"], h) <= BF16_TOL


def test_out_dtype_sets_default_output_dtype(seed, rel):
    """An fp32 `out` for D (default dtype) makes D fp32 even with bf16 A and B."""
    a, w, bias = torch.randn(M, K).bfloat16(), torch.randn(N, K).bfloat16(), torch.randn(N).bfloat16()
    d = torch.full((M, N), float("nan"))
    gemm(a, w, bias_gelu, bias=bias, out={"D": d})
    assert rel(d, gelu_erf(acc64(a, w) + bias.double())) <= FP32_TOL


def test_out_batched_with_shared_b(seed, rel):
    a, w = torch.randn(L, M, K), torch.randn(N, K)
    d = torch.full((L, M, N), float("nan"))
    res = gemm(a, w, cd.identity, out={"D": d})
    assert res["D"].shape == (L, M, N) and not torch.isnan(d).any()
    assert rel(d, torch.einsum("lmk,nk->lmn", a.double(), w.double())) <= FP32_TOL


# ---------------------------------------------------------------------------------------------
# reductions (fp32)
# ---------------------------------------------------------------------------------------------
REDUCE = {"sum": lambda x, d: x.sum(dim=d), "max": lambda x, d: x.amax(dim=d),
          "min": lambda x, d: x.amin(dim=d), "amax": lambda x, d: x.abs().amax(dim=d)}


@pytest.mark.parametrize("kind", sorted(REDUCE))
@pytest.mark.parametrize("axis", ["n", "m", None])
@pytest.mark.parametrize("ab", [torch.float32, torch.bfloat16])
def test_reductions(seed, rel, kind, axis, ab):
    def fn(acc, bias: cd.VecN):
        h = acc + bias
        return {"D": h, "r": getattr(cd, kind)(h * h if kind == "sum" else h, axis=axis)}

    ep = cd.epilogue(fn)
    a, w, bias = torch.randn(M, K).to(ab), torch.randn(N, K).to(ab), torch.randn(N).to(ab)
    out = gemm(a, w, ep, bias=bias)
    h = acc64(a, w) + bias.double()
    dims = {"n": (-1,), "m": (-2,), None: (-2, -1)}[axis]
    ref = REDUCE[kind](h * h if kind == "sum" else h, dims)
    r = out["r"]
    assert r.dtype == torch.float32 and out["D"].dtype == ab
    assert r.shape == {"n": (M,), "m": (N,), None: ()}[axis]
    assert rel(r, ref) <= FP32_TOL


def test_reduction_of_broadcast_operand(seed, rel):
    """A reduction of a value that does not depend on acc still runs over the full [M, N]."""
    @cd.epilogue
    def vec_only(acc, b: cd.VecN, s: cd.VecM):
        return {"D": acc, "sn": cd.sum(b * 1, axis="m"), "sm": cd.sum(s * 1, axis="n")}

    a, w, b, s = torch.randn(M, K), torch.randn(N, K), torch.randn(N), torch.randn(M)
    out = gemm(a, w, vec_only, b=b, s=s)
    assert rel(out["sn"], b.double() * M) <= FP32_TOL and rel(out["sm"], s.double() * N) <= FP32_TOL


def test_reductions_batched(seed, rel):
    ep = cd.epilogue(lambda acc: {"D": acc, "n": cd.max(acc, axis="n"), "all": cd.sum(acc * acc, axis=None)})
    a, w = torch.randn(L, M, K), torch.randn(L, N, K)
    out = gemm(a, w, ep)
    acc = torch.einsum("lmk,lnk->lmn", a.double(), w.double())
    assert out["n"].shape == (L, M) and rel(out["n"], acc.amax(-1)) <= FP32_TOL
    assert out["all"].shape == (L,) and rel(out["all"], (acc * acc).sum((-2, -1))) <= FP32_TOL


# ---------------------------------------------------------------------------------------------
# scalars and consts at call time
# ---------------------------------------------------------------------------------------------
def test_scalar_change_does_not_retrace(seed, rel):
    calls = []

    @cd.epilogue
    def affine(acc, alpha: cd.Scalar, beta: cd.Scalar):
        calls.append(1)
        return acc * alpha + beta

    a, w = torch.randn(M, K), torch.randn(N, K)
    acc = acc64(a, w)
    for alpha, beta in [(1.5, 0.0), (-2.0, 3), (0, 1e-3)]:
        d = gemm(a, w, affine, alpha=alpha, beta=beta)["D"]
        assert rel(d, acc * alpha + beta) <= FP32_TOL
    assert len(calls) == 1


def test_const_values(seed, rel):
    @cd.epilogue
    def with_const(acc, c: cd.Const):
        return acc * (c * 2) + c

    a, w = torch.randn(M, K), torch.randn(N, K)
    for c in (3, -0.5):
        d = gemm(a, w, with_const, c=c)["D"]
        assert rel(d, acc64(a, w) * (2 * c) + c) <= FP32_TOL


def test_ragged_tiny_shapes(seed, rel):
    for m, n, k in [(1, 1, 1), (3, 5, 7), (M, N, K)]:
        a, w, b = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
        d = gemm(a, w, bias_gelu, bias=b)["D"]
        assert d.shape == (m, n)
        assert rel(d, gelu_erf(acc64(a, w) + b.double())) <= BF16_TOL


def test_identity_default_epilogue(seed, rel):
    a, w = torch.randn(M, K).half(), torch.randn(N, K).half()
    d = cd.gemm(a, w, backend="reference")["D"]
    assert d.dtype == torch.float16 and rel(d, acc64(a, w)) <= BF16_TOL


# ---------------------------------------------------------------------------------------------
# torch.compile: cd.gemm is one custom op in the graph (runtime/torch_op.py)
# ---------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph(seed, rel):
    @cd.epilogue
    def affine16(acc, b: cd.VecN, s: cd.Scalar):
        return {"D": acc * s + b, "h": cd.cast(acc, cd.float16)}

    def block(a, w, b):
        o = cd.gemm(a, w, affine16, backend="reference", b=b, s=2.0)
        return o["D"] + 1, o["h"]

    torch._dynamo.reset()
    a, w, b = torch.randn(M, K), torch.randn(N, K), torch.randn(N)
    d, h = torch.compile(block, fullgraph=True)(a, w, b)
    assert d.shape == h.shape == (M, N) and h.dtype == torch.float16
    assert rel(d, acc64(a, w) * 2 + b.double() + 1) <= FP32_TOL
    assert rel(h, acc64(a, w)) <= BF16_TOL


def test_torch_compile_with_a_reduction(seed, rel):
    ep = cd.epilogue(lambda acc: {"D": acc, "s": cd.sum(acc, axis="n")})

    def block(a, w):
        return cd.gemm(a, w, ep, backend="reference")["s"] * 2

    torch._dynamo.reset()
    a, w = torch.randn(M, K), torch.randn(N, K)
    s = torch.compile(block, fullgraph=True)(a, w)
    assert s.shape == (M,) and rel(s, acc64(a, w).sum(-1) * 2) <= FP32_TOL
    # fp64 A and B: every output in fp64, the statistic too (the op's fake kernel said fp32: a compile error)
    a, w = a.double(), w.double()
    s = torch.compile(block, fullgraph=True)(a, w)
    assert s.dtype == torch.float64 and rel(s, acc64(a, w).sum(-1) * 2) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outputs_are_tensors_of_their_own(dtype):
    """As the kernel's: one value stored as two outputs is two tensors, and no output is a view (cd.linear's
    outputs, views of a custom Function, could not be changed in place)."""
    ep = cd.epilogue(lambda acc: (lambda h: {"D": h, "E": h})(cd.tanh(acc)))
    a, w = torch.randn(4, 3, dtype=dtype), torch.randn(6, 3, dtype=dtype)
    o = cd.gemm(a, w, ep, backend="reference")
    o["D"].add_(1.0)
    assert torch.equal(o["E"] + 1, o["D"]) and not any(t._is_view() for t in o.values())
    x, w = a.requires_grad_(), w.requires_grad_()
    y = cd.linear(x, w, backend="reference")["D"]
    y.add_(1.0)
    y.sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand_as(x))


def test_epilogue_factory_is_cached_and_runs_under_torch_compile(seed, rel):
    """cd.epilogue_factory: one epilogue per arguments, and callable inside torch.compile(fullgraph=True), where
    Dynamo calls it (tracing the DSL's tracer would break the graph); a factory that returns something else
    says so."""
    made = []

    @cd.epilogue_factory
    def scaled(factor: float, act: str):
        made.append((factor, act))
        return cd.epilogue(lambda acc: {"D": getattr(cd, act)(acc * factor)}, name=f"scaled_{act}")

    assert scaled(2.0, "relu") is scaled(2.0, "relu") and scaled(2.0, "silu") is not scaled(2.0, "relu")
    assert made == [(2.0, "relu"), (2.0, "silu")]

    def block(a, w):  # two epilogues made while one graph is traced (the second was a KeyError once)
        return cd.gemm(a, w, scaled(3.0, "relu"), backend="reference")["D"] + \
            cd.gemm(a, w, scaled(4.0, "relu"), backend="reference")["D"]

    torch._dynamo.reset()
    a, w = torch.randn(M, K), torch.randn(N, K)
    d = torch.compile(block, fullgraph=True, backend="aot_eager")(a, w)
    assert rel(d, torch.relu(acc64(a, w) * 3) + torch.relu(acc64(a, w) * 4)) <= FP32_TOL
    assert made[-2:] == [(3.0, "relu"), (4.0, "relu")]

    @cd.epilogue_factory
    def not_one(x):
        return x

    with pytest.raises(TypeError, match="not_one is a cd.epilogue_factory but returned int"):
        not_one(1)
    with pytest.raises(TypeError, match="takes constants, not tensors"):  # cached per tensor object otherwise
        scaled(torch.tensor(2.0), "relu")
    with pytest.raises(cd.EpilogueError, match="takes hashable constants.*\n  fix: pass a tuple"):
        scaled([2.0], "relu")
    assert scaled(float("nan"), "relu") is scaled(float("nan"), "relu")  # made once, though NaN equals no NaN
    for not_a_function in (3, scaled(2.0, "relu")):  # refused when decorated, not when first called
        with pytest.raises(cd.EpilogueError, match="decorates a function that makes an epilogue"):
            cd.epilogue_factory(not_a_function)


def test_torch_compile_statistics_of_half_and_double_width_values(seed, rel):
    """The custom op's fake outputs (what the graph believes before running) of column and row statistics
    over an N/2-wide (cd.pairs) and a 2N-wide (cd.interleave) value: the shapes eager gives, static and
    dynamic shapes."""
    @cd.epilogue
    def widths(acc):
        g, u = cd.pairs(acc)
        y = cd.silu(g) * u
        return {"D": y, "cols": cd.sum(y, axis="m"), "rows": cd.sum(y, axis="n"),
                "wide_cols": cd.sum(cd.interleave(acc, acc * 2), axis="m")}

    def block(a, w):
        o = cd.gemm(a, w, widths, backend="reference")
        return o["cols"] + torch.ones(o["cols"].shape[0]), o["rows"] * 2, o["wide_cols"] - 1

    for dynamic in (None, True):
        torch._dynamo.reset()
        a, w = torch.randn(M, K), torch.randn(N, K)
        got, want = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=dynamic)(a, w), block(a, w)
        assert [t.shape for t in got] == [t.shape for t in want] == [(N // 2,), (M,), (2 * N,)]
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e)


def _messages(e: BaseException) -> str:
    """An exception's message and its causes' (Dynamo wraps what the traced code raises)."""
    out = []
    while e is not None:
        out.append(str(e))
        e = e.__cause__ or e.__context__
    return "\n".join(out)


@pytest.mark.parametrize("call, message", [
    (lambda a, w, b: cd.gemm(a, w, _affine, backend="reference", b=b, s=2.0, scale=3.0), "unexpected operand(s) ['scale']"),
    (lambda a, w, b: cd.gemm(a, w, _affine, backend="reference", b=b, s="2"), "'s' (scalar) must be a number"),
    (lambda a, w, b: cd.gemm(a, w, _affine, backend="reference", b=b, s=2.0, deterministic="yes"),
     "deterministic must be True or False"),
    (lambda a, w, b: cd.gemm(a, w, _affine, backend="reference", b=b, s=2.0, out={"D": torch.empty(M, N).double()}),
     "out['D'] must be what the epilogue makes"),
    (lambda a, w, b: cd.gemm(a, w, _affine, backend="reference", b=b, s=2.0, out={"E": torch.empty(M, N)}),
     "out['E'] must be what the epilogue makes (no such output"),
])
def test_torch_compile_refuses_what_eager_refuses(call, message):
    """Inside torch.compile the operand names, numbers, flags and out= tensors are checked as eagerly (out=
    must be what the epilogue makes there: the op's outputs are copied in, so another dtype would lose
    precision silently)."""
    torch._dynamo.reset()
    a, w, b = torch.randn(M, K), torch.randn(N, K), torch.randn(N)
    with pytest.raises(Exception) as e:
        torch.compile(call, fullgraph=True, backend="aot_eager")(a, w, b)
    assert message in _messages(e.value)


@pytest.mark.filterwarnings("ignore:Error detected in:UserWarning")  # anomaly mode, as AOTAutograd traces
def test_torch_compile_of_a_gemm_whose_inputs_require_grad_says_why():
    """cd.gemm has no derivative; torch.compile differentiates a graph whose inputs require grad when it
    compiles it, so the refusal comes then, with the fix (eagerly it comes at backward)."""
    torch._dynamo.reset()
    x, w = torch.randn(M, K, requires_grad=True), torch.randn(N, K)
    with pytest.raises(Exception) as e:
        torch.compile(lambda x, w: cd.gemm(x, w, backend="reference")["D"], fullgraph=True, backend="aot_eager")(x, w)
    assert "cd.gemm has no derivative" in _messages(e.value) and "cd.linear" in _messages(e.value)


@cd.epilogue
def _affine(acc, b: cd.VecN, s: cd.Scalar):
    return acc * s + b


def test_interleave_of_a_constant_and_a_finish_without_its_input():
    """interleave(1.0, x) is [1, x0, 1, x1, ...]; a finishing expression that ignores the statistic still
    gives one value per row."""
    @cd.epilogue
    def ones_between(acc, c: cd.Scalar):
        even, _ = cd.pairs(acc)
        return {"D": cd.interleave(1.0, even), "c": cd.sum(acc, axis="n").then(lambda s: c * 2.0)}

    a, b = torch.randn(5, 16), torch.randn(8, 16)
    out = cd.gemm(a, b, ones_between, c=1.0, backend="reference")
    expect = torch.ones(5, 8)
    expect[:, 1::2] = (a @ b.t())[:, 0::2]
    assert torch.allclose(out["D"].float(), expect, atol=1e-2) and out["c"].shape == (5,)
    assert torch.equal(out["c"], torch.full((5,), 2.0))


def test_autocast_changes_nothing():
    """Under torch.autocast the ops compute as written (fp32 accumulation and math, as the kernels and compiled
    code do): autocast rounded the reference's accumulator, constants and scalars to bf16 (1001.0078 for
    1001.51), and cd.linear's and the cross-entropy's backward GEMMs."""
    @cd.epilogue
    def shifted(acc, b: cd.VecN, s: cd.Scalar):
        return {"D": cd.gelu(acc + b) + 1000.5 + s, "t": cd.sum(acc, axis="n")}

    x, w = torch.randn(6, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    b, t = torch.randn(16, requires_grad=True), torch.randint(0, 16, (6,))

    def run():
        out = cd.linear(x, w, shifted, b=b, s=1.01, backend="reference")
        loss = out["D"].sum() + cd.linear_cross_entropy(x, w, t, backend="reference")
        return [out["D"], out["t"], loss, *torch.autograd.grad(loss, (x, w, b))]

    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = run()
    assert all(torch.equal(p, u) for p, u in zip(plain, under))
    assert torch.is_autocast_enabled("cpu") is False  # and the context is back as it was
