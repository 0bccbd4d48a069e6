"""The callable op: checks, output allocation, launch, torch.compile registration, reference backend."""
from .autograd import backward_epilogue, first_order, forward_epilogue, linear, saved_operands
from .op import BACKENDS, CompiledOp, clear, compile, gemm, prebuild, set_tuning
from .reference import as_written
from .tune import is_gpu

__all__ = ["BACKENDS", "CompiledOp", "as_written", "backward_epilogue", "clear", "compile", "first_order",
           "forward_epilogue", "gemm", "is_gpu", "linear", "prebuild", "saved_operands", "set_tuning"]
