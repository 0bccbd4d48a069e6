"""Call-time checks of one tensor or value (runtime/call.py checks a whole call with them): every message names
the op, the operand and the fix."""
from __future__ import annotations

import difflib
import functools

import torch

from ..build.tools import MIN_CUDA_TEXT, older_than_min_cuda
from ..errors import OperandError, UnsupportedError
from ..ir.ops import INDEX_DTYPE, TORCH_TO_DTYPE

# fp64 inputs: the reference backend's math and outputs stay in fp64 (what torch.autograd.gradcheck
# needs); no kernel reads them
REFERENCE_FP64 = "fp64"


def fail(where: str, message: str, fix: str = "") -> OperandError:
    return OperandError(f"{where}: {message}" + (f"\n  fix: {fix}" if fix else ""))


BACKENDS = ("auto", "cutlass", "reference")


def backend(where: str, value) -> None:
    """value is one of BACKENDS; else the error names the closest."""
    if value not in BACKENDS:
        close = difflib.get_close_matches(str(value), BACKENDS, 1)
        raise fail(where, f"backend must be one of {BACKENDS}, not {value!r}", f"backend={close[0]!r}" if close else
                   "backend='auto' (the kernel where an sm_90 GPU runs it, else the reference semantics)")


def described(value) -> str:
    """A value as messages show it: a tensor by its dtype and shape (never its data), a number or a name as
    written, anything else by its type."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    if isinstance(value, (tuple, list)):  # the first few items
        return f"{type(value).__name__} ({', '.join([described(v) for v in value[:3]] + ['...'] * (len(value) > 3))})"
    if value is None or isinstance(value, (str, int, float)):
        return repr(value)
    return type(value).__name__


def _bare(name: str) -> str:
    """"operand 'b'" -> b: the name as the caller's code spells it, for a fix."""
    return name.split()[-1].strip("'")


def dtype_of(where: str, name: str, t: torch.Tensor, index: bool = False, fp64: bool = False,
             operand: bool = False) -> str:
    """The dtype name of a tensor the call reads; fp64 (REFERENCE_FP64) where the reference backend runs.
    index: column indices (int64) of cd.take or cd.onehot; operand: an epilogue operand, whose integers a cast
    keeps."""
    if index:
        if t.dtype != torch.int64:
            raise fail(where, f"{name} holds column indices (cd.take, cd.onehot) and must be torch.int64, not "
                       f"{t.dtype}", f"pass {_bare(name)}.long()")
        return INDEX_DTYPE
    if t.dtype == torch.float64:
        if fp64:
            return REFERENCE_FP64
        raise fail(where, f"{name} is torch.float64: kernels compute in fp32; fp64 is for the reference backend "
                   "with A and B in fp64 (as torch.autograd.gradcheck needs)",
                   "cast it to torch.float32, or pass A and B in fp64 with backend='reference'")
    d = TORCH_TO_DTYPE.get(t.dtype)
    if d is None:
        if operand and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            raise fail(where, f"{name} has dtype {t.dtype}; operands are floating point", f"pass {_bare(name)}.float() "
                       "(fp32 holds integers exactly up to 2^24; bf16 only up to 256)")
        raise fail(where, f"{name} has dtype {t.dtype}", "use torch.bfloat16, torch.float16 or torch.float32 "
                   "(torch.float64 with A and B in fp64 on the reference backend)")
    return d


def dense(where: str, name: str, t: torch.Tensor) -> None:
    """Strided (dense) tensors only: the checks and the kernel read strides and data pointers."""
    if t.is_nested:  # (torch's older nested tensors say strided)
        raise fail(where, f"{name} is a nested tensor; coda_dsl reads dense (strided) tensors only",
                   f"pass one dense tensor (torch.nested.to_padded_tensor({_bare(name)}, 0.0), or its parts in turn)")
    if t.layout != torch.strided:
        raise fail(where, f"{name} is a {t.layout} tensor; coda_dsl reads dense (strided) tensors only",
                   f"pass {_bare(name)}.to_dense()")


def tensor(where: str, name: str, t, shape: tuple, device: torch.device | None = None, meaning: str = "",
           batch: int | None = None) -> None:
    """Shape and device of a tensor operand: `shape`, or [batch, *shape] in a batched call (batch given).
    `meaning` says what the shape stands for, for the fix line."""
    if not isinstance(t, torch.Tensor):
        raise fail(where, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dense(where, name, t)
    got = tuple(t.shape)
    if got != shape and (batch is None or got != (batch, *shape)):
        raise fail(where, f"{name} has shape {list(got)}, expected {list(shape)}"
                   + (f" or {[batch, *shape]}" if batch is not None else " (the call is not batched)"), meaning)
    if device is not None and t.device != device:
        raise fail(where, f"{name} is on {t.device} but A is on {device}", f"move it: {_bare(name)}.to(A.device)")


def output(where: str, name: str, t: torch.Tensor) -> None:
    """An out= tensor must take writes: dense, no element stored twice (a stride-0 view), no autograd."""
    dense(where, name, t)
    if any(s == 0 and d > 1 for s, d in zip(t.stride(), t.shape)):
        raise fail(where, f"{name} has stride 0 along a dimension (strides {list(t.stride())}, an expand()ed "
                   "view?): several output elements would share one memory location", f"pass a new tensor, e.g. "
                   f"torch.empty_like({_bare(name)}, memory_format=torch.contiguous_format)")
    if t.requires_grad:
        raise fail(where, f"{name} requires grad: outputs are written in place, which autograd cannot record",
                   f"pass {_bare(name)}.detach() (same memory), or a tensor without requires_grad")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' byte ranges meet (views of one buffer that do not, e.g. its rows, are apart).
    Nothing stored (an empty or meta tensor) meets nothing."""
    storage = a.untyped_storage().data_ptr()
    if not storage or storage != b.untyped_storage().data_ptr() or not a.numel() or not b.numel():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((d - 1) * s for d, s in zip(t.shape, t.stride()))  # the last element's offset
        return t.data_ptr(), t.data_ptr() + t.element_size() * (last + 1)
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def tma_rows(t: torch.Tensor) -> bool:
    """Can TMA address t's rows (16-byte aligned base and strides)? tma_layout says why not."""
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


def tma_layout(where: str, name: str, t: torch.Tensor) -> None:
    """TMA needs the last dim contiguous, 16-byte aligned base and strides (bf16: multiples of 8)."""
    es = t.element_size()
    per16 = 16 // es
    if t.stride(-1) != 1:
        raise fail(where, f"{name} must be contiguous in its last dimension (strides {list(t.stride())})",
                   f"pass {_bare(name)}.contiguous()")
    if t.data_ptr() % 16:
        raise fail(where, f"{name}'s data pointer is not 16-byte aligned (a sliced view?)",
                   f"pass {_bare(name)}.clone()")
    bad = [s for s in t.stride()[:-1] if (s * es) % 16]
    if bad:
        raise fail(where, f"{name}'s row stride {bad[0]} is not a multiple of {per16} elements "
                   f"({t.dtype}): TMA needs 16-byte aligned rows",
                   f"pad the last dimension to a multiple of {per16} (e.g. N and K multiples of {per16})")


def vector(where: str, name: str, t: torch.Tensor) -> None:
    if t.dim() and t.stride(-1) != 1:  # a 0-d tensor (a whole-tensor statistic) has no stride
        raise fail(where, f"{name} must be contiguous", f"pass {_bare(name)}.contiguous()")
    if t.data_ptr() % 16:
        raise fail(where, f"{name}'s data pointer is not 16-byte aligned", f"pass {_bare(name)}.clone()")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability_of(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (no index: device 0)."""
    return _capability(device.index if device.index is not None else 0)


def old_runtime() -> str | None:
    """Why torch's CUDA runtime cannot run kernel libraries (older than the library API they load their
    GEMM with), else None."""
    if torch.version.cuda and older_than_min_cuda(torch.version.cuda):
        return (f"torch {torch.__version__} runs CUDA {torch.version.cuda}; kernel libraries need the CUDA "
                f"{MIN_CUDA_TEXT}+ runtime")
    return None


def is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and _capability_of(device) == (9, 0)


def cutlass_runs_on(device: torch.device) -> bool:
    """Whether the cutlass backend runs on `device`: an sm_90 GPU, and a runtime new enough."""
    return is_sm90(device) and old_runtime() is None


def require_cutlass(where: str, device: torch.device, instead: str = "pass backend='reference'") -> None:
    """An UnsupportedError with the fix where the cutlass backend cannot run on `device` (cutlass_runs_on);
    instead: the way to the reference backend from where the call came."""
    if device.type != "cuda":
        raise UnsupportedError(f"{where}: the cutlass backend needs CUDA tensors (A is on {device})\n"
                               f"  fix: move the tensors to an sm_90 GPU, or {instead}")
    cap = _capability_of(device)
    if cap != (9, 0):
        raise UnsupportedError(
            f"{where}: the cutlass backend needs an sm_90 (Hopper) GPU; {torch.cuda.get_device_name(device)} "
            f"is sm_{cap[0]}{cap[1]}\n  fix: run on an H100/H200, or {instead} (slow)")
    if why := old_runtime():
        raise UnsupportedError(f"{where}: {why}\n  fix: install a torch built with CUDA {MIN_CUDA_TEXT}+, or "
                               f"{instead} (slow)")
