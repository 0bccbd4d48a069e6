"""Every benchmark in one run: the GEMM epilogues (each case at its own shapes), then the LM head +
cross-entropy. Tables on stdout, progress on stderr; JSON and a PNG chart under bench/results/
(or $OUT). The same as `coda-dsl bench ARGS`.

    python -m bench [--only identity,...,cross_entropy] [--shapes MxNxK,...] [--ce-shape MxDxV,...]
                    [--iters 50] [--autotune] [--compile-dynamic] [--tune] [--sustained MS | --graph] [--dry-run]

Each part also runs alone: python -m bench.epilogues, python -m bench.cross_entropy. --sustained and
--graph act on the epilogue part (the cross-entropy's steps run long enough to load the GPU as training
does, and for the host to stay ahead).
"""
from __future__ import annotations

import sys

from . import cross_entropy, epilogues
from .harness import Timing, compile_label, markdown, no_gpu, parser, results_only_on_stdout, shapes
from .harness import command as command_line

CE = "cross_entropy"


def main(argv=None) -> int:
    p = parser("python -m bench", __doc__)
    epilogues.add_args(p, only=(*epilogues.CASES, CE))
    p.add_argument("--ce-shape", type=shapes, default=cross_entropy.SHAPES,
                   help="MxDxV,... of the cross-entropy benchmark")
    args = p.parse_args(argv)
    cases = [epilogues.CASES[n] for n in args.only if n != CE]
    with_ce = CE in args.only
    if args.dry_run:
        plan = epilogues.plan_rows(cases, args.shapes, args.autotune, args.compile_dynamic)
        compiles = len(plan) if not args.compile_dynamic else len(cases)
        print(markdown(["bench", "shape", "variants"],
                       plan + (cross_entropy.plan_rows(args.ce_shape, args.autotune) if with_ce else [])))
        print(f"\n{len(plan)} epilogue measurements; {compile_label(args.autotune, args.compile_dynamic)}: "
              f"about {compiles + 2 * with_ce * len(args.ce_shape)} compilations")
        return 0
    if no_gpu():
        return 1
    command = command_line("python -m bench", argv)
    failed = []
    if cases:
        with results_only_on_stdout():
            ce_kernels = cross_entropy.kernels() if with_ce else []  # one parallel build for all
            rows, ep_failed = epilogues.run(cases, args.shapes, args.autotune, args.iters, args.tune,
                                            args.compile_dynamic, ce_kernels, epilogues.checkpoint(command),
                                            args.config, Timing.of(args))
        epilogues.report(rows, ep_failed, command)
        failed += ep_failed
    if with_ce:
        with results_only_on_stdout():
            ce_rows, ce_failed = cross_entropy.run(args.ce_shape, iters=args.iters, autotune=args.autotune)
        print()
        cross_entropy.report(ce_rows, ce_failed, command)
        failed += ce_failed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
