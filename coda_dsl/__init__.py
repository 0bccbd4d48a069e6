"""coda_dsl: GEMM epilogues written in Python, fused into CUTLASS Hopper kernels.

    import coda_dsl as cd

    @cd.epilogue
    def bias_gelu(acc, bias: cd.VecN):
        return cd.gelu(acc + bias)

    out = cd.gemm(x, w, bias_gelu, bias=b)["D"]      # x: [M, K], w: [N, K]
"""
import torch as _torch

from .dsl import Acc, Const, Epilogue, Scalar, Tensor, VecM, VecN, epilogue, identity
from .dsl.ops import (abs, amax, cast, cos, exp, gelu, interleave, log, logsumexp, max, maximum, min, minimum,
                      pairs, relu, rsqrt, sigmoid, silu, sin, sqrt, sum, take, tanh, where)
from .errors import CodaError, EpilogueError, OperandError, SharedMemoryError, UnsupportedError
from .passes.plan import Config
from .runtime import CompiledOp, compile, gemm, prebuild, set_tuning

bfloat16, float16, float32 = _torch.bfloat16, _torch.float16, _torch.float32
__version__ = "0.1.0"

from .library import linear_cross_entropy  # noqa: E402  (the library is written in the DSL above)
