"""The reference backend: the IR evaluated with PyTorch ops in fp32. It defines the semantics.

Runs on any device. Outputs are cast like the kernel casts them: tensors to their output dtype,
reductions kept in fp32. With A and B in fp64 (no kernel takes them) the math and every output stay
in fp64, for torch.autograd.gradcheck.
"""
from __future__ import annotations

import functools
from fractions import Fraction

import torch

from ..ir import graph as ir
from ..ir.ops import DTYPES, REDUCTIONS, math_dtype
from ..passes.widths import WIDTH_SCALE, infer as infer_widths

PRIOR_D_OPERAND = "<D>"  # the operands key the leaf `prior_d` (D before the kernel) is read from (never an identifier)

def accumulator(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 A @ B^T (b is [N, K] or [L, N, K]), computed in full fp32 (no TF32); fp64 for fp64 A and B."""
    dt = math_dtype(a.dtype)
    return torch.matmul(a.to(dt), b.to(dt).transpose(-1, -2))


def _real(t: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """A loaded value in the math's precision (the operand itself where it already is)."""
    return t.to(math_dtype(acc.dtype))


def _operand_memory(node: ir.Node, operands: dict, acc: torch.Tensor) -> bool:
    """Whether node's value may be (a view of) an operand tensor: a load that _real kept, or columns of one."""
    while node.op == "pair":
        node = node.inputs[0]
    return node.op == "load" and operands[node.attr[1]].dtype == math_dtype(acc.dtype)


def _leaf(node: ir.Node, operands: dict, acc: torch.Tensor) -> torch.Tensor:
    if node.op == "acc":
        return acc
    if node.op == "const":
        return torch.tensor(node.attr, dtype=acc.dtype, device=acc.device)
    if node.op == "prior_d":
        return _real(operands[PRIOR_D_OPERAND].to(acc.device), acc)
    if node.op == "scalar":
        v = operands[node.attr]
        if isinstance(v, torch.Tensor):
            return _real(v, acc)
        return torch.tensor(float(v), dtype=acc.dtype, device=acc.device)
    if node.op == "onehot":  # [.., M, 1] indices against the columns; one outside [0, N) matches none
        index = operands[node.attr].to(acc.device).unsqueeze(-1)
        return (torch.arange(acc.shape[-1], device=acc.device) == index).to(acc.dtype)
    kind, name = node.attr
    t = _real(operands[name].to(acc.device), acc)  # in math, indices too (cd.take reads its own from operands)
    if kind == "vec_n":  # [N] or [L, N] -> broadcast over rows
        return t.unsqueeze(-2)
    if kind == "vec_m":  # [M] or [L, M] -> broadcast over columns
        return t.unsqueeze(-1)
    return t


def _reduce_dims(axis, ndim: int):
    return {"n": (-1,), "m": (-2,), None: (-2, -1)}[axis] if ndim >= 2 else None


def _full(v: torch.Tensor, acc: torch.Tensor, width) -> torch.Tensor:
    """v broadcast to the [.., M, width * N] shape of its value (constants and vectors expand)."""
    # integer arithmetic (a Fraction or int width): under torch.compile the shape is symbolic
    return torch.broadcast_to(v, (*acc.shape[:-1], acc.shape[-1] * width.numerator // width.denominator))


_REDUCED = ir.reduced()  # made once: under torch.compile, making it in _evaluate guarded on the interning table


def _evaluate(nodes, values: dict, operands: dict, acc: torch.Tensor, widths: dict) -> dict[int, torch.Tensor]:
    for node in nodes:
        if id(node) in values:
            continue
        if node.is_leaf:
            values[id(node)] = _leaf(node, operands, acc)
            continue
        args = [values[id(i)] for i in node.inputs]
        if node.op == "reduce":
            kind, axis = node.attr
            x = _full(args[0], acc, widths.get(id(node.inputs[0]), 1))
            r = REDUCTIONS[kind]
            v = r.torch_fn(x, operands[node.inputs[1].attr[1]]) if r.indexed else \
                r.torch_fn(x, _reduce_dims(axis, x.ndim))
        elif node.op == "finish":  # the finishing expression, with `reduced` bound to the statistic
            done = _evaluate(ir.topo_order([node.attr]), {id(_REDUCED): args[0]}, operands, acc, widths)
            v = done[id(node.attr)]
        elif node.op == "pair" and id(node) not in widths:  # of a uniform value (passes/widths.py):
            v = args[0]  # the value itself, still broadcast to whatever width it meets
        elif node.kind == "structural":  # on operands expanded to their widths (constants and vectors)
            here = widths.get(id(node), Fraction(1))  # an interleave of uniform values: N wide
            ws = [widths[id(i)] if id(i) in widths else here / WIDTH_SCALE[node.definition.width_rule]
                  for i in node.inputs]
            v = node.definition.apply(node.attr, *(_full(x, acc, w) for x, w in zip(args, ws)))
        else:
            v = node.definition.apply(node.attr, *args)  # elementwise: the op's reference semantics
        values[id(node)] = v
    return values


def as_written(fn):
    """fn with torch.autocast off: coda_dsl's ops compute in the dtypes they are given, fp32 accumulation and
    epilogue math, on every backend and in compiled code alike; autocast would round the reference's
    accumulator, constants and scalars to bf16 (and the backward's GEMMs). Callers cast A and B themselves."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
            return fn(*args, **kwargs)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)
    return run


@as_written
def evaluate(program: ir.Program, a: torch.Tensor, b: torch.Tensor, operands: dict,
             out_dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Run a specialized program (constants bound). out_dtypes: output name -> dtype name."""
    return evaluate_on(program, accumulator(a, b), operands, out_dtypes)


def evaluate_on(program: ir.Program, acc: torch.Tensor, operands: dict,
                out_dtypes: dict[str, str | None], share: bool = False) -> dict[str, torch.Tensor]:
    """The program on a given accumulator: fp32 (the semantics), or fp64 for autodiff's checks, where the
    math stays in fp64 and is differentiable by torch.autograd. An out dtype None keeps the math's. share:
    outputs of one value and dtype are one tensor (a derived backward's dacc and a residual's gradient:
    one store, not two). No output shares memory with an operand (acc + r: r's gradient is dy itself, which
    autograd would keep as .grad and add the next backward's gradient into, in place)."""
    widths = infer_widths(program)
    values = _evaluate(ir.walk(program), {}, operands, acc, widths)
    result, made = {}, {}
    for o in program.outputs:
        key = (id(o.node), out_dtypes.get(o.name))
        if share and key in made:
            result[o.name] = made[key]
            continue
        v = values[id(o.node)]
        if ir.reduction_of(o.node) is None:
            v = _full(v, acc, widths.get(id(o.node), 1))
        elif o.node.op == "finish":  # constants in the expression must not shrink the statistic's shape
            v = torch.broadcast_to(v, values[id(o.node.inputs[0])].shape)
        dtype = out_dtypes.get(o.name)
        v = v.to(DTYPES[dtype]) if dtype else v
        kept = v.dtype == math_dtype(acc.dtype) and _operand_memory(o.node, operands, acc)  # decided on dtypes: traces
        result[o.name] = made[key] = v.clone(memory_format=torch.contiguous_format) if kept else v.contiguous()
    return result
