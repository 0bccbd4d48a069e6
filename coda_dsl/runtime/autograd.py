"""cd.linear: cd.gemm with autograd. The backward is the epilogue's derived program
(passes/autodiff.py), then the two GEMMs of a linear layer.

Forward: the fused GEMM, with the accumulator as one more output when the derivative reads it (in
A's dtype: the pre-activation that training frameworks save). Backward: the derived epilogue on the
saved accumulator gives dacc and the operands' gradients (for now as an unfused torch step, on the
reference semantics), then grad_x = dacc @ W and grad_W = dacc^T x.
"""
from __future__ import annotations

import weakref

import torch

from ..dsl import Epilogue, identity
from ..errors import OperandError
from ..ir import graph as ir
from ..passes import specialize
from ..passes.autodiff import GRAD, SAVED, Backward, derive
from . import reference
from .op import gemm

SAVED_ACC = "acc"  # the forward's extra output: its accumulator (derive() refuses operands of that name)

# epilogue -> {consts: (forward epilogue with the accumulator as an output, its backward)}
_derived: "weakref.WeakKeyDictionary[Epilogue, dict]" = weakref.WeakKeyDictionary()


def _derive(ep: Epilogue, consts: dict) -> tuple[Epilogue, Backward]:
    key = tuple(sorted((k, repr(v)) for k, v in consts.items()))
    per_ep = _derived.setdefault(ep, {})
    if key not in per_ep:
        back = derive(specialize(ep.program, consts))
        forward = ep
        if back.uses_acc:
            if ep.program.output(SAVED_ACC):
                raise OperandError(f"cd.linear: epilogue '{ep.name}' has an output named '{SAVED_ACC}', the name "
                                   "its saved accumulator takes: rename that output")
            p = ep.program
            outputs = (*p.outputs, ir.Output(SAVED_ACC, ir.acc(), None))
            forward = Epilogue.of_program(ir.Program(p.name, p.params, outputs, p.defined_at, p.locations))
        per_ep[key] = (forward, back)
    return per_ep[key]


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ep, names, numbers, options, x, w, *tensors):
        operands = {**dict(zip(names, tensors)), **numbers}
        consts = {p.name: operands[p.name] for p in ep.params if p.kind == "const"}
        forward, back = _derive(ep, consts)
        outs = gemm(x, w, forward, **options, **operands)
        acc = outs.pop(SAVED_ACC, None)
        ctx.back, ctx.names, ctx.numbers = back, names, numbers
        ctx.save_for_backward(x, w, acc, *tensors, *(outs[o] for o in back.saved))
        return tuple(outs[o] for o in ep.output_names)  # linear() names them in this order

    @staticmethod
    def backward(ctx, *grads):
        back, names = ctx.back, ctx.names
        x, w, acc, *rest = ctx.saved_tensors
        tensors, saved = rest[:len(names)], rest[len(names):]
        outs = dict(zip(back.grads, grads))  # the forward's outputs, in its order
        operands = {**dict(zip(names, tensors)), **ctx.numbers,
                    **{SAVED + o: t for o, t in zip(back.saved, saved)},
                    **{GRAD + o: (g if g is not None else torch.zeros((), device=x.device)) for o, g in outs.items()
                       if o in back.grads}}
        if acc is None:  # the derivative does not read the accumulator: any tensor of its shape will do
            acc = torch.zeros(x.shape[0], w.shape[0], device=x.device)
        got = reference.evaluate_on(back.program, acc.float(), operands, {})
        dacc = got.get("acc")
        need_x, need_w = ctx.needs_input_grad[4:6]
        grad_x = dacc.to(x.dtype) @ w if need_x and dacc is not None else None
        grad_w = dacc.t().to(x.dtype) @ x if need_w and dacc is not None else None
        grad_ops = [got[n].to(t.dtype) if n in got and ctx.needs_input_grad[6 + i] else None
                    for i, (n, t) in enumerate(zip(names, tensors))]
        return (None, None, None, None, grad_x, grad_w, *grad_ops)


def linear(A: torch.Tensor, B: torch.Tensor, epilogue: Epilogue | None = None, /, *, backend: str = "auto",
           config=None, **operands) -> dict[str, torch.Tensor]:
    """cd.gemm(A, B, epilogue, **operands) with autograd: a trainable linear layer with its epilogue.

    A is [M, K] (flatten a batch into rows), B is [N, K] (an nn.Linear weight). Gradients flow to A, B and
    every cd.Tensor / cd.VecN / cd.VecM operand passed as a tensor; cd.Scalar and cd.Const values are
    numbers and get none. The epilogue's backward is derived automatically (coda_dsl.passes.autodiff):
    statistics it cannot differentiate yet (cd.max/min/amax/take, .then finishing steps) raise
    UnsupportedError. Returns the outputs like cd.gemm.
    """
    ep = epilogue or identity
    if not isinstance(ep, Epilogue):
        raise TypeError(f"cd.linear: epilogue must be a function decorated with @cd.epilogue, got {ep!r}")
    if not isinstance(A, torch.Tensor) or A.dim() != 2:
        raise OperandError("cd.linear: A must be a 2-D tensor [M, K]; flatten a batch into rows: A.flatten(0, -2)")
    names = tuple(k for k, v in operands.items() if isinstance(v, torch.Tensor))
    numbers = {k: v for k, v in operands.items() if not isinstance(v, torch.Tensor)}
    options = {"backend": backend, "config": config}
    outs = _Linear.apply(ep, names, numbers, options, A, B, *(operands[k] for k in names))
    return dict(zip(ep.output_names, outs))
