"""Width inference: how many columns each value has, relative to the accumulator's N.

Pairwise ops change widths: `cd.pairs(x)` gives two values of half x's width (even and odd
columns); `cd.interleave(a, b)` one of twice theirs. Elementwise ops need equal widths. An operand's
width follows from what it is combined with (a cos table combined with a pair half is N/2 wide);
operands combined with nothing of known width are N wide, unless the program declares theirs
(ir.Param.width). Uniform values, the same in every column of
a row (scalars, constants, VecM operands and elementwise math or pair halves of only those), fit any
width and get none: one such value may meet values of several widths. An interleave of two of them is N
wide (the kernels' interleave parts are the accumulator's even and odd columns).
"""
from __future__ import annotations

from fractions import Fraction

from ..errors import EpilogueError
from ..ir import graph as ir

WIDTH_SCALE = {"same": 1, "half": Fraction(1, 2), "double": 2}  # a value's width over its inputs', per rule


def _rule(n: ir.Node) -> str | None:
    """The op's width rule (ir/ops.py); None for leaves and reductions, which take no part here."""
    d = n.definition
    return d.width_rule if d else None


def any_width(n: ir.Node) -> bool:
    """Does n broadcast to any width (the uniform leaves of ir/ops.py: scalars, constants; and VecM loads)?"""
    return n.leaf_value == "uniform" or (n.op == "load" and n.attr[0] == "vec_m")


def uniform(nodes: list[ir.Node]) -> set[int]:
    """ids of the uniform values among `nodes` (topologically ordered): any_width leaves, and elementwise
    ops or pair halves whose inputs are all uniform."""
    out: set[int] = set()
    for n in nodes:
        rule = _rule(n)
        if (n.is_leaf and any_width(n)) or (rule in ("same", "half") and all(id(i) in out for i in n.inputs)):
            out.add(id(n))
    return out


def infer(program: ir.Program) -> dict[int, Fraction]:
    """id(node) -> width (as a fraction of N) for every node with columns but uniform ones; loads keyed as
    well."""
    nodes = [n for n in ir.walk(program)]
    free = uniform(nodes)
    # the program's own acc and load nodes, not ir.acc() / ir.load(): those intern, and Dynamo, tracing a
    # derived backward through here, guarded on the interning table (any new node anywhere: a recompile)
    declared = {(p.kind, p.name): p.width for p in program.params if p.width is not None}
    width: dict[int, Fraction] = {id(n): Fraction(1) for n in nodes if n.op in ("acc", "onehot")}
    width.update({id(n): declared[n.attr] for n in nodes if n.op == "load" and n.attr in declared})
    load_of = {id(n): n for n in nodes if n.op == "load"}

    def fail(node: ir.Node, what: str) -> EpilogueError:
        return EpilogueError(f"epilogue '{program.name}' ({program.where(node)}): {what}\n  fix: combine values "
                             "of one width; cd.pairs(x) halves a width, cd.interleave(a, b) doubles it")

    def unify(node: ir.Node, key: int, w: Fraction) -> bool:
        old = width.get(key)
        if old is None:
            width[key] = w
            return True
        if old != w:
            raise fail(node, f"a value {width_text(old)} wide meets one {width_text(w)} wide")
        return False

    changed = True
    while changed:  # propagate forward and backward until nothing new is learned
        changed = False
        for n in nodes:
            rule = _rule(n)
            if rule is None or id(n) in free:
                continue
            ins = [i for i in n.inputs if id(i) not in free]
            if rule == "half":
                (x,) = n.inputs
                if id(x) in width:
                    changed |= unify(n, id(n), width[id(x)] / 2)
                elif id(n) in width:
                    changed |= unify(n, id(x), width[id(n)] * 2)
                continue
            known = [width[id(i)] for i in ins if id(i) in width]
            if rule == "double":
                if known:
                    changed |= unify(n, id(n), known[0] * 2)
                elif not ins:  # of uniform values: N wide (see above)
                    changed |= unify(n, id(n), Fraction(1))
                elif id(n) in width:
                    known = [width[id(n)] / 2]
            elif id(n) in width:
                known.append(width[id(n)])
            if known:
                for i in ins:
                    changed |= unify(n, id(i), known[0])
                if rule == "same":
                    changed |= unify(n, id(n), known[0])
    for key, n in load_of.items():  # operands combined with nothing of known width: N wide
        if n.attr[0] != "vec_m":
            width.setdefault(key, Fraction(1))
    changed = True
    while changed:  # values built only from such operands
        changed = False
        for n in nodes:
            rule = _rule(n)
            if rule is None or id(n) in width or id(n) in free:
                continue
            ins = [width.get(id(i)) for i in n.inputs if id(i) not in free]
            if ins and all(w is not None for w in ins):
                w = ins[0] * WIDTH_SCALE[rule]
                changed |= unify(n, id(n), w)
    for n in nodes:
        if n.op == "reduce" and id(n.inputs[0]) not in width and id(n.inputs[0]) not in free:
            width[id(n.inputs[0])] = Fraction(1)
    return width


def load_widths(program: ir.Program) -> dict[str, Fraction]:
    """Operand name -> width of every tensor/vector operand the program reads, or declares a width for (one it
    does not read still has the shape the caller passes: a derived backward's 2N-wide residual, say)."""
    widths = infer(program)
    declared = {p.name: p.width for p in program.params if p.kind in ir.LOAD_KINDS and p.width is not None}
    return {**declared, **{n.attr[1]: widths.get(id(n), Fraction(1)) for n in ir.walk(program) if n.op == "load"}}


def width_text(w: Fraction) -> str:
    """N, N/2, 2·N: a width for messages."""
    return "N" if w == 1 else f"{w}·N" if w.denominator == 1 else f"N/{w.denominator}" if w.numerator == 1 \
        else f"{w}·N"
