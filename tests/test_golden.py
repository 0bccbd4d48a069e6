"""Golden files: the generated .cu of every example and library epilogue, byte for byte.

Each case renders one specialization through the path `coda-dsl emit` uses
(cli.specialization_from_options / CompiledOp.create: specialize, lower, key, render; no toolchain)
and compares it with tests/golden/<case>.cu. A refactor of the IR, the passes or codegen must leave
them unchanged; a change to the generated code must show up here as a diff to review.

Regenerate only on purpose (after an intended change to the generated code), then review the diff:

    CODA_REGEN_GOLDEN=1 PYTHONPATH=$PWD python -m pytest tests/test_golden.py

The key (and so the op name in the .cu) hashes the template and csrc headers too; the test pins
that digest, so that the files show the code and the plan, not the bytes of those sources.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import coda_dsl as cd
from coda_dsl import cli, examples, nn
from coda_dsl.build import cache
from coda_dsl.library import cross_entropy as ce
from coda_dsl.library import gated, rmsnorm, rope
from coda_dsl.runtime.op import CompiledOp, signature

import epilogues

GOLDEN = Path(__file__).resolve().parent / "golden"
REGEN = os.environ.get("CODA_REGEN_GOLDEN") == "1"
PINGPONG = "128x128x64_c1x1_pingpong"

# (epilogue, consts) of every example and library epilogue, named by case
EPILOGUES = {
    "residual_rms": (examples.residual_rms, {}),
    "bias_gelu": (examples.bias_gelu, {}),
    "leaky_relu": (examples.leaky_relu, {"slope": 0.01}),
    "swiglu": (gated.swiglu, {}),
    "geglu": (gated.geglu, {}),
    "reglu": (gated.reglu, {}),
    "swiglu_keep_preactivation": (gated.swiglu_keep_preactivation, {}),
    "swiglu_backward": (gated.swiglu_backward, {}),
    "swiglu_backward_derived": (cd.backward_epilogue(gated.swiglu), {}),
    "rms_swiglu_backward_derived": (nn.rms_swiglu_grad, {}),  # the Llama layer's: narrowed, split
    "rope_tables": (rope.rope_tables, {}),
    "rope_positions": (rope.rope_positions, {}),
    "rms_producer": (rmsnorm.rms_producer, {}),
    "gain_wgrad": (rmsnorm.gain_wgrad, {}),
    "input_norm_grad": (nn.input_norm_grad, {}),  # the Llama layer's norm backward steps
    "post_norm_grad": (nn.post_norm_grad, {}),
    **{f"rms_consumer_{a or 'linear'}": (rmsnorm.rms_consumer(a), {}) for a in rmsnorm._ACTIVATIONS},
    **{f"ce_forward_{int(s)}{int(c is not None)}{int(lg is not False)}": (ce._forward_epilogue(s, c, lg), {})
       for s in (False, True) for c in (None, 30.0) for lg in (False, torch.float16)},
    "ce_backward": (ce.ce_backward, {}),
    "ce_backward_softcap": (ce._backward_softcap_epilogue(30.0), {}),
    "extrema": (epilogues.extrema, {}),
}

# signature variants: name -> keyword arguments of signature() besides the epilogue
VARIANTS = {
    "fp16": dict(ab="fp16"),
    "kn": dict(b_layout="kn"),
    "km": dict(a_layout="km", b_layout="kn"),  # a weight gradient's dY^T @ X
    "deterministic": dict(deterministic=True),
    "accumulate": dict(accumulate=True),
    "pingpong": dict(config=PINGPONG),
}
VARIANT_CASES = {  # which epilogues each variant is rendered for
    "fp16": ["residual_rms", "swiglu", "rope_positions", "rms_producer"],
    "kn": ["residual_rms", "rope_tables", "input_norm_grad", "post_norm_grad"],
    "km": ["gain_wgrad", "residual_rms"],
    "deterministic": ["rms_producer", "ce_forward_110", "ce_forward_011", "extrema"],
    "accumulate": ["residual_rms", "leaky_relu", "rms_consumer_silu"],  # (a pairwise D is refused: no C to read)
    "pingpong": ["residual_rms", "swiglu", "rope_tables", "rms_producer", "ce_forward_000"],
}
CASES = [(name, None) for name in EPILOGUES] + [(name, v) for v, names in VARIANT_CASES.items() for name in names]


def render(name: str, variant: str | None) -> str:
    ep, consts = EPILOGUES[name]
    if variant in (None, "fp16", "kn", "km", "pingpong"):  # exactly what `coda-dsl emit` does
        kw = VARIANTS.get(variant, {})
        return cli.specialization_from_options(ep, kw.get("ab", "bf16"), kw.get("b_layout", "nk"), consts=consts,
                                           config=kw.get("config"), a_layout=kw.get("a_layout", "mk")).cu_text
    # emit has no flags for these: the same CompiledOp.create, with the signature cd.gemm would build
    dtypes = {p.name: "bf16" for p in ep.params if p.kind in ("tensor", "vec_m", "vec_n")}
    sig = signature(ep, "bf16", "nk", dtypes, consts, **VARIANTS[variant])
    return CompiledOp.create(ep, sig).cu_text


@pytest.mark.parametrize("name, variant", CASES, ids=[f"{n}-{v}" if v else n for n, v in CASES])
def test_generated_source_is_unchanged(name, variant, monkeypatch):
    monkeypatch.setattr(cache, "_generator_digest", lambda: "golden")
    path = GOLDEN / f"{name}{'.' + variant if variant else ''}.cu"
    got = render(name, variant)
    if REGEN:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(got)
    assert path.exists(), f"{path.name} missing: CODA_REGEN_GOLDEN=1 pytest tests/test_golden.py writes it"
    assert got == path.read_text(), (f"the generated code of {path.name} changed; if on purpose, regenerate "
                                     "with CODA_REGEN_GOLDEN=1 and review the diff")


def test_no_stale_golden_files():
    expected = {f"{n}{'.' + v if v else ''}.cu" for n, v in CASES}
    assert {p.name for p in GOLDEN.glob("*.cu")} == expected
