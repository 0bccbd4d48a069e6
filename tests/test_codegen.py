"""Rendering plans into CUDA C++ (codegen.render + templates/kernel.cu.j2), checked as text: the
visitor types and edges, operand node types, bindings, scalars, literals, layouts, dtypes, config."""
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import coda_dsl as cd
from coda_dsl.codegen import evt, op_name, render
from coda_dsl.codegen.cpp import functor as cpp_functor
from coda_dsl.library import rope_tables
from coda_dsl.passes import Config
from coda_dsl.passes.plan import AccFetch, AuxLoad, AuxStore, ColBroadcast, Compute, RowBroadcast
from epilogues import bias_gelu
from epilogues import rich_operands as rich

KEY = "0123456789abcdef01234567"


@cd.epilogue
def scalars_only(acc, s: cd.Scalar, t: cd.Scalar):
    return {"D": acc * s, "t_out": cd.cast(t * 1, cd.float32)}


@cd.epilogue
def acc_copy(acc):
    return {"D": acc, "copy": acc}  # two nodes: AccFetch and an AuxStore that passes acc through as D


EPILOGUES = {"bias_gelu": (bias_gelu, {}), "rich": (rich, {"c": 0.5}), "identity": (cd.identity, {}),
             "scalars_only": (scalars_only, {}), "acc_copy": (acc_copy, {})}


def emit(make_plan, ep, consts=None, **kw):
    plan = make_plan(ep, consts=consts, **kw)
    return plan, render(plan, KEY, ep.defined_at)


def using_types(src):
    """{alias: C++ type} of every `using X = ...;` line."""
    return dict(re.findall(r"^using (\w+) = (.+?);", src, re.M))


def evt_edges(src):
    """(edges, node names) of the EVT type: a topological visitor, or (two nodes) a plain Sm90EVT tree."""
    tree = re.search(r"^using Visitor = fusion::Sm90EVT<(\w+), (\w+)>;", src, re.M)
    if tree:
        assert "Sm90TopologicalVisitor" not in src
        return [(), (0,)], [tree.group(2), tree.group(1)]
    m = re.search(r"Sm90TopologicalVisitor<\s*float,\s*cute::tuple<(.*?)>,\s*\n\s*(.*?)>;", src, re.S)
    assert m, "no Sm90TopologicalVisitor in the .cu"
    seqs = re.findall(r"cute::seq<([^>]*)>", m.group(1))
    edges = [tuple(int(x) for x in s.split(",") if x.strip()) for s in seqs]
    names = [x.strip() for x in m.group(2).split(",")]
    return edges, names


@pytest.mark.parametrize("which", sorted(EPILOGUES))
def test_visitor_nodes_and_edges(make_plan, which):
    ep, consts = EPILOGUES[which]
    plan, src = emit(make_plan, ep, consts)
    types = using_types(src)
    for n in plan.nodes:
        assert types[n.name] == evt.node(n).type, n.name
        assert len(re.findall(rf"^using {n.name} = ", src, re.M)) == 1
    edges, names = evt_edges(src)
    assert names == [n.name for n in plan.nodes]
    assert edges == [tuple(n.children) for n in plan.nodes]
    # two nodes (one edge) render as a tree: CUTLASS's topological visitor does not instantiate with one
    assert ("Sm90TopologicalVisitor<" in src) == (len(plan.nodes) > 2)
    # Arguments: one initializer per node, in node order
    args = re.search(r"typename EVT::Arguments evt_args\{\n(.*?)\n  \};", src, re.S).group(1)
    assert [line.rsplit("// ", 1)[1] for line in args.splitlines()] == names
    for f in plan.functors:
        assert f"struct {f.name} {{" in src
        assert f"struct {f.name}<cutlass::Array<T, N>> {{" in src


@pytest.mark.parametrize("which", sorted(EPILOGUES))
def test_build_and_entry_point_text(make_plan, which):
    ep, consts = EPILOGUES[which]
    plan, src = emit(make_plan, ep, consts)
    assert "-gencode" not in src  # flags belong to the build, not the source
    # the library's two extern "C" functions (csrc/coda_dsl/abi.h), both through the one run()
    assert src.count('extern "C" int coda_workspace_size(') == 1 and src.count('extern "C" int coda_launch(') == 1
    assert src.count(f"{op_name(KEY)}_ns::run(coda::Call(args, ") == 2
    assert f"Specialization key: {KEY}" in src
    assert f"epilogue {plan.name}" in src and ep.defined_at in src
    first_input = 3 if plan.d_dtype else 2  # A, B, then D if the kernel stores one
    assert (f"constexpr int n_inputs = {len(plan.inputs)}, n_outputs = {len(plan.outputs)}, "
            f"first_input = {first_input};") in src
    assert f"call.n_scalars != {len(plan.scalars)}" in src
    assert ("coda::TensorRef d(call.tensors + 2);" in src) == bool(plan.d_dtype)
    assert '#include "coda_dsl/evt.h"' in src


def test_operand_kinds_map_to_node_types(make_plan):
    plan, src = emit(make_plan, rich, {"c": 0.5}, operand_dtypes={"rstd": "fp32"},
                     output_dtypes={"h32": "fp32", "g16": "fp16"})
    types = using_types(src)
    assert types["Acc"] == "fusion::Sm90AccFetch"
    assert types["Load_residual"] == "coda::AuxLoadFor<EpilogueDescriptor, cutlass::bfloat16_t>"
    assert types["Load_bias"].startswith("fusion::Sm90RowBroadcast<0, TileShape, cutlass::bfloat16_t, float,")
    assert "cute::Stride<cute::_0, cute::_1, int64_t>" in types["Load_bias"]  # broadcast down the rows
    assert types["Load_rstd"].startswith("fusion::Sm90ColBroadcast<0, TileShape, float, float,")
    assert "cute::Stride<cute::_1, cute::_0, int64_t>" in types["Load_rstd"]
    assert types["Store_h32"] == "coda::AuxStoreFor<EpilogueDescriptor, float>"
    assert types["Store_g16"] == "coda::AuxStoreFor<EpilogueDescriptor, cutlass::half_t>"
    assert sum(isinstance(n, Compute) for n in plan.nodes) == sum("fusion::Sm90Compute<Fn" in t
                                                                   for t in types.values())
    kinds = {type(n) for n in plan.nodes}
    assert {AccFetch, AuxLoad, RowBroadcast, ColBroadcast, Compute, AuxStore} <= kinds
    # runtime binding by position
    for n in plan.nodes:
        if isinstance(n, (AuxLoad, RowBroadcast, ColBroadcast)):
            assert f"<{n.name}>(inputs[{n.input_index}]),  // {n.name}" in src
            assert plan.inputs[n.input_index] == n.name.removeprefix("Load_")
        if isinstance(n, AuxStore):
            assert f"<{n.name}>(outputs[{n.output_index}])" in src
            assert plan.outputs[n.output_index][0] == n.name.removeprefix("Store_")


def test_take_derivative_reads_the_one_hot_of_its_index(make_plan):
    """cd.take's derivative in a kernel: a coda::RowOneHot leaf bound to the int64 index operand, in the
    functor beside the log-sum-exp's softmax."""
    from coda_dsl.passes.plan import OneHot
    from coda_dsl.runtime.autograd import derived_backward

    @cd.epilogue
    def ce(acc, target: cd.VecM):
        return {"lse": cd.logsumexp(acc), "zt": cd.take(acc, target)}
    bw = derived_backward(ce)
    plan, src = emit(make_plan, bw, operand_dtypes={"target": "i64", "grad_lse": "fp32", "saved_lse": "fp32",
                                                    "grad_zt": "fp32"})
    (hot,) = [n for n in plan.nodes if isinstance(n, OneHot)]
    assert using_types(src)[hot.name] == "coda::RowOneHot" and plan.inputs[hot.input_index] == "target"
    assert f"coda::one_hot_args<{hot.name}>(inputs[{hot.input_index}]),  // {hot.name}" in src


def scalars_struct(src):
    body = re.search(r"struct Scalars \{\n(.*?)\};", src, re.S).group(1)
    return re.findall(r"^\s*float (\w+);", body, re.M)


def test_scalars_struct_and_binding(make_plan):
    plan, src = emit(make_plan, rich, {"c": 0.5})
    # fields by position (names never reach C++ or the key); the user's names stay as comments
    assert scalars_struct(src) == ["s0", "s1"] and plan.scalars == ["alpha", "beta"]
    assert "float s0;  // alpha" in src and "float s1;  // beta" in src
    assert "Scalars scalars{ float(call.scalars[0]), float(call.scalars[1]) };" in src
    assert re.search(r"\bp\.s0\b", src) and re.search(r"\bp\.s1\b", src)
    _, src0 = emit(make_plan, bias_gelu)
    assert scalars_struct(src0) == [] and "Scalars scalars{  };" in src0


CPP_KEYWORDS = {"new", "delete", "this", "float", "int", "double", "char", "void", "auto", "const", "static",
                "struct", "union", "template", "typename", "operator", "private", "public", "protected",
                "virtual", "friend", "default", "register", "signed", "unsigned", "switch", "case", "goto",
                "sizeof", "typedef", "volatile", "extern", "inline", "namespace", "using", "bool", "short", "long",
                "explicit", "mutable", "throw", "catch", "do", "enum", "export", "this", "concept", "requires"}


def test_scalar_named_like_a_cpp_keyword(make_plan):
    ns: dict = {}
    exec("import coda_dsl as cd\n"
         "def kw(acc, new: cd.Scalar, default: cd.Scalar):\n"
         "    return acc * new + default\n", ns)
    ep = cd.epilogue(ns["kw"])
    _, src = emit(make_plan, ep)
    members = scalars_struct(src)
    assert len(members) == 2 and not set(members) & CPP_KEYWORDS, members
    assert not re.search(r"\bp\.(new|default)\b", src)


def float_literals(src):
    return re.findall(r"(?<![\w.])(-?\d+\.\d+(?:e[-+]?\d+)?)f\b", src)


@pytest.mark.parametrize("value", [0.1, 1e-6, 3.14159, 1 / 3, 6.02e23, 2.0 ** -140, 65504.0])
def test_const_literals_round_trip_exactly(make_plan, value):
    @cd.epilogue
    def lit(acc, c: cd.Const):
        return acc * c

    plan, src = emit(make_plan, lit, {"c": value})
    (body,) = [cpp_functor(f).body for f in plan.functors]
    (lits,) = [float_literals(line) for line in body]
    assert len(lits) == 1
    want = torch.tensor(value, dtype=torch.float32)
    got = torch.tensor(float(lits[0]), dtype=torch.float32)  # what a C++ compiler makes of `<lit>f`
    assert torch.equal(got, want) and lits[0] in src


def test_inf_literals_via_where(make_plan):
    @cd.epilogue
    def masked(acc):
        return cd.where(acc > 0, cd.minimum(acc, float("inf")), float("-inf"))

    plan, src = emit(make_plan, masked)
    body = " ".join(cpp_functor(plan.functors[0]).body)
    assert "(-INFINITY)" in body and re.search(r"[^-]INFINITY", body)
    assert "inf" not in body.replace("INFINITY", "")


def test_const_beyond_fp32_range(make_plan):
    @cd.epilogue
    def huge(acc):
        return cd.where(acc > 0, acc, -1e40) + 1e39

    _, src = emit(make_plan, huge)
    assert "inff" not in src
    assert "(-INFINITY)" in src


def test_b_layout(make_plan):
    _, nk = emit(make_plan, bias_gelu)
    _, kn = emit(make_plan, bias_gelu, b_layout="kn")
    assert "using LayoutB = cutlass::layout::ColumnMajor;" in nk
    assert "using LayoutB = cutlass::layout::RowMajor;" in kn
    assert "K-contiguous" in nk and "N-contiguous" in kn


def test_dtypes(make_plan):
    _, bf = emit(make_plan, bias_gelu)
    assert "using ElementAB = cutlass::bfloat16_t;" in bf and "using ElementD = cutlass::bfloat16_t;" in bf
    _, hf = emit(make_plan, bias_gelu, ab="fp16", operand_dtype="fp16")
    assert "using ElementAB = cutlass::half_t;" in hf and "using ElementD = cutlass::half_t;" in hf
    assert "Sm90RowBroadcast<0, TileShape, cutlass::half_t, float" in hf
    _, d32 = emit(make_plan, bias_gelu, output_dtypes={"D": "fp32"})
    assert "using ElementAB = cutlass::bfloat16_t;" in d32 and "using ElementD = float;" in d32


def test_config(make_plan):
    _, coop = emit(make_plan, bias_gelu, config=Config(tile=(256, 128, 64), cluster=(1, 2)))
    assert "using TileShape = Shape<_256, _128, _64>;" in coop
    assert "using ClusterShape = Shape<_1, _2, _1>;" in coop
    assert "KernelTmaWarpSpecializedCooperative" in coop and "Pingpong" not in coop
    _, ping = emit(make_plan, bias_gelu, config=Config(tile=(64, 128, 64), cluster=(1, 1), schedule="pingpong"))
    assert "using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;" in ping
    assert "using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;" in ping
    assert "coda::swizzle_for<TileShape, ClusterShape>(M, N, 8);" in ping  # at most 8: chosen per launch
    assert "StreamK" not in ping and "coda::launch<GemmKernel>(" in ping


@pytest.mark.parametrize("text", ["128x256x64_c2x1x1_cooperative", "128x256x64_x2x1_cooperative",
                                  "128x256x64_c+2x1_cooperative", "128x256x64_c2x1_cooperative_rm_rn",
                                  "128x256x64_c2x1_cooperative_streamk_streamk", "128x256x64_c2x1_pingpong_e64x0"])
def test_config_text_is_checked(text):
    """Every accepted text prints back as itself; the rest is a ValueError naming the form (no silent
    normalizing, no ZeroDivisionError)."""
    with pytest.raises(ValueError, match="bad config"):
        Config.parse(text)


def test_config_fields_are_checked():
    for kw in (dict(cluster=(2, 1, 5)), dict(epilogue_tile=(128, 0)), dict(epilogue_tile=(128, 64, 1)),
               dict(tile=(128.0, 256, 64)), dict(swizzle=True), dict(swizzle=2.0)):  # 2.0: text _s2.0, unparsable
        with pytest.raises(ValueError):
            Config(**kw)
    assert Config(swizzle=np.int64(4)).text.endswith("_s4")  # numpy's integers are integers
    c = Config(tile=[128, 256, 64])  # a list is its tuple: hashable, and prints as the default
    assert hash(c) == hash(Config()) and Config.parse(c.text) == c
    for text in ("128x256x64_c2x1_cooperative", "64x128x64_c1x2_pingpong_e64x64_rm_s4_streamk"):
        assert Config.parse(text).text == text


def test_scheduler_options(make_plan):
    _, src = emit(make_plan, bias_gelu, config=Config(raster="m", swizzle=2, scheduler="streamk"))
    assert "args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM;" in src
    assert "args.scheduler.max_swizzle_size = coda::swizzle_for<TileShape, ClusterShape>(M, N, 2);" in src
    assert "CollectiveEpilogue,\n" in src and "cutlass::gemm::StreamKScheduler>;" in src
    assert "coda::launch<GemmKernel, true>(args, gemm_entry, gemm_ws, gemm_ws_size, call, op_name);" in src  # stream-K: flags zeroed per launch
    _, along_n = emit(make_plan, bias_gelu, config=Config(raster="n", swizzle=1))
    assert "RasterOrderOptions::AlongN;" in along_n and "swizzle_for<TileShape, ClusterShape>(M, N, 1);" in along_n
    assert "StreamKScheduler" not in along_n and "coda::launch<GemmKernel>(" in along_n


def test_functor_text(make_plan):
    plan, src = emit(make_plan, bias_gelu)
    (f,) = map(cpp_functor, plan.functors)
    assert f.arity == 2
    assert "CUTLASS_HOST_DEVICE T operator()(T const& x0_, T const& x1_, Arguments const& p) const {" in src
    assert "coda::gelu_erf(" in src
    for line in f.body:
        assert f"    {line}\n" in src
    assert f"return T({f.result});" in src


def test_cast_renders_round_to(make_plan):
    ep = cd.epilogue(lambda acc: cd.cast(cd.cast(acc, cd.bfloat16), cd.float32) + cd.cast(acc, cd.float16))
    _, src = emit(make_plan, ep)
    assert "coda::round_to<cutlass::bfloat16_t>(" in src and "coda::round_to<float>(" in src
    assert "coda::round_to<cutlass::half_t>(" in src


def test_render_is_deterministic(make_plan):
    _, a = emit(make_plan, rich, {"c": 0.5})
    _, b = emit(make_plan, rich, {"c": 0.5})
    assert a == b


def test_op_name():
    assert op_name(KEY) == "k" + KEY[:20]
    assert re.fullmatch(r"k[0-9a-f]{20}", op_name(KEY))


def test_pair_functors_write_both_slots(make_plan):
    plan, src = emit(make_plan, rope_tables)
    (f,) = [cpp_functor(f) for f in plan.functors if f.pairwise]
    assert f"r[2 * q] = T({f.result});" in src and f"r[2 * q + 1] = T({f.result_odd});" in src


def test_accumulate_reads_d_as_the_c_operand(make_plan):
    _, src = emit(make_plan, bias_gelu, accumulate=True)
    assert "using ElementC = ElementD;" in src and "ElementC const* ptr_C = ptr_D;" in src
    assert "{evt_args, ptr_C, dD, ptr_D, dD}" in src


@pytest.mark.parametrize("accumulate", [False, True], ids=["no C", "C = D"])
def test_auxloads_are_staged_as_the_collectives_c(make_plan, accumulate):
    """The epilogue descriptor that stages AuxLoad nodes names the collective's C type: C's stage count depends
    on it (C = D: one more than D's), and an AuxLoad indexing stages the collective does not have would read a
    buffer the producer is refilling (with accumulation on a tile of two epilogue subtiles it did)."""
    _, src = emit(make_plan, rich, {"c": 0.5}, accumulate=accumulate)
    assert ("using ElementC = ElementD;" if accumulate else "using ElementC = void;") in src
    assert "EpilogueDescriptor<TileShape, EpilogueTile, ElementC, ElementD, EpilogueSchedule>" in src
    assert re.search(r"CollectiveBuilder<\s*cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, "
                     r"ClusterShape, EpilogueTile,\s*float, float,\s*ElementC,", src)


def test_kernels_include_hoppers_cutlass_only():
    """A kernel's translation unit parses CUTLASS's sm90 mainloop, builder and kernels, not the umbrella
    headers that bring every architecture's and CUTLASS 2.x's device layer (10-18 % of a cold build)."""
    evt_h = (Path(__file__).resolve().parents[1] / "csrc" / "coda_dsl" / "evt.h").read_text()
    includes = set(re.findall(r'#include "(cutlass/gemm/[^"]+)"', evt_h))
    assert not includes & {"cutlass/gemm/collective/collective_builder.hpp", "cutlass/gemm/kernel/gemm_universal.hpp",
                           "cutlass/gemm/device/gemm_universal_adapter.h"}
    assert "cutlass/gemm/collective/builders/sm90_gmma_builder.inl" in includes
