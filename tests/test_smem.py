"""The shared-memory model (passes/smem.py): kernels that cannot fit are made to fit (a narrower epilogue
tile) or refused before nvcc, and every example still fits at the default config, unchanged."""
import importlib

import pytest
import torch

import coda_dsl as cd
from coda_dsl import SharedMemoryError, examples
from coda_dsl.library import cross_entropy, gated, rmsnorm, rope
from coda_dsl.passes import Config, accumulate_into_d, smem, specialize, widths
from coda_dsl.runtime import tune as tuning
from epilogues import signature_for

lowering = importlib.import_module("coda_dsl.passes.lower")  # the module (the package exports its function)


@cd.epilogue
def two_fp32_tensors(acc, r1: cd.Tensor, r2: cd.Tensor):
    """Issue 10's repro: at the default config CUTLASS had room for 1 mainloop stage and failed to compile."""
    h = acc + r1 * r2
    return {"D": h, "a1": h * 2.0, "a2": h + r1}


@cd.epilogue
def four_fp32_tensors(acc, r1: cd.Tensor, r2: cd.Tensor, r3: cd.Tensor, r4: cd.Tensor):
    h = acc + r1 * r2 + r3 * r4
    return {"D": h, "a1": h * 2.0, "a2": h + r1, "a3": h - r4}


FP32 = {"r1": "fp32", "r2": "fp32", "r3": "fp32", "r4": "fp32"}


def test_the_repro_gets_a_narrower_epilogue_tile(make_plan):
    """At CUTLASS's 128x32 epilogue tile the two fp32 operands alone take 128 KiB (4 stages each):
    the plan is given 128x16, where the model leaves the 2 mainloop stages CUTLASS needs (this plan
    compiled with nvcc; the 128x32 one failed the Stages >= 2 assertion)."""
    plan = make_plan(two_fp32_tensors, operand_dtypes=FP32)
    assert plan.signature.config == Config(epilogue_tile=(128, 16))
    assert "_e128x16" in plan.canonical
    assert smem.usage(plan, Config()).stages == 1 and smem.usage(plan).stages == 2


def test_an_explicit_epilogue_tile_that_cannot_fit_is_refused(make_plan):
    """The user's epilogue tile is kept, not overridden: refused, naming the costliest operands and a config
    that fits."""
    with pytest.raises(SharedMemoryError) as info:
        make_plan(two_fp32_tensors, operand_dtypes=FP32, config=Config(epilogue_tile=(128, 32)))
    msg = str(info.value)
    assert "'two_fp32_tensors'" in msg and "128x256x64_c2x1_cooperative_e128x32" in msg
    assert msg.index("operand 'r1' (cd.Tensor, fp32) 64 KiB") < msg.index("operand 'r2'") < msg.index("fix:")
    assert "1 mainloop stage(s)" in msg and "config='" in msg
    suggested = Config.parse(msg.split("config='")[1].split("'")[0])
    assert make_plan(two_fp32_tensors, operand_dtypes=FP32, config=suggested).signature.config == suggested
    assert isinstance(info.value, cd.UnsupportedError)  # backend="auto" falls back to the reference backend


def test_nothing_fits_at_the_configs_tile(make_plan):
    with pytest.raises(SharedMemoryError, match="(?s)operand 'r1' .*fp32.*fix: pass the largest operands and outputs "
                                                "in bf16/fp16"):
        make_plan(four_fp32_tensors, operand_dtypes=FP32)
    # already bf16 everywhere: the dtype advice would be wrong (a 128x256 epilogue tile leaves no room)
    with pytest.raises(SharedMemoryError) as info:
        make_plan(four_fp32_tensors, config=Config(epilogue_tile=(128, 256)))
    assert "fix: use fewer full-size operands" in str(info.value) and "bf16/fp16" not in str(info.value)
    # with bf16 operands (half the bytes) the same epilogue fits, at a narrower epilogue tile
    assert make_plan(four_fp32_tensors).signature.config.epilogue_tile == (128, 16)


def test_deterministic_reductions_keep_their_epilogue_tile(make_plan):
    """CUTLASS's deterministic row and column reductions use the D buffer as scratch sized by the epilogue
    tile: a plan with one is refused rather than given a narrower tile. Atomic ones (registers to global
    memory) may narrow it."""
    @cd.epilogue
    def with_column_sum(acc, r1: cd.Tensor, r2: cd.Tensor):
        h = acc + r1 * r2
        return {"D": h, "a1": h * 2.0, "a2": h + r1, "s": cd.sum(h, axis="m")}

    with pytest.raises(SharedMemoryError, match="with_column_sum"):
        make_plan(with_column_sum, operand_dtypes=FP32, deterministic=True)
    assert make_plan(with_column_sum, operand_dtypes=FP32).signature.config.epilogue_tile == (128, 16)


# sizeof(CollectiveEpilogue::SharedStorage) and mainloop stages, read from nvcc (CUTLASS 4.2, the
# nvidia-cutlass wheel) for these plans; the model must never be below the first or above the second.
MEASURED = [
    (two_fp32_tensors, dict(operand_dtypes=FP32, config=Config(epilogue_tile=(128, 32))), 181248, 1),
    (two_fp32_tensors, dict(operand_dtypes=FP32, config=Config(epilogue_tile=(128, 16))), 90624, 2),
    (examples.residual_rms, dict(config=Config(epilogue_tile=(128, 64))), 133120, 2),
    (examples.residual_rms, dict(operand_dtypes={"gamma": "fp32"}, accumulate=True), 83456, 3),
    (cross_entropy._forward_epilogue(True, 30.0), dict(operand_dtypes={"target": "i64"}), 34816, 4),
    (gated.swiglu_keep_preactivation, dict(config=Config((64, 256, 64), (2, 1), "pingpong")), 29696, 4),  # PairStore smem
]


@pytest.mark.parametrize("ep, options, epilogue_bytes, stages", MEASURED)
def test_the_model_is_conservative_against_cutlass(ep, options, epilogue_bytes, stages):
    program = specialize(ep.program, {})
    sig = signature_for(ep, **options)
    program = accumulate_into_d(program) if sig.accumulate else program
    plan = lowering._Lowering(program, sig, lowering.validate(program)).run()  # before fit() adjusts it
    usage = smem.usage(plan)
    assert usage.epilogue >= epilogue_bytes and usage.stages <= stages
    assert usage.epilogue - epilogue_bytes <= 1024  # and close: it does not refuse what fits with room to spare


EXAMPLES = [(examples.residual_rms, {}), (examples.bias_gelu, {}), (examples.leaky_relu, {"slope": 0.1}),
            (gated.swiglu, {}), (gated.geglu, {}), (gated.reglu, {}), (gated.swiglu_keep_preactivation, {}),
            (rmsnorm.rms_producer, {}), (rmsnorm.rms_consumer("silu"), {}), (rope.rope_tables, {}),
            (rope.rope_positions, {}), (cross_entropy.ce_backward, {}),
            (cross_entropy._forward_epilogue(True, 30.0), {}), (cross_entropy._backward_softcap_epilogue(30.0), {})]


@pytest.mark.parametrize("ep, consts", EXAMPLES, ids=lambda x: getattr(x, "name", ""))
@pytest.mark.parametrize("operand_dtype", ["bf16", "fp32"])
def test_examples_fit_at_the_default_config(make_plan, ep, consts, operand_dtype):
    """Unchanged, or (where CUTLASS's epilogue tile leaves the mainloop 2 stages) with a narrower epilogue
    tile that leaves it PREFERRED_STAGES."""
    dtypes = {p.name: "i64" for p in ep.params if p.name == "target"}
    d = ep.program.output("D")  # accumulate=True needs an N-wide D
    for accumulate in (False, True) if d and widths.infer(ep.program).get(id(d.node), 1) == 1 else (False,):
        plan = make_plan(ep, consts=consts, operand_dtype=operand_dtype, operand_dtypes=dtypes, accumulate=accumulate)
        cfg, default = plan.signature.config, smem.usage(plan, tuning.DEFAULT)
        assert smem.fit(plan) is plan and default.fits
        if cfg != tuning.DEFAULT:
            assert cfg.tile == tuning.DEFAULT.tile and cfg.epilogue_tile[1] < smem.epilogue_tile(tuning.DEFAULT)[1]
            assert default.stages < smem.PREFERRED_STAGES <= smem.usage(plan).stages


def test_tuning_skips_candidates_that_cannot_fit(cache_root, monkeypatch):
    """A candidate config whose buffers do not fit is not built or timed; the others are."""
    monkeypatch.setattr(tuning, "device_key", lambda device: "FakeGPU|sm90")
    monkeypatch.setattr(tuning, "round_robin", lambda fns, iters: {k: fn() or 1.0 for k, fn in fns.items()})
    built, launched = [], []
    monkeypatch.setattr(tuning.build, "build_units", lambda units, **kw: built.extend(units))
    a, b = torch.randn(64, 32).bfloat16(), torch.randn(48, 32).bfloat16()
    from coda_dsl.runtime.call import _check_tensors, normalize
    from coda_dsl.runtime.op import specialization
    ops = dict(r1=torch.randn(64, 48), r2=torch.randn(64, 48))
    call = normalize(two_fp32_tensors, a, b, ops)
    dtypes = _check_tensors(two_fp32_tensors, call, cutlass=True)
    spec = lambda cfg: specialization(two_fp32_tensors, call, dtypes, None, cfg)  # noqa: E731
    best = tuning.tune(spec, launched.append, torch.device("cpu"), (64, 48, 32, 1), log=lambda msg: None)
    e64 = Config((128, 256, 64), (2, 1), "cooperative", (128, 64))
    assert e64 in tuning.CANDIDATES and len(built) == len(launched) == len(tuning.CANDIDATES) - 1
    assert all(op.plan.signature.config != e64 for op in launched) and best != e64
