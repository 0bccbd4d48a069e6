"""Fixtures shared by several test files, and nothing else: fresh random seeds, the relative-error
metric, a temporary kernel cache, the fake toolchain and builds, fake kernels for the cutlass call path,
a fresh runtime, and a helper that lowers an epilogue into an EVT plan without a GPU.

What tests import by name lives in plain modules: tests/epilogues.py (the test epilogues, `signature_for`,
`rel_err`) and tests/build_helpers.py (FAKE_TC, real_toolchain_or_skip, build-unit helpers)."""
import random
import time
import types
from pathlib import Path

import pytest
import torch

import coda_dsl.build as b
from build_helpers import FAKE_TC
from coda_dsl.build import builder, cache
from coda_dsl import pipeline
from coda_dsl import runtime
from epilogues import rel_err, signature_for


@pytest.fixture
def seed():
    """A fresh seed per test (new data every run); printed so a failure can be replayed."""
    s = random.randrange(2**31)
    print(f"torch seed: {s}")
    torch.manual_seed(s)
    return s


@pytest.fixture
def rel():
    """The relative-error metric `epilogues.rel_err`, as a fixture."""
    return rel_err


@pytest.fixture
def make_plan():
    """make_plan(ep, consts={}, **signature options) -> the lowered Plan."""
    def make(ep, consts=None, **kw):
        return pipeline.plan(ep.program, signature_for(ep, consts=consts, **kw))[1]
    return make


# ---- kernel cache and builds --------------------------------------------------------------------
@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """An empty kernel cache of this test's own (CODA_DSL_CACHE), and a toolchain found afresh."""
    root = tmp_path / "cache"
    monkeypatch.setenv("CODA_DSL_CACHE", str(root))
    toolchain = b.toolchain  # the real, memoized one (a test may replace b.toolchain)
    toolchain.cache_clear()
    yield root
    toolchain.cache_clear()


@pytest.fixture
def fake_toolchain(cache_root, monkeypatch):
    """The cache and the builder see FAKE_TC (stable keys everywhere), in a temporary cache."""
    for mod in (cache, builder):
        monkeypatch.setattr(mod, "toolchain", lambda: FAKE_TC)
    return FAKE_TC


@pytest.fixture
def fake(fake_toolchain, cache_root, monkeypatch):
    """Fake toolchain + fake ninja that 'builds' every target and records its calls (in a file, so
    forked processes count too)."""
    counter = cache_root.parent / "ninja_calls"
    state = types.SimpleNamespace(delay=0.0)
    state.calls = lambda: counter.read_text().splitlines() if counter.exists() else []

    def run(staging, targets, jobs, verbose, log):
        with open(counter, "a") as f:
            f.write(" ".join(targets) + "\n")
        time.sleep(state.delay)
        for t in targets:
            d = staging / t.split("/")[0]
            (d / "kernel.o").write_bytes(b"\0" * 64)
            (d / "kernel.fatbin").write_bytes(b"\0" * 32)
            if t.endswith(".so"):
                (d / "kernel.so").write_bytes(b"\0" * 128)
            (d / "host.log").write_text("ok\n")
        return 0, ""

    monkeypatch.setattr(builder, "_run_ninja", run)
    return state


@pytest.fixture
def loads(monkeypatch):
    """The library loader (builder._dlopen) replaced by a recorder of the bytes it loads, and a fresh
    process (nothing loaded or verified yet: the build layer has no public reset, so its memos are swapped)."""
    calls = []
    monkeypatch.setattr(builder, "_dlopen", lambda p: calls.append(Path(p).read_bytes()))
    monkeypatch.setattr(builder, "_loaded", {})
    monkeypatch.setattr(builder, "_handles", {})
    monkeypatch.setattr(cache, "_verified", {})
    return calls


# ---- the runtime --------------------------------------------------------------------------------
@pytest.fixture
def fresh_runtime():
    """No specialization, config choice or warm-path entry from earlier tests (runtime.clear()), and
    none left behind for later ones."""
    runtime.clear()
    yield
    runtime.clear()


@pytest.fixture
def fake_kernels(fresh_runtime, monkeypatch):
    """The cutlass call path on CPU tensors, up to the launch, warm and cold, without a GPU: no Hopper
    check, no tuning record, and CompiledOps launch a recorder instead of a built kernel. Returns the
    launches, each (the CompiledOp, its launch arguments (a, b, d, inputs, scalars, outputs))."""
    launches = []

    def load(self):
        self._op = lambda *args: launches.append((self, args))
        return self

    monkeypatch.setattr(runtime.CompiledOp, "load", load)
    monkeypatch.setattr(runtime.op.checks, "require_cutlass", lambda *_: None)
    monkeypatch.setattr(runtime.op.tuning, "recorded", lambda *args: None)
    return launches
