"""Lowering a specialized program into an EVT plan (see plan.py).

Partition: every elementwise node that is an output, or that feeds two or more users, becomes one
visitor node (`Compute` with a generated functor); the expression tree below it, down to leaves and
other such nodes, is fused into that functor. So a shared subexpression is computed once, and each
fused region is one functor. Leaves: acc -> Sm90AccFetch, cd.Tensor -> AuxLoad (TMA), VecN ->
RowBroadcast, VecM -> ColBroadcast, the halves cd.pairs(x) of a double-width (2N) cd.Tensor -> Unpack
of its WideLoad, onehot (cd.take's derivative) -> OneHot; scalars ride in the functors' Arguments;
constants are literals.
Outputs other than D are taps on their value: AuxStore for tensors (PairStore at half width, WideStore
of a Pack for a double-width cd.interleave(a, b)),
Reduce nodes for statistics (LogSumExp and Take for cd.logsumexp / cd.take), with their finishing
expression, if any; the last node yields D. With accumulation, D's value reads the
prior D (`prior_d` -> Sm90SrcFetch, CUTLASS's C operand).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from fractions import Fraction

from ..errors import EpilogueError, UnsupportedError
from ..ir import graph as ir
from ..ir.ops import DTYPES, INDEX_DTYPE
from . import smem, widths
from .plan import (KIND_OF_AXIS, AccFetch, AuxLoad, AuxStore, ColBroadcast, Compute, EvtNode, Functor, LogSumExp,
                   OneHot, Pack, PairLoad, PairStore, Plan, Reduce, Ref, RowBroadcast, Signature, SrcFetch, Step, Take,
                   Unpack, WideLoad, WideStore)

_LOAD_NODE = {"tensor": AuxLoad, "vec_n": RowBroadcast, "vec_m": ColBroadcast}


def validate(program: ir.Program) -> dict[int, Fraction]:
    """Reject what no lowering can run, with the user's line; returns the widths of the values."""
    w = widths.infer(program)  # raises on mixed widths, naming the line
    users: dict[int, list[ir.Node]] = {}
    for node in ir.walk(program):
        for i in node.inputs:
            users.setdefault(id(i), []).append(node)
    outputs = {id(o.node) for o in program.outputs}

    def unsupported(node, what):
        return UnsupportedError(f"epilogue '{program.name}' ({program.where(node)}): {what}")

    indices = ir.index_operands(ir.walk(program))  # (a derived backward's onehot names one too)
    for node in ir.walk(program):
        if node.op == "load" and node.attr[1] in indices and (id(node) in outputs or not all(
                _as_index(u, node) for u in users.get(id(node), []))):
            raise unsupported(node, f"'{node.attr[1]}' holds int64 column indices (cd.take, cd.onehot), which the "
                                    "kernel reads as indices only; used as values too (in math or as an output), they "
                                    "run on the reference backend only\n  fix: pass the values a second time, as "
                                    "another operand")
        if w.get(id(node), 1) > 1 and not _double_width_ok(node, w, users.get(id(node), []), outputs):
            raise unsupported(node, "a 2N-wide value must be a cd.Tensor operand split by cd.pairs(x), or an "
                                    "output cd.interleave(a, b) of N-wide values; other uses run on the reference "
                                    "backend only")
        if node.op == "reduce" and w.get(id(node.inputs[0]), 1) != 1:
            raise unsupported(node, "column statistics (axis='m') and cd.take of values not N wide run on the "
                                    "reference backend only")
        if w.get(id(node), 1) < HALF:
            raise unsupported(node, "cd.pairs of a half (a value N/4 wide) runs on the reference backend only")
        if node.definition is None:
            raise EpilogueError(f"epilogue '{program.name}' ({program.where(node)}): unknown op '{node.op}'")
    return w


def _as_index(user: ir.Node, node: ir.Node) -> bool:
    """Whether user reads node as cd.take's column index, and not as its value."""
    return user.op == "reduce" and user.inputs[1:] == (node,) and user.inputs[0] is not node


def _double_width_ok(node: ir.Node, w: dict[int, Fraction], users: list[ir.Node], outputs: set[int]) -> bool:
    """The two shapes of a 2N-wide value the kernel has nodes for (WideLoad, WideStore), in 16-bit words."""
    if w[id(node)] != 2:
        return False
    if node.op == "load":
        return node.attr[0] == "tensor" and all(u.op == "pair" for u in users)
    return node.op == "interleave" and id(node) in outputs and not users


def _wide_half(n: ir.Node, w: dict[int, Fraction]) -> bool:
    """cd.pairs(x)[i] of a 2N-wide operand x: an N-wide leaf, half i of x's WideLoad (an Unpack)."""
    return n.op == "pair" and w.get(id(n.inputs[0]), 1) == 2


HALF = Fraction(1, 2)


class _Lowering:
    def __init__(self, program: ir.Program, sig: Signature, width: dict[int, Fraction]):
        self.program, self.sig, self.width = program, sig, width
        self.nodes: list[EvtNode] = []
        self.functors: list[Functor] = []
        self.index: dict[int, int] = {}  # id(IR node) -> index of the visitor node holding its value
        self.inputs: list[str] = []
        self.dtypes = dict(sig.operand_dtypes)
        self.scalars = [p.name for p in program.params if p.kind == "scalar"]
        self.widened: list[str] = []

    def add(self, node: EvtNode) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def input(self, name: str) -> int:
        """The position of operand `name` among the op's inputs."""
        if name not in self.inputs:
            self.inputs.append(name)
        return self.inputs.index(name)

    def sixteen_bit(self, name: str, dtype: str, what: str) -> None:
        """A [M, 2N] tensor moves as 32-bit words of two values: it must be bf16 or fp16."""
        if DTYPES[dtype].itemsize != 2:
            raise UnsupportedError(f"epilogue '{self.program.name}': {what} '{name}' is [M, 2N] {dtype}; the cutlass "
                                   "backend moves [M, 2N] tensors as 32-bit words of two 16-bit values\n  fix: pass "
                                   "it in bfloat16 or float16, or use backend='reference'")

    def leaf(self, n: ir.Node) -> int:
        """The visitor node of an acc or load leaf, created on first use."""
        if id(n) not in self.index:
            if n.op == "acc":
                self.index[id(n)] = self.add(AccFetch("Acc", comment="fp32 accumulator of A @ B^T"))
            elif n.op == "prior_d":
                self.index[id(n)] = self.add(SrcFetch("Source", comment="current D (accumulate: D += ...)"))
            elif n.op == "onehot":
                self.index[id(n)] = self.add(OneHot(f"OneHot_{n.attr}", dtype=INDEX_DTYPE,
                                                    input_index=self.input(n.attr),
                                                    comment=f"1 at column {n.attr}[m] of row m, else 0"))
            elif _wide_half(n, self.width):
                x = n.inputs[0]
                _, name = x.attr
                self.sixteen_bit(name, self.dtypes[name], "operand")
                if id(x) not in self.index:
                    self.index[id(x)] = self.add(WideLoad(f"Load_{name}", dtype=self.dtypes[name],
                                                          input_index=self.input(name),
                                                          comment=f"{name}: cd.Tensor [M, 2N], {self.dtypes[name]}, "
                                                                  "as [M, N] 32-bit words"))
                self.index[id(n)] = self.add(Unpack(f"Unpack_{name}_{n.attr}", (self.index[id(x)],),
                                                    comment=f"{name}'s columns 2n + {n.attr}",
                                                    dtype=self.dtypes[name], part=n.attr))
            else:
                kind, name = n.attr
                cls = _LOAD_NODE[kind]
                if self.width.get(id(n), 1) == HALF:
                    if kind == "tensor":  # [M, N/2]: read per column pair
                        cls = PairLoad
                    else:  # a VecN of N/2 values: the runtime widens it to N (each value twice)
                        self.widened.append(name)
                self.index[id(n)] = self.add(cls(f"Load_{name}", dtype=self.dtypes[name],
                                                 input_index=self.input(name),
                                                 comment=f"{name}: {kind}, {self.dtypes[name]}"))
        return self.index[id(n)]

    def expression(self, root: ir.Node, operand) -> tuple[list[Step], Ref, Ref]:
        """The steps computing `root` in fp32; returns them and the values of its even and odd parts.

        `operand(n)` gives the functor input holding node n as (even, odd) references, or None where n
        is computed here. In elementwise functors both parts are one value. In pairwise functors
        (per column pair q) a full-width value has two parts and a half-width one a single value
        kept in both slots; a node is computed twice only when its inputs differ between parts.
        """
        steps: list[Step] = []
        values: dict[int, tuple[Ref, Ref]] = {}

        def emit(n: ir.Node, args: list[Ref]) -> Ref:
            steps.append(Step(n.op, n.attr, tuple(args)))
            return Ref("temp", len(steps) - 1)

        def expr(n: ir.Node):  # a generator: yields each input whose (even, odd) it needs, in order
            if id(n) in values:
                return values[id(n)]
            given = operand(n)
            if given is not None:
                r = given
            elif n.op == "const":
                r = (Ref("const", n.attr),) * 2
            elif n.op == "scalar":  # by position: the key must not depend on names
                r = (Ref("scalar", self.scalars.index(n.attr)),) * 2
            elif n.kind == "structural":  # a re-selection of its inputs' parts: no step
                r = []
                for i, part in n.definition.parts(n.attr):
                    r.append((yield n.inputs[i])[part])
                r = tuple(r)
            else:
                args = []
                for i in n.inputs:
                    args.append((yield i))
                even = emit(n, [a[0] for a in args])
                r = (even, even if all(a[0] == a[1] for a in args) else emit(n, [a[1] for a in args]))
            values[id(n)] = r
            return r

        # depth first as a recursion would go (the order operand() sees nodes in), on a stack of our own:
        # a chain of thousands of ops must not meet Python's recursion limit
        frames, result = [expr(root)], None
        while frames:
            try:
                child = frames[-1].send(result)
            except StopIteration as done:
                frames.pop()
                result = done.value
            else:
                frames.append(expr(child))
                result = None
        even, odd = result
        return steps, even, odd

    def fetched(self, n: ir.Node) -> bool:
        """Is n's value read by a visitor node of its own (see leaf): a fetched leaf (ir/ops.py), or a half of
        a 2N-wide operand?"""
        return n.leaf_value == "fetched" or _wide_half(n, self.width)

    def _pairwise(self, root: ir.Node) -> bool:
        """Does this region touch column pairs (pair/interleave, or any half-width value)? Its leaves
        (a half of a 2N operand among them) are N wide."""
        seen, todo = set(), [root]
        while todo:
            n = todo.pop()
            if id(n) in seen or (n is not root and self.fetched(n)):
                continue
            seen.add(id(n))
            if n.kind == "structural" or self.width.get(id(n), 1) != 1:
                return True
            todo.extend(n.inputs)
        return False

    def functor(self, arity: int, steps: list[Step], result: Ref, text: str) -> Functor:
        f = Functor(f"Fn{len(self.functors)}", arity, steps, result, text=text)
        self.functors.append(f)
        return f

    def region(self, root: ir.Node) -> int:
        """Fuse the expression below `root` (down to leaves and other materialized values) into one functor."""
        children: list[int] = []

        pairwise = self._pairwise(root)

        def operand(n: ir.Node):
            if n is root or not (id(n) in self.index or self.fetched(n)):
                return None
            child = self.index[id(n)] if id(n) in self.index else self.leaf(n)
            if child not in children:
                children.append(child)
            k = children.index(child)
            if not pairwise:
                return Ref("input", k), Ref("input", k)
            even = Ref("input", k, 0)
            per_row = n.op == "load" and n.attr[0] == "vec_m"  # the same value in every column
            full = self.width.get(id(n), 1) == 1 and not per_row
            return (even, Ref("input", k, 1)) if full else (even, even)

        steps, result, odd = self.expression(root, operand)
        if not children:  # a constant output still needs one input for Sm90Compute
            children.append(self.leaf(ir.acc()))
        f = self.functor(len(children), steps, result, self.program.where(root))
        if pairwise:
            f.pairwise, f.result_odd = True, odd
        idx = self.add(Compute(f"Region{f.name[2:]}", tuple(children), comment=f"{f.name}: {f.text}", functor=f))
        self.index[id(root)] = idx
        return idx

    def reduction(self, name: str, node: ir.Node, output_index: int) -> str:
        """A reduction tap (with its finishing expression, if any); returns the output's shape kind."""
        finish = None
        if node.op == "finish":
            x0 = Ref("input", 0)
            steps, result, _ = self.expression(node.attr, lambda n: (x0, x0) if n.op == "reduced" else None)
            finish = self.functor(1, steps, result, f"{name}: finishing expression")
            node = node.inputs[0]
        kind, axis = node.attr
        child = self.value(node.inputs[0])
        then = f", then {finish.name}" if finish else ""
        common = dict(kind=kind, axis=axis, output_index=output_index, finish=finish)
        if kind == "logsumexp":
            self.add(LogSumExp(f"Reduce_{name}", (child,), comment=f"output {name}: log-sum-exp over n, fp32, "
                               f"online per tile{then}", **common))
        elif kind == "take":
            index = node.inputs[1].attr[1]
            self.add(Take(f"Take_{name}", (child,), comment=f"output {name}: the value at column {index}[m], "
                          f"fp32{then}", index_input=self.input(index), **common))
        else:
            mode = "deterministic" if self.sig.deterministic else "atomic"
            self.add(Reduce(f"Reduce_{name}", (child,), comment=f"output {name}: {kind} over "
                               f"{axis or 'm and n'}, fp32, {mode}{then}", deterministic=self.sig.deterministic,
                               **common))
        return KIND_OF_AXIS[axis]

    def value(self, n: ir.Node) -> int:
        if self.fetched(n):
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
        for n in order:  # materialize shared values and outputs, inputs first (a pair half is free to re-read)
            shared = uses[id(n)] >= 2 and n.op != "pair"
            wide = self.width.get(id(n), 1) == 2  # an interleaved output: its WideStore takes both halves
            if n.kind in ("elementwise", "structural") and (shared or id(n) in outputs_at) and not wide:
                self.value(n)
        for n in order:
            if id(n) in outputs_at and n.op in ("const", "scalar"):
                self.region(n)
        d_out = program.output("D")
        if d_out is not None and (self.width.get(id(d_out.node), 1) != 1 or d_out.node.kind == "reduction"):
            d_out = None  # a D not N wide, or a statistic, is stored as a tap
        aux = [o for o in program.outputs if o is not d_out]  # D is stored as D unless it became a tap
        out_dtypes = dict(self.sig.output_dtypes)
        outputs = []
        for j, o in enumerate(aux):
            if o.node.kind == "reduction":  # a tap on the reduced value, fed by its own region
                outputs.append((o.name, "fp32", self.reduction(o.name, o.node, j)))
            elif self.width.get(id(o.node), 1) == HALF:  # one value per column pair: [M, N/2]
                child = self.value(o.node)
                self.add(PairStore(f"Store_{o.name}", (child,), dtype=out_dtypes[o.name], output_index=j,
                                   comment=f"output {o.name}: {out_dtypes[o.name]}, [M, N/2]"))
                outputs.append((o.name, out_dtypes[o.name], "mh"))
            elif self.width.get(id(o.node), 1) == 2:  # cd.interleave(a, b): [M, 2N]
                dtype = out_dtypes[o.name]
                self.sixteen_bit(o.name, dtype, "output")
                halves = tuple(self.value(x) for x in o.node.inputs)
                packed = self.add(Pack(f"Pack_{o.name}", halves, comment=f"{o.name}'s halves in {dtype} words",
                                       dtype=dtype))
                self.add(WideStore(f"Store_{o.name}", (packed,), dtype=dtype, output_index=j,
                                   comment=f"output {o.name}: {dtype}, [M, 2N], interleaved"))
                outputs.append((o.name, out_dtypes[o.name], "mw"))
            else:
                child = self.value(o.node)
                self.add(AuxStore(f"Store_{o.name}", (child,), dtype=out_dtypes[o.name], output_index=j,
                                  comment=f"output {o.name}: {out_dtypes[o.name]}"))
                outputs.append((o.name, out_dtypes[o.name], "mn"))
        d = self.value(d_out.node) if d_out else None
        last = self.nodes[-1]
        last_value = last.children[0] if isinstance(last, (AuxStore, Reduce)) else len(self.nodes) - 1
        if d is not None and (len(self.nodes) < 2 or last_value != d):  # the last node must yield D
            f = self.functor(1, [], Ref("input", 0), "D")
            self.add(Compute(f"Region{f.name[2:]}", (d,), comment=f"{f.name}: D", functor=f))
        return Plan(program.name, self.sig, self.nodes, self.functors, self.inputs, outputs,
                    out_dtypes["D"] if d_out else None, self.scalars, self.widened)


def lower(program: ir.Program, sig: Signature) -> Plan:
    """The plan of `program`, at a config whose kernel fits in shared memory (see smem.fit)."""
    program = _over_full_rows(program)
    return smem.fit(_Lowering(program, sig, validate(program)).run())


# A row's or the whole statistic of an N/2-wide value y (the amax of SwiGLU's output, say) is taken over
# interleave(g(y), g(y)), N wide, which the kernel lays out: each value twice, g making that count once
# (a sum of halves; a logsumexp of values less ln 2). kind -> g
_TWICE = {"max": None, "min": None, "amax": None, "sum": ("mul", 0.5), "logsumexp": ("sub", math.log(2.0))}


def _over_full_rows(program: ir.Program) -> ir.Program:
    w = widths.infer(program)
    swap = {}
    for o in program.outputs:
        r = ir.reduction_of(o.node)
        if r is not None and r.attr[0] in _TWICE and r.attr[1] in ("n", None) and w.get(id(r.inputs[0])) == HALF:
            g = _TWICE[r.attr[0]]
            y = r.inputs[0] if g is None else ir.compute(g[0], r.inputs[0], ir.const(g[1]))
            swap[id(r)] = ir.reduce(*r.attr, ir.interleave(y, y))
    if not swap:
        return program
    outputs, locations = [], dict(program.locations)
    for o in program.outputs:
        r = ir.reduction_of(o.node)
        node = o.node if r is None or id(r) not in swap else swap[id(r)] if o.node is r else ir.finish(swap[id(r)], o.node.attr)
        locations.setdefault(id(node), program.where(o.node))
        outputs.append(ir.Output(o.name, node, o.dtype))
    return replace(program, outputs=tuple(outputs), locations=locations)
