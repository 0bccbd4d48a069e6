"""From a traced epilogue to a kernel, stated once:

    trace (dsl/) -> specialize: bind cd.Const values, fold constants (passes/simplify.py)
    -> accumulate into D, if asked -> lower to an EVT plan (passes/lower.py, passes/smem.py)
    -> specialization key (build/cache.py) -> render the .cu (codegen/)
    -> build and load, on first use (build/)

The runtime (cd.gemm, cd.compile), the command line (emit, explain, build) and the tests go through
these functions; runtime/ keeps the call path: bind, check, launch.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import build, codegen
from .ir import graph as ir
from .passes import accumulate_into_d, lower, rounding_in_stores, specialize
from .passes.plan import Plan, Signature


@dataclass(frozen=True)
class Rendered:
    """One specialization, rendered (not built)."""

    program: ir.Program  # specialized: constants bound and folded
    plan: Plan
    key: str  # the specialization key: names the op and, with the toolchain, the cache entry
    cu_text: str  # the rendered .cu
    op_name: str  # its name in C++ and in its messages: coda_dsl::<op_name>


def plan(program: ir.Program, sig: Signature) -> tuple[ir.Program, Plan]:
    """The specialized program (with the signature's cd.Const values) and its EVT plan."""
    program = rounding_in_stores(specialize(program, dict(sig.consts)))
    if sig.accumulate:
        program = accumulate_into_d(program)
    return program, lower(program, sig)


def render(program: ir.Program, sig: Signature) -> Rendered:
    """plan(), then the key and the rendered .cu."""
    program, p = plan(program, sig)
    key = build.specialization_key(p.canonical)
    return Rendered(program, p, key, codegen.render(p, key, program.defined_at), codegen.op_name(key))
