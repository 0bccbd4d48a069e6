"""Binding compile-time constants and folding constant subexpressions (and moving a cast of an
interleave onto its halves).

Common subexpressions need no pass: IR nodes are hash-consed (ir/graph.py).
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import EpilogueError, OperandError, UnsupportedError
from ..ir import graph as ir
from ..ir.ops import FoldError
from .widths import infer, width_text


def _fold(root: ir.Node, memo: dict[int, ir.Node], consts: dict[str, float], program: ir.Program) -> ir.Node:
    """root with constants bound and folded, inputs (and a finishing expression) first, first to last (an
    error names the first bad node); what memo holds is done."""
    def inputs(n: ir.Node) -> tuple:
        return () if id(n) in memo else (*n.inputs, *([n.attr] if n.op == "finish" else []))
    for node in ir.topo_order([root], inputs):
        if id(node) not in memo:
            memo[id(node)] = _fold_one(node, memo, consts, program)
    return memo[id(root)]


def _fold_one(node: ir.Node, memo: dict[int, ir.Node], consts: dict[str, float], program: ir.Program) -> ir.Node:
    """One node, its inputs folded already (in memo)."""
    if node.op == "const_param":
        return ir.const(consts[node.attr])
    if node.is_leaf:
        return node
    inputs = tuple(memo[id(i)] for i in node.inputs)
    attr = memo[id(node.attr)] if node.op == "finish" else node.attr
    out = ir.Node(node.op, inputs, attr)
    if node.op == "cast" and inputs[0].op == "interleave":  # the rounding of each half: the form kernels store
        out = ir.interleave(*(ir.Node("cast", (half,), attr) for half in inputs[0].inputs))
    op = node.definition
    if op is not None and op.fold and all(i.op == "const" for i in inputs):
        try:
            out = ir.const(op.evaluate(node.attr, [i.attr for i in inputs]))
        except FoldError as e:
            raise EpilogueError(f"epilogue '{program.name}' ({program.where(node)}): {e}\n  fix: interleave "
                                "traced values (a constant of the tile's width: cd.where(acc == acc, 1.0, 1.0))") from None
    return out


def specialize(program: ir.Program, consts: dict[str, float]) -> ir.Program:
    """The program with cd.Const parameters bound to values and constant subexpressions folded."""
    missing = [p.name for p in program.params if p.kind == "const" and p.name not in consts]
    if missing:
        raise EpilogueError(f"epilogue '{program.name}': compile-time constant(s) {missing} need a value: "
                            f"pass {missing[0]}=<number> to the call (cd.gemm, cd.compile, cd.linear, "
                            "cd.backward_epilogue)")
    memo: dict[int, ir.Node] = {}
    outputs = tuple(ir.Output(o.name, _fold(o.node, memo, consts, program), o.dtype) for o in program.outputs)
    locations = {id(memo[k]): v for k, v in program.locations.items() if k in memo}
    locations.update(program.locations)
    return replace(program, outputs=outputs, locations=locations)


def _unrounded(o: ir.Output) -> ir.Node:
    """What o's store is to round: a rounding to o's own dtype (a cast) is the store's own."""
    d = o.node.definition
    return o.node.inputs[0] if d is not None and d.rounds and o.node.attr == o.dtype else o.node


def rounding_in_stores(program: ir.Program) -> ir.Program:
    """Each output as the value its store rounds (_unrounded): the kernel has no rounding step of its own
    for a cast to the output's dtype. (Kernels only: the reference backend's fp64 mode keeps outputs
    unrounded but for their casts.)"""
    outputs = tuple(ir.Output(o.name, _unrounded(o), o.dtype) for o in program.outputs)
    return program if outputs == program.outputs else replace(program, outputs=outputs)


def accumulate_into_d(program: ir.Program) -> ir.Program:
    """D += value: the stored D becomes its prior contents plus what the epilogue computes."""
    d = program.output("D")
    if d is None:
        raise OperandError(f"{program.title} has no D output to accumulate into")
    if ir.reduction_of(d.node) is not None:
        raise OperandError(f"{program.title}: its D is a reduction; accumulate=True "
                            "adds an [M, N] D into out['D'] as the tiles store it\n  fix: add the reduction's result "
                            "yourself (t += cd.gemm(...)['D'])")
    width = infer(program).get(id(d.node), 1)
    if same := [name for name, of in program.aliases if of == "D"]:
        raise UnsupportedError(f"{program.title}: output '{same[0]}' is D's value, returned as the tensor of D; "
                               "with accumulate=True D holds the sum instead\n  fix: add it yourself (out['D'] += "
                               "cd.gemm(...)['D'])")
    if width != 1:  # stored by the pair store, not CUTLASS's D: no prior D to read
        raise UnsupportedError(f"{program.title}: accumulate=True needs an N-wide D; "
                               f"this D is {width_text(width)} wide (a cd.pairs / cd.interleave result)\n  fix: "
                               "add it yourself (out['D'] += cd.gemm(...)['D'])")
    value = _unrounded(d)  # the sum is rounded once, when stored
    outputs = tuple(ir.Output("D", ir.compute("add", ir.prior_d(), value), o.dtype) if o.name == "D" else o
                    for o in program.outputs)
    return replace(program, outputs=outputs)
