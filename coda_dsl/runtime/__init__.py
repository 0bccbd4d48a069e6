"""The callable op: checks, output allocation, launch, torch.compile registration, reference backend."""
from .autograd import backward_epilogue, linear
from .op import CompiledOp, clear, compile, gemm, prebuild, set_tuning

__all__ = ["CompiledOp", "backward_epilogue", "clear", "compile", "gemm", "linear", "prebuild", "set_tuning"]
