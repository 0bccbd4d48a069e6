"""The callable op: checks, output allocation, launch, torch.compile registration, reference backend."""
from .op import CompiledOp, compile, gemm

__all__ = ["CompiledOp", "compile", "gemm"]
