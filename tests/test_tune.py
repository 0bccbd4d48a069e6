"""Tuning records (CPU): keys, persistence across processes, no rebuild when a record exists."""
from __future__ import annotations

import pytest
import torch

import coda_dsl as cd
from coda_dsl import runtime as public_runtime
from coda_dsl.passes.plan import Config
from coda_dsl.runtime import op as runtime
from coda_dsl.runtime import tune as tuning


def test_record_key_ignores_config_and_buckets_shapes():
    canonical = f"bf16|nk|{tuning.DEFAULT.text}|bf16|0|AccFetch()"
    other = canonical.replace(tuning.DEFAULT.text, Config((256, 128, 64)).text)
    k = tuning.record_key(canonical, tuning.DEFAULT, 4000, 4096, 4096, 1)
    assert k == tuning.record_key(other, Config((256, 128, 64)), 4096, 4096, 4096, 1)  # same bucket
    assert k != tuning.record_key(canonical, tuning.DEFAULT, 8192, 4096, 4096, 1)


def test_records_persist_and_are_found(cache_root, monkeypatch):
    monkeypatch.setattr(tuning, "device_key", lambda device: "FakeGPU|sm90")
    canonical = f"k|{tuning.DEFAULT.text}|x"
    dev = torch.device("cpu")
    assert tuning.recorded(dev, canonical, tuning.DEFAULT, (100, 200, 300, 1)) is None
    best = Config((256, 128, 64), (2, 1), "cooperative")
    tuning._store("FakeGPU|sm90", tuning.record_key(canonical, tuning.DEFAULT, 100, 200, 300, 1), best, {"a": 1.0})
    assert tuning.recorded(dev, canonical, tuning.DEFAULT, (120, 250, 300, 1)) == best
    (cache_root / "tuned.json").write_text("{not json")  # a corrupt record file means: tune again
    assert tuning.recorded(dev, canonical, tuning.DEFAULT, (120, 250, 300, 1)) is None
    key = tuning.record_key(canonical, tuning.DEFAULT, 100, 200, 300, 1)
    for damaged in ("[]", '{"FakeGPU|sm90": []}', '{"FakeGPU|sm90": {"%s": "x"}}' % key,
                    '{"FakeGPU|sm90": {"%s": {"config": "garbage"}}}' % key,
                    '{"FakeGPU|sm90": {"%s": {"config": 5}}}' % key):  # JSON, but not records
        (cache_root / "tuned.json").write_text(damaged)
        assert tuning.recorded(dev, canonical, tuning.DEFAULT, (120, 250, 300, 1)) is None, damaged


def test_tune_uses_a_record_without_building(cache_root, monkeypatch):
    monkeypatch.setattr(tuning, "device_key", lambda device: "FakeGPU|sm90")
    a, b = torch.randn(64, 32).bfloat16(), torch.randn(48, 32).bfloat16()
    from coda_dsl.runtime.call import _check_tensors, normalize
    from coda_dsl.runtime.op import specialization
    call = normalize(cd.identity, a, b, {})
    dtypes = _check_tensors(cd.identity, call, cutlass=True)
    spec = lambda cfg: specialization(cd.identity, call, dtypes, None, cfg)  # noqa: E731
    best = Config((128, 128, 64), (2, 1), "pingpong")
    tuning._store("FakeGPU|sm90", tuning.record_key(spec(tuning.DEFAULT).plan.canonical, tuning.DEFAULT, 64, 48, 32, 1),
                  best, {})
    built = []
    monkeypatch.setattr(tuning.build, "build_units", lambda units, **kw: built.append(units))
    assert tuning.tune(spec, lambda op: None, torch.device("cpu"), (64, 48, 32, 1)) == best
    assert built == []


def test_records_of_other_keys_and_devices_are_kept(cache_root, monkeypatch):
    dev = torch.device("cpu")
    configs = {("GPU-A", "k1"): Config((256, 128, 64)), ("GPU-A", "k2"): Config((128, 128, 64)),
               ("GPU-B", "k1"): Config((64, 256, 64), (1, 1), "pingpong")}
    for (device, canonical), config in configs.items():
        tuning._store(device, tuning.record_key(canonical, tuning.DEFAULT, 100, 200, 300, 1), config, {})
    for (device, canonical), config in configs.items():
        monkeypatch.setattr(tuning, "device_key", lambda d, device=device: device)
        assert tuning.recorded(dev, canonical, tuning.DEFAULT, (100, 200, 300, 1)) == config


def test_record_key_separates_batch_counts():
    assert tuning.record_key("k", tuning.DEFAULT, 64, 64, 64, 1) != tuning.record_key("k", tuning.DEFAULT, 64, 64, 64, 4)


H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


@pytest.mark.parametrize("mnk", [(8192, 4096, 4096), (8192, 14336, 4096), (8192, 6144, 4096), (8192, 4096, 14336),
                                 (8192, 28672, 8192), (777, 4104, 1000)])
def test_default_config_on_an_h100_is_the_cooperative_tile(mnk):
    config, why = tuning.default(*mnk, gpu=H100)
    assert config == tuning.DEFAULT and H100 in why and config.swizzle == 8


@pytest.mark.parametrize("gpu", [H200, "", "NVIDIA GH200 480GB"])
@pytest.mark.parametrize("mnk, expected", [
    ((8192, 4096, 4096), tuning.PINGPONG), ((8192, 14336, 4096), tuning.PINGPONG),
    ((8192, 6144, 4096), tuning.PINGPONG_192), ((8192, 12288, 4096), tuning.PINGPONG_192),
    ((8192, 4096, 14336), tuning.DEFAULT), ((8192, 28672, 8192), tuning.DEFAULT),
    ((777, 4104, 1000), tuning.DEFAULT), ((2048, 2048, 2048), tuning.DEFAULT)])
def test_default_config_elsewhere_is_the_h200_shape_rule(gpu, mnk, expected):
    """Pingpong at K < 8192 (128x192 where 192 divides N), the cooperative tile at K >= 8192 and below
    4096 x 4096 outputs; the reason names the rule and whether the GPU was measured."""
    config, why = tuning.default(*mnk, gpu=gpu)
    assert config == expected and config.swizzle == 8 and "the H200's rule" in why
    assert ("not measured" in why) == (gpu not in (H200, "")) and ("no GPU here" in why) == (gpu == "")


def test_gpu_name_off_cuda_is_empty():
    assert tuning.gpu_name(torch.device("cpu")) == "" and tuning.gpu_name("cpu") == ""
    assert not cd.is_gpu("H100", "cpu")  # a device string, as torch's own functions take


def test_gpu_name_takes_an_index(monkeypatch):
    monkeypatch.setattr(tuning, "_cuda_name", lambda index: f"NVIDIA H100 #{index}")
    assert tuning.gpu_name(1) == tuning.gpu_name("cuda:1") == "NVIDIA H100 #1"


@pytest.mark.parametrize("gpu, h100", [(H100, True), ("NVIDIA H100 PCIe", True), ("H100-SXM5-80GB", True), ("h100", True),
                                       ("NVIDIA H1000", False), ("NVIDIA GH100X", False), (H200, False)])
def test_the_h100_rule_goes_to_h100_names_only(gpu, h100):
    assert (tuning.default(8192, 4096, 4096, gpu=gpu)[0] == tuning.DEFAULT) == h100


def test_gemm_uses_the_shape_default_and_tells_buckets_apart(fake_kernels, monkeypatch):
    """Two shapes of one bucket (N 6144 and 8192) get the configurations the rule gives each."""
    rule = lambda m, n, k, l=1, gpu=None: (tuning.PINGPONG_192 if n % 192 == 0 else tuning.PINGPONG, "test rule")  # noqa: E731
    monkeypatch.setattr(tuning, "default", rule)
    for n in (6144, 8192):
        cd.gemm(torch.randn(4096, 64).bfloat16(), torch.randn(n, 64).bfloat16(), backend="cutlass")
    assert [op.plan.signature.config for op, _ in fake_kernels] == [tuning.PINGPONG_192, tuning.PINGPONG]


def test_clear_forgets_specializations_choices_and_warm_entries(fake_kernels, monkeypatch):
    """runtime.clear() starts over as a fresh process would: a new specialization, the config chosen
    (the record looked up) again, and no warm-path entry launching the old choice."""
    looked_up = []
    monkeypatch.setattr(runtime.tuning, "recorded", lambda *args: looked_up.append(1))
    a, b = torch.randn(64, 32).bfloat16(), torch.randn(48, 32).bfloat16()
    op = cd.compile(cd.identity, a, b)
    for _ in range(2):
        cd.gemm(a, b, backend="cutlass")
    assert len(looked_up) == 1 and cd.compile(cd.identity, a, b) is op
    public_runtime.clear()
    cd.gemm(a, b, backend="cutlass")
    assert len(looked_up) == 2 and cd.compile(cd.identity, a, b) is not op


def test_tuning_switches_are_booleans(monkeypatch):
    """set_tuning("false") and CODA_DSL_TUNE=off must not turn tuning on (truthy strings)."""
    with pytest.raises(cd.OperandError, match="True or False"):
        cd.set_tuning("false")
    for value, expected in (("1", True), ("on", True), ("TRUE", True), ("off", False), ("false", False), ("", False)):
        monkeypatch.setenv("CODA_DSL_TUNE", value)
        assert tuning._env_tuning() is expected, value
    monkeypatch.setenv("CODA_DSL_TUNE", "maybe")
    with pytest.warns(UserWarning, match="tuning stays off"):
        assert tuning._env_tuning() is False
