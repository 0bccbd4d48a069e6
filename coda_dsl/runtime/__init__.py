"""The callable op: checks, output allocation, launch, torch.compile registration, reference backend."""
from .op import CompiledOp, clear, compile, gemm, prebuild, set_tuning

__all__ = ["CompiledOp", "clear", "compile", "gemm", "prebuild", "set_tuning"]
