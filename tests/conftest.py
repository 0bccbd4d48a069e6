"""Shared fixtures of the CPU test suite: fresh random seeds, the relative-error metric, a fake
toolchain, a helper that lowers an epilogue into an EVT plan without a GPU, and an epilogue that both
the CPU functor simulation and the GPU suite check."""
import random

import pytest
import torch

import coda_dsl as cd
from coda_dsl import build
from coda_dsl.build import Toolchain, ToolchainError
from coda_dsl.cli import torch_cuda_problem
from coda_dsl.passes import Config, Signature, accumulate_into_d, lower, specialize

# A fixed toolchain for tests that fake the builds: specialization keys are then the same everywhere.
FAKE_TC = Toolchain(nvcc="/fake/bin/nvcc", cuda_home="/fake", nvcc_version="13.0.88",
                    cutlass_include=["/fake/include", "/fake/tools/util/include"],
                    cutlass_version="4.2.0.0", torch_version="2.14.1", csrc_include="/fake/csrc")


def real_toolchain_or_skip() -> Toolchain:
    """The real toolchain for the real-nvcc tests, or a skip with doctor's reason: a missing piece, or
    a CPU-only torch (whose missing c10/cuda headers would fail the compile)."""
    try:
        tc = build.toolchain()
    except ToolchainError as e:
        pytest.skip(f"no CUDA toolchain to compile with: {e}")
    problem = torch_cuda_problem()
    if problem:
        pytest.skip(problem)
    return tc


@pytest.fixture
def seed():
    """A fresh seed per test (new data every run); printed so a failure can be replayed."""
    s = random.randrange(2**31)
    print(f"torch seed: {s}")
    torch.manual_seed(s)
    return s


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖, computed in fp64 (a zero reference divides by 1e-30, not 0)."""
    out, ref = out.detach().double(), ref.detach().double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture
def rel():
    """The relative-error metric `rel_err`, as a fixture."""
    return rel_err


def signature(ep, ab="bf16", b_layout="nk", operand_dtype="bf16", operand_dtypes=None, output_dtypes=None,
              consts=None, config=None, deterministic=False, accumulate=False) -> Signature:
    """The Signature cd.gemm would build for `ep`: every load operand `operand_dtype` unless given in
    `operand_dtypes`, outputs their traced dtype (else `ab`) unless given in `output_dtypes`."""
    loads = {p.name: (operand_dtypes or {}).get(p.name, operand_dtype) for p in ep.params
             if p.kind in ("tensor", "vec_n", "vec_m")}
    outs = tuple((o.name, (output_dtypes or {}).get(o.name, o.dtype or ab)) for o in ep.program.outputs)
    return Signature(ab, b_layout, tuple(sorted(loads.items())), outs, tuple(sorted((consts or {}).items())),
                     config or Config(), deterministic, accumulate)


@pytest.fixture
def make_plan():
    """make_plan(ep, consts={}, **signature options) -> the lowered Plan."""
    def make(ep, consts=None, **kw):
        sig = signature(ep, consts=consts, **kw)
        program = specialize(ep.program, consts or {})
        return lower(accumulate_into_d(program) if sig.accumulate else program, sig)
    return make


@cd.epilogue
def pairs_with_full_width_operands(acc, bias: cd.VecN, rs: cd.VecM, s: cd.Scalar):
    """Inside one pair functor: a full-width VecN (read per slot), a VecM and a scalar (one per row)."""
    even, odd = cd.pairs(acc)
    y = cd.interleave(even * rs - odd, odd * s + 1.0)
    return {"D": y * 2.0 + bias, "h": cd.cast(odd - even * s, cd.float32)}
