"""Rendering an EVT plan into one self-contained CUDA translation unit (templates/kernel.cu.j2).

All C++ text comes from here: cpp.py spells functors and ops, evt.py the visitor nodes."""
from __future__ import annotations

import functools
import re

import jinja2

from ..build.paths import templates_dir
from ..passes.plan import Plan
from . import cpp, evt
from .cpp import cpp_element


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def op_name(key: str) -> str:
    """A specialization's name: its C++ namespace and, as coda_dsl::<op_name>, its messages."""
    return f"k{key[:20]}"


def gemm_kernel(op: str) -> str:
    """The name of op's GEMM kernel: an extern "C" kernel in the library's embedded fatbinary (the name
    profilers list)."""
    return f"{op}_gemm"


# an op_name inside a compiled symbol: its GEMM kernel's, or its namespace (k<key>_ns) in a mangled one
SYMBOL_OP_NAME = re.compile(r"k[0-9a-f]{20}(?=_ns|_gemm)")


def header_fields(cu_text: str) -> tuple[str, str]:
    """(epilogue name, config) from the header comment kernel.cu.j2 writes atop every kernel; "?" for a
    field the text lacks."""
    name = config = "?"
    for line in cu_text.splitlines()[:8]:
        if line.startswith("// Epilogue `"):
            name = line.split("`")[1]
        elif line.startswith("// Config: "):
            config = line[len("// Config: "):].strip()
    return name, config


def file_header_fields(cu_path: str | None) -> tuple[str, str]:
    """header_fields of a kernel.cu on disk (a cache entry's); "?" for both if it cannot be read."""
    try:
        with open(cu_path or "", encoding="utf-8", errors="replace") as f:
            return header_fields("".join(next(f, "") for _ in range(8)))
    except OSError:
        return "?", "?"


def render(plan: Plan, key: str, defined_at: str = "") -> str:
    sig = plan.signature
    return _environment().get_template("kernel.cu.j2").render(
        plan=plan,
        nodes=[evt.node(n) for n in plan.nodes],
        functors=[cpp.functor(f) for f in plan.functors],
        key=key,
        op_name=op_name(key),
        gemm_kernel=gemm_kernel(op_name(key)),
        defined_at=defined_at,
        cfg=sig.config,
        ab_dtype=sig.ab_dtype,
        element_ab=cpp_element(sig.ab_dtype),
        element_d=cpp_element(plan.d_dtype) if plan.d_dtype else "void",
    )
