"""The C++ of each visitor node of a plan (passes/plan.py holds them as data): its type, its
Arguments initializer, and the host code before and after the launch (on coda::Tensor views of the
caller's tensors: csrc/coda_dsl/abi.h), chosen by the node's class in _spell."""
from __future__ import annotations

from dataclasses import dataclass

from ..passes import plan as p
from .cpp import cpp_element

ROUND = "cutlass::FloatRoundStyle::round_to_nearest"


@dataclass(frozen=True)
class CppNode:
    """A visitor node as the template renders it."""

    name: str
    children: tuple[int, ...]
    comment: str
    type: str  # the C++ type of the node
    args: str  # its Arguments initializer
    init: str  # host code before the launch, a size query too: workspace buffers ("" for none)
    fill: str  # an output set to a start value before the GEMM, as a coda::Fill ("" for none): one launch for all
    finish: str  # host code after the launch ("" for none)


# kind -> (register reduce, warp-shuffle reduce, global atomic reduce, tile combine, identity)
_REDUCE_FNS = {
    "sum": ("cutlass::plus", "cutlass::plus", "cutlass::atomic_add", "cutlass::plus", "0.f"),
    "max": ("coda::maximum_nan", "coda::maximum_nan", "coda::atomic_maximum", "coda::maximum_nan", "-INFINITY"),
    "min": ("coda::minimum_nan", "coda::minimum_nan", "coda::atomic_minimum", "coda::minimum_nan", "INFINITY"),
    "amax": ("coda::amax_reduce", "coda::maximum_nan", "coda::atomic_maximum", "coda::maximum_nan", "0.f"),
}
_FINISH_COMBINE = {"sum": "coda::Plus", "max": "coda::Max", "min": "coda::Min", "amax": "coda::Max", "take": "coda::Plus"}
# operand leaves: node class -> (C++ type over {e}, the element type; args helper)
_BROADCAST = {
    p.RowBroadcast: ("fusion::Sm90RowBroadcast<0, TileShape, {e}, float, cute::Stride<cute::_0, cute::_1, int64_t>>",
                     "vec_n_args"),
    p.ColBroadcast: ("fusion::Sm90ColBroadcast<0, TileShape, {e}, float, cute::Stride<cute::_1, cute::_0, int64_t>>",
                     "vec_m_args"),
    p.AuxLoad: ("coda::AuxLoadFor<EpilogueDescriptor, {e}>", "aux_load_args"),
    p.PairLoad: ("coda::PairLoad<{e}>", "pair_args"),
    p.WideLoad: ("coda::WideLoad<EpilogueDescriptor>", "wide_args"),
}
_STORE = {  # output taps: node class -> (C++ type over {e}; args helper)
    p.AuxStore: ("coda::AuxStoreFor<EpilogueDescriptor, {e}>", "aux_store_args"),
    p.PairStore: ("coda::PairStore<EpilogueDescriptor, {e}>", "pair_args"),
    p.WideStore: ("coda::WideStore<EpilogueDescriptor>", "wide_args"),
}


def identity(r: p.Reduce) -> str:
    """The reduction's identity as a C++ literal (what atomic outputs are filled with)."""
    return _REDUCE_FNS[r.kind][4] if r.kind in _REDUCE_FNS else "0.f"


def _partials(r: p.Reduce) -> str:
    return f"partial_{r.output_index}"


def _finish_fn(r: p.Reduce) -> str:
    """The functor the finishing kernel applies to each complete statistic."""
    return f"{r.finish.name}<float>" if r.finish else "coda::Identity<float>"


def _reduction_type(r: p.Reduce) -> str:
    reg, shuffle, atomic, combine, _ = _REDUCE_FNS[r.kind]
    if r.axis is None and not r.deterministic:
        return (f"fusion::Sm90ScalarReduction<{reg}, {atomic}, float, float, {ROUND}, "
                "cute::Stride<cute::_0, cute::_0, int64_t>>")
    if r.axis == "m":  # deterministic: a row of partials per tile row and warp
        return (f"coda::ColumnReduction<{reg}, {shuffle}, coda::store_value, coda::kTileWarps<KernelSchedule>>"
                if r.deterministic else f"coda::ColumnReduction<{reg}, {shuffle}, {atomic}>")
    # per row, and deterministic totals (which reduce per-row partials)
    tail = ", 4, true, false" if r.deterministic else ""  # alignment, nullptr check, no final pass
    return (f"fusion::Sm90ColReduction<{reg}, {shuffle}, {combine if r.deterministic else atomic}, 0, TileShape, "
            f"float, float, {ROUND}, cute::Stride<cute::_1, cute::_0, int64_t>{tail}>")


def _reduction_args(r: p.Reduce) -> str:
    if r.axis == "m":
        q = _partials(r)
        return (f"{{{q}, {identity(r)}, {q}_shape.size(1), int64_t(N)}}" if r.deterministic else
                f"{{outputs[{r.output_index}].data_ptr<float>(), {identity(r)}, int64_t(N), 0}}")
    axis = "n" if r.axis is None and r.deterministic else r.axis
    stride, batch = {"n": ("cute::_1{}, cute::_0{}", "M"), None: ("cute::_0{}, cute::_0{}", "1")}[axis]
    ptr = _partials(r) if r.deterministic else f"outputs[{r.output_index}].data_ptr<float>()"
    return f"{{{ptr}, {identity(r)}, {{{stride}, int64_t({batch})}}}}"


def _reduction_init(r: p.Reduce) -> tuple[str, str]:
    """(init, fill) before the launch: atomics accumulate into the output, so fill it with the identity;
    deterministic mode gets a workspace buffer for the per-tile partials instead."""
    if not r.deterministic:
        return "", _fill(r.output_index, identity(r))
    q = _partials(r)
    shape = "coda::column_partials<TileShape>(M, N, coda::kTileWarps<KernelSchedule>)" if r.axis == "m" else \
        "coda::row_partials<TileShape>(M, N)"
    return f"auto {q}_shape = {shape};\n  float* {q} = ws.floats({q}_shape.size(L));", ""


def _fill(output_index: int, value: str) -> str:
    return f"coda::Fill{{outputs[{output_index}], {value}}}"


def _reduction_finish(r: p.Reduce) -> str:
    """After the launch: combine partials and/or apply the finishing expression (else nothing)."""
    if not r.deterministic and r.finish is None:
        return ""
    out = f"outputs[{r.output_index}].data_ptr<float>()"
    if r.deterministic:
        q = _partials(r)
        shape = f"{q}_shape.rows, {q}_shape.rows_padded, {q}_shape.tiles, L, {str(r.axis is None).lower()}"
        src = q
    else:  # in place on the atomically reduced output
        rows = {"n": "M", "m": "N", None: "1"}[r.axis]
        shape, src = f"{rows}, {rows}, 1, L, false", out
    return (f"coda::finish<{_FINISH_COMBINE[r.kind]}, {_finish_fn(r)}>({src}, {out}, {shape}, {identity(r)}, "
            "scalars, call, op_name);")


def _logsumexp(r: p.LogSumExp) -> tuple[str, str, str, str, str]:
    """cd.logsumexp: always per-tile partials (reference point, sum of exp), combined by the finishing kernel."""
    q = _partials(r)
    init = (f"auto {q}_shape = coda::row_partials<TileShape>(M, N);\n"
            f"  float* {q} = ws.floats(2 * {q}_shape.size(L));")
    finish = (f"coda::finish_logsumexp<{_finish_fn(r)}>({q}, outputs[{r.output_index}].data_ptr<float>(), "
              f"{q}_shape, L, scalars, call, op_name);")
    return "coda::RowLogSumExp<TileShape>", f"{{{q}}}", init, "", finish


def _take(r: p.Take) -> tuple[str, str, str, str, str]:
    """cd.take: the output is zeroed first (rows whose index is outside [0, N) keep the 0)."""
    args = f"coda::take_args<{r.name}>(inputs[{r.index_input}], outputs[{r.output_index}])"
    return "coda::RowTake", args, "", _fill(r.output_index, "0.f"), _reduction_finish(r)


def _spell(n: p.EvtNode) -> tuple[str, str, str, str, str]:
    """(type, args, init, fill, finish) of a visitor node."""
    kind = type(n)
    if kind in _BROADCAST:
        fmt, helper = _BROADCAST[kind]
        return fmt.format(e=cpp_element(n.dtype)), f"coda::{helper}<{n.name}>(inputs[{n.input_index}])", "", "", ""
    if kind in _STORE:
        fmt, helper = _STORE[kind]
        return fmt.format(e=cpp_element(n.dtype)), f"coda::{helper}<{n.name}>(outputs[{n.output_index}])", "", "", ""
    if kind is p.AccFetch:
        return "fusion::Sm90AccFetch", "{}", "", "", ""
    if kind is p.SrcFetch:  # the collective loads it: the kernel's C (kernel.cu.j2), D itself
        return "fusion::Sm90SrcFetch<ElementC>", "{}", "", "", ""
    if kind is p.OneHot:
        return "coda::RowOneHot", f"coda::one_hot_args<{n.name}>(inputs[{n.input_index}])", "", "", ""
    if kind is p.Unpack:
        return f"coda::Unpack<{cpp_element(n.dtype)}, {n.part}>", "{}", "", "", ""
    if kind is p.Pack:
        return f"coda::Pack<{cpp_element(n.dtype)}>", "{}", "", "", ""
    if kind is p.Compute:
        return f"fusion::Sm90Compute<{n.functor.name}, float, float, {ROUND}>", "scalars", "", "", ""
    if kind is p.LogSumExp:
        return _logsumexp(n)
    if kind is p.Take:
        return _take(n)
    if kind is p.Reduce:
        return _reduction_type(n), _reduction_args(n), *_reduction_init(n), _reduction_finish(n)
    raise TypeError(f"no C++ for visitor node {kind.__name__}")


def node(n: p.EvtNode) -> CppNode:
    return CppNode(n.name, n.children, n.comment, *_spell(n))
