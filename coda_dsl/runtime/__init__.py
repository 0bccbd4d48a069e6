"""The callable op: checks, output allocation, launch, torch.compile registration, reference backend."""
from .autograd import backward_epilogue, first_order, forward_epilogue, linear, saved_operands
from .checks import BACKENDS
from .op import CompiledOp, clear, compile, gemm, prebuild
from .reference import as_written
from .tune import is_gpu, set_tuning

__all__ = ["BACKENDS", "CompiledOp", "as_written", "backward_epilogue", "clear", "compile", "first_order",
           "forward_epilogue", "gemm", "is_gpu", "linear", "prebuild", "saved_operands", "set_tuning"]
