"""coda_dsl: GEMM epilogues written in Python, fused into CUTLASS Hopper kernels.

    import coda_dsl as cd

    @cd.epilogue
    def bias_gelu(acc, bias: cd.VecN):
        return cd.gelu(acc + bias)

    out = cd.gemm(x, w, bias_gelu, bias=b)["D"]      # x: [M, K], w: [N, K]

Defining and running epilogues:
    cd.epilogue           decorator: traces fn(acc, operand: kind, ...) into an epilogue
    cd.epilogue_factory   decorator: a function of constants making an epilogue, cached, callable in torch.compile
    cd.gemm(A, B, ep, **operands)   runs it: {output name: tensor} (the epilogue is positional)
    cd.linear(A, B, ep, **operands) the same with autograd: its backward derived from the epilogue
    cd.backward_epilogue(ep)        that derived backward as the epilogue of the GEMM producing dY
    cd.forward_epilogue(ep, dtype)  the forward kernel's epilogue: ep, keeping what the backward reads
    cd.saved_operands(bw, outs)     the backward epilogue's saved_* operands, from that kernel's outputs
    cd.compile, cd.prebuild, cd.set_tuning, cd.CompiledOp, cd.Config   building and tuning kernels
    cd.identity           the epilogue D = acc

Operand kinds (annotations of the epilogue's parameters after acc):
    cd.Tensor [M, N]   cd.VecN [N]   cd.VecM [M]   cd.Scalar (runtime number)   cd.Const (compile-time)

Inside an epilogue (all math in fp32; traced values support + - * / unary -, abs(), round(),
math.floor/ceil/trunc, x ** n (integers |n| <= 8, 0.5, -0.5) and the comparisons < <= > >= == !=,
which give 1.0 or 0.0):
    elementwise   cd.exp cd.log cd.sqrt cd.rsqrt cd.tanh cd.sin cd.cos cd.sigmoid cd.abs cd.erf
                  cd.relu cd.silu cd.gelu(x, approximate="none"|"tanh") cd.round cd.floor cd.ceil
                  cd.maximum(a, b) cd.minimum(a, b) cd.clamp(x, min, max) cd.where(cond, a, b)
                  cd.cast(x, dtype)   (cd.bfloat16, cd.float16, cd.float32)
    reductions    cd.sum cd.max cd.min cd.amax (x, axis="n"|"m"|None); cd.logsumexp(x), cd.take(x, index): per row
                  (returned as outputs; .then(fn) finishes the statistic)
    indices       cd.onehot(index): 1.0 at column index[m] of row m, else 0.0 (index: a cd.VecM of int64)
    column pairs  cd.pairs(x) -> (even, odd), cd.interleave(a, b)
math.*, numpy and torch functions cannot take traced values: use the cd. functions above.

Glue around the GEMMs: cd.on_cuda(fn) runs a function of torch ops compiled (fused) on CUDA tensors.
cd.first_order(what) marks an autograd.Function's backward that has no graph: a second derivative raises.
cd.as_written(fn) runs fn with torch.autocast off, as cd.gemm, cd.linear and the library run (dtypes as given).
cd.is_gpu(model, device) tells a GPU model ("H100", "H200") for choices measured per model, as the library's tiles.

Library: cd.linear_cross_entropy (more in coda_dsl.library). Errors: cd.CodaError and its subclasses
cd.EpilogueError, cd.OperandError, cd.UnsupportedError (cd.SharedMemoryError), cd.KernelError. The
README's DSL reference has the details.
"""
from importlib import import_module as _import_module

from .errors import CodaError, EpilogueError, KernelError, OperandError, SharedMemoryError, UnsupportedError

__version__ = "0.1.0"

# The rest loads on first use (`cd.gemm` imports torch and the DSL then): `import coda_dsl` and the
# `coda-dsl` command line stay fast for what needs neither (e.g. `coda-dsl --help`).
_LAZY = {
    "dsl": ("Acc", "Const", "Epilogue", "Scalar", "Tensor", "VecM", "VecN", "epilogue", "identity"),
    "dsl.ops": ("abs", "amax", "cast", "ceil", "clamp", "cos", "erf", "exp", "floor", "gelu", "interleave", "log",
                "logsumexp", "max", "maximum", "min", "minimum", "onehot", "pairs", "relu", "round", "rsqrt", "sigmoid",
                "silu", "sin", "sqrt", "sum", "take", "tanh", "where"),
    "passes.plan": ("Config",),
    "runtime": ("BACKENDS", "CompiledOp", "as_written", "backward_epilogue", "compile", "first_order",
                "forward_epilogue", "gemm", "is_gpu", "linear", "prebuild", "saved_operands", "set_tuning"),
    "runtime.torch_compile": ("epilogue_factory", "on_cuda"),
    "library": ("linear_cross_entropy",),
}
_DTYPES = ("bfloat16", "float16", "float32")  # torch's, under the names cd.cast accepts

__all__ = [name for names in _LAZY.values() for name in names] + list(_DTYPES) + [
    "CodaError", "EpilogueError", "KernelError", "OperandError", "SharedMemoryError", "UnsupportedError"]


def __getattr__(name: str):
    for module, names in _LAZY.items():
        if name in names:
            value = getattr(_import_module(f"{__name__}.{module}"), name)
            break
    else:
        if name not in _DTYPES:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import torch
        value = getattr(torch, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
