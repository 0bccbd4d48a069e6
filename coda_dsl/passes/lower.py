"""Lowering a specialized program into an EVT plan (see plan.py).

Partition: every elementwise node that is an output, or that feeds two or more users, becomes one
visitor node (`Compute` with a generated functor); the expression tree below it, down to leaves and
other such nodes, is fused into that functor. So a shared subexpression is computed once, and each
fused region is one functor. Leaves: acc -> Sm90AccFetch, cd.Tensor -> AuxLoad (TMA), VecN ->
RowBroadcast, VecM -> ColBroadcast; scalars ride in the functors' Arguments; constants are literals.
Outputs other than D are taps (AuxStore) on their value; the last node yields D.
"""
from __future__ import annotations

from collections import Counter

from ..errors import EpilogueError, UnsupportedError
from ..ir import graph as ir
from ..ir.ops import OPS, cpp_float
from .plan import (AccFetch, AuxLoad, AuxStore, ColBroadcast, Compute, EvtNode, Functor, Plan, Reduction,
                   RowBroadcast, Signature, cpp_element)

_LOAD_NODE = {"tensor": AuxLoad, "vec_n": RowBroadcast, "vec_m": ColBroadcast}


def validate(program: ir.Program) -> None:
    """Reject what no lowering can run, with the user's line."""
    if program.output("D") is None:
        raise UnsupportedError(f"epilogue '{program.name}' ({program.source}) has no 'D' output; "
                               "an epilogue without D is not supported yet: return {'D': ..., ...}")
    for node in ir.walk(program):
        if not node.is_leaf and node.op not in OPS and node.op not in ("cast", "reduce"):
            raise EpilogueError(f"epilogue '{program.name}' ({program.where(node)}): unknown op '{node.op}'")


class _Lowering:
    def __init__(self, program: ir.Program, sig: Signature):
        self.program, self.sig = program, sig
        self.nodes: list[EvtNode] = []
        self.functors: list[Functor] = []
        self.index: dict[int, int] = {}  # id(IR node) -> index of the visitor node holding its value
        self.inputs: list[str] = []
        self.dtypes = dict(sig.operand_dtypes)
        self.scalars = [p.name for p in program.params if p.kind == "scalar"]

    def add(self, node: EvtNode) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def leaf(self, n: ir.Node) -> int:
        """The visitor node of an acc or load leaf, created on first use."""
        if id(n) not in self.index:
            if n.op == "acc":
                self.index[id(n)] = self.add(AccFetch("Acc", comment="fp32 accumulator of A @ B^T"))
            else:
                kind, name = n.attr
                self.inputs.append(name)
                cls = _LOAD_NODE[kind]
                self.index[id(n)] = self.add(cls(f"Load_{name}", dtype=self.dtypes[name],
                                                 input_index=len(self.inputs) - 1,
                                                 comment=f"{name}: {kind}, {self.dtypes[name]}"))
        return self.index[id(n)]

    def region(self, root: ir.Node) -> int:
        """Fuse the expression below `root` (down to leaves and other materialized values) into one functor."""
        children: list[int] = []
        body: list[str] = []
        names: dict[int, str] = {}

        def expr(n: ir.Node) -> str:
            if id(n) in names:
                return names[id(n)]
            if n is not root and (id(n) in self.index or n.op in ("acc", "load")):
                child = self.index[id(n)] if id(n) in self.index else self.leaf(n)
                if child not in children:
                    children.append(child)
                names[id(n)] = f"x{children.index(child)}"
            elif n.op == "const":
                names[id(n)] = cpp_float(n.attr)
            elif n.op == "scalar":  # by position: the key must not depend on names, nor C++ on them
                names[id(n)] = f"p.s{self.scalars.index(n.attr)}"
            else:
                args = [expr(i) for i in n.inputs]
                if n.op == "cast":
                    value = f"coda::round_to<{cpp_element(n.attr)}>({args[0]})"
                else:
                    value = OPS[n.op].cpp.format(*args)
                names[id(n)] = f"t{len(body)}"
                body.append(f"float t{len(body)} = {value};")
            return names[id(n)]

        result = expr(root)
        if not children:  # a constant output still needs one input for Sm90Compute
            children.append(self.leaf(ir.acc()))
        functor = Functor(f"Fn{len(self.functors)}", len(children), body, result,
                          text=self.program.where(root))
        self.functors.append(functor)
        idx = self.add(Compute(f"Region{len(self.functors) - 1}", tuple(children), comment=f"{functor.name}: {functor.text}",
                               functor=functor))
        self.index[id(root)] = idx
        return idx

    def value(self, n: ir.Node) -> int:
        if n.op in ("acc", "load"):
            return self.leaf(n)
        return self.index[id(n)] if id(n) in self.index else self.region(n)

    def run(self) -> Plan:
        program = self.program
        order = list(ir.walk(program))
        uses: Counter[int] = Counter()
        for n in order:
            for i in {id(x) for x in n.inputs}:
                uses[i] += 1
        outputs_at = {id(o.node) for o in program.outputs}
        for n in order:  # materialize shared values and outputs, inputs first
            if not n.is_leaf and n.op != "reduce" and (uses[id(n)] >= 2 or id(n) in outputs_at):
                self.value(n)
        for n in order:
            if id(n) in outputs_at and n.op in ("const", "scalar"):
                self.region(n)
        aux = [o for o in program.outputs if o.name != "D"]
        out_dtypes = dict(self.sig.output_dtypes)
        outputs = []
        for j, o in enumerate(aux):
            if o.node.op == "reduce":  # a tap on the reduced value, which is fed by its own region
                kind, axis = o.node.attr
                child = self.value(o.node.inputs[0])
                self.add(Reduction(f"Reduce_{o.name}", (child,), comment=f"output {o.name}: {kind} over "
                                   f"{axis or 'm and n'}, fp32", kind=kind, axis=axis, output_index=j))
                outputs.append((o.name, "fp32", {"n": "m", "m": "n", None: ""}[axis]))
            else:
                child = self.value(o.node)
                self.add(AuxStore(f"Store_{o.name}", (child,), dtype=out_dtypes[o.name], output_index=j,
                                  comment=f"output {o.name}: {out_dtypes[o.name]}"))
                outputs.append((o.name, out_dtypes[o.name], "mn"))
        d = self.value(program.output("D").node)
        last = self.nodes[-1]
        last_value = last.children[0] if isinstance(last, (AuxStore, Reduction)) else len(self.nodes) - 1
        if len(self.nodes) < 2 or last_value != d:  # the visitor's last node must yield D
            functor = Functor(f"Fn{len(self.functors)}", 1, [], "x0", text="D")
            self.functors.append(functor)
            self.add(Compute(f"Region{len(self.functors) - 1}", (d,), comment=f"{functor.name}: D", functor=functor))
        return Plan(program.name, self.sig, self.nodes, self.functors, self.inputs, outputs, out_dtypes["D"],
                    self.scalars)


def lower(program: ir.Program, sig: Signature) -> Plan:
    validate(program)
    return _Lowering(program, sig).run()
