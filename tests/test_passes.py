"""Passes: constant binding and folding (specialize), validation, and lowering into an EVT plan."""
import pytest
import torch

import coda_dsl as cd
from coda_dsl import EpilogueError
from coda_dsl.codegen import evt
from coda_dsl.ir import graph as ir
from coda_dsl.library import rope_tables
from coda_dsl.passes import Config, specialize
from coda_dsl.passes.plan import (AccFetch, AuxLoad, AuxStore, ColBroadcast, Compute, Reduce, Ref, RowBroadcast,
                                  Step)


def D(program):
    return program.output("D").node


def computes(plan):
    return [(i, n) for i, n in enumerate(plan.nodes) if isinstance(n, Compute)]


def is_identity(node):
    return isinstance(node, Compute) and node.functor.steps == [] and node.functor.result == Ref("input", 0) \
        and len(node.children) == 1


def uses(functor, op):
    """Does the functor apply op (an op name of ir/ops.py)?"""
    return any(s.op == op for s in functor.steps)


def reads_a_scalar(functor):
    return functor.result.kind == "scalar" or any(a.kind == "scalar" for s in functor.steps for a in s.args)


def d_index(plan):
    """Index of the visitor node whose value is stored as D: the last node, seen through an identity
    functor or an AuxStore (which passes its input through)."""
    last = plan.nodes[-1]
    return last.children[0] if isinstance(last, AuxStore) or is_identity(last) else len(plan.nodes) - 1


# ---------------------------------------------------------------------------------------------
# specialize
# ---------------------------------------------------------------------------------------------
@cd.epilogue
def scaled(acc, c: cd.Const):
    return acc * (c * 2)


def test_const_binds_and_folds():
    prog = specialize(scaled.program, {"c": 3})
    d = D(prog)
    assert d is ir.compute("mul", ir.acc(), ir.const(6.0))  # c * 2 folded to one literal
    assert D(scaled.program).inputs[1].op == "mul"  # the traced program is untouched
    assert D(specialize(scaled.program, {"c": 0.25})).inputs[1] is ir.const(0.5)


def test_folded_const_is_a_single_multiply_in_the_plan(make_plan):
    plan = make_plan(scaled, consts={"c": 3.0})
    (_, comp), = computes(plan)
    assert comp.functor.steps == [Step("mul", None, (Ref("input", 0), Ref("const", 6.0)))]
    assert "3.0" not in plan.canonical and "6.0f" in plan.canonical


def test_an_output_cast_to_its_own_dtype_is_rounded_by_its_store(make_plan):
    """cd.cast(x, fp16) as an output: the kernel stores x as fp16 (the store rounds to nearest, as the cast
    does), no rounding step of its own; a cast inside the expression stays. The reference keeps the cast."""
    @cd.epilogue
    def stored_half(acc):
        return {"D": cd.cast(acc * 2.0, cd.float16), "y": cd.cast(cd.cast(acc, cd.bfloat16) + 1.0, cd.float32)}

    plan = make_plan(stored_half)
    assert plan.d_dtype == "fp16"
    assert [s.op for _, comp in computes(plan) for s in comp.functor.steps].count("cast") == 1  # y's inner cast
    a, b = torch.randn(8, 16), torch.randn(16, 16)
    out = cd.gemm(a.bfloat16(), b.bfloat16(), stored_half, backend="reference")
    assert out["D"].dtype == torch.float16 and out["y"].dtype == torch.float32


def test_fold_uses_fp32_and_cast_semantics():
    @cd.epilogue
    def folds(acc, c: cd.Const):
        return acc + cd.cast(c, cd.bfloat16) + cd.exp(c - c) + cd.where(c > 1, 10, 20)

    prog = specialize(folds.program, {"c": 0.1})
    consts = [n.attr for n in ir.walk(prog) if n.op == "const"]
    bf = float(torch.tensor(0.1).to(torch.bfloat16).float())  # 0.10009765625
    assert bf in consts and 1.0 in consts and 20.0 in consts
    assert not any(n.op in ("const_param", "cast", "exp", "where", "gt") for n in ir.walk(prog))


def test_fold_keeps_nonconstant_parts():
    @cd.epilogue
    def partial(acc, s: cd.Scalar, c: cd.Const):
        return acc * s + c * c

    d = D(specialize(partial.program, {"c": -3}))
    assert d is ir.compute("add", ir.compute("mul", ir.acc(), ir.scalar("s")), ir.const(9.0))


def test_missing_const_value():
    with pytest.raises(EpilogueError) as info:
        specialize(scaled.program, {})
    msg = str(info.value)
    assert "'scaled'" in msg and "['c']" in msg and "c=<number>" in msg


# ---------------------------------------------------------------------------------------------
# lower: node kinds
# ---------------------------------------------------------------------------------------------
@cd.epilogue
def kinds(acc, r: cd.Tensor, bias: cd.VecN, rstd: cd.VecM, alpha: cd.Scalar):
    return (acc * rstd + bias) * alpha + r


def test_operand_kinds_lower_to_cutlass_nodes(make_plan):
    plan = make_plan(kinds, operand_dtypes={"rstd": "fp32"})
    by_name = {n.name: n for n in plan.nodes}
    assert isinstance(plan.nodes[0], AccFetch)
    # the CUTLASS inversion: a vector over n is broadcast along rows -> RowBroadcast, and vice versa
    assert type(by_name["Load_bias"]) is RowBroadcast
    assert type(by_name["Load_rstd"]) is ColBroadcast
    assert type(by_name["Load_r"]) is AuxLoad
    assert by_name["Load_rstd"].dtype == "fp32" and by_name["Load_bias"].dtype == "bf16"
    # runtime binding: inputs[i] is the operand whose load node has input_index i
    assert sorted(plan.inputs) == ["bias", "r", "rstd"]
    for name in plan.inputs:
        assert by_name[f"Load_{name}"].input_index == plan.inputs.index(name)
    assert plan.scalars == ["alpha"]
    # one fused functor over acc and the three loads, and it is D
    (i, comp), = computes(plan)
    assert sorted(comp.children) == sorted(plan.nodes.index(by_name[n]) for n in ("Acc", "Load_r", "Load_bias",
                                                                                   "Load_rstd"))
    assert i == len(plan.nodes) - 1
    assert any(Ref("scalar", 0) in s.args for s in comp.functor.steps)  # alpha, by position


def test_children_come_before_parents(make_plan):
    plan = make_plan(kinds)
    for i, n in enumerate(plan.nodes):
        assert all(c < i for c in n.children), (i, n)
    names = [n.name for n in plan.nodes]
    assert len(set(names)) == len(names)


def test_shared_subexpression_is_materialized_once(make_plan):
    @cd.epilogue
    def shared(acc, bias: cd.VecN, rstd: cd.VecM):
        h = acc * rstd + bias
        return {"D": cd.gelu(h), "e": cd.cast(cd.exp(h), cd.float32)}

    plan = make_plan(shared)
    leaves = {i for i, n in enumerate(plan.nodes) if not n.children}
    h_nodes = [i for i, n in computes(plan) if set(n.children) == leaves]
    assert len(h_nodes) == 1, plan.nodes  # h computed by exactly one functor
    h = h_nodes[0]
    gelu = [i for i, n in computes(plan) if uses(n.functor, "gelu") or uses(n.functor, "gelu_tanh")]
    exp = [i for i, n in computes(plan) if uses(n.functor, "exp")]
    assert len(gelu) == 1 and len(exp) == 1
    assert plan.nodes[gelu[0]].children == (h,) and plan.nodes[exp[0]].children == (h,)
    # nothing else recomputes h: only the h functor reads the leaves
    assert [i for i, n in computes(plan) if set(n.children) & leaves] == [h]
    (store,) = [n for n in plan.nodes if isinstance(n, AuxStore)]
    assert store.children == (exp[0],) and store.dtype == "fp32"
    assert d_index(plan) == gelu[0]


def test_square_of_a_value_is_not_shared(make_plan):
    """h * h uses h once (one user): it fuses into a single functor."""
    ep = cd.epilogue(lambda acc: (acc + 1) * (acc + 1))
    plan = make_plan(ep)
    assert len(computes(plan)) == 1


def test_d_is_the_last_nodes_value(make_plan):
    @cd.epilogue
    def d_first(acc, bias: cd.VecN):
        h = acc + bias
        return {"D": h, "g": cd.cast(cd.silu(h), cd.float16), "t": cd.cast(cd.tanh(h), cd.bfloat16)}

    plan = make_plan(d_first)
    h = [i for i, n in computes(plan) if uses(n.functor, "add")]
    assert len(h) == 1
    last = plan.nodes[-1]
    assert is_identity(last) and last.children == (h[0],)
    stores = [n for n in plan.nodes if isinstance(n, AuxStore)]
    assert [(s.name, s.dtype, s.output_index) for s in stores] == [("Store_g", "fp16", 0), ("Store_t", "bf16", 1)]


def test_d_after_aux_store_needs_no_identity(make_plan):
    @cd.epilogue
    def same(acc, bias: cd.VecN):
        h = acc + bias
        return {"D": h, "copy": h}

    plan = make_plan(same)
    assert isinstance(plan.nodes[-1], AuxStore)
    assert d_index(plan) == plan.nodes[-1].children[0]
    assert not any(is_identity(n) for n in plan.nodes)


def test_return_acc_gets_an_identity_functor(make_plan):
    plan = make_plan(cd.epilogue(lambda acc: acc))
    assert [type(n) for n in plan.nodes] == [AccFetch, Compute]
    assert is_identity(plan.nodes[1]) and plan.nodes[1].children == (0,)
    assert plan.inputs == [] and plan.outputs == [] and plan.scalars == []


def test_identity_epilogue(make_plan):
    plan = make_plan(cd.identity)
    assert [type(n) for n in plan.nodes] == [AccFetch, Compute] and is_identity(plan.nodes[1])


def test_operand_passthrough_and_constant_outputs(make_plan):
    @cd.epilogue
    def passthrough(acc, r: cd.Tensor, s: cd.Scalar):
        return {"D": r, "s_out": s * 1, "k": acc * 0 + 2}

    plan = make_plan(passthrough)
    assert isinstance(plan.nodes[d_index(plan)], AuxLoad)
    stores = {n.name: n for n in plan.nodes if isinstance(n, AuxStore)}
    assert set(stores) == {"Store_s_out", "Store_k"}
    s_fn = plan.nodes[stores["Store_s_out"].children[0]].functor
    assert reads_a_scalar(s_fn)


def test_output_dtypes(make_plan):
    @cd.epilogue
    def outs(acc, bias: cd.VecN):
        h = acc + bias
        return {"D": h, "h32": cd.cast(h, cd.float32), "h16": cd.cast(h, cd.float16), "hb": h * 2}

    plan = make_plan(outs, ab="fp16", output_dtypes={"hb": "fp32"})
    assert plan.d_dtype == "fp16"
    assert plan.outputs == [("h32", "fp32", "mn"), ("h16", "fp16", "mn"), ("hb", "fp32", "mn")]
    stores = [n for n in plan.nodes if isinstance(n, AuxStore)]
    assert [(n.dtype, n.output_index) for n in stores] == [("fp32", 0), ("fp16", 1), ("fp32", 2)]
    plan_d32 = make_plan(outs, output_dtypes={"D": "fp32"})
    assert plan_d32.d_dtype == "fp32"


# ---------------------------------------------------------------------------------------------
# plan.canonical
# ---------------------------------------------------------------------------------------------
@cd.epilogue
def keyed(acc, res: cd.Tensor, bias: cd.VecN, rstd: cd.VecM, c: cd.Const):
    h = acc * rstd + bias
    return {"D": h + res * c, "aux": cd.cast(cd.gelu(h), cd.float32)}


@cd.epilogue
def keyed_renamed(a, residual: cd.Tensor, b: cd.VecN, scale: cd.VecM, k: cd.Const):
    g = a * scale + b
    return {"D": g + residual * k, "other": cd.cast(cd.gelu(g), cd.float32)}


@cd.epilogue
def keyed_swapped_params(acc, c: cd.Const, rstd: cd.VecM, bias: cd.VecN, res: cd.Tensor):
    h = acc * rstd + bias
    return {"D": h + res * c, "aux": cd.cast(cd.gelu(h), cd.float32)}


def test_canonical_text_independent_of_user_names(make_plan):
    base = make_plan(keyed, consts={"c": 0.5}).canonical
    assert make_plan(keyed_renamed, consts={"k": 0.5}).canonical == base
    assert make_plan(keyed_swapped_params, consts={"c": 0.5}).canonical == base
    for forbidden in ("keyed", "res", "bias", "rstd", "aux", "test_passes"):
        assert forbidden not in base


@pytest.mark.parametrize("change", [
    dict(ab="fp16"),
    dict(b_layout="kn"),
    dict(config=Config(tile=(128, 128, 64))),
    dict(config=Config(cluster=(1, 1))),
    dict(config=Config(tile=(64, 128, 64), schedule="pingpong")),
    dict(config=Config(raster="m")),
    dict(config=Config(swizzle=1)),
    dict(config=Config(scheduler="streamk")),
    dict(consts={"c": 0.25}),
    dict(operand_dtypes={"bias": "fp32"}),
    dict(operand_dtypes={"res": "fp16"}),
    dict(operand_dtypes={"rstd": "fp32"}),
    dict(output_dtypes={"D": "fp32"}),
    dict(output_dtypes={"aux": "bf16"}),
])
def test_canonical_text_sensitive_to_what_changes_the_code(make_plan, change):
    base = make_plan(keyed, consts={"c": 0.5}).canonical
    kw = {"consts": {"c": 0.5}, **change}
    assert make_plan(keyed, **kw).canonical != base


def test_canonical_text_sensitive_to_the_program(make_plan):
    a = make_plan(cd.epilogue(lambda acc: cd.gelu(acc))).canonical
    b = make_plan(cd.epilogue(lambda acc: cd.gelu(acc, approximate="tanh"))).canonical
    c = make_plan(cd.epilogue(lambda acc: acc + 1)).canonical
    d = make_plan(cd.epilogue(lambda acc: 1 + acc)).canonical
    assert len({a, b, c, d}) == 4


@cd.epilogue
def two_scalars(acc, alpha: cd.Scalar, beta: cd.Scalar):
    return acc * alpha + beta


@cd.epilogue
def two_scalars_swapped(acc, beta: cd.Scalar, alpha: cd.Scalar):  # same body, other binding order
    return acc * alpha + beta


@cd.epilogue
def two_scalars_renamed(acc, a: cd.Scalar, b: cd.Scalar):
    return acc * a + b


def test_scalar_binding_order_is_in_the_canonical_text(make_plan):
    p1, p2 = make_plan(two_scalars), make_plan(two_scalars_swapped)
    assert p1.scalars != p2.scalars
    assert p1.canonical != p2.canonical


def test_scalar_rename_keeps_the_canonical_text(make_plan):
    assert make_plan(two_scalars).canonical == make_plan(two_scalars_renamed).canonical


# ---------------------------------------------------------------------------------------------
# validate / reductions
# ---------------------------------------------------------------------------------------------
def test_program_without_d_stores_no_d(make_plan):
    ep = cd.epilogue(lambda acc: {"y": acc * 2, "s": cd.sum(acc, axis="n")})
    plan = make_plan(ep)
    assert plan.d_dtype is None
    assert [o[0] for o in plan.outputs] == ["y", "s"]
    assert not any(isinstance(n, Compute) and n.functor.text == "D" for n in plan.nodes)


@pytest.mark.parametrize("kind", ["sum", "max", "min", "amax"])
@pytest.mark.parametrize("axis", ["n", "m", None])
def test_reductions_lower_to_their_node(make_plan, kind, axis):
    """Each kind and axis becomes one reduction node with its own type and reduce op (CUTLASS's names are
    inverted: a statistic over n, one per row, is its ColReduction; one per column is coda's own node, whose
    type names all three of its functors)."""
    def fn(acc, bias: cd.VecN):
        h = acc + bias
        return {"D": h, "r": getattr(cd, kind)(h * h, axis=axis)}

    [r] = [n for n in make_plan(cd.epilogue(fn)).nodes if isinstance(n, Reduce)]
    assert (r.kind, r.axis) == (kind, axis)
    node = {"n": "fusion::Sm90ColReduction<", "m": "coda::ColumnReduction<", None: "fusion::Sm90ScalarReduction<"}
    reduce_op = {"sum": "cutlass::plus", "max": "coda::maximum_nan", "min": "coda::minimum_nan", "amax": "coda::amax_reduce"}
    cpp_type = evt.node(r).type
    assert cpp_type.startswith(f"{node[axis]}{reduce_op[kind]}, "), cpp_type
    if axis == "m":
        combine, atomic = {"sum": ("cutlass::plus", "cutlass::atomic_add"), "max": ("coda::maximum_nan", "coda::atomic_maximum"),
                           "min": ("coda::minimum_nan", "coda::atomic_minimum"),
                           "amax": ("coda::maximum_nan", "coda::atomic_maximum")}[kind]
        assert cpp_type == f"coda::ColumnReduction<{reduce_op[kind]}, {combine}, {atomic}>"


def test_config_roundtrip_and_validation():
    cfg = Config(tile=(256, 128, 64), cluster=(1, 2), schedule="cooperative")
    assert Config.parse(cfg.text) == cfg
    with pytest.raises(ValueError, match="pingpong"):
        Config(tile=(64, 128, 64))
    with pytest.raises(ValueError, match="1 to 4 CTAs"):
        Config(cluster=(4, 2))
    with pytest.raises(ValueError, match="1 to 4 CTAs"):
        Config(cluster=(0, 1))
    with pytest.raises(ValueError, match="each side 1, 2 or 4"):  # accepted before, then nvcc failed in CUTLASS
        Config((128, 128, 64), (3, 1), "pingpong")
    with pytest.raises(ValueError, match="positive multiple of 64"):
        Config((0, 0, 0), (1, 1), "pingpong")
    with pytest.raises(ValueError, match="bad config"):
        Config.parse("128x128")
    with pytest.raises(cd.OperandError):  # coda_dsl's own error (a ValueError too): `except cd.CodaError` catches it
        Config((64, 64, 64), (1, 1), "cooperative")


@pytest.mark.parametrize("text", ["128x256x64_c2x1_cooperative_rm", "128x256x64_c2x1_cooperative_s1",
                                  "128x192x64_c2x1_pingpong_e64x64_rn_s2_streamk", "256x128x64_c1x2_cooperative_streamk"])
def test_config_scheduler_options_round_trip(text):
    cfg = Config.parse(text)
    assert cfg.text == text and Config.parse(cfg.text) == cfg


@pytest.mark.parametrize("bad", [dict(raster="x"), dict(swizzle=3), dict(scheduler="dynamic")])
def test_config_scheduler_options_validated(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Config(**bad)
    with pytest.raises(ValueError, match="bad config"):
        Config.parse("128x256x64_c2x1_cooperative_s3")


def test_config_text_covers_the_epilogue_tile():
    tiled = Config(epilogue_tile=(128, 64))
    assert Config.parse(tiled.text) == tiled and tiled.text != Config().text


@cd.epilogue
def _sub_h_acc(acc, r: cd.Tensor):
    h = acc + r
    return {"D": h - acc, "h": h}


@cd.epilogue
def _sub_acc_h(acc, r: cd.Tensor):
    h = acc + r
    return {"D": acc - h, "h": h}


@cd.epilogue
def _sum_n(acc):
    return {"D": acc, "s": cd.sum(acc, axis="n")}


@cd.epilogue
def _sum_m(acc):
    return {"D": acc, "s": cd.sum(acc, axis="m")}


@cd.epilogue
def _interleave_even_odd(acc):
    even, odd = cd.pairs(acc)
    return cd.interleave(even, odd)


@cd.epilogue
def _interleave_even_even(acc):
    even, _ = cd.pairs(acc)
    return cd.interleave(even, even)


@cd.epilogue
def _take_one_index(acc, t: cd.VecM):
    return {"a": cd.take(acc, t), "b": cd.take(acc * 2.0, t)}


@cd.epilogue
def _take_two_indices(acc, t1: cd.VecM, t2: cd.VecM):
    return {"a": cd.take(acc, t1), "b": cd.take(acc * 2.0, t2)}


@pytest.mark.parametrize("first, second", [
    ((_sub_h_acc, {}), (_sub_acc_h, {})),  # the same nodes, other edges
    ((_sum_n, {}), (_sum_m, {})),
    ((_interleave_even_odd, {}), (_interleave_even_even, {})),  # pair functors differ only in the odd slot
    ((_take_one_index, dict(operand_dtype="i64")), (_take_two_indices, dict(operand_dtype="i64"))),
    ((rope_tables, {}), (rope_tables, dict(operand_dtype="fp16"))),  # half-width tables of another dtype
], ids=["edges", "reduction axis", "odd slot", "take index", "pair load dtype"])
def test_different_kernels_have_different_canonical_texts(make_plan, first, second):
    """Two programs that compute different things must never share a cache entry."""
    assert make_plan(first[0], **first[1]).canonical != make_plan(second[0], **second[1]).canonical


def _onehot_index_out(acc, t: cd.VecM):
    return {"D": acc * cd.onehot(t), "t": t}


def _onehot_index_summed(acc, t: cd.VecM):
    return {"D": acc * cd.onehot(t), "s": cd.sum(t, axis="m")}


def _take_index_out(acc, t: cd.VecM):
    return {"k": cd.take(acc, t), "t": t}


def _take_of_its_index(acc, t: cd.VecM):
    return {"k": cd.take(t, t)}


def _onehot_index_in_math(acc, t: cd.VecM):
    return acc * cd.onehot(t) + cd.silu(t)  # (torch has no silu of int64: the reference's math is fp32)


@pytest.mark.parametrize("fn", [_onehot_index_out, _onehot_index_summed, _take_index_out, _take_of_its_index,
                                _onehot_index_in_math],
                         ids=lambda f: f.__name__.strip("_"))
def test_indices_used_as_values_are_refused_for_the_kernel(make_plan, fn):
    """An index operand read as a value too (an output, another reduction's input, cd.take's own value) has no
    kernel node (the kernel reads it as int64 indices only): refused with the reason, the reference runs it."""
    ep = cd.epilogue(fn)
    with pytest.raises(cd.UnsupportedError, match="'t' holds int64 column indices (.|\n)*as an output"):
        make_plan(ep, operand_dtype="i64")
    t = torch.tensor([0, 2, -1])
    out = cd.gemm(torch.randn(3, 4), torch.randn(5, 4), ep, t=t, backend="reference")
    assert all(v.dtype == torch.float32 for v in (out.values() if isinstance(out, dict) else [out]))


def test_every_op_definition_is_complete():
    """What passes read from an op definition is there (so no pass needs a list of op names)."""
    from coda_dsl.ir.ops import KINDS, NODE_OPS
    for name, op in NODE_OPS.items():
        assert op.name == name and op.kind in KINDS
        if op.kind in ("elementwise", "structural"):
            assert op.torch_fn is not None and op.width_rule in ("same", "half", "double") and op.fold, name
        if op.kind == "structural":
            assert op.parts is not None and op.folder is not None, name
        if op.kind in ("leaf", "reduction"):
            assert op.width_rule is None and not op.fold, name
        assert (op.leaf_value in ("fetched", "uniform")) == (op.kind == "leaf"), name  # how widths and lowering read it


def test_a_new_elementwise_op_is_its_definition_and_spelling(monkeypatch, make_plan):
    """An elementwise op is one OpDef (ir/ops.py) plus one C++ spelling (codegen/cpp.py): tracing,
    folding, validation, widths, the reference backend, lowering and codegen need nothing else."""
    from coda_dsl.codegen import cpp
    from coda_dsl.dsl.trace import apply
    from coda_dsl.ir import ops
    softsign = ops.elementwise("softsign", 1, lambda x: x / (1 + x.abs()))
    monkeypatch.setitem(ops.OPS, "softsign", softsign)
    monkeypatch.setitem(ops.NODE_OPS, "softsign", softsign)
    monkeypatch.setitem(cpp.OP_CPP, "softsign", "({0} / (1.f + fabsf({0})))")

    @cd.epilogue
    def soft(acc, c: cd.Const):
        return apply("softsign", acc) * apply("softsign", c)  # the constant's softsign folds

    a, b = torch.randn(4, 16), torch.randn(8, 16)
    got = cd.gemm(a, b, soft, c=1.0, backend="reference")["D"].float()
    z = a @ b.t()
    assert torch.allclose(got, (z / (1 + z.abs()) * 0.5).bfloat16().float(), atol=1e-2)
    plan = make_plan(soft, consts={"c": 1.0})
    (_, comp), = computes(plan)
    assert [s.op for s in comp.functor.steps] == ["softsign", "mul"]
    assert "float t0 = (x0 / (1.f + fabsf(x0)));" in cpp.functor(comp.functor).body


def test_a_chain_of_thousands_of_ops_meets_no_recursion_limit(make_plan):
    """Folding and lowering walk the graph on stacks of their own: a 3000-op sequential chain (a loop adding
    terms) ran into Python's recursion limit at ~495 ops; now it plans into one functor, and the reference
    and cd.linear run it."""
    n = 3000

    @cd.epilogue
    def chain(acc, b: cd.VecN, c: cd.Const):
        s = acc
        for i in range(n):
            s = s + b * (c / (i + 1))
        return {"D": s, "r": cd.sum(s, axis="n").then(lambda z: cd.rsqrt(z * z + 1.0))}

    plan = make_plan(chain, consts={"c": 1.0})
    assert max(len(f.steps) for f in plan.functors) >= 2 * n
    x, w, b = torch.randn(8, 16, requires_grad=True), torch.randn(24, 16), torch.randn(24)
    ref = x.detach() @ w.t()
    for i in range(n):
        ref = ref + b * (1.0 / (i + 1))
    out = cd.linear(x, w, chain, b=b, c=1.0, backend="reference")
    assert torch.allclose(out["D"], ref, rtol=1e-4, atol=1e-4)
    out["D"].sum().backward()
    assert torch.allclose(x.grad, torch.ones(8, 24) @ w, rtol=1e-4, atol=1e-4)
