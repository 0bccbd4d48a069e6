"""cd.linear: cd.gemm with autograd. The backward is the epilogue's derived program
(passes/autodiff.py), then the two GEMMs of a linear layer.

Forward: the fused GEMM, with the accumulator as one more output when the derivative reads it (in
A's dtype: the pre-activation that training frameworks save; fp32 for fp16, whose range ends at 65504),
and, for a statistic finished by .then whose derivative reads it, the statistic before .then (output
saved_<name>); outputs the derivative reads back (a residual stream) are saved as they are. Backward:
the derived epilogue on the saved accumulator gives dacc and the operands' gradients (its reference
semantics as torch ops; on CUDA through torch.compile, which fuses them into a kernel or two instead of a
pass per op), then grad_x = dacc @ W and grad_W = dacc^T x.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from ..dsl import Epilogue
from ..errors import OperandError, UnsupportedError
from ..ir import graph as ir
from ..ir.ops import dtype_name, math_dtype, torch_dtype
from ..passes import specialize
from ..passes.autodiff import (ACC, GRAD, SAVED, Backward, derive, into_producer, saved_from, stored_once,
                               underivable, underived_what)
from . import reference, torch_compile
from .torch_compile import made_once
from .call import check_consts, check_operands, epilogue_of, with_aliases
from .op import gemm


def first_order(what: str):
    """A decorator for an autograd.Function's backward that computes its gradients without a graph (kernels,
    in-place steps; it runs under no_grad):

        @staticmethod
        @cd.first_order("my fused op")
        def backward(ctx, grad): ...

    After backward(create_graph=True) its gradients come back tied to a node whose own backward raises
    UnsupportedError naming `what`, where torch would silently give a second derivative of 0
    (torch.autograd.function.once_differentiable raises only where the incoming gradients require grad,
    which a loss's gradient does not)."""
    def decorate(backward):
        @functools.wraps(backward)
        def call(ctx, *grads):
            with torch.no_grad():
                out = backward(ctx, *grads)
            if not torch.is_grad_enabled():  # the usual backward: nothing to tie
                return out
            outs = out if isinstance(out, tuple) else (out,)
            at = [i for i, g in enumerate(outs) if isinstance(g, torch.Tensor) and g.is_floating_point()]
            # tied to the saved inputs and the incoming gradients too: a gradient of the gradients with respect to
            # them (a parameter that reaches this op only through its incoming gradient) reaches the node
            inputs = [t for t in (*ctx.saved_tensors, *grads) if isinstance(t, torch.Tensor) and t.requires_grad]
            tied = _NoSecondDerivative.apply(what, len(at), *(outs[i].detach().requires_grad_() for i in at), *inputs)
            outs = list(outs)
            for i, g in zip(at, tied):
                outs[i] = g
            return tuple(outs) if isinstance(out, tuple) else outs[0]
        return call
    return decorate


class _NoSecondDerivative(torch.autograd.Function):
    """The gradients of a first_order backward, unchanged; differentiating them raises."""

    @staticmethod
    def forward(ctx, what: str, n: int, *grads_and_inputs):
        ctx.what = what
        return tuple(g.view_as(g) for g in grads_and_inputs[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise UnsupportedError(f"{ctx.what} has no second derivative (its backward computes gradients without a "
                               "graph): a gradient of its gradient was asked for (create_graph=True)\n  fix: "
                               "differentiate through it once, or compute that part with plain torch ops")


class _Derived:
    """An epilogue's forward with its accumulator as an output (when the derivative reads it), and the
    derived backward program as a function of (acc, operands, out_dtypes), fused on CUDA."""

    def __init__(self, forward: Epilogue, back: Backward):
        self.forward, self.back = forward, back
        self.backward = torch_compile.on_cuda(self._backward)

    def _backward(self, acc: torch.Tensor, operands: dict, out_dtypes: dict) -> dict[str, torch.Tensor]:
        """The gradients, in out_dtypes (name -> dtype name)."""
        return reference.evaluate_on(self.back.program, acc.to(math_dtype(acc.dtype)),
                                     operands, out_dtypes, share=True)


@made_once  # for the process's life: one small entry per epilogue, consts and outputs left out
def _derived(uid: str, consts: tuple, no_grad: tuple[str, ...], reuse: tuple[str, ...] | None,
             acc_dtype: str | None) -> _Derived:
    """The derivation of the epilogue named uid with these (name, value) consts, leaving out no_grad's
    outputs, reading back reuse's outputs (None: derive's choice), the forward keeping the accumulator in
    acc_dtype (None: A's). Inside torch.compile, Dynamo calls this instead of tracing it (a pass over the IR)."""
    ep = Epilogue.by_uid(uid)
    back = derive(specialize(ep.program, dict(consts)), no_grad, reuse)
    p, forward = ep.program, ep
    taken = [name for name in ([ACC] if back.uses_acc else []) + [SAVED + o for o in back.unfinished]
             if p.output(name)]
    if taken:
        raise OperandError(f"epilogue '{ep.name}' has an output named '{taken[0]}', the name cd.linear's forward "
                           "kernel gives a value its derivative reads: rename that output to differentiate it")
    extra = ((ir.Output(ACC, ir.acc(), acc_dtype),) if back.uses_acc else ()) + tuple(
        ir.Output(SAVED + o, ir.reduction_of(p.output(o).node), None) for o in back.unfinished)
    if extra:
        forward = Epilogue.of_program(replace(p, outputs=(*p.outputs, *extra)))
    return _Derived(forward, back)


@made_once  # a pass over the program, once per epilogue: cd.linear asks at every call
def _underived(uid: str, fused_into: str | None = None) -> tuple[str, ...]:
    """The outputs of the epilogue named uid that are statistics with no derivative yet (underivable)."""
    return underivable(Epilogue.by_uid(uid).program, fused_into)


def _derive(ep: Epilogue, consts: dict, no_grad: tuple[str, ...] = (), reuse: tuple[str, ...] | None = None,
            a_dtype: torch.dtype | None = None) -> _Derived:
    """The epilogue's derivation (made once), in a form torch.compile(fullgraph=True) traces. a_dtype: A's,
    which picks the dtype the forward keeps the accumulator in."""
    if torch.compiler.is_compiling():
        consts = {k: torch_compile.guarded_constant(v) for k, v in consts.items()}
    # fp16's range ends at 65504, where an accumulator may not (cd.sin(acc * 1e-5)): kept in fp32 rather than inf
    # (bf16 has fp32's range)
    acc_dtype = "fp32" if a_dtype == torch.float16 else None
    return _derived(ep.uid, tuple(sorted(consts.items())), tuple(sorted(no_grad)), reuse, acc_dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    @reference.as_written
    def forward(ctx, ep, names, numbers, options, x, w, *tensors):
        operands = {**dict(zip(names, tensors)), **numbers}  # numbers last: a learnt cd.Scalar's value
        consts = {p.name: operands[p.name] for p in ep.params if p.kind == "const"}
        # statistics with no derivative yet (cd.max/min/amax, e.g. an fp8 scale's amax) are computed, and
        # refused only if a gradient reaches them (inside torch.compile: refused by linear())
        frozen = _underived(ep.uid)
        derived = _derive(ep, consts, frozen, a_dtype=x.dtype)
        back = derived.back
        if learnt := [n for i, n in enumerate(names) if n in back.ungraded and ctx.needs_input_grad[6 + i]]:
            raise UnsupportedError(f"cd.linear: epilogue '{ep.name}' reads cd.Scalar '{learnt[0]}' inside .then(...), "
                                   "where its gradient is not derived\n  fix: pass it as a number (no gradient)")
        outs = gemm(x, w, derived.forward, **options, **operands)
        acc = outs.pop(ACC) if back.uses_acc else None
        statistics = [outs.pop(SAVED + o) if o in back.unfinished else outs[o] for o in back.saved]
        ctx.ep, ctx.consts, ctx.derived, ctx.frozen = ep, consts, derived, frozen
        ctx.names, ctx.numbers = names, numbers
        ctx.save_for_backward(x, w, acc, *tensors, *statistics)
        # an output the loss does not use gets None, not zeros: its derivative is left out of the backward,
        # where 0 * f'(x) would still be NaN at f's singular points (sqrt at 0, log at 0, ...). (Under
        # torch.compile, AOTAutograd passes zeros instead.)
        ctx.set_materialize_grads(False)
        return tuple(outs[o] for o in ep.output_names)  # linear() names them in this order

    @staticmethod
    @reference.as_written
    @first_order("cd.linear")  # the saved accumulator has no graph
    def backward(ctx, *grads):
        names = ctx.names
        grads = dict(zip(ctx.ep.output_names, grads))
        if used := [o for o in ctx.frozen if grads[o] is not None]:
            raise UnsupportedError(f"cd.linear: epilogue '{ctx.ep.name}': the loss depends on output '{used[0]}', a "
                                   f"{underived_what(ctx.ep.program, used[0])}, which has no derivative yet\n  fix: "
                                   f"use it detached (out['{used[0]}'].detach()), or compute it outside the epilogue")
        x, w, acc, *rest = ctx.saved_tensors
        derived = ctx.derived
        if unused := tuple(o for o, g in grads.items() if g is None):
            # without the unused outputs: it reads a subset of what the full derivative had saved
            derived = _derive(ctx.ep, ctx.consts, unused, derived.back.reused)
        tensors, saved = rest[:len(names)], rest[len(names):]
        operands = {**dict(zip(names, tensors)), **ctx.numbers,
                    **{SAVED + o: t for o, t in zip(ctx.derived.back.saved, saved)},
                    **{GRAD + o: g for o, g in grads.items() if g is not None}}
        fp64 = x.dtype == torch.float64  # the reference backend's gradcheck precision: gradients stay fp64
        if acc is None:  # the derivative does not read the accumulator: its shape and dtype, no memory
            acc = torch.zeros((), device=x.device, dtype=math_dtype(x.dtype)).expand(
                x.shape[0], w.shape[0])
        # (a learnt cd.Scalar's gradient keeps the math's dtype: autograd casts it to the scalar's; cd.take's
        # int64 indices get none)
        out_dtypes = {} if fp64 else {ACC: dtype_name(x.dtype), **{n: dtype_name(t.dtype) for n, t in
                                                                    zip(names, tensors) if t.dim() and t.is_floating_point()}}
        got = derived.backward(acc, operands, out_dtypes)
        dacc = got.get(ACC)
        need_x, need_w = ctx.needs_input_grad[4:6]
        # (no dacc: the outputs do not depend on the accumulator, or only where its derivative is 0: zeros, as
        # torch gives, so that optimizers and DDP see the parameter used)
        grad_x = (dacc @ w if dacc is not None else torch.zeros_like(x)) if need_x else None
        grad_w = (dacc.t() @ x if dacc is not None else torch.zeros_like(w)) if need_w else None
        grad_ops = [_shaped(got[n], t) if n in got and ctx.needs_input_grad[6 + i] else None
                    for i, (n, t) in enumerate(zip(names, tensors))]
        return (None, None, None, None, grad_x, grad_w, *grad_ops)


def _shaped(grad: torch.Tensor, operand: torch.Tensor) -> torch.Tensor:
    """An operand's gradient in the operand's shape. A gradient with no width of its own (the same in every
    column: it comes from a row or whole-tile statistic) is evaluated N wide; the operand may be N/2^k or 2^k N
    wide (nested cd.pairs / cd.interleave)."""
    if grad.dim() and grad.shape != operand.shape:
        n, want = grad.shape[-1], operand.shape[-1]
        if grad.shape[:-1] != operand.shape[:-1] or not want or (n % want and want % n):  # an autodiff bug: say so
            raise RuntimeError(f"cd.linear: internal error: an operand's gradient is {list(grad.shape)}, the operand "
                               f"{list(operand.shape)}")
        return grad[..., :1].expand(operand.shape)
    return grad


def linear(A: torch.Tensor, B: torch.Tensor, epilogue: Epilogue | None = None, /, *, backend: str = "auto",
           config=None, deterministic: bool = False, tune: bool | None = None, **operands) -> dict[str, torch.Tensor]:
    """cd.gemm(A, B, epilogue, **operands) with autograd: a trainable linear layer with its epilogue.

    A is [M, K] (flatten a batch into rows), B is [N, K] (an nn.Linear weight). Gradients flow to A, B and
    every cd.Tensor / cd.VecN / cd.VecM operand passed as a tensor, and to a cd.Scalar passed as a 0-d
    tensor (its value is read to the host for the kernel: on CUDA one synchronization per call); a
    cd.Scalar given as a number, and cd.Const values, get none. The epilogue's backward is derived
    automatically (coda_dsl.passes.autodiff): statistics it cannot differentiate yet
    (cd.max/min/amax) are computed, and raise UnsupportedError if the loss depends on them.
    backend, config, deterministic and tune are cd.gemm's, for the forward kernel. Returns the outputs
    like cd.gemm.
    """
    ep = epilogue_of("cd.linear", epilogue, operands)
    for name in ("out", "accumulate"):
        if name in operands:
            raise OperandError(f"cd.linear: {name}= writes outputs in place, which autograd cannot record; "
                               "cd.linear allocates its outputs (use cd.gemm for this)")
    # B first: with a batch of weights, flattening A (the advice for A alone) would not help
    if not isinstance(B, torch.Tensor) or B.dim() != 2:
        raise OperandError("cd.linear: B must be a 2-D weight [N, K] (an nn.Linear's); batched GEMMs have no "
                           "derivative here: call cd.linear per batch")
    if not isinstance(A, torch.Tensor) or A.dim() != 2:
        raise OperandError("cd.linear: A must be a 2-D tensor [M, K]; flatten a batch into rows: A.flatten(0, -2)")
    names = tuple(k for k, v in operands.items() if isinstance(v, torch.Tensor))
    # a cd.Scalar given as a 0-d tensor (to learn it): the kernel takes its value, the tensor its gradient
    learnt = [p.name for p in ep.params if p.kind == "scalar"
              and isinstance(operands.get(p.name), torch.Tensor) and operands[p.name].dim() == 0]
    if bad := [n for n in learnt if operands[n].is_complex() or operands[n].dtype == torch.bool]:
        raise OperandError(f"cd.linear: {ep.program.title}: cd.Scalar '{bad[0]}' given as a 0-d tensor of dtype "
                           f"{operands[bad[0]].dtype}, which is no real number\n  fix: pass a real number (a float "
                           "0-d tensor to learn it)")
    values = {n: float(operands[n].detach()) for n in learnt}
    if values and torch.compiler.is_compiling():
        raise OperandError(f"cd.linear: cd.Scalar {sorted(values)} given as a tensor inside torch.compile: the "
                           "kernel needs its value as a number, which a traced tensor is not\n  fix: pass a number, "
                           "or learn it outside the compiled region")
    check_operands(ep, {**operands, **values})  # before the derivation, which reads the cd.Const values
    tensors = (A, B, *(operands[k] for k in names))
    if not torch.is_grad_enabled() or not any(getattr(t, "requires_grad", False) for t in tensors):
        # nothing to differentiate: the plain fused GEMM (no accumulator kept, no derivative needed)
        return gemm(A, B, ep, backend=backend, config=config, deterministic=deterministic, tune=tune,
                    **{**operands, **values})
    if torch.compiler.is_compiling() and (frozen := _underived(ep.uid)):
        # AOTAutograd hands an unused output zeros rather than None: a use cannot be told from none
        raise UnsupportedError(f"cd.linear: epilogue '{ep.name}' has output '{frozen[0]}', a statistic with no "
                               "derivative yet, which inside torch.compile cannot be told unused\n  fix: compute it "
                               "in its own cd.gemm or torch op, or call this cd.linear outside the compiled region")
    numbers = {**{k: v for k, v in operands.items() if not isinstance(v, torch.Tensor)}, **values}
    options = {"backend": backend, "config": config, "deterministic": deterministic, "tune": tune}
    outs = _Linear.apply(ep, names, numbers, options, A, B, *(operands[k] for k in names))
    return with_aliases(ep, dict(zip(ep.output_names, outs)))


def forward_epilogue(epilogue: Epilogue, dtype: torch.dtype | str = torch.bfloat16, **consts) -> Epilogue:
    """The epilogue cd.linear's forward kernel runs for A of this dtype: `epilogue`, with its accumulator
    as one more output when the derivative reads it (in A's dtype; fp32 for fp16), e.g. to build that
    kernel ahead of the first call."""
    epilogue = _checked("forward_epilogue", epilogue, consts, ("dtype",))
    given, dtype = dtype, torch_dtype(dtype)  # a name too, as cd.cast takes: "bf16", "float16", "float64"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise OperandError(f"forward_epilogue: dtype is A's, a torch floating dtype or its name, not {given!r}\n  fix: "
                           "dtype=torch.bfloat16 (or torch.float16, 'bf16', 'fp16')")
    return _derive(epilogue, consts, _underived(epilogue.uid), a_dtype=dtype).forward


def _checked(api: str, epilogue, consts: dict, options: tuple[str, ...] = ()) -> Epilogue:
    """The epilogue a derivation entry point was given, with its cd.Const values checked (and none named like
    one of the entry point's keyword options, which would take its value)."""
    epilogue = epilogue_of(api, epilogue, {})
    if clash := [p.name for p in epilogue.params if p.kind == "const" and p.name in options]:
        raise OperandError(f"{api}: epilogue '{epilogue.name}' has a cd.Const named '{clash[0]}', like an option of "
                           f"{api} ({', '.join(options)}), so its value cannot be passed\n  fix: rename the constant")
    check_consts(api, epilogue, consts, options)
    return epilogue


def saved_operands(backward: Epilogue, forward_outputs: dict) -> dict:
    """The saved_* operands a backward_epilogue (or derived_backward) declares, from the outputs of its
    forward_epilogue kernel: saved_acc is the output acc, saved_<statistic> of a statistic under .then the
    output saved_<statistic> (before .then), and any other saved_<output> that output (passes.autodiff.saved_from)."""
    backward = epilogue_of("saved_operands", backward, {})
    if backward.saved_from is None:
        raise OperandError(f"saved_operands: epilogue '{backward.name}' is not a derived backward\n  fix: pass "
                           "cd.backward_epilogue(ep) (or derived_backward(ep)) and the outputs of "
                           "cd.forward_epilogue(ep)'s kernel")
    if not isinstance(forward_outputs, dict):
        raise OperandError(f"saved_operands: forward_outputs must be the dict of outputs the forward_epilogue kernel "
                           f"returned, not {type(forward_outputs).__name__}")

    def of(name: str):
        if (source := backward.saved_from[name]) in forward_outputs:
            return forward_outputs[source]
        raise OperandError(f"backward epilogue '{backward.name}' reads {name}, the output '{source}' of the forward "
                           f"kernel, which the outputs given lack ({sorted(forward_outputs)})\n  fix: pass the outputs "
                           "of the forward_epilogue kernel")
    return {p.name: of(p.name) for p in backward.params if p.name.startswith(SAVED)}


def derived_backward(epilogue: Epilogue, **consts) -> Epilogue:
    """The backward program cd.linear runs for `epilogue`, as an epilogue of its own (operands, grad_<output>,
    saved_<statistic>, saved_<output> for outputs read back; outputs acc and each operand's gradient, one
    that is acc's value an alias of it: stored_once). Statistics with no derivative yet are left out, as
    cd.linear leaves them. cd.Const values go in `consts`."""
    epilogue = _checked("derived_backward", epilogue, consts)
    back = _derive(epilogue, consts, _underived(epilogue.uid)).back
    return Epilogue.of_program(stored_once(back.program), saved_from(back))


def backward_epilogue(epilogue: Epilogue, output: str = "D", split: bool = False,
                      no_grad: str | tuple[str, ...] = (), recompute: str | tuple[str, ...] = (), **consts) -> Epilogue:
    """The derived backward of `epilogue` as the epilogue of the GEMM that produces the gradient of its
    `output` (the backward's dY = dOut @ W of the layer above): call it on that GEMM with what the
    forward_epilogue kernel saved as the operands it declares, `saved_acc` (its output acc) where the
    derivative reads the accumulator and `saved_<name>` for the forward's outputs it reads back (and the
    forward's other operands, and the other outputs' gradients as `grad_<name>`); its D is the gradient of
    the forward's accumulator, whose GEMMs (dacc @ W, dacc^T x) follow, and an output per differentiable
    operand holds that operand's gradient. split (a pairwise forward): D's even and odd columns as two
    outputs D_even and D_odd instead, e.g. SwiGLU's gate and up gradients for their own weights. no_grad:
    outputs with no incoming gradient (a pre-activation kept for the backward, say), which then need no
    grad_<name> operand; statistics with no derivative yet (cd.max/min/amax) are among them. recompute:
    forward outputs it also computes again, as outputs recomputed_<name> (so the forward need not keep them:
    SwiGLU's y, which W_down's gradient reads). cd.Const values go in `consts`. library.swiglu_backward is
    SwiGLU's."""
    names = lambda x: (x,) if isinstance(x, str) else tuple(x)  # noqa: E731  a single name, or several
    epilogue = _checked("cd.backward_epilogue", epilogue, consts, ("output", "split", "no_grad", "recompute"))
    frozen = _underived(epilogue.uid, output)
    saved = _derive(epilogue, consts, frozen).back.reused  # what the forward kernel keeps
    back = _derive(epilogue, consts, tuple(dict.fromkeys(names(no_grad) + frozen)), saved).back
    # an output named saved_<an output the backward reads> would be taken for it by saved_operands
    if clash := [SAVED + o for o in back.saved if epilogue.program.output(SAVED + o)]:
        raise OperandError(f"cd.backward_epilogue: epilogue '{epilogue.name}' has an output named '{clash[0]}', the "
                           f"operand its backward reads output '{clash[0][len(SAVED):]}' back as\n  fix: rename that "
                           "output")
    return Epilogue.of_program(into_producer(back, output, split, names(recompute)), saved_from(back))
