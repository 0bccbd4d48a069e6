"""Build on a machine without a GPU (nvcc and CUTLASS only) the kernels that the GPU suite and benchmarks build
on an sm_90 GPU, under the same cache keys, so that a GPU machine imports them instead of building them:

    CODA_DSL_CACHE=/tmp/kc python tests/prebuild_without_gpu.py [--sets gpu,nn] [--gpus h200,h100] [--dry-run]
    CODA_DSL_CACHE=/tmp/kc python -m coda_dsl cache export k.tar.gz     # here
    python -m coda_dsl cache import k.tar.gz                            # there (or CODA_KERNELS=k.tar.gz
                                                                        #   bash tests/gpu_check.sh)
Sets: gpu (tests/test_gpu.py's `build_kernels`), nn (tests/test_gpu_nn.py's `build_kernels` and the calls of
its tests), llama_layer (`python -m bench.llama_layer --tokens 8192,16384`), linear_backward (`python -m
bench.linear_backward --with-dy --configs 128x128x64_c1x2_pingpong`), epilogues (`python -m bench`'s epilogue
cases at their default shapes), cross_entropy (`python -m bench.cross_entropy`'s default kernels), train_llama
(`python -m bench.train_llama`'s model), host_overhead (`python -m bench.host_overhead`'s one kernel). A key
is a hash of the rendered kernel and the nvcc and CUTLASS versions: the same here and there when both have the
same nvcc and CUTLASS, and the configurations are the GPU's. This script runs the code as it is, with what
would run on "cuda" on the CPU or on the meta device (shapes only), and answers as the GPU machine would: the
CUTLASS path is taken, the GPU's name (which picks the default configuration, runtime/tune.py) is the one of
--gpus, and there is no tuning record. Nothing is launched: cd.compile renders, prebuild(fn) runs fn on the
reference backend and notes its kernels; all are built at the end in one parallel ninja run.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import coda_dsl.build as cbuild  # noqa: E402
from coda_dsl.passes.plan import Config  # noqa: E402
from coda_dsl.runtime import checks, op as runtime, tune  # noqa: E402

GPUS = {"h200": "NVIDIA H200", "h100": "NVIDIA H100 80GB HBM3"}


class OnDevice(TorchFunctionMode):
    """Tensors the code makes on "cuda" are made on `device` (cpu or meta) instead."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)
        self._autocast = torch.is_autocast_enabled

    def __enter__(self):
        if self.device.type == "meta":  # torch will not say whether autocast is on for "meta": it is not
            torch.is_autocast_enabled = lambda *a: False if a and a[0] == "meta" else self._autocast(*a)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.is_autocast_enabled = self._autocast
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        cuda = lambda d: isinstance(d, (str, torch.device)) and torch.device(d).type == "cuda"  # noqa: E731
        if func is torch.Tensor.cuda:
            return args[0].to(self.device)
        if cuda(kwargs.get("device")):
            kwargs["device"] = self.device
        if func is torch.Tensor.to:
            args = tuple(self.device if cuda(a) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def as_gpu(name: str, collected: list):
    """The code inside sees an sm_90 GPU called `name` and no tuning record; build_units only collects."""
    saved = (checks.cutlass_runs_on, checks.require_cutlass, tune.gpu_name, tune.recorded, cbuild.build_units)
    checks.cutlass_runs_on = lambda device: True
    checks.require_cutlass = lambda *a, **k: None
    tune.gpu_name = lambda device=None: name
    tune.recorded = lambda *a, **k: None
    cbuild.build_units = lambda units, **k: collected.extend(units) or []
    runtime.clear()  # configurations chosen under another GPU's rule
    try:
        yield
    finally:
        checks.cutlass_runs_on, checks.require_cutlass, tune.gpu_name, tune.recorded, cbuild.build_units = saved
        runtime.clear()


def gpu_suite() -> None:
    import test_gpu
    with OnDevice("cpu"):
        test_gpu.build_kernels()


def nn_suite() -> None:
    import test_gpu_nn
    with OnDevice("cpu"):
        test_gpu_nn.build_kernels()
        for tied in (False, True):
            runtime.prebuild(test_gpu_nn.test_cutlass_matches_reference_bf16, tied)
        runtime.prebuild(test_gpu_nn.test_cutlass_within_hf_bf16_error)


def llama_layer(tokens=(8192, 16384)) -> None:
    from bench.llama_layer import llama_config
    from coda_dsl import nn as cdnn
    for t in tokens:  # as bench.llama_layer makes it: from_hf(..., backend="cutlass"), tie_gate_up, keep_y
        with OnDevice("meta"):
            layer = cdnn.LlamaDecoderLayer(llama_config("8b"), 0, backend="cutlass", dtype=torch.bfloat16,
                                           device="cuda")
            layer.mlp.tie_gate_up()
            layer.mlp.keep_y = True
            layer.prebuild(t)


def linear_backward() -> None:
    from bench import linear_backward as lb
    with OnDevice("cpu"):
        lb.prebuild([(name, s) for name in lb.CASES for s in lb.SHAPES], True,
                    [Config((128, 128, 64), (1, 2), "pingpong")])


def epilogues() -> None:
    from bench import epilogues as ep
    with OnDevice("cpu"):
        runtime.prebuild(list(ep.kernels(ep.plan(list(ep.CASES.values()))).values()))


def cross_entropy() -> None:
    from bench import cross_entropy as ce
    with OnDevice("cpu"):
        runtime.prebuild(ce.kernels())


def train_llama() -> None:
    from bench import train_llama as tl
    args = tl.parse([])
    with OnDevice("cpu"):
        init = tl.initial_model(args.layers, "cuda", torch.bfloat16, args.seed)
        batch = tl.markov_batches(init.model.config.vocab_size, 1, args.batch, args.seq, args.seed)[0].cuda()
        tl.prebuilt(tl.CodaLM(init, args.backend), batch)


def host_overhead() -> None:
    from bench import host_overhead as ho
    with OnDevice("cpu"):
        runtime.prebuild([ho.kernel(*ho.operands("cuda"))])


SETS = {"gpu": gpu_suite, "nn": nn_suite, "llama_layer": llama_layer, "linear_backward": linear_backward,
        "epilogues": epilogues, "cross_entropy": cross_entropy, "train_llama": train_llama,
        "host_overhead": host_overhead}


def collect(sets: list[str], gpus: list[str]) -> dict[str, cbuild.BuildUnit]:
    units: dict[str, cbuild.BuildUnit] = {}
    for s in sets:
        for g in gpus:
            got: list = []
            t0 = time.time()
            with as_gpu(GPUS[g], got):
                SETS[s]()
            new = {u.key: u for u in got if u.key not in units}
            print(f"{s} as {GPUS[g]}: {len({u.key for u in got})} kernels, {len(new)} new ({time.time() - t0:.1f} s)",
                  flush=True)
            units.update(new)
    return units


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sets", default="gpu,nn", help=f"comma-separated, of {', '.join(SETS)} (default %(default)s)")
    p.add_argument("--gpus", default="h200,h100", help=f"whose rules: {', '.join(GPUS)} (default %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print 'build key, key, epilogue' per kernel; build none")
    args = p.parse_args(argv)
    sets, gpus = args.sets.split(","), args.gpus.split(",")
    if bad := [s for s in sets if s not in SETS] + [g for g in gpus if g not in GPUS]:
        p.error(f"unknown: {', '.join(bad)}")
    units = collect(sets, gpus)
    print(f"{len(units)} kernels", flush=True)
    if args.dry_run:
        print("\n".join(f"{cbuild.build_key(k)} {k} {u.epilogue}" for k, u in units.items()))
    else:
        cbuild.build_units(list(units.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
