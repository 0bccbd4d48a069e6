"""The callable op: checks, output allocation, launch, torch.compile registration, reference backend."""
from .autograd import backward_epilogue, first_order, linear
from .op import BACKENDS, CompiledOp, clear, compile, gemm, prebuild, set_tuning
from .reference import as_written

__all__ = ["BACKENDS", "CompiledOp", "as_written", "backward_epilogue", "clear", "compile", "first_order", "gemm", "linear",
           "prebuild", "set_tuning"]
