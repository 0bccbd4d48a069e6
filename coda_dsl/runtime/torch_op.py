"""torch.compile support: one functional custom op, `coda_dsl::gemm`, that Dynamo records as a single
node (no graph break); eager calls never go through it, so they pay no dispatcher overhead."""
from __future__ import annotations

from fractions import Fraction

import torch

from ..dsl import Epilogue
from ..errors import OperandError, UnsupportedError
from ..ir import graph as ir
from ..ir.ops import DTYPES
from ..passes.plan import KIND_OF_AXIS, OUTPUT_SHAPES
from ..passes.widths import infer as infer_widths
from .call import with_aliases
from .checks import described


# cd.gemm's eager path, which the custom op runs: runtime/op.py registers it when it imports this
# module (imports flow one way: op -> torch_op)
_eager_gemm = None


def register_eager(gemm) -> None:
    global _eager_gemm
    _eager_gemm = gemm


def _operands(ep: Epilogue, tensors: list, numbers: list) -> dict:
    it_t, it_n = iter(tensors), iter(numbers)
    return {p.name: next(it_t) if p.kind in ir.LOAD_KINDS else next(it_n) for p in ep.params}


@torch.library.custom_op("coda_dsl::gemm", mutates_args=())
def _custom_op(uid: str, a: torch.Tensor, b: torch.Tensor, tensors: list[torch.Tensor], numbers: list[float],
          backend: str, config: str, deterministic: bool) -> list[torch.Tensor]:
    ep = Epilogue.by_uid(uid)
    with torch.no_grad():  # an op's implementation: autograd is torch.compile's affair (it has no formula here)
        res = _eager_gemm(a, b, ep, backend=backend, config=config or None, deterministic=deterministic,
                          **_operands(ep, tensors, numbers))
    return [res[name] for name in ep.output_names]


def _no_derivative(ctx, grads):
    raise UnsupportedError("cd.gemm has no derivative (inside torch.compile, a graph whose cd.gemm inputs require "
                           "grad is differentiated when it is compiled, even where nothing uses that gradient)\n  fix: "
                           "call cd.linear(A, B, epilogue, ...) for a trainable layer, or detach what needs none")


_custom_op.register_autograd(_no_derivative)


@_custom_op.register_fake
def _(uid, a, b, tensors, numbers, backend, config, deterministic):
    ep = Epilogue.by_uid(uid)
    lead, m, n = a.shape[:-2], a.shape[-2], b.shape[-2]
    widths = infer_widths(ep.program)
    outs = []
    for o in ep.program.outputs:
        r = ir.reduction_of(o.node)
        w = Fraction(widths.get(id(o.node if r is None else r.inputs[0]), 1))  # a statistic: its value's width
        cols = n * w.numerator // w.denominator  # integer math: n may be a SymInt
        shape = (*lead, m, cols) if r is None else OUTPUT_SHAPES[KIND_OF_AXIS[r.attr[1]]][1](lead, m, cols)
        # fp64 A and B (the reference backend's gradcheck mode): every output in fp64, as run_reference makes it
        dtype = a.dtype if a.dtype == torch.float64 or not o.dtype else DTYPES[o.dtype]
        outs.append(a.new_empty(shape, dtype=dtype))
    return outs


def traced_gemm(ep: Epilogue, a, b, out, backend, config, deterministic, operands) -> dict:
    """What cd.gemm does while Dynamo traces it: one call of the custom op."""
    tensors = [operands[p.name] for p in ep.params if p.kind in ir.LOAD_KINDS]
    numbers = [float(operands[p.name]) for p in ep.params if p.kind not in ir.LOAD_KINDS]
    cfg = config if isinstance(config, str) else (config.text if config is not None else "")
    outs = dict(zip(ep.output_names, torch.ops.coda_dsl.gemm(ep.uid, a, b, tensors, numbers, backend, cfg,
                                                                   deterministic)))
    for name, t in (out or {}).items():  # given outputs: what the op made, copied in (so the same dtype, shape)
        made = outs.get(name)
        if made is None or not isinstance(t, torch.Tensor) or t.dtype != made.dtype or t.shape != made.shape:
            want = "no such output" if made is None else described(made)
            raise OperandError(f"cd.gemm (epilogue '{ep.name}'): inside torch.compile, out['{name}'] must be what the "
                               f"epilogue makes ({want}; outputs {list(ep.output_names)}), got {described(t)}\n  fix: "
                               "cast in the epilogue (cd.cast) for another dtype, or use the returned tensor")
        t.copy_(made)
        outs[name] = t
    return with_aliases(ep, outs)
