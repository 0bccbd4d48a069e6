"""Reverse-mode differentiation of an epilogue program: its backward is another epilogue program.

For a forward program y_i = f_i(acc, operands), `derive` builds the program that, given the same
acc and operands, the incoming gradients of the outputs (`grad_<output>`) and the statistics that the
derivative needs (`saved_<output>`), computes the gradients of acc and of every differentiable operand:

    output "acc"         dL/dacc, [M, N]: what grad_x = dacc @ W and grad_W = dacc^T x need
    output <tensor op>   [M, N] (or its width), elementwise
    output <VecN op>     sum over m (a reduction in the same program), <VecM op> sum over n,
    output <Scalar op>   sum over all

cd.Const operands, comparisons and int64 indices get none. Each op's rule lives in its definition
(ir/ops.py: OpDef.grad, ReduceDef.grad); this pass only walks the graph backwards and sums adjoints.
A statistic finished by .then(f) passes back dy * f'(s), with s the statistic before f (`saved_<output>`,
which the forward kernel then also outputs); a cd.Scalar that f reads gets no gradient at all, not
even from the rest of the program (f's part is a per-row quantity that an epilogue cannot sum into
one number): Backward.ungraded names them. A value of the forward that is also one of its [M, N]
outputs is read back from that output (`saved_<output>`) where that moves fewer [M, N] values than
computing it again: a residual stream h = acc + r is one load of h, not a stored accumulator and two
loads.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from ..errors import OperandError, UnsupportedError
from ..ir import graph as ir
from ..ir.ops import REDUCTIONS
from .widths import WIDTH_SCALE, infer as infer_widths, uniform

GRAD, SAVED = "grad_", "saved_"  # parameter names of the incoming gradients and of saved statistics
ACC = "acc"  # the backward's output dL/dacc; cd.linear's forward kernel outputs its accumulator by this name
_VEC_OF_AXIS = {"n": "vec_m", "m": "vec_n", None: "scalar"}  # the gradient of a statistic over `axis`
_SUM_AXIS = {"vec_n": "m", "vec_m": "n", "scalar": None}  # how an operand's adjoint is reduced to its shape


class _Builder:
    """The node constructors the rules use: d.mul(a, b), d.pair(x, 0), d.c(0.5), ..."""

    def c(self, value: float) -> ir.Node:
        return ir.const(value)

    def pair(self, x: ir.Node, which: int) -> ir.Node:
        return ir.pair(x, which)

    def interleave(self, a: ir.Node, b: ir.Node) -> ir.Node:
        return ir.interleave(a, b)

    def onehot(self, index: ir.Node) -> ir.Node:
        return ir.onehot(index)

    def __getattr__(self, op: str):
        return lambda *inputs: ir.compute(op, *inputs)


_d = _Builder()


@dataclass(frozen=True)
class Backward:
    """A derived program and what calling it needs."""

    program: ir.Program
    grads: tuple[str, ...]  # forward outputs whose incoming gradient is a parameter (grad_<name>)
    saved: tuple[str, ...]  # forward outputs the derivative reads (saved_<name>): statistics (before .then, if
    #                         any), then the [M, N] outputs of `reused`
    unfinished: tuple[str, ...]  # statistics of `saved` under a .then: the forward must output them as saved_<name>
    uses_acc: bool  # reads the forward's accumulator (else only the operands, gradients and saved outputs)
    forward: ir.Program  # the (specialized) forward it was derived from
    ungraded: tuple[str, ...] = ()  # cd.Scalars read by a .then: no gradient output, though one exists
    reused: tuple[str, ...] = ()  # [M, N] outputs read back instead of computed again (_read_outputs)


def _add(a: ir.Node | None, b: ir.Node) -> ir.Node:
    return b if a is None else ir.compute("add", a, b)


def _into_uniform(program: ir.Program):
    """(node, input, its adjoint by the rule, node's adjoint) -> the adjoint the input receives. A uniform
    input (passes/widths.py: a scalar, constant or VecM value, the same in every column) has no width: its
    adjoints from values of several widths are summed, and a VecM or Scalar operand's gradient is their
    sum over N columns. So an adjoint entering it where it is read w·N wide is put in N-column form
    first, with the same column sum: a uniform one times w, an N/2-wide one interleaved with zeros, a
    2N-wide one's halves added. A pair half of a uniform value is that value: its adjoint passes as is."""
    nodes = list(ir.walk(program))
    free, widths = uniform(nodes), infer_widths(program)

    def into(node: ir.Node, x: ir.Node, gx: ir.Node, g: ir.Node) -> ir.Node:
        if id(x) not in free:
            return gx
        if id(node) in free:
            return g if node.op == "pair" else gx
        w = widths.get(id(node), Fraction(1)) / WIDTH_SCALE[node.definition.width_rule]  # x's width as read here
        if w != 1 and id(gx) in uniform(ir.topo_order([gx])):
            return ir.compute("mul", gx, ir.const(float(w)))
        while w < 1:
            gx, w = ir.interleave(gx, ir.const(0.0)), w * 2
        while w > 1:
            gx, w = ir.compute("add", ir.pair(gx, 0), ir.pair(gx, 1)), w / 2
        return gx
    return into


def _backprop(order: list[ir.Node], adjoint: dict[int, ir.Node], program: ir.Program, into=None) -> None:
    """Adjoints of `order`'s nodes (topological) from those given, by each op's rule, in place; into:
    _into_uniform's adjustment of what enters a uniform value."""
    for node in reversed(order):
        g = adjoint.get(id(node))
        if g is None or node.is_leaf or node.kind == "reduction":
            continue
        definition = node.definition
        if definition.grad is None:
            raise UnsupportedError(f"{program.where(node)}: '{node.op}' has no derivative yet")
        for x, gx in zip(node.inputs, definition.grad(_d, node.attr, node.inputs, node, g)):
            if gx is not None:
                adjoint[id(x)] = _add(adjoint.get(id(x)), into(node, x, gx, g) if into else gx)


def _rebuilder(swap: dict[int, ir.Node], make=lambda n, inputs: ir.Node(n.op, inputs, n.attr)):
    """node -> node with the nodes in `swap` (by id) replaced, the rest rebuilt by make(n, new inputs), inputs
    first (ir.topo_order, which stops at what is swapped or rebuilt already)."""
    memo: dict[int, ir.Node] = {}

    def done(n: ir.Node) -> ir.Node | None:
        return swap.get(id(n), memo.get(id(n)))

    def rebuild(root: ir.Node) -> ir.Node:
        for n in ir.topo_order([root], lambda n: () if done(n) is not None else n.inputs):
            if done(n) is None:
                memo[id(n)] = make(n, tuple(done(i) for i in n.inputs))
        return done(root)
    return rebuild


def _moved(outputs: list[ir.Output]) -> int:
    """The [M, N] values a backward program moves besides its incoming gradients: each tensor it loads, and the
    accumulator twice (the forward stores it for the backward)."""
    leaves = {n for n in ir.topo_order([o.node for o in outputs]) if n.op == "acc" or n.op == "load"}
    return sum(2 if n.op == "acc" else n.attr[0] == "tensor" and not n.attr[1].startswith(GRAD) for n in leaves)


# What an output read back may be: the accumulator, or sums and products of it with operands and constants,
# whose rounding to A's dtype costs what the accumulator's would. Not an activation's output: tanh's and
# sigmoid's rules read y, and 1 - y^2 from a rounded y loses its digits where the activation saturates.
_READ_BACK = frozenset({"acc", "add", "sub", "mul", "neg"})


def _read_outputs(program: ir.Program, outputs: list[ir.Output], widths: dict, reuse: tuple[str, ...] | None) \
        -> tuple[list[ir.Output], tuple[str, ...]]:
    """The backward's outputs with forward values that are also [M, N] outputs of the forward (stored in A's
    dtype, as the accumulator would be; of _READ_BACK's ops) read back as saved_<output>, and the names of those
    read. reuse: which to read (a subset of the same program's derivation, which must read no more than it
    saved); None: the choice that moves the fewest [M, N] values (_moved), reading none on a tie."""
    inside = {id(n) for n in ir.topo_order([o.node for o in outputs])}
    candidates = {}
    for o in program.outputs:
        n = o.node
        if (id(n) in inside and o.dtype is None and n.op in _READ_BACK
                and (o.name != ACC or n.op == "acc")  # saved_acc is the accumulator, whoever saves it
                and widths.get(id(n), 1) == 1 and id(n) not in candidates and (reuse is None or o.name in reuse)):
            candidates[id(n)] = o.name
    picks = [list(candidates)] if reuse is not None else [  # every subset of a few; else none or all
        [c for i, c in enumerate(candidates) if mask >> i & 1] for mask in range(1 << len(candidates))
    ] if len(candidates) <= 6 else [[], list(candidates)]
    best = None
    for pick in picks:
        swap = _rebuilder({c: ir.load("tensor", SAVED + candidates[c]) for c in pick})
        new = [replace(o, node=swap(o.node)) for o in outputs]
        loads = {n.attr[1] for n in ir.topo_order([o.node for o in new]) if n.op == "load"}
        read = tuple(candidates[c] for c in pick if SAVED + candidates[c] in loads)
        cost = (_moved(new), len(read))
        if best is None or cost < best[0]:
            best = cost, new, read
    return best[1], best[2]


def derive(program: ir.Program, no_grad: tuple[str, ...] = (), reuse: tuple[str, ...] | None = None) -> Backward:
    """The backward of a specialized forward program (cd.Const values bound). no_grad: outputs whose
    incoming gradient is zero (e.g. a pre-activation stored for the backward): no grad_<name> for them.
    reuse: the [M, N] outputs it may read back (Backward.reused of the derivation whose saved values the
    caller holds); None: chosen here."""
    where = program.title
    if unknown := set(no_grad) - {o.name for o in program.outputs}:
        raise OperandError(f"{where}: no_grad names {sorted(unknown)}, which are not outputs of the epilogue\n  fix: "
                           f"name some of its outputs ({', '.join(o.name for o in program.outputs)})")
    kinds = {p.name: p.kind for p in program.params}
    for name in kinds:
        if name.startswith((GRAD, SAVED)) or name == ACC:
            raise OperandError(f"{where}: operand '{name}' clashes with the backward's names ('{ACC}', '{GRAD}*', "
                               f"'{SAVED}*')\n  fix: rename it to differentiate the epilogue")
    adjoint: dict[int, ir.Node] = {}
    params, grads, saved, unfinished, finishing_scalars = [], [], [], [], set()
    # Each incoming gradient is as wide as its output (a column statistic's: as its input): declared, since
    # nothing in the backward need tie it to the accumulator (cd.pairs(acc)[0] + s: dy -> interleave(dy, 0))
    forward_widths = infer_widths(program)
    underived = underivable(program)
    for o in (o for o in program.outputs if o.name not in no_grad):
        r = ir.reduction_of(o.node)
        if r is None:
            grads.append(o.name)
            params.append(ir.Param(GRAD + o.name, "tensor", forward_widths.get(id(o.node), Fraction(1))))
            adjoint[id(o.node)] = _add(adjoint.get(id(o.node)), ir.load("tensor", GRAD + o.name))
            continue
        kind, axis = r.attr
        rule = REDUCTIONS[kind].grad
        if o.name in underived:
            raise UnsupportedError(f"{where}: output '{o.name}' is a {underived_what(program, o.name)}, which has no "
                                   "derivative yet")
        vec = _VEC_OF_AXIS[axis]
        leaf = (lambda name: ir.scalar(name)) if vec == "scalar" else (lambda name: ir.load(vec, name))
        dy, s = leaf(GRAD + o.name), leaf(SAVED + o.name)  # s: the statistic (before .then)
        width = forward_widths.get(id(r.inputs[0]), Fraction(1)) if vec == "vec_n" else None
        grads.append(o.name)
        params.append(ir.Param(GRAD + o.name, vec, width))
        if o.node.op == "finish":  # dy * f'(s): f's own graph, backwards, over s
            f = o.node.attr
            order = ir.topo_order([f])
            local = {id(f): dy}
            _backprop(order, local, program)
            finishing_scalars |= {n.attr for n in order if n.op == "scalar"}
            dy = local.get(id(ir.reduced()))
            if dy is None:  # f ignores the statistic
                continue
            dy = _rebuilder({id(ir.reduced()): s})(dy)
        if kind == "logsumexp" or o.node.op == "finish":  # the derivative reads the statistic
            saved.append(o.name)
            params.append(ir.Param(SAVED + o.name, vec, width))
            if o.node.op == "finish":
                unfinished.append(o.name)
        x = r.inputs[0]
        adjoint[id(x)] = _add(adjoint.get(id(x)), rule(_d, r.inputs, s, dy))
    _backprop(ir.topo_order([o.node for o in program.outputs]), adjoint, program, _into_uniform(program))
    outputs = []
    acc_grad = adjoint.get(id(ir.acc()))
    if acc_grad is not None:
        outputs.append(ir.Output(ACC, acc_grad, None))
    for p in program.params:
        leaf = ir.scalar(p.name) if p.kind == "scalar" else ir.load(p.kind, p.name) if p.kind != "const" else None
        g = adjoint.get(id(leaf)) if leaf is not None else None
        if g is None or p.name in finishing_scalars:
            continue
        outputs.append(ir.Output(p.name, g if p.kind == "tensor" else ir.reduce("sum", _SUM_AXIS[p.kind], g), None))
    outputs, reused = _read_outputs(program, outputs, forward_widths, reuse)
    saved += reused
    params += [ir.Param(SAVED + o, "tensor", Fraction(1)) for o in reused]
    uses = {n.op for n in ir.topo_order([o.node for o in outputs])}
    # the forward's operands declare the widths it reads them at, but N (the default): the backward may read one
    # only where nothing ties its width (dy_r * t for a row statistic r)
    read = [(p, _read_width(p, forward_widths)) for p in program.params if p.kind != "const"]
    declared = tuple(p if w in (None, 1) else replace(p, width=w) for p, w in read)
    backward = ir.Program(f"{program.name}_backward", declared + tuple(params), tuple(outputs), program.defined_at,
                          program.locations)
    ungraded = tuple(p.name for p in program.params if p.name in finishing_scalars)
    return Backward(backward, tuple(grads), tuple(saved), tuple(unfinished), "acc" in uses, program, ungraded, reused)


def underivable(program: ir.Program, fused_into: str | None = None) -> tuple[str, ...]:
    """The outputs that are statistics with no derivative yet: of a kind with no rule (cd.max/min/amax), or a
    cd.take of a value not N wide (its one-hot is N wide). fused_into: the output into whose gradient's GEMM
    the backward goes (into_producer), where columns are that output's: a take's one-hot has none unless that
    output is N wide."""
    widths = infer_widths(program)
    fused = program.output(fused_into) if fused_into is not None else None
    elsewhere = fused is not None and widths.get(id(fused.node), 1) != 1
    return tuple(o.name for o in program.outputs if (r := ir.reduction_of(o.node)) is not None and (
        REDUCTIONS[r.attr[0]].grad is None or (REDUCTIONS[r.attr[0]].indexed and (
            elsewhere or widths.get(id(r.inputs[0]), 1) != 1))))


def underived_what(program: ir.Program, output: str) -> str:
    """How messages name an output of underivable(program): 'cd.max', 'cd.take of a value not N wide'."""
    kind = ir.reduction_of(program.output(output).node).attr[0]
    return f"cd.{kind}" + ("" if REDUCTIONS[kind].grad is None else " of a value not N wide")


def _read_width(p: ir.Param, forward_widths: dict) -> Fraction | None:
    """An operand's width as the forward reads it: declared, else inferred there (None: a VecM or a scalar)."""
    if p.width is not None or p.kind not in ir.LOAD_KINDS:
        return p.width
    return forward_widths.get(id(ir.load(p.kind, p.name)))


SAVED_ACC = SAVED + ACC  # the forward's accumulator, an operand of the fused backward


def saved_from(back: Backward) -> dict[str, str]:
    """Each saved_* operand of back's programs -> the output of the forward kernel (cd.linear's: the program
    with the accumulator and the statistics under .then as outputs too) that it is: saved_acc is the output
    acc, a statistic under .then the output saved_<name> (before .then), any other the output itself."""
    return {SAVED_ACC: ACC, **{SAVED + o: SAVED + o if o in back.unfinished else o for o in back.saved}}


RECOMPUTED = "recomputed_"  # output names of forward outputs computed again by the fused backward


def into_producer(back: Backward, output: str = "D", split: bool = False, recompute: tuple[str, ...] = ()) \
        -> ir.Program:
    """The derived backward as the epilogue of the GEMM that computes the incoming gradient of `output`
    (e.g. dY = dOut @ W_next in the layer above): that GEMM's accumulator is the gradient, the forward's
    accumulator becomes the cd.Tensor operand `saved_acc` (declared only if read: a derivative may read
    saved outputs instead, saved_<output>), and dL/dacc is its D. So the derivative costs
    no pass of its own. For a pairwise forward (2N wide, e.g. SwiGLU) the program is narrowed to N-wide
    values (_narrower), so its D is one 2N-wide cd.interleave, the form the kernels store; split: that
    interleave's halves as two N-wide outputs instead, D_even and D_odd (for SwiGLU the gate's and the
    up projection's gradients, each the plain GEMM operand of its own weight's gradient). recompute:
    forward outputs to compute again from saved_acc, as outputs recomputed_<name>, so that the forward
    need not keep them for the backward (e.g. SwiGLU's y, an operand of W_down's gradient). A gradient that
    is another output's value (a residual's: dacc) is stored once (stored_once)."""
    program = back.program
    where = program.title
    if output not in back.grads:
        error = UnsupportedError if back.forward.output(output) else OperandError  # no_grad's, or a typo
        raise error(f"{where}: the forward has no output '{output}' with a gradient\n  fix: output= one of "
                    f"{sorted(back.grads)}")
    if program.output(ACC) is None:
        raise UnsupportedError(f"{where}: nothing to fuse: the forward's outputs do not depend on the accumulator")
    if ir.reduction_of(back.forward.output(output).node) is not None:
        raise UnsupportedError(f"{where}: output '{output}' is a reduction, whose gradient is a vector, not the "
                               "[M, N] accumulator of a producing GEMM: nothing to fuse into")
    grad = ir.load("tensor", GRAD + output)
    # (the outputs read back replace their values in what `recompute` computes again, as in the derivative)
    read_back = {id(back.forward.output(r).node): ir.load("tensor", SAVED + r) for r in back.reused}
    swap = _rebuilder({id(ir.acc()): ir.load("tensor", SAVED_ACC), **read_back, id(grad): ir.acc()})
    # widths are over the accumulator's: now dy's, which is the forward's times dy's width; the forward's
    # operands keep the widths they had there (a 2N-wide residual of a pairwise forward stays 2N wide)
    w = next(p.width for p in program.params if p.name == GRAD + output)
    forward_widths = infer_widths(back.forward)
    # (an output named acc that is the accumulator, read back: the same as SAVED_ACC)
    read = [(p, _read_width(p, forward_widths)) for p in program.params if p.name != SAVED_ACC]
    params = tuple(ir.Param(SAVED_ACC, "tensor", 1 / w) if p.name == GRAD + output
                   else replace(p, width=pw / w) if pw is not None else p for p, pw in read)
    swapped = tuple(ir.Output("D" if o.name == ACC else o.name, swap(o.node), o.dtype) for o in program.outputs)
    computed = [o.name for o in back.forward.outputs  # what recompute may name
                if ir.reduction_of(o.node) is None and not o.node.is_leaf and o.name not in back.reused]
    for name in dict.fromkeys(recompute):
        o = back.forward.output(name)
        if name not in computed:
            error = OperandError if o is None else UnsupportedError  # a typo, or an output it cannot recompute
            raise error(f"{where}: recompute names '{name}', which is not a computed elementwise output of the "
                        "forward (a statistic needs every tile; an operand, the accumulator or an output the "
                        "derivative reads back the caller has already)\n  fix: "
                        + (f"recompute one of {computed}, or none" if computed else "recompute none: this forward has "
                           "no output to recompute"))
        swapped += (ir.Output(RECOMPUTED + name, swap(o.node), o.dtype),)
    narrow = _narrower(infer_widths(ir.Program(program.name, params, swapped, program.defined_at, {})))
    outputs = []
    for o in swapped:
        node = narrow(o.node)
        if split and o.name == "D":
            if node.op != "interleave":
                raise UnsupportedError(f"{where}: split=True needs a pairwise forward (cd.pairs of the "
                                       "accumulator), whose accumulator gradient interleaves two halves")
            outputs += [ir.Output("D_even", node.inputs[0], o.dtype), ir.Output("D_odd", node.inputs[1], o.dtype)]
        else:
            outputs.append(ir.Output(o.name, node, o.dtype))
    names = [o.name for o in outputs]
    if clash := sorted({n for n in names if names.count(n) > 1}):
        raise OperandError(f"{where}: the fused backward would have two outputs named {clash} (an operand's "
                           "gradient is named like the operand)\n  fix: rename that operand")
    if not any(n.op == "load" and n.attr[1] == SAVED_ACC for n in ir.topo_order([o.node for o in outputs])):
        params = tuple(p for p in params if p.name != SAVED_ACC)  # the derivative reads saved outputs instead
    return stored_once(ir.Program(f"{program.name}_fused", params, tuple(outputs), program.defined_at, {}))


def stored_once(program: ir.Program) -> ir.Program:
    """program with each output of an earlier output's value and dtype (a residual's gradient, which is dacc)
    taken out of its outputs and named in its aliases instead: a kernel stores that value once, and the call
    returns that tensor under both names."""
    first, aliases = {}, []
    for o in program.outputs:
        if (key := (id(o.node), o.dtype)) in first:
            aliases.append((o.name, first[key]))
        first.setdefault(key, o.name)
    kept = tuple(o for o in program.outputs if first[(id(o.node), o.dtype)] == o.name)
    return replace(program, outputs=kept, aliases=program.aliases + tuple(aliases))


def _narrower(widths: dict):
    """node -> the same value with its 2N-wide intermediates taken apart into N-wide halves: cd.pairs moved
    down onto the 2N-wide operands, elementwise math pushed inside cd.interleave (op(interleave(a, b), x) =
    interleave(op(a, pair0(x)), op(b, pair1(x))), broadcast values going to both), and a row's or the
    whole sum of an interleave summing its halves. What stays 2N wide is what the kernels move: operands
    read as pairs, and an output that is one interleave."""
    def wide(n: ir.Node) -> bool:
        return n.op == "interleave" or (n.op == "load" and widths.get(id(n)) == 2)

    def halves(n: ir.Node) -> tuple[ir.Node, ir.Node]:
        if n.op == "interleave":
            return n.inputs
        return (ir.pair(n, 0), ir.pair(n, 1)) if wide(n) else (n, n)

    def make(n: ir.Node, inputs: tuple[ir.Node, ...]) -> ir.Node:
        if not any(wide(i) for i in inputs):
            return ir.Node(n.op, inputs, n.attr)
        if n.op == "pair":
            return halves(inputs[0])[n.attr]
        if n.kind == "elementwise" and all(wide(i) or id(i) in uniform(ir.topo_order([i])) for i in inputs):
            return ir.interleave(*(ir.Node(n.op, tuple(halves(i)[k] for i in inputs), n.attr) for k in (0, 1)))
        if n.op == "reduce" and n.attr[0] == "sum" and n.attr[1] in ("n", None) and len(inputs) == 1:
            return ir.Node(n.op, (ir.compute("add", *halves(inputs[0])),), n.attr)
        return ir.Node(n.op, inputs, n.attr)
    return _rebuilder({}, make)
